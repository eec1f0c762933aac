"""Conformance of the `cuda` device plugin.

Without the hardware, the suite runs on a stand-in for torch.cuda (`StandInDeviceConformance`).
Where no stand-in is installed, the plugin must report itself unavailable, or, on a machine with a
GPU, pass the suite for real (TestCudaConformance).
"""

from __future__ import annotations

import pytest

from kvbridge.testing import DeviceConformance, StandInDeviceConformance, UnavailableDeviceConformance
from kvbridge_cuda.plugin import probe

NO_GPU = probe()


class TestCudaStandInConformance(StandInDeviceConformance):
    device_name = "cuda"
    transports = (("tcp", None), ("loopback", None), ("mooncake", "tcp"))


@pytest.mark.skipif(NO_GPU is not None, reason=f"real-GPU conformance run pending: {NO_GPU}")
class TestCudaConformance(DeviceConformance):
    """The same suite on a real GPU, with nothing stood in: runs wherever CUDA is available."""

    device_name = "cuda"
    transports = (("tcp", None), ("loopback", None), ("mooncake", "tcp"))


@pytest.mark.skipif(NO_GPU is None, reason="a CUDA device is available here")
class TestCudaUnavailableConformance(UnavailableDeviceConformance):
    device_name = "cuda"
    reason_contains = "no CUDA device"
