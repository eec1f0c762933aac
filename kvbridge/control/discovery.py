"""Finding a rank's side channel: peer-to-peer by default, or a registry in redis or etcd.

Peer-to-peer needs no service: the transfer params carry the remote engine's host and base
port, and rank r listens on base + r (vLLM's NIXL convention). For many nodes, every rank
publishes a `RankRecord` (address + readiness) in a registry that the other side reads. The
same redis or etcd can serve as Mooncake's metadata server: kvbridge keys live under
`kvbridge/`, Mooncake's under `mooncake/`.
"""

from __future__ import annotations

import abc
import base64
import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import attrs

from kvbridge import wire
from kvbridge.control.params import KVTransferParams
from kvbridge.errors import ConfigError, PeerGone, ProtocolError, TransferTimeout

log = logging.getLogger(__name__)

PREFIX = "kvbridge/ranks/"
Address = tuple[str, int]


@attrs.frozen
class RankRecord:
    """Where one engine rank's side channel listens, and whether its KV cache is registered."""

    engine_id: str
    rank: int
    host: str
    port: int
    ready: bool = False
    meta: dict[str, str] = attrs.field(factory=dict)

    @property
    def address(self) -> Address:
        return (self.host, self.port)


class Registry(abc.ABC):
    """A shared directory of rank records."""

    url: str

    @abc.abstractmethod
    def publish(self, record: RankRecord) -> None:
        """Create or replace the record of (record.engine_id, record.rank)."""

    @abc.abstractmethod
    def lookup(self, engine_id: str, rank: int) -> RankRecord | None:
        """The record, or None when that rank never published (or withdrew)."""

    @abc.abstractmethod
    def ranks(self, engine_id: str) -> list[RankRecord]:
        """Every published rank of an engine, by rank."""

    @abc.abstractmethod
    def remove(self, engine_id: str, rank: int) -> None:
        """Withdraw a record (idempotent)."""

    def close(self) -> None:
        """Release the connection."""

    def wait_ready(self, engine_id: str, rank: int, timeout_s: float) -> RankRecord:
        """Poll until the rank published itself ready; TransferTimeout after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        delay = 0.01
        while True:
            record = self.lookup(engine_id, rank)
            if record is not None and record.ready:
                return record
            if time.monotonic() + delay > deadline:
                state = "registered but not ready" if record else "not registered"
                raise TransferTimeout(
                    f"rank {rank} of engine {engine_id!r} is {state} in {self.url} after {timeout_s}s; check that "
                    "the engine started and allocated its KV cache, and that both sides use the same registry",
                    peer=f"{engine_id}/{rank}",
                    cause="peer not ready",
                )
            time.sleep(delay)  # bounded by the deadline above
            delay = min(delay * 2, 0.5)

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _key(engine_id: str, rank: int | None = None) -> str:
    return f"{PREFIX}{engine_id}/" + ("" if rank is None else str(rank))


def _decode(data: bytes, where: str) -> RankRecord | None:
    try:
        return wire.decode(data, RankRecord, max_bytes=64 * 1024)
    except ProtocolError as exc:
        log.warning("ignoring a malformed rank record in %s: %s", where, exc)
        return None


class RedisRegistry(Registry):
    """Records as fields of one redis hash per engine (`kvbridge/ranks/<engine>/`)."""

    def __init__(self, url: str, *, timeout_s: float = 5.0) -> None:
        try:
            import redis
        except ImportError:
            raise ConfigError("a redis registry needs the redis client: pip install 'kvbridge[discovery]'") from None
        self.url = redacted(url)  # what errors and logs name
        self._errors = (redis.RedisError, OSError)
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def _run(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self._errors as exc:
            raise PeerGone(
                f"registry {self.url} failed on {what}: {exc}; check that redis is running there",
                peer=self.url,
                cause=str(exc),
            ) from None

    def publish(self, record: RankRecord) -> None:
        self._run("publish", self._client.hset, _key(record.engine_id), str(record.rank), wire.encode(record))

    def lookup(self, engine_id: str, rank: int) -> RankRecord | None:
        data = self._run("lookup", self._client.hget, _key(engine_id), str(rank))
        return None if data is None else _decode(data, self.url)

    def ranks(self, engine_id: str) -> list[RankRecord]:
        found = self._run("ranks", self._client.hgetall, _key(engine_id))
        records = [r for r in (_decode(v, self.url) for v in found.values()) if r is not None]
        return sorted(records, key=lambda r: r.rank)

    def remove(self, engine_id: str, rank: int) -> None:
        self._run("remove", self._client.hdel, _key(engine_id), str(rank))

    def close(self) -> None:
        self._client.close()


class EtcdRegistry(Registry):
    """Records as etcd v3 keys `kvbridge/ranks/<engine>/<rank>`, spoken through etcd's JSON gateway.

    The gateway (`/v3/kv/*`, on the client port, etcd >= 3.4) needs no client library; this
    uses the standard library's HTTP client only.
    """

    def __init__(self, url: str, *, timeout_s: float = 5.0) -> None:
        parsed = urllib.parse.urlsplit(url)
        scheme = "https" if parsed.scheme in ("etcds", "https") else "http"
        if not parsed.hostname:
            raise ConfigError(f"etcd registry URL {redacted(url)!r} has no host; use etcd://HOST:PORT")
        self.url = redacted(url)  # what errors and logs name
        self._base = f"{scheme}://{parsed.hostname}:{parsed.port or 2379}/v3"
        self._timeout = timeout_s

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            f"{self._base}/{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=self._timeout) as resp:  # noqa: S310 (URL built from config)
                return json.loads(resp.read() or b"{}")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise PeerGone(
                f"registry {self.url} failed on {path}: {exc}; check that etcd is running there (v3 API, etcd >= 3.4)",
                peer=self.url,
                cause=str(exc),
            ) from None

    @staticmethod
    def _b64(text: str | bytes) -> str:
        return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()

    def publish(self, record: RankRecord) -> None:
        self._post(
            "kv/put", {"key": self._b64(_key(record.engine_id, record.rank)), "value": self._b64(wire.encode(record))}
        )

    def _range(self, key: str, prefix: bool) -> list[RankRecord]:
        body = {"key": self._b64(key)}
        if prefix:  # every key that starts with `key`: range_end is the prefix with its last byte + 1
            body["range_end"] = self._b64(key[:-1] + chr(ord(key[-1]) + 1))
        kvs = self._post("kv/range", body).get("kvs", [])
        records = [_decode(base64.b64decode(kv.get("value", "")), self.url) for kv in kvs]
        return sorted((r for r in records if r is not None), key=lambda r: r.rank)

    def lookup(self, engine_id: str, rank: int) -> RankRecord | None:
        found = self._range(_key(engine_id, rank), prefix=False)
        return found[0] if found else None

    def ranks(self, engine_id: str) -> list[RankRecord]:
        return self._range(_key(engine_id), prefix=True)

    def remove(self, engine_id: str, rank: int) -> None:
        self._post("kv/deleterange", {"key": self._b64(_key(engine_id, rank))})


def redacted(url: str) -> str:
    """`url` with any password replaced by `***`: URLs go into errors and logs.

    As in redis://:PASSWORD@host, etcd://user:PASSWORD@host."""
    try:
        parts = urllib.parse.urlsplit(url)
        password = parts.password
    except ValueError:  # a malformed URL: keep nothing that may be a credential
        return url.split("://", 1)[0] + "://***" if "@" in url else url
    if password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def open_registry(url: str | None) -> Registry | None:
    """A registry for `redis://…` or `etcd://…`; None for peer-to-peer (None, "", "p2p", "P2PHANDSHAKE")."""
    if not url or url.lower() in ("p2p", "p2phandshake"):
        return None
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme in ("redis", "rediss", "unix"):
        return RedisRegistry(url)
    if scheme in ("etcd", "etcds", "http", "https"):
        return EtcdRegistry(url)
    raise ConfigError(f"unknown registry URL {redacted(url)!r}; use redis://HOST:PORT, etcd://HOST:PORT or p2p")


def resolve(params: KVTransferParams, rank: int, *, registry: Registry | None = None, wait_s: float = 0.0) -> Address:
    """Where rank `rank` of the remote engine in `params` listens.

    Its registry record (waiting up to `wait_s` for it to be ready) or, peer-to-peer, `remote_host` and `remote_port +
    rank`."""
    if registry is not None:
        if params.remote_engine_id is None:
            raise ConfigError("kv_transfer_params lack remote_engine_id, which a registry lookup needs")
        return registry.wait_ready(params.remote_engine_id, rank, wait_s).address
    return params.side_channel(rank)
