"""Registers the `nixl` transport (declared in `spec`). Imports nothing from NIXL until it is created or probed."""

from __future__ import annotations

from collections.abc import Callable

import kvbridge
from kvbridge_nixl.spec import INSTALL_HINT, NixlOptions, capabilities, probe

KVBRIDGE_PLUGIN_API = 1


def _factory(config: kvbridge.BackendConfig) -> kvbridge.MigrationBackend:
    from kvbridge_nixl.backend import NixlBackend

    return NixlBackend.from_config(config)


@kvbridge.hookimpl
def kvbridge_register_backends(register: Callable[..., None]) -> None:
    register("nixl", _factory, capabilities=capabilities(), probe=probe, install_hint=INSTALL_HINT, options=NixlOptions)
