"""Conformance of the `mlu` device plugin.

Without the hardware, the suite runs on a stand-in for torch_mlu (`StandInDeviceConformance`).
Where no stand-in is installed, the plugin must report itself unavailable.
"""

from __future__ import annotations

from kvbridge.testing import StandInDeviceConformance, UnavailableDeviceConformance


class TestMluStandInConformance(StandInDeviceConformance):
    device_name = "mlu"
    standin_module = "torch_mlu"
    transports = (("tcp", None), ("loopback", None), ("mooncake", "tcp"))


class TestMluUnavailableConformance(UnavailableDeviceConformance):
    device_name = "mlu"
    reason_contains = "torch_mlu is not importable"
