"""The cuda, npu and mlu device plugins beyond the conformance suite.

What `kvbridge plugins` says here (no accelerator), that installing them keeps the environment's torch, and their
library calls on stand-ins (kvbridge.testing.standins: host memory behind the library surface; ids say stand-in).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import types
from importlib import metadata
from pathlib import Path

import pytest

import kvbridge
import kvbridge.base.memory
import kvbridge.plugin.placement
from kvbridge.testing.standins import install_standin
from kvbridge.transport import staging

PLUGINS = {  # device -> (distribution, vendor module or None, reason here, protocols)
    "cuda": ("kvbridge-cuda", None, "no CUDA device", ("rdma", "nvlink", "ucx")),
    "npu": ("kvbridge-ascend", "torch_npu", "torch_npu is not importable", ("ascend",)),
    "mlu": ("kvbridge-mlu", "torch_mlu", "torch_mlu is not importable", ("rdma",)),
}


def test_kvbridge_plugins_lists_accelerators_unavailable_with_reasons() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvbridge", "plugins", "--json"], capture_output=True, text=True, timeout=120, check=True
    )
    rows = {(r["kind"], r["name"]): r for r in json.loads(out.stdout)}
    for name, (dist, _, reason, _) in PLUGINS.items():
        row = rows[("device", name)]
        assert row["available"] is False
        assert reason in row["reason"]
        assert row["hint"] and row["distribution"] == dist
    assert rows[("device", "cpu")]["available"] is True


def test_installing_the_plugins_keeps_torch() -> None:
    assert metadata.version("torch") == "2.13.0+cpu"
    for dist, _, _, _ in PLUGINS.values():
        hard = [r for r in metadata.requires(dist) or [] if "extra ==" not in r]
        # nothing that could make a resolver replace torch: no torch, torch-npu or torch_mlu requirement
        assert not any(r.replace("_", "-").lower().startswith("torch") for r in hard), hard
    extras = metadata.requires("kvbridge-ascend") or []
    assert any(r.startswith("torch-npu") and 'extra == "torch-npu"' in r for r in extras)
    for vendor in ("torch_npu", "torch_mlu"):  # never installed here (CI must not pull them in)
        assert importlib.util.find_spec(vendor) is None, f"{vendor} is installed in this environment"


@pytest.fixture(params=sorted(set(PLUGINS) - {"cuda"}), ids=lambda n: f"{n}-stand-in")  # no fake torch.cuda
def standin(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    name = request.param
    acc = install_standin(monkeypatch, name, PLUGINS[name][1])
    kvbridge.reset_plugins()
    yield name, acc, kvbridge.get_device(name)
    kvbridge.reset_plugins()


def test_there_is_no_cuda_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    with pytest.raises(ValueError, match="no CUDA stand-in"):
        install_standin(monkeypatch, "cuda")
    assert torch.cuda.__name__ == "torch.cuda"  # torch's own module, untouched


def test_before_transfer_waits_for_the_compute_stream(standin) -> None:
    _, acc, device = standin
    device.before_transfer(1)
    assert acc.calls == [("event_record", 1), ("event_synchronize", 1)]


def test_after_transfer_synchronizes_the_device(standin) -> None:
    _, acc, device = standin
    device.after_transfer(1)
    assert acc.calls == [("synchronize", 1)]
    acc.calls.clear()
    device.after_transfer(-1)
    assert acc.calls == [("synchronize", 0), ("synchronize", 1)]


def test_tensor_regions_carry_kind_and_device_id(standin) -> None:
    import torch

    name, _, device = standin
    kv = torch.zeros(2, 16, 64, dtype=torch.bfloat16, device=f"{name}:1")
    assert kvbridge.plugin.placement.device_of([kv, kv[1]]) is device  # found through the registry by device type
    (region,) = kvbridge.plugin.placement.regions_of(kv)
    assert (region.addr, region.length, region.kind, region.device_id) == (
        kv.data_ptr(),
        2 * 16 * 64 * 2,
        device.memory_kind,
        1,
    )
    assert region.kind != kvbridge.MemoryKind.DRAM
    with pytest.raises(kvbridge.ConfigError, match="regions_of"):  # below the registry: host memory only
        kvbridge.base.memory.as_regions(kv)
    with pytest.raises(kvbridge.ConfigError, match=f"a {name} tensor .* cpu memory"):
        kvbridge.plugin.placement.regions_of(kv, kvbridge.get_device("cpu"))


def test_protocols_decide_staging(standin) -> None:
    name, acc, device = standin
    assert device.protocols() == PLUGINS[name][3]
    from kvbridge_mooncake.spec import CAPABILITIES

    for protocol in CAPABILITIES.protocols:  # which Mooncake protocols reach the memory directly
        mooncake = types.SimpleNamespace(capabilities=CAPABILITIES, protocol=protocol)
        assert staging.reaches(device, mooncake) == (protocol in PLUGINS[name][3])
    tcp = kvbridge.create_backend("tcp")
    try:
        staged = staging.attach(tcp, device)
        assert isinstance(staged, staging.StagedBackend)
        staged.register_memory(device.allocate(4096, 0))
        assert acc.pinned == [4096]  # the mirror is pinned host memory
        assert staged.endpoint().regions[0].kind == kvbridge.MemoryKind.DRAM
    finally:
        tcp.close()


def test_cuda_pci_address_from_the_driver_listing(tmp_path: Path) -> None:
    from kvbridge_cuda.device import _pci_by_uuid

    gpu = tmp_path / "0000:3b:00.0"
    gpu.mkdir()
    (gpu / "information").write_text("Model: stand-in\nGPU UUID: GPU-1234abcd-0000\nBus Location: 0000:3b:00.0\n")
    assert _pci_by_uuid("GPU-1234abcd-0000", tmp_path) == "0000:3b:00.0"
    assert _pci_by_uuid("GPU-ffff", tmp_path) is None
    assert _pci_by_uuid("GPU-1234abcd-0000", tmp_path / "absent") is None


@pytest.mark.parametrize(
    "module, node", [("kvbridge_cuda", "nvidia0"), ("kvbridge_ascend", "davinci3"), ("kvbridge_mlu", "cambricon_dev1")]
)
def test_hardware_check_reads_device_nodes_without_the_vendor_runtime(tmp_path: Path, module: str, node: str) -> None:
    hardware = importlib.import_module(f"{module}.plugin").hardware
    (tmp_path / "nvidiactl").touch()  # control nodes alone are not a device
    (tmp_path / "davinci_manager").touch()
    assert hardware(tmp_path) is False
    (tmp_path / node).touch()
    assert hardware(tmp_path) is True
