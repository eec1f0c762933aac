"""Closed by default: where the shared secret comes from, and who may listen without one. See docs/internals.md."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
from pathlib import Path

from kvbridge.base.errors import ConfigError

log = logging.getLogger(__name__)

SECRET_ENV = "KVBRIDGE_SECRET"
SECRET_FILE_ENV = "KVBRIDGE_SECRET_FILE"
MIN_SECRET_BYTES = 16
HOW_TO_SET = (
    f"set {SECRET_ENV} (at least {MIN_SECRET_BYTES} bytes, the same on every prefill and decode engine, e.g. "
    f"`export {SECRET_ENV}=$(openssl rand -hex 32)`) or put it in a file and set {SECRET_FILE_ENV}=/path/to/it"
)
# The uses of the shared secret, each with its own key: HKDF's `info` is `kvbridge/<use>`.
SIDE_CHANNEL, TCP, RECORDS = "side-channel", "tcp-transport", "registry-records"
DRAIN_ORDERS, LMDEPLOY, ADMIN = "drain-orders", "lmdeploy-endpoints", "admin-token"


def derive(secret: str | bytes | None, use: str) -> bytes | None:
    """The 32-byte key for one use of the shared secret: HKDF-SHA256 (RFC 5869), salt `kvbridge`; None without one."""
    if not secret:
        return None
    prk = hmac.new(b"kvbridge", secret.encode() if isinstance(secret, str) else secret, hashlib.sha256).digest()
    return hmac.new(prk, f"kvbridge/{use}".encode() + b"\x01", hashlib.sha256).digest()


def admin_token(secret: str | bytes | None) -> str | None:
    """The bearer token of the proxy's `/admin` calls (`kvbridge proxy --admin-token` prints it); None without one."""
    return None if (key := derive(secret, ADMIN)) is None else key.hex()


def load_secret(secret_file: str | os.PathLike[str] | None = None) -> bytes | None:
    """The shared secret: `KVBRIDGE_SECRET`, else the file `secret_file` or `KVBRIDGE_SECRET_FILE` names.

    None if neither is set. A secret shorter than 16 bytes, or a file that cannot be read, is a ConfigError."""
    value = os.environ.get(SECRET_ENV)
    source = f"${SECRET_ENV}"
    path = secret_file or os.environ.get(SECRET_FILE_ENV)
    if value:
        secret = value.encode().strip()  # as the file's: `export KVBRIDGE_SECRET="$(cat file)"` keeps a newline
    elif path:
        source = str(path)
        try:
            secret = Path(path).read_bytes().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the kvbridge secret file {path}: {exc.strerror}; {HOW_TO_SET}") from None
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"the kvbridge secret from {source} is {len(secret)} bytes; {HOW_TO_SET}")
    return secret


def is_loopback(host: str) -> bool:
    """True for addresses only this host can reach (127.0.0.0/8, ::1, `localhost`).

    A wildcard (`0.0.0.0`, `::`, empty) or any other name or address counts as reachable from elsewhere."""
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_listen(what: str, host: str, secret: str | bytes | None, *, insecure: bool = False) -> None:
    """Refuse to listen on `host` unprotected: call before binding. See docs/internals.md."""
    if secret or is_loopback(host):
        return
    if insecure:
        log.warning(
            "%s listens on %s WITHOUT authentication (insecure opt-in): anyone who can reach it can read "
            "KV blocks and abort requests; use only on a network you trust, or %s",
            what,
            host,
            HOW_TO_SET,
        )
        return
    raise ConfigError(
        f"{what} refuses to listen on {host!r}, which other hosts can reach, without a shared secret: {HOW_TO_SET}; "
        "or bind to 127.0.0.1; or, on a network you trust, opt in to running unauthenticated with insecure=True "
        '(vLLM: "insecure": true in kv_connector_extra_config)'
    )
