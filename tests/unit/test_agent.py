"""KVAgent: registration, RankInfo exchange, layout checks, pulls and the completion seam.

Agents run in one process here over the loopback transport (bytes really move, by memmove)
and over Mooncake TCP on 127.0.0.1; the multi-process runs are in test_parallel_bench.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import attrs
import numpy as np
import pytest

from kvbridge import create_backend
from kvbridge.agent.kv_agent import KVAgent, PullResult, RankInfo
from kvbridge.base.errors import ConfigError, LayoutMismatch, TopologyError, TransferFailed
from kvbridge.plan.layout import KVLayout, vllm_layout
from kvbridge.plan.presets import PRESETS, ModelSpec
from kvbridge.plan.topology import HeadPlacement, ParallelConfig
from kvbridge_tools.bench.shares import Share, fill, mismatches

MODEL = PRESETS["tiny-gqa"]


def _cache(model: ModelSpec, heads: int, num_blocks: int) -> tuple[np.ndarray, KVLayout]:
    layer = 2 * num_blocks * heads * model.block_size * model.head_dim * model.dtype_bytes
    buf = np.zeros(model.layers * layer, dtype=np.uint8)
    return buf, vllm_layout(model, heads, [buf.ctypes.data + i * layer for i in range(model.layers)], num_blocks)


def _agents(
    spec: str, engine: str, num_blocks: int, backend: str, *, stage: bool = False, **options: object
) -> list[tuple[KVAgent, np.ndarray]]:
    config = ParallelConfig.parse(spec)
    heads = HeadPlacement.of(MODEL, config, engine).per_rank
    out = []
    for rank in range(config.world_size):
        buf, layout = _cache(MODEL, heads, num_blocks)
        out.append((KVAgent(engine, rank, config, layout, buf, backend=backend, stage=stage, **options), buf))
    return out


@pytest.fixture(params=["loopback", "mooncake"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def pair(backend: str) -> Iterator[tuple[list[tuple[KVAgent, np.ndarray]], list[tuple[KVAgent, np.ndarray]]]]:
    prefill = _agents("tp2", "prefill", 8, backend)
    decode = _agents("tp4", "decode", 12, backend)
    yield prefill, decode
    for agent, _ in prefill + decode:
        agent.close()


def test_rank_info_round_trips_on_the_wire(pair) -> None:  # type: ignore[no-untyped-def]
    agent = pair[0][0][0]
    info = agent.info()
    back = RankInfo.decode(info.encode())
    assert back == info
    assert back.layout.regions[3].addr == agent.layout.regions[3].addr


def test_each_decode_rank_pulls_exactly_its_heads(pair) -> None:  # type: ignore[no-untyped-def]
    prefill, decode = pair
    tokens = 5 * MODEL.block_size - 3
    infos = [a.info() for a, _ in prefill]
    src_place = HeadPlacement.of(MODEL, prefill[0][0].parallel, "prefill")
    for agent, buf in prefill:
        fill(agent.layout, buf, [Share([7, 6, 5, 0, 1], range(5), src_place.heads(agent.coords.shard), tokens)])
    results: list[PullResult] = []
    done = threading.Event()

    def on_done(r: PullResult) -> None:
        results.append(r)
        if len(results) == len(decode):
            done.set()

    dst_place = HeadPlacement.of(MODEL, decode[0][0].parallel, "decode")
    handles = [
        agent.pull("req-1", infos, {0: [7, 6, 5, 0, 1], 1: [7, 6, 5, 0, 1]}, [2, 3, 4, 10, 11], tokens, on_done=on_done)
        for agent, _ in decode
    ]
    for h in handles:
        h.wait(30)
    assert done.wait(30)
    for agent, buf in decode:
        share = Share([2, 3, 4, 10, 11], range(5), dst_place.heads(agent.coords.shard), tokens)
        n, notes = mismatches(agent.layout, buf, [share])
        assert n == 0, notes
    # decode shards 0,1 read prefill rank 0, shards 2,3 read rank 1: two DONEs each
    pulled = sorted(p for r in results for p in r.pulled)
    assert pulled == [("prefill", 0), ("prefill", 0), ("prefill", 1), ("prefill", 1)]
    assert all(r.error is None and r.notify == () for r in results)
    assert prefill[0][0].release_count(decode[0][0].parallel, tokens) == 2


def test_unpulled_ranks_are_reported_by_the_notifier_only() -> None:
    mla = PRESETS["tiny-mla"]
    agents = []
    try:
        for engine, spec in (("prefill", "tp4"), ("decode", "tp2")):
            config = ParallelConfig.parse(spec)
            for rank in range(config.world_size):
                buf, layout = _cache(mla, 1, 4)
                agents.append((KVAgent(engine, rank, config, layout, buf, backend="loopback"), buf))
        prefill, decode = agents[:4], agents[4:]
        infos = [a.info() for a, _ in prefill]
        results = [a.pull("r", infos, [0, 1], [2, 3], 20).wait(30) for a, _ in decode]
        assert [r.pulled for r in results] == [(("prefill", 0),), (("prefill", 1),)]
        assert results[0].notify == (("prefill", 2), ("prefill", 3)) and results[1].notify == ()
        assert prefill[3][0].release_count(decode[0][0].parallel, 20) == 0
    finally:
        for a, _ in agents:
            a.close()


def test_layout_mismatch_is_refused_before_any_byte_moves() -> None:
    ((p, _),) = _agents("tp1", "prefill", 4, "loopback", fault_injection={})  # counts the submissions
    buf, layout = _cache(attrs.evolve(MODEL, block_size=32), 16, 4)
    d = KVAgent("decode", 0, ParallelConfig(), layout, buf, backend="loopback", fault_injection={})
    try:
        with pytest.raises(LayoutMismatch, match="model.block_size"):
            d.pull("r", [p.info()], [0], [0], 10)
        assert p.backend.submissions == d.backend.submissions == 0
    finally:
        p.close()
        d.close()


def test_transfer_failure_reaches_wait_and_the_callback() -> None:
    ((p, _),) = _agents("tp1", "prefill", 4, "loopback")
    ((d, _),) = _agents("tp1", "decode", 4, "loopback", fault_injection={})
    try:
        d.backend.inject(fail_completion=1)
        seen: list[PullResult] = []
        handle = d.pull("r", [p.info()], [0, 1], [2, 3], 20, on_done=seen.append)
        with pytest.raises(TransferFailed):
            handle.wait(30)
        assert len(seen) == 1 and isinstance(seen[0].error, TransferFailed)
        assert seen[0].pulled == (("prefill", 0),)  # the DONE still goes out: the prefill side frees
    finally:
        p.close()
        d.close()


def test_bad_agent_setup_is_refused_and_leaks_nothing() -> None:
    buf, layout = _cache(MODEL, 8, 4)
    with pytest.raises(TopologyError, match="holds 16 KV heads"):
        KVAgent("e", 0, ParallelConfig(), layout, buf, backend="loopback")
    backend = create_backend("loopback")
    small = buf[: buf.nbytes // 2]
    _, full = _cache(MODEL, 16, 4)
    with pytest.raises(ConfigError, match="outside the tensors"):
        KVAgent("e", 0, ParallelConfig(), full, small, backend=backend)
    assert backend.registered == ()  # what the failed agent registered on a borrowed backend is gone again
    backend.close()
    ((d, _),) = _agents("tp1", "decode", 4, "loopback")
    ((p, _),) = _agents("tp1", "prefill", 4, "loopback")
    try:
        with pytest.raises(ConfigError, match="holds 3 blocks of 40 tokens, got 1 block ids"):
            d.pull("r", [p.info()], [0, 1, 2], [0], 40)
        with pytest.raises(ConfigError, match="out of range"):
            d.pull("r", [p.info()], [0, 1, 9], [0, 1, 2], 40)
    finally:
        d.close()
        p.close()


def test_rank_info_from_a_peer_is_validated() -> None:
    from kvbridge.base import wire
    from kvbridge.base.errors import ProtocolError

    ((p, _),) = _agents("tp1", "prefill", 4, "loopback")
    try:
        data = wire.to_dict(p.info())
        with pytest.raises(ProtocolError):
            RankInfo.decode(b"\x93garbage")
        data["parallel"]["dcp"] = 3  # dcp must divide tp
        with pytest.raises(ProtocolError, match="RankInfo"):
            wire.from_dict(data, RankInfo)
        data["parallel"]["dcp"] = 1
        data["layout"]["regions"][0]["kind"] = "q"
        with pytest.raises(ProtocolError, match="RankInfo"):
            wire.from_dict(data, RankInfo)
    finally:
        p.close()


def test_the_request_dp_group_picks_the_prefill_ranks() -> None:
    prefill = _agents("tp1,dp2", "prefill", 4, "loopback")
    ((d, dbuf),) = _agents("tp1", "decode", 4, "loopback")
    try:
        infos = [a.info() for a, _ in prefill]
        with pytest.raises(TopologyError, match="span DP groups"):
            d.pull("r", infos, [0, 1], [2, 3], 20)
        agent, buf = prefill[1]
        fill(agent.layout, buf, [Share([0, 1], [0, 1], range(16), 20)])
        result = d.pull("r", infos, {1: [0, 1]}, [2, 3], 20, prefill_dp=1).wait(30)
        assert result.pulled == (("prefill", 1),)
        assert mismatches(d.layout, dbuf, [Share([2, 3], [0, 1], range(16), 20)])[0] == 0
    finally:
        for a, _ in prefill:
            a.close()
        d.close()


def test_staged_agents_publish_mirrors_and_land_pulls_in_device_memory(backend: str) -> None:
    # Both sides staged through host mirrors (as GPU memory over tcp is): peers address the mirrors,
    # `publish` copies computed blocks into them, and a pull lands in the mirror, then the device buffer.
    prefill = _agents("tp2", "prefill", 8, backend, stage=True)
    decode = _agents("tp1", "decode", 12, backend, stage=True)
    try:
        tokens = 4 * MODEL.block_size
        src_blocks, dst_blocks = [6, 1, 2, 3], [9, 10, 0, 4]
        src_place = HeadPlacement.of(MODEL, prefill[0][0].parallel, "prefill")
        for agent, buf in prefill:
            info = agent.info()
            assert info.layout.regions[0].addr != buf.ctypes.data  # peers see the mirror, not the device buffer
            fill(agent.layout, buf, [Share(src_blocks, range(4), src_place.heads(agent.coords.shard), tokens)])
        infos = [a.info() for a, _ in prefill]
        ((agent, buf),) = decode
        share = Share(dst_blocks, range(4), HeadPlacement.of(MODEL, agent.parallel, "decode").heads(0), tokens)

        agent.pull("early", infos, src_blocks, dst_blocks, tokens).wait(30)
        assert mismatches(agent.layout, buf, [share])[0] > 0, "read the device buffer before it was published"

        for a, _ in prefill:
            a.publish(src_blocks)
        agent.pull("req", infos, src_blocks, dst_blocks, tokens).wait(30)
        n, notes = mismatches(agent.layout, buf, [share])
        assert n == 0, notes
        with pytest.raises(ConfigError, match="block ids"):
            prefill[0][0].publish([8])
    finally:
        for a, _ in prefill + decode:
            a.close()
