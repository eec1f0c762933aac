"""kvbridge for vLLM: `KVBridgeConnector` (a `KVConnectorBase_V1`) and its registration. See docs/internals.md."""

from __future__ import annotations

CONNECTOR_NAME = "KVBridgeConnector"


def register() -> None:
    """Register `KVBridgeConnector` with vLLM's connector factory (idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:  # vLLM raises on a second registration
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "kvbridge.adapters.vllm.connector", CONNECTOR_NAME)
