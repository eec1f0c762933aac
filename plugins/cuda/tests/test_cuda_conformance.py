"""Conformance of the `cuda` device plugin.

Without the hardware, the suite runs on a *stand-in* for torch.cuda (kvbridge.testing.standins):
host memory behind the library's module surface, installed only inside these tests. Test ids
carry `stand-in`. Where no stand-in is installed, the plugin must report itself unavailable.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvbridge.testing import DeviceConformance, UnavailableDeviceConformance
from kvbridge.testing.standins import install_standin


class TestCudaStandInConformance(DeviceConformance):
    device_name = "cuda"
    device_ids = (0, 1)
    transports = (("tcp", None), ("loopback", None), ("mooncake", "tcp"))

    @pytest.fixture(params=["stand-in"])
    def library(self, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
        return install_standin(monkeypatch, "cuda")


class TestCudaUnavailableConformance(UnavailableDeviceConformance):
    device_name = "cuda"
    reason_contains = "no CUDA device"
