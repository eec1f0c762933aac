"""kvbridge's own plugins, returned through the same hooks as third-party ones."""

from __future__ import annotations

from kvbridge.base.options import NoOptions
from kvbridge.base.types import MemoryKind
from kvbridge.device.contract import Device
from kvbridge.plugin.hookspecs import hookimpl
from kvbridge.plugin.specs import BackendSpec, DeviceSpec

KVBRIDGE_PLUGIN_API = 3


@hookimpl
def kvbridge_backends() -> list[BackendSpec]:
    from kvbridge.transport import loopback, tcp

    return [
        BackendSpec(cls.name, cls, cls.capabilities, options=cls.options_class)
        for cls in (tcp.TcpBackend, loopback.LoopbackBackend)
    ]


def _cpu(options: NoOptions) -> Device:
    from kvbridge.device.cpu import CpuDevice

    return CpuDevice()


@hookimpl
def kvbridge_devices() -> list[DeviceSpec]:
    return [DeviceSpec("cpu", _cpu, MemoryKind.DRAM)]
