"""Host staging (kvbridge.transport.staging) and NIC affinity (kvbridge.device.nics), below the conformance suites."""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import torch

import kvbridge
from kvbridge.base.memory import Descriptors
from kvbridge.base.types import BackendConfig, MemoryKind
from kvbridge.device import nics
from kvbridge.testing.standins import install_standin
from kvbridge.transport import staging
from kvbridge.transport.contract import MigrationBackend, Op, Peer
from kvbridge.transport.loopback import LoopbackBackend


@pytest.mark.parametrize("ranges", [4, 64], ids=["few-runs", "gather-scatter"])
@pytest.mark.parametrize("kind", ["numpy", "torch", "mixed"])
def test_copy_ranges_matches_slicing(kind: str, ranges: int) -> None:
    rng = np.random.default_rng(ranges)
    block = 256
    src = rng.integers(0, 256, 128 * block, dtype=np.uint8)
    dst = np.zeros_like(src)
    d_off = rng.permutation(128)[:ranges].astype(np.int64) * block  # shuffled: nothing merges
    s_off = rng.permutation(128)[:ranges].astype(np.int64) * block
    lengths = rng.integers(1, 3, ranges).astype(np.int64) * block // 2  # half and whole blocks
    expected = dst.copy()
    for d, s, n in zip(d_off, s_off, lengths):
        expected[d : d + n] = src[s : s + n]
    if kind == "numpy":
        staging.copy_ranges(dst, src, d_off, s_off, lengths)
    elif kind == "torch":
        staging.copy_ranges(torch.from_numpy(dst), torch.from_numpy(src), d_off, s_off, lengths)
    else:
        staging.copy_ranges(torch.from_numpy(dst), src, d_off, s_off, lengths)
    assert np.array_equal(dst, expected)


@pytest.mark.parametrize("packed", ["dst", "src"])
def test_copy_ranges_gathers_into_and_scatters_from_consecutive_rows(packed: str) -> None:
    """The gather strategy's two copies: scattered blocks into a packed staging region, and back out."""
    rng = np.random.default_rng(7)
    block, n = 256, 40
    src = rng.integers(0, 256, 128 * block, dtype=np.uint8)
    dst = np.zeros_like(src)
    scattered = rng.permutation(128)[:n].astype(np.int64) * block
    packed_off = (np.arange(n, dtype=np.int64) + 5) * block
    d_off, s_off = (packed_off, scattered) if packed == "dst" else (scattered, packed_off)
    expected = dst.copy()
    for d, s in zip(d_off, s_off):
        expected[d : d + block] = src[s : s + block]
    staging.copy_ranges(dst, src, d_off, s_off, np.full(n, block, dtype=np.int64))
    assert np.array_equal(dst, expected)


def test_copy_ranges_with_odd_offsets_uses_byte_rows() -> None:
    src = np.arange(1000, dtype=np.int64).astype(np.uint8)
    dst = np.zeros(1000, dtype=np.uint8)
    d_off = np.arange(20, dtype=np.int64) * 40 + 3  # 20 runs (more than FEW_RUNS), odd offsets: rows of 1 byte
    s_off = (np.arange(20, dtype=np.int64) * 37 + 11)[::-1]
    lengths = np.full(20, 7, dtype=np.int64)
    assert len(d_off) > staging.FEW_RUNS
    staging.copy_ranges(dst, src, d_off, s_off, lengths)
    expected = np.zeros_like(dst)
    for d, s, n in zip(d_off, s_off, lengths):
        expected[d : d + n] = src[s : s + n]
    assert np.array_equal(dst, expected)


def test_staged_publish_and_accept_ranges() -> None:
    device = kvbridge.get_device("cpu")
    a = staging.attach(kvbridge.create_backend("loopback"), device, force=True)
    try:
        buf = np.arange(4096, dtype=np.uint8).astype(np.uint8)
        a.register_memory(buf)
        mirror = a.endpoint().regions[0]
        assert mirror.addr != buf.ctypes.data and mirror.length == 4096
        a.publish([(buf.ctypes.data + 1024, 512)])
        host = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * 4096).from_address(mirror.addr))
        assert host[:1024].sum() == 0 and np.array_equal(host[1024:1536], buf[1024:1536]) and host[1536:].sum() == 0
        host[:16] = 7
        a.accept([(buf.ctypes.data, 16)])
        assert (buf[:16] == 7).all() and buf[16] == 16
        with pytest.raises(kvbridge.InvalidDescriptor):
            a.publish([(buf.ctypes.data + 4000, 200)])
        with pytest.raises(kvbridge.ConfigError):
            a.accept([(buf.ctypes.data, 0)])
    finally:
        a.close()


def test_direct_when_the_transport_reaches_host_memory() -> None:
    tcp = kvbridge.create_backend("tcp")
    try:
        assert staging.attach(tcp, kvbridge.get_device("cpu")) is tcp
    finally:
        tcp.close()


def _pci(sysfs: Path, chain: str) -> Path:
    node = sysfs / "devices" / chain
    node.mkdir(parents=True)
    return node


def _link(sysfs: Path, cls: str, name: str, target: Path) -> None:
    entry = sysfs / "class" / cls / name
    entry.mkdir(parents=True)
    (entry / "device").symlink_to(target)


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    """A sysfs tree: a GPU and mlx5_1 behind one PCIe switch, mlx5_0 on another root port."""
    gpu = _pci(tmp_path, "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0")
    near = _pci(tmp_path, "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0")
    far = _pci(tmp_path, "pci0000:00/0000:00:02.0/0000:05:00.0")
    bus = tmp_path / "bus" / "pci" / "devices"
    bus.mkdir(parents=True)
    for node, vendor, cls in ((gpu, "0x10de", "0x030200"), (near, "0x15b3", "0x020000"), (far, "0x15b3", "0x020000")):
        (node / "vendor").write_text(vendor + "\n")
        (node / "class").write_text(cls + "\n")
        (bus / node.name).symlink_to(node)
    _link(tmp_path, "infiniband", "mlx5_0", far)
    _link(tmp_path, "infiniband", "mlx5_1", near)
    _link(tmp_path, "net", "eth1", near)
    (tmp_path / "class" / "net" / "lo").mkdir()  # virtual: no PCI function
    return tmp_path


def test_nics_ranked_by_pci_distance(sysfs: Path) -> None:
    assert nics.nics_near("0000:03:00.0", sysfs) == ["mlx5_1", "mlx5_0"]
    assert nics.nics_near("0000:99:00.0", sysfs) == []
    assert nics.pci_functions("0x10de", sysfs=sysfs) == ["0000:03:00.0"]
    assert nics.pci_functions("0x15b3", device_class="0x0200", sysfs=sysfs) == ["0000:04:00.0", "0000:05:00.0"]


def test_net_interfaces_when_no_rdma_device(sysfs: Path) -> None:
    for entry in (sysfs / "class" / "infiniband").iterdir():
        (entry / "device").unlink()
        entry.rmdir()
    assert nics.nics_near("0000:03:00.0", sysfs) == ["eth1"]


def test_environment_overrides_topology(sysfs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBRIDGE_NIC_CUDA_0", "mlx5_0")
    assert nics.device_nics("cuda", 0, "0000:03:00.0", sysfs) == ["mlx5_0"]
    assert nics.device_nics("cuda", 1, "0000:03:00.0", sysfs) == ["mlx5_1", "mlx5_0"]
    monkeypatch.setenv("KVBRIDGE_NIC_CUDA_0", "")  # set but empty: the operator says none
    assert nics.device_nics("cuda", 0, "0000:03:00.0", sysfs) == []


class _Throttled(LoopbackBackend):
    """The in-process loopback transport, reaching a stand-in NPU's memory in place ("ascend"), with one path slowed.

    `slow` names the memory kind whose transfers wait `DELAY_S` first: NPU throttles the in-place path (as UCX moving
    VRAM over TCP through cuda_copy did on the H200), DRAM the staged one (host mirrors behind a slow host path)."""

    capabilities = attrs.evolve(
        LoopbackBackend.capabilities, protocols=("ascend",), memory_kinds={MemoryKind.DRAM, MemoryKind.NPU}
    )
    DELAY_S = 0.05
    slow = MemoryKind.NPU

    def _move(self, peer: Peer, desc: Descriptors, op: Op) -> None:
        if any(r.kind == self.slow for r in self._local.regions):
            threading.Event().wait(self.DELAY_S)  # the throttle itself: bytes move as fast as ever after it
        super()._move(peer, desc, op)


@pytest.fixture
def npu(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    install_standin(monkeypatch, "npu", "torch_npu")
    kvbridge.reset_plugins()
    yield kvbridge.get_device("npu")
    kvbridge.reset_plugins()


@pytest.mark.parametrize("slow", [MemoryKind.NPU, MemoryKind.DRAM], ids=["in-place-throttled", "staging-throttled"])
def test_the_path_probe_picks_the_faster_path_and_attach_follows_it(
    npu: Any, slow: MemoryKind, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 42 (5): on the H200 NIXL's in-place VRAM path was 8x slower than staging through host memory."""
    monkeypatch.setattr(_Throttled, "slow", slow)
    monkeypatch.setattr(staging, "_choices", {})
    made: list[int] = []

    def make() -> MigrationBackend:
        made.append(1)
        return _Throttled(BackendConfig(protocol="ascend"))

    caplog.set_level(logging.INFO, "kvbridge.transport.staging")
    backend = staging.attach(make(), npu, probe=make)
    try:
        staged = slow == MemoryKind.NPU
        assert isinstance(backend, staging.StagedBackend) is staged
        choice = staging.probe_paths(make, npu, key="npu/loopback/ascend")  # cached: nothing more is made
        assert choice.staged is staged and len(made) == 5, (choice, len(made))
        assert f"path probe npu/loopback/ascend: {'staged' if staged else 'in place'} (" in caplog.text
        # and the bound backend moves the right bytes
        src, dst = npu.allocate(4096, 0), npu.allocate(4096, 1)
        npu.from_host(src, np.arange(4096, dtype=np.uint8))
        other = staging.attach(_Throttled(BackendConfig(protocol="ascend")), npu, force=staged)
        try:
            other.register_memory(src)
            (local,) = backend.register_memory(dst)
            other.publish()
            peer = backend.connect(other.endpoint_info())
            backend.transfer(peer, [(local.addr, other.endpoint().regions[0].addr, 4096)], "read").wait(5)
            assert np.array_equal(npu.to_host(dst), np.arange(4096, dtype=np.uint8))
        finally:
            other.close()
    finally:
        backend.close()


def test_the_path_probe_counts_a_path_that_returns_wrong_bytes_as_slowest(npu: Any) -> None:
    class Corrupting(_Throttled):
        slow = MemoryKind.DRAM  # staging is slower, yet the in-place path is wrong

        def _move(self, peer: Peer, desc: Descriptors, op: Op) -> None:
            super()._move(peer, desc, op)
            if not any(r.kind == MemoryKind.DRAM for r in self._local.regions):
                ctypes.memset(int(desc[0, 0]), 0, 1)

    choice = staging.probe_paths(lambda: Corrupting(BackendConfig(protocol="ascend")), npu, nbytes=4096)
    assert choice.staged and choice.in_place_s == float("inf"), choice


@pytest.mark.parametrize(("asked", "env"), [(True, None), (False, "1"), (None, "1"), (None, None)])
def test_an_agent_given_its_transport_by_name_probes_once_per_process_when_asked(
    asked: bool | None, env: str | None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The example device: host memory behind a device that synchronizes, which loopback reaches in place.

    Asked by the argument, else by KVBRIDGE_PATH_PROBE=1 (off by default). Which path wins here is the machine's
    business (the throttled tests above pin it): the agents follow the one logged choice, made once for both."""
    from kvbridge.agent.kv_agent import KVAgent
    from kvbridge.plan.layout import vllm_layout
    from kvbridge.plan.presets import PRESETS
    from kvbridge.plan.topology import ParallelConfig

    monkeypatch.setattr(staging, "_choices", {})
    if env is None:
        monkeypatch.delenv("KVBRIDGE_PATH_PROBE", raising=False)
    else:
        monkeypatch.setenv("KVBRIDGE_PATH_PROBE", env)
    probe = asked if asked is not None else env == "1"
    caplog.set_level(logging.INFO, "kvbridge.transport.staging")
    model, blocks = PRESETS["tiny-gqa"], 4
    layer_bytes = 2 * blocks * model.kv_heads * model.block_size * model.head_dim * model.dtype_bytes
    kinds = []
    for _ in range(2):
        buf = np.zeros(model.layers * layer_bytes, dtype=np.uint8)
        addrs = [buf.ctypes.data + i * layer_bytes for i in range(model.layers)]
        layout = vllm_layout(model, model.kv_heads, addrs, blocks)
        agent = KVAgent("e", 0, ParallelConfig(), layout, buf, backend="loopback", device="example", probe=asked)
        kinds.append(type(agent.backend))
        agent.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("path probe example/loopback/")]
    assert len(lines) == (1 if probe else 0), lines
    staged = probe and lines[0].startswith("path probe example/loopback/loopback: staged (")
    assert kinds == [staging.StagedBackend if staged else staging.DeviceBackend] * 2, (kinds, lines)
