"""Provides the `mlu` device. Imports torch_mlu only when the registry asks whether an MLU is here."""

from __future__ import annotations

from pathlib import Path

import kvbridge
from kvbridge.base.types import MemoryKind
from kvbridge.device.probes import device_nodes, library_probe

KVBRIDGE_PLUGIN_API = 3

INSTALL_HINT = (
    "on a machine with a Cambricon MLU and CNToolkit, install Cambricon's torch_mlu wheel built for your torch "
    "(it is not on PyPI; Cambricon's PyTorch containers ship it)"
)


def hardware(dev: Path = Path("/dev")) -> bool:
    """A Cambricon MLU device node (/dev/cambricon_devN) exists here; needs neither torch_mlu nor CNToolkit."""
    return device_nodes("cambricon_dev[0-9]*", dev)


def probe() -> str | None:
    """Why a Cambricon MLU cannot be used here, or None."""
    return library_probe("torch_mlu", "mlu", "MLU", "the driver and MLU_VISIBLE_DEVICES")


def _factory(options: kvbridge.NoOptions) -> kvbridge.Device:
    from kvbridge_mlu.device import MluDevice

    return MluDevice()


@kvbridge.hookimpl
def kvbridge_devices() -> list[kvbridge.DeviceSpec]:
    return [
        kvbridge.DeviceSpec("mlu", _factory, MemoryKind.MLU, probe=probe, install_hint=INSTALL_HINT, hardware=hardware)
    ]
