"""The example device runs kvbridge's conformance suite: `pytest` in this folder, after `pip install -e .`."""

from __future__ import annotations

from typing import Any

from kvbridge import Device
from kvbridge.testing import DeviceConformance


class TestExampleDeviceConformance(DeviceConformance):
    device_name = "example"
    transports = (("tcp", None), ("loopback", None))

    def observed_syncs(self, library: Any, device: Device) -> list[tuple[str, int]]:
        return list(device.synchronizations.elements())  # type: ignore[attr-defined]
