"""Conformance of the `cuda` device plugin.

Without the hardware, the suite runs on a *stand-in* for torch.cuda (kvbridge.testing.standins):
host memory behind the library's module surface, installed only inside these tests. Test ids
carry `stand-in`. Where no stand-in is installed, the plugin must report itself unavailable, or,
on a machine with a GPU, pass the suite for real (TestCudaConformance).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvbridge.testing import DeviceConformance, UnavailableDeviceConformance
from kvbridge.testing.standins import install_standin
from kvbridge_cuda.plugin import probe

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
