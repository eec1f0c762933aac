"""Every hook a kvbridge plugin can implement, and nothing else.

A plugin is a module (or object) exposed under the entry point group ``kvbridge``. It sets
``KVBRIDGE_PLUGIN_API = 2`` and implements hooks marked with ``kvbridge.hookimpl`` that return
typed specs (`kvbridge.plugin.specs`). The hooks are historic: pluggy calls each plugin's hooks as the
plugin is registered, so every spec is known to come from the plugin that returned it.

Plugins written for plugin API 1 (``KVBRIDGE_PLUGIN_API = 1``) implement the two ``register``
hooks at the end instead, and still load: the registry turns each ``register(...)`` call into a spec.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from kvbridge.plugin.specs import DeviceSpec, TransportSpec

hookspec = pluggy.HookspecMarker("kvbridge")
hookimpl = pluggy.HookimplMarker("kvbridge")

# The hooks of each plugin API version; a plugin implements only those of the version it declares.
API_HOOKS = {
    1: ("kvbridge_register_backends", "kvbridge_register_devices"),
    2: ("kvbridge_devices", "kvbridge_transports"),
}


@hookspec(historic=True)
def kvbridge_transports() -> Sequence[TransportSpec]:
    """The transports this plugin provides, as a list of ``kvbridge.TransportSpec``.

    ``kvbridge.TransportSpec(name, factory, capabilities, options=TransportOptions, probe=None, install_hint="",
    hardware=None)``.

    ``factory(config: BackendConfig, options) -> MigrationBackend`` is called only when a user creates the
    transport, so a missing native library never breaks ``import kvbridge``; ``options`` is an instance of
    the spec's ``options`` class, parsed from what the user passed and checked against its declarations.
    """


@hookspec(historic=True)
def kvbridge_devices() -> Sequence[DeviceSpec]:
    """The devices this plugin provides, as a list of ``kvbridge.DeviceSpec``.

    ``kvbridge.DeviceSpec(name, factory, memory_kind, options=NoOptions, probe=None, install_hint="", hardware=None)``.

    ``factory(options) -> Device`` is called on first use. ``hardware() -> bool`` says, cheaply and without
    the vendor runtime, whether the device is on this machine at all (device nodes, sysfs), so
    `kvbridge doctor` can tell "no GPU here" from "a GPU the plugin cannot use".
    """


@hookspec(historic=True)
def kvbridge_register_backends(register: Callable[..., None]) -> None:
    """Plugin API 1: register transports; implement ``kvbridge_transports`` in a new plugin.

    Calls ``register(name, factory, *, capabilities, probe=None, install_hint="", hardware=None,
    options=TransportOptions)`` once per transport, with ``factory(config: BackendConfig)``: the fields of
    a `TransportSpec`, whose factory also takes the parsed options.
    """


@hookspec(historic=True)
def kvbridge_register_devices(register: Callable[..., None]) -> None:
    """Plugin API 1: register devices; implement ``kvbridge_devices`` in a new plugin.

    Calls ``register(name, factory, *, memory_kind, probe=None, install_hint="", hardware=None,
    options=NoOptions)`` once per device, with ``factory()``: the fields of a `DeviceSpec`, whose factory
    also takes the parsed options.
    """
