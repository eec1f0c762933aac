"""How the LMDeploy adapter is configured. See docs/internals.md."""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Mapping
from typing import Any

import attrs

from kvbridge.base.errors import ConfigError
from kvbridge.base.options import env_flag
from kvbridge.base.secret import load_secret

TRANSPORT_ENV = "KVBRIDGE_LMDEPLOY_TRANSPORT"
PROTOCOL_ENV = "KVBRIDGE_LMDEPLOY_PROTOCOL"
HOSTNAME_ENV = "KVBRIDGE_LMDEPLOY_HOSTNAME"
METADATA_ENV = "KVBRIDGE_LMDEPLOY_METADATA_SERVER"
DEVICES_ENV = "KVBRIDGE_LMDEPLOY_DEVICES"
DEVICE_ENV = "KVBRIDGE_LMDEPLOY_DEVICE"
TIMEOUT_ENV = "KVBRIDGE_LMDEPLOY_TIMEOUT"
INSECURE_ENV = "KVBRIDGE_LMDEPLOY_INSECURE"
# LMDeploy's own switch for asynchronous migration; CacheEngine never passes async_op itself.
LMDEPLOY_ASYNC_ENV = "LMDEPLOY_USE_ASYNC_MIGRATION"


def _outbound_ip() -> str:
    """The address of the interface that routes off this host, or loopback where none does. See docs/internals.md."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def _timeout(value: str | None) -> float | None:
    if value is None or value.strip() == "":
        return 300.0
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if math.isnan(seconds):  # NaN compares false with everything: a wait that neither waits nor ends
        raise ConfigError(f"{TIMEOUT_ENV}={value!r} is not a number of seconds (0 waits forever)")
    return None if seconds <= 0 or math.isinf(seconds) else seconds


@attrs.frozen
class AdapterSettings:
    """Transport and limits for the LMDeploy migration backend. See docs/internals.md."""

    transport: str = "mooncake"
    protocol: str | None = None
    hostname: str = "127.0.0.1"
    metadata_server: str | None = None
    devices: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    device: str | None = None
    timeout: float | None = 300.0
    async_migration: bool = False
    secret: bytes | None = attrs.field(default=None, repr=False)
    insecure: bool = False
    fault_injection: Mapping[str, Any] | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> AdapterSettings:
        env = os.environ if env is None else env
        devices = tuple(d.strip() for d in env.get(DEVICES_ENV, "").split(",") if d.strip())
        return cls(
            transport=env.get(TRANSPORT_ENV) or "mooncake",
            protocol=env.get(PROTOCOL_ENV) or None,
            hostname=env.get(HOSTNAME_ENV) or _outbound_ip(),
            metadata_server=env.get(METADATA_ENV) or None,
            devices=devices,
            device=env.get(DEVICE_ENV) or None,
            timeout=_timeout(env.get(TIMEOUT_ENV)),
            # LMDeploy's own backends take any value as on, "0" too; here it means off (`env_flag`)
            async_migration=env_flag(LMDEPLOY_ASYNC_ENV, env=env),
            secret=load_secret(),
            insecure=env_flag(INSECURE_ENV, env=env),
        )

    def device_for(self, rank: int | None) -> str:
        if not self.devices:
            return ""
        return self.devices[(rank or 0) % len(self.devices)]
