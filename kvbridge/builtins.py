"""kvbridge's own plugins, returned through the same hooks as third-party ones."""

from __future__ import annotations

from kvbridge.device import Device
from kvbridge.hookspecs import hookimpl
from kvbridge.options import NoOptions
from kvbridge.specs import DeviceSpec, TransportSpec
from kvbridge.types import MemoryKind

KVBRIDGE_PLUGIN_API = 2


@hookimpl
def kvbridge_transports() -> list[TransportSpec]:
    from kvbridge.transports import loopback, tcp

    return [
        TransportSpec(cls.name, cls, cls.capabilities, options=cls.options_class)
        for cls in (tcp.TcpBackend, loopback.LoopbackBackend)
    ]


def _cpu(options: NoOptions) -> Device:
    from kvbridge.devices.cpu import CpuDevice

    return CpuDevice()


@hookimpl
def kvbridge_devices() -> list[DeviceSpec]:
    return [DeviceSpec("cpu", _cpu, MemoryKind.DRAM)]
