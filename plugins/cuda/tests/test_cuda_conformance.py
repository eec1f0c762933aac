"""Conformance of the `cuda` device plugin.

torch.cuda is never stood in (nothing pretends to be a GPU): on a machine with a GPU the suite runs
for real (TestCudaConformance, and the bench on GPU memory); elsewhere the plugin must report itself
unavailable, and what it decides without CUDA (protocols, Mooncake locations, staging) is checked on
the plugin class itself. The accelerator code it shares with npu and mlu runs on their stand-ins.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.testing import DeviceConformance, UnavailableDeviceConformance
from kvbridge_cuda.plugin import probe

NO_GPU = probe()


@pytest.mark.skipif(NO_GPU is not None, reason=f"real-GPU conformance run pending: {NO_GPU}")
class TestCudaConformance(DeviceConformance):
    """The same suite on a real GPU, with nothing stood in: runs wherever CUDA is available."""

    device_name = "cuda"
    transports = (("tcp", None), ("loopback", None), ("mooncake", "tcp"), ("nixl", None))


@pytest.mark.skipif(NO_GPU is None, reason="a CUDA device is available here")
class TestCudaUnavailableConformance(UnavailableDeviceConformance):
    device_name = "cuda"
    reason_contains = "no CUDA device"


def test_what_the_plugin_decides_without_cuda(tmp_path: Path) -> None:
    from kvbridge.base.types import MemoryKind
    from kvbridge.transport import staging
    from kvbridge_cuda.device import CudaDevice
    from kvbridge_mooncake import spec

    cuda = CudaDevice()  # no torch.cuda call below: these are the plugin's declarations
    assert (cuda.name, cuda.memory_kind, cuda.synchronizes) == ("cuda", MemoryKind.VRAM, True)
    assert cuda.location(3) == "cuda:3"
    cuda.sys_modules = tmp_path  # type: ignore[misc]
    assert cuda.protocols() == ("nvlink", "ucx")  # no peer-memory module: a NIC cannot reach GPU memory, rdma stages
    (tmp_path / "nvidia_peermem").mkdir()
    assert cuda.protocols() == ("rdma", "nvlink", "ucx")

    class Mooncake:  # what a Mooncake engine of each protocol declares, for a CUDA and a plain wheel
        def __init__(self, protocol: str, built: frozenset[str]) -> None:
            self.protocol, self.capabilities = protocol, spec.capabilities(protocol, {}, built)

    cuda_wheel = frozenset({"cuda", "intra_nvlink"})
    assert staging.reaches(cuda, Mooncake("rdma", cuda_wheel))  # GPUDirect RDMA: registered at cuda:N
    assert staging.reaches(cuda, Mooncake("nvlink", cuda_wheel))
    assert not staging.reaches(cuda, Mooncake("rdma", frozenset()))  # a wheel without CUDA: staged
    assert not staging.reaches(cuda, Mooncake("tcp", cuda_wheel))  # tcp never reaches GPU memory: staged


QUICK = ["--model", "small", "--tokens", "256", "--requests", "2", "--repeat", "1"]


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "kvbridge",
            "bench",
            "--migration-backend",
            "mooncake",
            "--device",
            "cuda",
            *QUICK,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.mark.skipif(NO_GPU is not None, reason=f"the bench on a GPU needs one: {NO_GPU}")
@pytest.mark.parametrize("stage", [[], ["--stage"]], ids=["auto", "staged"])
def test_bench_moves_gpu_memory_verified(stage: list[str]) -> None:
    """Both KV caches in CUDA memory, through the cuda plugin: staged over tcp, direct where rdma has GPUDirect."""
    out = _bench("--json", *stage)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["verified"] is True and result["config"]["device"] == "cuda"


@pytest.mark.skipif(NO_GPU is None, reason="a CUDA device is available here")
def test_bench_without_a_gpu_says_why_before_starting() -> None:
    out = _bench()
    assert out.returncode != 0
    assert "no CUDA device" in out.stderr and "cuda" in out.stderr
