"""What the proxy reads server records from: a registry in redis or etcd, or a static JSON file (docs/elastic.md)."""

from __future__ import annotations

import json
import urllib.parse
from pathlib import Path

from kvbridge.base.errors import ConfigError
from kvbridge.control.discovery import ROLES, STATES, DiscoveryRegistry, ServerRecord, open_registry, redacted


class StaticMembers:
    """Server records from a JSON file the operator edits, read again on every call.

    `[{"role": "decode", "url": "http://...", "state": "draining"?}, ...]`. Local and the operator's own:
    no MAC, no expiry.
    """

    url: str

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.url = str(self.path)

    def servers(self) -> list[ServerRecord]:
        try:
            entries = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the server list {self.path}: {exc}; it is a JSON list of servers") from None
        if not isinstance(entries, list):
            raise ConfigError(f"{self.path} must hold a JSON list of {{'role': ..., 'url': ...}} objects")
        records = []
        for n, entry in enumerate(entries):
            try:
                role, url, state = entry["role"], entry["url"], entry.get("state", "serving")
                if role not in ROLES or state not in STATES or not isinstance(url, str):
                    raise ValueError(f"role must be one of {ROLES}, state one of {STATES}, url a string")
            except (TypeError, KeyError, ValueError, AttributeError) as exc:
                raise ConfigError(f"{self.path}, entry {n}: {exc!r}; each entry needs a role and a url") from None
            records.append(ServerRecord(url, role, url, expires=float("inf"), state=state))
        return records

    def close(self) -> None:
        """Nothing to release."""


def open_members(url: str, *, secret: str | bytes | None = None) -> DiscoveryRegistry | StaticMembers:
    """What the proxy reads server records from.

    `redis://…` or `etcd://…` (records checked with `secret`), or a static JSON file (`file:///path`, or a
    path with a `/` or ending in `.json`).
    """
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme == "file":
        return StaticMembers(parsed.path)
    if not parsed.scheme and ("/" in url or url.endswith(".json")):
        return StaticMembers(url)
    registry = open_registry(url, secret=secret)
    if registry is None:
        raise ConfigError(f"{redacted(url)!r} is no registry; use redis://HOST:PORT, etcd://HOST:PORT or a file")
    return registry
