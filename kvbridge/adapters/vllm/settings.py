"""`kv_connector_extra_config` of KVBridgeConnector, read once into a frozen value."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs

from kvbridge.errors import ConfigError

DEFAULT_SIDE_CHANNEL_PORT = 5800
SECRET_ENV = "KVBRIDGE_SECRET"


@attrs.frozen
class Settings:
    """What the connector is told by the operator.

    - `migration_backend`: any installed kvbridge transport, by name (`kvbridge plugins` lists them).
    - `protocol`: that transport's protocol (e.g. `tcp`); default its first.
    - `host`: address this engine's side channel and transport bind to.
    - `side_channel_port`: base port of the side channel; TP rank r (and DP rank d) listen on
      `port + d * tp_size + r`. Prefill servers on one host need distinct ports.
    - `lease_s`: how long prefill holds a finished request's blocks for its pullers' DONE.
    - `pull_timeout_s`: how long decode waits for one request's pull (and for a prefill rank to be
      ready and to hold the request) before it counts as failed.
    - `secret`: shared secret (at least 16 bytes, the same on prefill and decode) that authenticates
      every side-channel message; without it the side channel trusts its network. Default: the
      `KVBRIDGE_SECRET` environment variable (which vLLM does not log, unlike its config).
    - `fault_injection`: TESTING ONLY, off by default: `{"transfer_error": P, "slow_peer": P,
      "slow_s": S, "seed": N}` makes that fraction of this engine's transfers fail inside the
      transport or be held S seconds (`kvbridge chaos` uses it; see `kvbridge.chaos.inject`).
    """

    migration_backend: str = attrs.field(default="mooncake", converter=str)
    protocol: str | None = None
    host: str = attrs.field(default="127.0.0.1", converter=str)
    side_channel_port: int = attrs.field(default=DEFAULT_SIDE_CHANNEL_PORT, converter=int)
    metadata_server: str | None = None
    lease_s: float = attrs.field(default=120.0, converter=float)
    pull_timeout_s: float = attrs.field(default=60.0, converter=float)
    secret: str | None = attrs.field(default=None, repr=False)  # never in a log line
    fault_injection: dict[str, Any] | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> Settings:
        extra = dict(extra or {})
        known = {a.name for a in attrs.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config keys for KVBridgeConnector: {unknown}; known: {sorted(known)}"
            )
        extra.setdefault("host", os.environ.get("VLLM_HOST_IP") or "127.0.0.1")
        extra.setdefault("secret", os.environ.get(SECRET_ENV) or None)
        try:
            return cls(**extra)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"bad kv_connector_extra_config for KVBridgeConnector: {exc}") from None
