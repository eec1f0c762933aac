"""`kv_connector_extra_config` of KVBridgeConnector, read once into a frozen value."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs

from kvbridge.base import placement
from kvbridge.base.errors import ConfigError
from kvbridge.base.options import parse, unknown_names, within
from kvbridge.base.secret import HOW_TO_SET, check_listen, load_secret
from kvbridge.control.discovery import url_problem
from kvbridge.control.ledger import MAX_LEASE_S

DEFAULT_SIDE_CHANNEL_PORT = 5800
EXTRA_CONFIG = "KVBridgeConnector's kv_connector_extra_config"
# `stream_idle_wait_ms` defaults: where the engine core's input queue is watched an arriving request ends the wait,
# so it can be long; elsewhere it delays such a request by up to its length.
STREAM_IDLE_WAIT_MS = 20.0
WATCHED_STREAM_IDLE_WAIT_MS = 100.0
# transport settings the connector derives from its own keys; `backend_options` may not override them
_CONNECTOR_SET = frozenset(
    {"protocol", "hostname", "host", "metadata_server", "secret", "insecure", "device_name", "fault_injection"}
)


@attrs.frozen
class Settings:
    """What the operator tells the connector: every key, default and meaning (docs/vllm.md). See docs/internals.md."""

    migration_backend: str = "mooncake"
    protocol: str | None = None
    host: str = "127.0.0.1"
    # the base: every rank listens on a port above it (kvbridge.plan.rank_ports checks each is one)
    side_channel_port: int = attrs.field(default=DEFAULT_SIDE_CHANNEL_PORT, validator=within(1, 65535))
    metadata_server: str | None = None
    lease_s: float = attrs.field(default=120.0, validator=within(0.0, MAX_LEASE_S, above=True))
    pull_timeout_s: float = attrs.field(default=60.0, validator=within(0.0, 86_400.0, above=True))
    kv_cache_layout: str | None = None
    secret_file: str | None = None
    insecure: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    transfer: str = attrs.field(default="pull", validator=attrs.validators.in_(("pull", "layerwise")))
    early_offer: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    read_first: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    idle_wait_ms: float = attrs.field(default=2.0, validator=within(0.0, 60_000.0))
    stream_idle_wait_ms: float | None = attrs.field(default=None, validator=within(0.0, 60_000.0))
    registry: str | None = None
    advertise_url: str | None = None
    server_role: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.in_(("prefill", "decode")))
    )
    registry_ttl_s: float = attrs.field(default=10.0, validator=within(1.0, 3600.0))
    drain_grace_s: float = attrs.field(default=3.0, validator=within(0.0, 600.0))
    backend_options: dict[str, Any] = attrs.field(factory=dict)
    fault_injection: dict[str, Any] | None = None
    cpu_affinity: str | None = attrs.field(default=None, validator=lambda _i, _a, v: placement.check(v))
    io_cpus: str = attrs.field(default=placement.OTHERS, validator=lambda _i, _a, v: placement.check_io(v))
    secret: bytes | None = attrs.field(default=None, repr=False)  # resolved; never in a log line

    def __attrs_post_init__(self) -> None:
        own = sorted(set(self.backend_options) & _CONNECTOR_SET)
        if own:
            raise ConfigError(
                f"backend_options may not set {own}: the connector sets them (protocol, metadata_server and host "
                f"are kv_connector_extra_config keys; the secret comes from {HOW_TO_SET} or secret_file)"
            )
        check_listen("KVBridgeConnector (side channel and transport)", self.host, self.secret, insecure=self.insecure)
        if self.advertise_url is not None and (problem := url_problem(self.advertise_url)):
            # a proxy skips a record it cannot send to: this server would get no request
            raise ConfigError(f'"advertise_url" names no {problem}')

    def stream_idle_wait_s(self, *, inbox_watched: bool) -> float:
        """`stream_idle_wait_ms` in seconds, its default chosen by whether the input queue is watched."""
        if self.stream_idle_wait_ms is not None:
            return self.stream_idle_wait_ms / 1e3
        return (WATCHED_STREAM_IDLE_WAIT_MS if inbox_watched else STREAM_IDLE_WAIT_MS) / 1e3

    def transport_options(self) -> dict[str, Any]:
        """`backend_options`, plus the secret and insecure opt-in of transports with them. See docs/internals.md."""
        from kvbridge.plugin.registry import registry

        declared = {o.name for o in registry().backend_entry(self.migration_backend).option_infos()}
        auth = {k: v for k, v in {"secret": self.secret, "insecure": self.insecure}.items() if k in declared}
        faults = {} if self.fault_injection is None else {"fault_injection": self.fault_injection}
        return {**self.backend_options, **auth, **faults}

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> Settings:
        """The settings from vLLM's `kv_connector_extra_config`: each key checked, its value converted to its type."""
        extra = dict(extra or {})
        if "secret" in extra:
            raise ConfigError(
                "KVBridgeConnector takes no secret in kv_connector_extra_config (vLLM logs it, and the "
                f'command line shows it): {HOW_TO_SET}, or name a file with "secret_file"'
            )
        unknown_names(extra, [a.name for a in attrs.fields(cls) if a.name != "secret"], what=EXTRA_CONFIG)
        extra.setdefault("host", os.environ.get("VLLM_HOST_IP") or "127.0.0.1")
        extra["secret"] = load_secret(extra.get("secret_file") if isinstance(extra.get("secret_file"), str) else None)
        try:
            return parse(cls, extra, what=EXTRA_CONFIG)
        except ConfigError:
            raise
        except (TypeError, ValueError) as exc:  # a choice (attrs' validators put their message first)
            why = exc.args[0] if exc.args and isinstance(exc.args[0], str) else str(exc)
            raise ConfigError(f"{EXTRA_CONFIG}: {why}") from None
