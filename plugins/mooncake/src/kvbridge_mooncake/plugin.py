"""Registers the `mooncake` transport (declared in `spec`). Imports nothing from Mooncake until it is created."""

from __future__ import annotations

from collections.abc import Callable

import kvbridge
from kvbridge_mooncake.spec import CAPABILITIES, INSTALL_HINT, MooncakeOptions, probe

KVBRIDGE_PLUGIN_API = 1


def _factory(config: kvbridge.BackendConfig) -> kvbridge.MigrationBackend:
    from kvbridge_mooncake.backend import MooncakeBackend

    return MooncakeBackend(config)


@kvbridge.hookimpl
def kvbridge_register_backends(register: Callable[..., None]) -> None:
    register(
        "mooncake", _factory, capabilities=CAPABILITIES, probe=probe, install_hint=INSTALL_HINT, options=MooncakeOptions
    )
