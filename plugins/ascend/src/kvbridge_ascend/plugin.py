"""Provides the `npu` device. Imports torch_npu only when the registry asks whether an NPU is here."""

from __future__ import annotations

from pathlib import Path

import kvbridge
from kvbridge.base.types import MemoryKind
from kvbridge.device.probes import device_nodes, library_probe

KVBRIDGE_PLUGIN_API = 3

INSTALL_HINT = (
    "on a machine with an Ascend NPU and CANN, in an environment built for torch-npu (it pins its own torch): "
    "pip install 'kvbridge-ascend[torch-npu]'"
)


def hardware(dev: Path = Path("/dev")) -> bool:
    """An Ascend NPU device node (/dev/davinciN) exists here; needs neither torch_npu nor CANN."""
    return device_nodes("davinci[0-9]*", dev)


def probe() -> str | None:
    """Why an Ascend NPU cannot be used here, or None."""
    return library_probe("torch_npu", "npu", "Ascend NPU", "CANN and ASCEND_RT_VISIBLE_DEVICES")


def _factory(options: kvbridge.NoOptions) -> kvbridge.Device:
    from kvbridge_ascend.device import NpuDevice

    return NpuDevice()


@kvbridge.hookimpl
def kvbridge_devices() -> list[kvbridge.DeviceSpec]:
    return [
        kvbridge.DeviceSpec("npu", _factory, MemoryKind.NPU, probe=probe, install_hint=INSTALL_HINT, hardware=hardware)
    ]
