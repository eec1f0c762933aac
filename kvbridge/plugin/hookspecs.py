"""Every hook a kvbridge plugin can implement, and nothing else.

A plugin is a module (or object) exposed under the entry point group ``kvbridge``. It sets
``KVBRIDGE_PLUGIN_API = 3`` and implements hooks marked with ``kvbridge.hookimpl`` that return
typed specs (`kvbridge.plugin.specs`) or the subcommands it adds to the ``kvbridge`` CLI. The hooks are
historic: pluggy calls each plugin's hooks as the plugin is registered, so every answer is known to come from
the plugin that returned it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from kvbridge.plugin.specs import BackendSpec, DeviceSpec

hookspec = pluggy.HookspecMarker("kvbridge")
hookimpl = pluggy.HookimplMarker("kvbridge")

# The hooks of the plugin API (KVBRIDGE_PLUGIN_API = 3); a plugin implements any of them.
HOOKS = ("kvbridge_backends", "kvbridge_commands", "kvbridge_devices")


@hookspec(historic=True)
def kvbridge_backends() -> Sequence[BackendSpec]:
    """The transports this plugin provides, as a list of ``kvbridge.BackendSpec``.

    ``kvbridge.BackendSpec(name, factory, capabilities, options=BackendOptions, probe=None, install_hint="",
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
def kvbridge_commands() -> Mapping[str, str]:
    """The subcommands this plugin adds to the ``kvbridge`` CLI: ``{"bench": "kvbridge_tools.cli.bench"}``.

    Each value names a module (imported only when the CLI builds its parser, so a broken one costs its own
    subcommand alone) with ``add_parser(subparsers)`` and ``run(args) -> int``.
    """
