"""Provides the `mooncake` transport (declared in `spec`). Imports nothing from Mooncake until it is created."""

from __future__ import annotations

import kvbridge
from kvbridge_mooncake.spec import CAPABILITIES, INSTALL_HINT, MooncakeOptions, probe

KVBRIDGE_PLUGIN_API = 3


def _factory(config: kvbridge.BackendConfig, options: MooncakeOptions) -> kvbridge.MigrationBackend:
    from kvbridge_mooncake.backend import MooncakeBackend

    return MooncakeBackend(config, options)


@kvbridge.hookimpl
def kvbridge_backends() -> list[kvbridge.BackendSpec]:
    return [
        kvbridge.BackendSpec(
            "mooncake", _factory, CAPABILITIES, options=MooncakeOptions, probe=probe, install_hint=INSTALL_HINT
        )
    ]
