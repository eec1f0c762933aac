"""The module the entry point names: the plugin API version and one hook.

Cheap to import: the device class is imported only when someone uses the device."""

from __future__ import annotations

import mmap

import kvbridge
from kvbridge import MemoryKind

KVBRIDGE_PLUGIN_API = 3


def probe() -> str | None:
    """Why the device cannot be used here, or None. A real plugin checks its library and hardware."""
    if not hasattr(mmap, "MAP_ANONYMOUS"):
        return "anonymous mmap is not supported on this platform"
    return None


def _factory(options: kvbridge.NoOptions) -> kvbridge.Device:
    from kvbridge_example_device.device import ExampleDevice

    return ExampleDevice()


@kvbridge.hookimpl
def kvbridge_devices() -> list[kvbridge.DeviceSpec]:
    # `options` names the attrs class that declares the plugin's options (a device takes none: NoOptions, the
    # default; a transport's class subclasses kvbridge.BackendOptions): `kvbridge plugins example` lists them,
    # and the factory gets them parsed.
    return [
        kvbridge.DeviceSpec(
            "example",
            _factory,
            MemoryKind.DRAM,
            options=kvbridge.NoOptions,
            probe=probe,
            install_hint="use Linux or macOS (the example device maps anonymous memory)",
        )
    ]
