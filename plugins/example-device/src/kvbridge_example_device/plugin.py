"""The module the entry point names: the plugin API version and one hook. Cheap to import: the device
class is imported only when someone uses the device."""

from __future__ import annotations

import mmap
from collections.abc import Callable

import kvbridge
from kvbridge.types import MemoryKind

KVBRIDGE_PLUGIN_API = 1


def probe() -> str | None:
    """Why the device cannot be used here, or None. A real plugin checks its library and hardware."""
    if not hasattr(mmap, "MAP_ANONYMOUS"):
        return "anonymous mmap is not supported on this platform"
    return None


def _factory() -> kvbridge.Device:
    from kvbridge_example_device.device import ExampleDevice

    return ExampleDevice()


@kvbridge.hookimpl
def kvbridge_register_devices(register: Callable[..., None]) -> None:
    # `options` names the attrs class that declares the plugin's options (a device takes none; a
    # transport's class subclasses kvbridge.TransportOptions): `kvbridge plugins example` lists them.
    register(
        "example",
        _factory,
        memory_kind=MemoryKind.DRAM,
        probe=probe,
        install_hint="use Linux or macOS (the example device maps anonymous memory)",
        options=kvbridge.NoOptions,
    )
