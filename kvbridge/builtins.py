"""kvbridge's own plugins, registered through the same hooks as third-party ones."""

from __future__ import annotations

from collections.abc import Callable

from kvbridge.hookspecs import hookimpl
from kvbridge.options import NoOptions

KVBRIDGE_PLUGIN_API = 1


@hookimpl
def kvbridge_register_backends(register: Callable[..., None]) -> None:
    from kvbridge.transports import loopback, tcp

    register("tcp", tcp.TcpBackend, capabilities=tcp.TcpBackend.capabilities, options=tcp.TcpOptions)
    register(
        "loopback",
        loopback.LoopbackBackend,
        capabilities=loopback.LoopbackBackend.capabilities,
        options=loopback.LoopbackOptions,
    )


@hookimpl
def kvbridge_register_devices(register: Callable[..., None]) -> None:
    from kvbridge.devices.cpu import CpuDevice

    register("cpu", CpuDevice, memory_kind=CpuDevice.memory_kind, options=NoOptions)
