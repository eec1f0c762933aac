"""Provides the `nixl` transport (declared in `spec`). Imports nothing from NIXL until it is created or probed."""

from __future__ import annotations

import kvbridge
from kvbridge_nixl.spec import INSTALL_HINT, NixlOptions, capabilities, probe

KVBRIDGE_PLUGIN_API = 3


def _factory(config: kvbridge.BackendConfig, options: NixlOptions) -> kvbridge.MigrationBackend:
    from kvbridge_nixl.backend import NixlBackend

    return NixlBackend(config, options)


@kvbridge.hookimpl
def kvbridge_backends() -> list[kvbridge.BackendSpec]:
    return [
        kvbridge.BackendSpec(
            "nixl", _factory, capabilities(), options=NixlOptions, probe=probe, install_hint=INSTALL_HINT
        )
    ]
