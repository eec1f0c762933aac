"""The `kvbridge` plugin of kvbridge-proxy: it adds `kvbridge proxy` (`kvbridge_proxy.cli`), nothing else."""

from __future__ import annotations

import kvbridge

KVBRIDGE_PLUGIN_API = 3


@kvbridge.hookimpl
def kvbridge_commands() -> dict[str, str]:
    return {"proxy": "kvbridge_proxy.cli"}
