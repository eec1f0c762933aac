"""Finding a rank's side channel: peer-to-peer by default, or a registry in redis or etcd.

Every rank publishes a `RankRecord` (address + readiness), and HTTP servers announce `ServerRecord`s
with a time to live (elastic membership); with the shared secret every record carries an HMAC that
readers check, ignoring (logged) one without it or with a bad one. Key layout, peer-to-peer ports and
sharing the store with Mooncake: docs/control-plane.md ("Discovery") and docs/elastic.md.
"""

from __future__ import annotations

import abc
import base64
import hashlib
import hmac
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
SERVERS = "kvbridge/servers/"
ROLES = ("prefill", "decode")
STATES = ("serving", "draining")
MAX_RECORD_BYTES = 64 * 1024
MAX_WARNED = 1024  # ignored records remembered so that each is warned of once
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
    mac: bytes = b""  # HMAC-SHA256 over the record without it, with the registry's key (see `Sealer`)

    @property
    def address(self) -> Address:
        return (self.host, self.port)


@attrs.frozen
class ServerRecord:
    """One HTTP server of the deployment as it announces itself (docs/elastic.md).

    Who, where, how much, whether it takes new requests, and until when the record holds unless renewed.
    """

    server_id: str  # unique in the deployment: an engine id
    role: str = attrs.field(validator=attrs.validators.in_(ROLES))
    url: str  # its OpenAI API base URL, as the proxy reaches it
    expires: float  # wall-clock (Unix) seconds: a reader ignores the record after it
    capacity: int = 0  # KV cache blocks (0: not said)
    state: str = attrs.field(default="serving", validator=attrs.validators.in_(STATES))
    # where its engine's rank 0 side channel listens, and its parallel sizes: what a decode needs to pull the KV
    # of a request migrated off this server (docs/elastic.md); empty for a static entry
    side_host: str = ""
    side_port: int = 0
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    mac: bytes = b""

    @property
    def draining(self) -> bool:
        return self.state == "draining"


class Sealer:
    """Signs registry records and checks them with a key derived from the deployment's shared secret.

    Without a secret nothing is signed and every record is taken (a trusted network only, as the side
    channel's rule).
    """

    def __init__(self, secret: str | bytes | None) -> None:
        if isinstance(secret, str):
            secret = secret.encode()
        # A key of its own: a record's MAC must never pass for a side-channel frame's, or the other way round.
        self._key = None if not secret else hmac.new(secret, b"kvbridge registry records v1", hashlib.sha256).digest()

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def _mac(self, record: Any) -> bytes:
        assert self._key is not None
        return hmac.new(self._key, wire.encode(attrs.evolve(record, mac=b"")), hashlib.sha256).digest()

    def seal(self, record: Any) -> Any:
        """The record with its MAC (unchanged without a secret)."""
        return attrs.evolve(record, mac=self._mac(record)) if self.enabled else record

    def problem(self, record: Any) -> str | None:
        """Why the record must not be used (no MAC, a bad one), or None."""
        if not self.enabled:
            return None
        if not record.mac:
            return "it carries no MAC (its writer has no KVBRIDGE_SECRET)"
        if not hmac.compare_digest(record.mac, self._mac(record)):
            return "its MAC is bad (forged, or written with another secret)"
        return None


class DiscoveryRegistry(abc.ABC):
    """A shared directory of rank records and server records, signed with `sealer`'s key."""

    def __init__(self, url: str, secret: str | bytes | None) -> None:
        self.url = redacted(url)  # what errors and logs name
        self.sealer = Sealer(secret)
        self._warned: set[tuple[str, bytes]] = set()  # (where, MAC) of the ignored records warned of

    def _decoded(self, data: bytes, cls: type[Any], where: str) -> Any:
        """The record in `data`, or None (logged) when it does not decode, is not authentic, or has expired."""
        try:
            record = wire.decode(data, cls, max_bytes=MAX_RECORD_BYTES)
        except ProtocolError as exc:
            log.warning("ignoring a malformed %s in %s at %s: %s", cls.__name__, self.url, where, exc)
            return None
        problem = self.sealer.problem(record)
        if problem is not None:
            # read again every round: warned once per record, then at debug
            seen = self._warned
            level = logging.DEBUG if (where, record.mac) in seen else logging.WARNING
            if len(seen) >= MAX_WARNED:
                seen.clear()
            seen.add((where, record.mac))
            log.log(level, "ignoring the %s at %s in %s: %s", cls.__name__, where, self.url, problem)
            return None
        if isinstance(record, ServerRecord) and record.expires < time.time():
            # the store should have dropped it (TTL, lease): one it kept, or a replayed old record, is stale
            log.debug("ignoring the expired server record %s in %s", where, self.url)
            return None
        return record

    @abc.abstractmethod
    def announce(self, record: ServerRecord, ttl_s: float) -> None:
        """Create or renew a server record that the store drops `ttl_s` seconds after its last renewal."""

    @abc.abstractmethod
    def servers(self) -> list[ServerRecord]:
        """Every authentic, unexpired server record, by id."""

    @abc.abstractmethod
    def withdraw(self, server_id: str) -> None:
        """Remove a server record (idempotent)."""

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

    def __enter__(self) -> DiscoveryRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _key(engine_id: str, rank: int | None = None) -> str:
    return f"{PREFIX}{engine_id}/" + ("" if rank is None else str(rank))


def _server_key(server_id: str) -> str:
    return f"{SERVERS}{server_id}"


class RedisRegistry(DiscoveryRegistry):
    """Records as fields of one redis hash per engine (`kvbridge/ranks/<engine>/`)."""

    def __init__(self, url: str, *, secret: str | bytes | None = None, timeout_s: float = 5.0) -> None:
        try:
            import redis
        except ImportError:
            raise ConfigError("a redis registry needs the redis client: pip install 'kvbridge[discovery]'") from None
        super().__init__(url, secret)
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
        data = wire.encode(self.sealer.seal(record))
        self._run("publish", self._client.hset, _key(record.engine_id), str(record.rank), data)

    def lookup(self, engine_id: str, rank: int) -> RankRecord | None:
        data = self._run("lookup", self._client.hget, _key(engine_id), str(rank))
        return None if data is None else self._decoded(data, RankRecord, _key(engine_id, rank))

    def ranks(self, engine_id: str) -> list[RankRecord]:
        found = self._run("ranks", self._client.hgetall, _key(engine_id))
        decoded = (self._decoded(v, RankRecord, _key(engine_id, int(k))) for k, v in found.items())
        return sorted((r for r in decoded if r is not None), key=lambda r: r.rank)

    def remove(self, engine_id: str, rank: int) -> None:
        self._run("remove", self._client.hdel, _key(engine_id), str(rank))

    def announce(self, record: ServerRecord, ttl_s: float) -> None:
        data = wire.encode(self.sealer.seal(record))
        self._run("announce", self._client.set, _server_key(record.server_id), data, None, max(1, int(ttl_s * 1000)))

    def servers(self) -> list[ServerRecord]:
        keys = sorted(self._run("servers", self._client.keys, f"{SERVERS}*"))
        values = self._run("servers", self._client.mget, keys) if keys else []
        decoded = (self._decoded(v, ServerRecord, k.decode()) for k, v in zip(keys, values) if v is not None)
        return [r for r in decoded if r is not None]

    def withdraw(self, server_id: str) -> None:
        self._run("withdraw", self._client.delete, _server_key(server_id))

    def close(self) -> None:
        self._client.close()


class EtcdRegistry(DiscoveryRegistry):
    """Records as etcd v3 keys `kvbridge/ranks/<engine>/<rank>`, spoken through etcd's JSON gateway.

    The gateway (`/v3/kv/*`, on the client port, etcd >= 3.4) needs no client library; this
    uses the standard library's HTTP client only.
    """

    def __init__(self, url: str, *, secret: str | bytes | None = None, timeout_s: float = 5.0) -> None:
        parsed = urllib.parse.urlsplit(url)
        scheme = "https" if parsed.scheme in ("etcds", "https") else "http"
        if not parsed.hostname:
            raise ConfigError(f"etcd registry URL {redacted(url)!r} has no host; use etcd://HOST:PORT")
        super().__init__(url, secret)
        self._base = f"{scheme}://{parsed.hostname}:{parsed.port or 2379}/v3"
        self._timeout = timeout_s
        self._leases: dict[str, str] = {}  # server id -> the etcd lease its record is put with

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
        value = self._b64(wire.encode(self.sealer.seal(record)))
        self._post("kv/put", {"key": self._b64(_key(record.engine_id, record.rank)), "value": value})

    def _range(self, key: str, prefix: bool, cls: type[Any] = RankRecord) -> list[Any]:
        body = {"key": self._b64(key)}
        if prefix:  # every key that starts with `key`: range_end is the prefix with its last byte + 1
            body["range_end"] = self._b64(key[:-1] + chr(ord(key[-1]) + 1))
        kvs = self._post("kv/range", body).get("kvs", [])
        records = [
            self._decoded(base64.b64decode(kv.get("value", "")), cls, base64.b64decode(kv.get("key", "")).decode())
            for kv in kvs
        ]
        return [r for r in records if r is not None]

    def lookup(self, engine_id: str, rank: int) -> RankRecord | None:
        found = self._range(_key(engine_id, rank), prefix=False)
        return found[0] if found else None

    def ranks(self, engine_id: str) -> list[RankRecord]:
        return sorted(self._range(_key(engine_id), prefix=True), key=lambda r: r.rank)

    def remove(self, engine_id: str, rank: int) -> None:
        self._post("kv/deleterange", {"key": self._b64(_key(engine_id, rank))})

    def announce(self, record: ServerRecord, ttl_s: float) -> None:
        """Put the record with an etcd lease of `ttl_s`, kept alive by each renewal.

        A lease etcd no longer knows (it expired: this server was silent too long) is replaced by a new one.
        """
        lease = self._leases.get(record.server_id)
        if lease is not None:
            alive = self._post("lease/keepalive", {"ID": lease}).get("result", {})
            if int(alive.get("TTL", 0)) <= 0:
                lease = None
        if lease is None:
            lease = str(self._post("lease/grant", {"TTL": max(1, round(ttl_s))})["ID"])
            self._leases[record.server_id] = lease
        value = self._b64(wire.encode(self.sealer.seal(record)))
        self._post("kv/put", {"key": self._b64(_server_key(record.server_id)), "value": value, "lease": lease})

    def servers(self) -> list[ServerRecord]:
        return sorted(self._range(SERVERS, prefix=True, cls=ServerRecord), key=lambda r: r.server_id)

    def withdraw(self, server_id: str) -> None:
        lease = self._leases.pop(server_id, None)
        if lease is not None:
            self._post("lease/revoke", {"ID": lease})
        self._post("kv/deleterange", {"key": self._b64(_server_key(server_id))})


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


def open_registry(url: str | None, *, secret: str | bytes | None = None) -> DiscoveryRegistry | None:
    """A registry for `redis://…` or `etcd://…`; None for peer-to-peer (None, "", "p2p", "P2PHANDSHAKE").

    `secret`: the deployment's shared secret, which signs and checks its records.
    """
    if not url or url.lower() in ("p2p", "p2phandshake"):
        return None
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme in ("redis", "rediss", "unix"):
        return RedisRegistry(url, secret=secret)
    if scheme in ("etcd", "etcds", "http", "https"):
        return EtcdRegistry(url, secret=secret)
    raise ConfigError(f"unknown registry URL {redacted(url)!r}; use redis://HOST:PORT, etcd://HOST:PORT or p2p")


def resolve(
    params: KVTransferParams, rank: int, *, registry: DiscoveryRegistry | None = None, wait_s: float = 0.0
) -> Address:
    """Where rank `rank` of the remote engine in `params` listens.

    Its registry record (waiting up to `wait_s` for it to be ready) or, peer-to-peer, `remote_host` and `remote_port +
    rank`."""
    if registry is not None:
        if params.remote_engine_id is None:
            raise ConfigError("kv_transfer_params lack remote_engine_id, which a registry lookup needs")
        return registry.wait_ready(params.remote_engine_id, rank, wait_s).address
    return params.side_channel(rank)
