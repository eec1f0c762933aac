"""Conformance of the `npu` device plugin.

Without the hardware, the suite runs on a stand-in for torch_npu (`StandInDeviceConformance`).
Where no stand-in is installed, the plugin must report itself unavailable.
"""

from __future__ import annotations

from kvbridge.testing import StandInDeviceConformance, UnavailableDeviceConformance


class TestNpuStandInConformance(StandInDeviceConformance):
    device_name = "npu"
    standin_module = "torch_npu"
    transports = (("tcp", None), ("loopback", None), ("mooncake", "tcp"))


class TestNpuUnavailableConformance(UnavailableDeviceConformance):
    device_name = "npu"
    reason_contains = "torch_npu is not importable"
