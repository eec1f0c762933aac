"""LMDeploy adapter: `--migration-backend Mooncake` served by kvbridge. See docs/internals.md."""

from __future__ import annotations

import sys

from kvbridge.adapters.lmdeploy.backend import KVBridgeLMDeployBackend, Link
from kvbridge.adapters.lmdeploy.settings import AdapterSettings

NAMES = ("Mooncake", "KVBridge")


def register() -> None:
    """Register `KVBridgeLMDeployBackend` in LMDeploy's registry under `NAMES`, replacing what is there."""
    from lmdeploy.pytorch.disagg.backend.backend import MIGRATION_BACKENDS

    # mmengine refuses a name that is taken unless forced; replacing LMDeploy's Mooncake is the point.
    MIGRATION_BACKENDS.register_module(name=list(NAMES), force=True, module=KVBridgeLMDeployBackend)


# kvbridge-lmdeploy registers `register` when LMDeploy's registry module is imported; where that import ran inside
# this module's (above), it waits for this line.
if (_hook := sys.modules.get("kvbridge_lmdeploy")) is not None:
    _hook.adapter_ready()

__all__ = ["NAMES", "AdapterSettings", "KVBridgeLMDeployBackend", "Link", "register"]
