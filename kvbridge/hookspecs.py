"""Every hook a kvbridge plugin can implement, and nothing else.

A plugin is a module (or object) exposed under the entry point group ``kvbridge``. It sets
``KVBRIDGE_PLUGIN_API = 1`` and implements hooks marked with ``kvbridge.hookimpl``.
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

hookspec = pluggy.HookspecMarker("kvbridge")
hookimpl = pluggy.HookimplMarker("kvbridge")


@hookspec
def kvbridge_register_backends(register: Callable[..., None]) -> None:
    """Register transports.

    Call ``register(name, factory, *, capabilities, probe=None, install_hint="", hardware=None,
    options=TransportOptions)`` once per transport (``hardware`` as for devices: an RDMA NIC, say).
    ``options`` is the attrs class declaring the transport's options (a subclass of
    ``kvbridge.TransportOptions``, fields made with ``kvbridge.option``); ``create_backend`` checks
    what the user passes against it before ``factory`` runs, and fills in the defaults.
    ``factory(config: BackendConfig) -> MigrationBackend`` is called only when a user creates the
    backend, so a missing native library never breaks ``import kvbridge``.
    ``probe() -> str | None`` returns why the transport cannot run here, or None when it can.
    """


@hookspec
def kvbridge_register_devices(register: Callable[..., None]) -> None:
    """Register devices.

    Call ``register(name, factory, *, memory_kind, probe=None, install_hint="", hardware=None,
    options=NoOptions)`` once per device. ``factory() -> Device``; ``probe() -> str | None`` as for backends.
    ``hardware() -> bool`` says, cheaply and without the vendor runtime, whether the device is on
    this machine at all (device nodes, sysfs), so `kvbridge doctor` can tell "no GPU here" from
    "a GPU the plugin cannot use".
    """
