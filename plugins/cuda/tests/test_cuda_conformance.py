"""Conformance of the `cuda` device plugin.

Without the hardware, the suite runs on a *stand-in* for torch.cuda (kvbridge.testing.standins):
host memory behind the library's module surface, installed only inside these tests. Test ids
carry `stand-in`. Where no stand-in is installed, the plugin must report itself unavailable, or,
on a machine with a GPU, pass the suite for real (TestCudaConformance).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from kvbridge_cuda.plugin import probe

from kvbridge.testing import DeviceConformance, UnavailableDeviceConformance
from kvbridge.testing.standins import install_standin

NO_GPU = probe()


class TestCudaStandInConformance(DeviceConformance):
    device_name = "cuda"
    device_ids = (0, 1)
    transports = (("tcp", None), ("loopback", None), ("mooncake", "tcp"))

    @pytest.fixture(params=["stand-in"])
    def library(self, monkeypatch: pytest.MonkeyPatch) -> Any:
        return install_standin(monkeypatch, "cuda")


@pytest.mark.skipif(NO_GPU is not None, reason=f"real-GPU conformance run pending: {NO_GPU}")
class TestCudaConformance(DeviceConformance):
    """The same suite on a real GPU, with nothing stood in: runs wherever CUDA is available."""

    device_name = "cuda"
    transports = (("tcp", None), ("loopback", None), ("mooncake", "tcp"))


@pytest.mark.skipif(NO_GPU is None, reason="a CUDA device is available here")
class TestCudaUnavailableConformance(UnavailableDeviceConformance):
    device_name = "cuda"
    reason_contains = "no CUDA device"


QUICK = ["--model", "small", "--tokens", "256", "--requests", "2", "--repeat", "1"]


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvbridge", "bench", "--migration-backend", "mooncake",
                           "--device", "cuda", *QUICK, *args], capture_output=True, text=True, timeout=600, check=False)


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
