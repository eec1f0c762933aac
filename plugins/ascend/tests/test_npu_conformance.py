"""Conformance of the `npu` device plugin.

Without the hardware, the suite runs on a *stand-in* for torch_npu (kvbridge.testing.standins):
host memory behind the library's module surface, installed only inside these tests. Test ids
carry `stand-in`. Where no stand-in is installed, the plugin must report itself unavailable.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvbridge.testing import DeviceConformance, UnavailableDeviceConformance
from kvbridge.testing.standins import install_standin


class TestNpuStandInConformance(DeviceConformance):
    device_name = "npu"
    device_ids = (0, 1)
    transports = (("tcp", None), ("loopback", None), ("mooncake", "tcp"))

    @pytest.fixture(params=["stand-in"])
    def library(self, monkeypatch: pytest.MonkeyPatch) -> Any:
        return install_standin(monkeypatch, "npu", "torch_npu")


class TestNpuUnavailableConformance(UnavailableDeviceConformance):
    device_name = "npu"
    reason_contains = "torch_npu is not importable"
