"""Finding a rank's side channel: peer-to-peer by default, or a registry in redis or etcd. See docs/internals.md."""

from __future__ import annotations

import abc
import base64
import hashlib
import hmac
import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import attrs

from kvbridge.base import wire
from kvbridge.base.errors import ConfigError, KVBridgeError, PeerGone, ProtocolError, TransferTimeout
from kvbridge.base.secret import DRAIN_ORDERS, RECORDS, derive
from kvbridge.base.threadname import NamedThread
from kvbridge.control.params import KVTransferParams

log = logging.getLogger(__name__)

PREFIX = "kvbridge/ranks/"
SERVERS = "kvbridge/servers/"
ORDERS = "kvbridge/drain/"
ROLES = ("prefill", "decode")
STATES = ("serving", "draining")
MAX_RECORD_BYTES = 64 * 1024
MAX_WARNED = 1024  # ignored records remembered so that each is warned of once
RANK_TTL_S = 30.0  # a rank record the store drops unless renewed (every third of it) by its publisher
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
    expires: float = 0.0  # wall-clock (Unix) seconds, stamped by `publish`: a reader ignores the record after it
    mac: bytes = b""  # HMAC-SHA256 over the record without it, with the registry's key (see `Sealer`)

    @property
    def address(self) -> Address:
        return (self.host, self.port)


@attrs.frozen
class ServerRecord:
    """One HTTP server of the deployment as it announces itself (docs/elastic.md). See docs/internals.md."""

    server_id: str  # unique in the deployment: an engine id
    role: str = attrs.field(validator=attrs.validators.in_(ROLES))
    url: str  # its OpenAI API base URL, as the proxy reaches it
    expires: float  # wall-clock (Unix) seconds: a reader ignores the record after it
    capacity: int = 0  # KV cache blocks (0: not said)
    state: str = attrs.field(default="serving", validator=attrs.validators.in_(STATES))
    # where its engine's rank 0 side channel listens, and its parallel sizes: what a decode needs to pull the KV
    # of a request moved off this server (docs/elastic.md); empty for a static entry
    side_host: str = ""
    side_port: int = 0
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    incarnation: str = ""  # random per run (`Announcer`): a drain order names it, so a restarted server ignores it
    mac: bytes = b""

    @property
    def draining(self) -> bool:
        return self.state == "draining"


@attrs.frozen
class DrainOrder:
    """An operator's order to one server to drain (`kvbridge drain`, docs/elastic.md), signed like the records."""

    server_id: str
    expires: float  # wall-clock (Unix) seconds, under the MAC: an old order written back is stale
    incarnation: str = ""  # the run of the server it is for (its record's): a later run does not take it
    mac: bytes = b""


class Sealer:
    """Signs and checks registry records (and drain orders) with keys from the shared secret. See docs/internals.md."""

    def __init__(self, secret: str | bytes | None) -> None:
        self._key, self._orders = derive(secret, RECORDS), derive(secret, DRAIN_ORDERS)

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def _mac(self, record: Any) -> bytes:
        key = self._orders if isinstance(record, DrainOrder) else self._key
        assert key is not None
        return hmac.new(key, wire.encode(attrs.evolve(record, mac=b"")), hashlib.sha256).digest()

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
    """A shared directory of rank records and server records, signed with `sealer`'s keys. See docs/internals.md."""

    def __init__(self, url: str, secret: str | bytes | None, rank_ttl_s: float = RANK_TTL_S) -> None:
        self.url = redacted(url)  # what errors and logs name
        self.sealer = Sealer(secret)
        self.rank_ttl_s = rank_ttl_s
        self._warned: set[tuple[str, bytes]] = set()  # (where, MAC) of the ignored records warned of
        self._mine: dict[str, RankRecord] = {}  # key -> a rank record this registry published and renews
        self._lock = threading.RLock()  # held while writing them: a removed record is never renewed back
        self._closed = threading.Event()
        self._renewer: threading.Thread | None = None

    def _decoded(self, data: bytes, cls: type[Any], where: str) -> Any:
        """The record in `data`, or None (logged) if it does not decode, is not authentic, not its key's, or expired."""
        try:
            record = wire.decode(data, cls, max_bytes=MAX_RECORD_BYTES)
        except ProtocolError as exc:
            log.warning("ignoring a malformed %s in %s at %s: %s", cls.__name__, self.url, where, exc)
            return None
        problem = self.sealer.problem(record)
        if problem is None and _record_key(record) != where:
            problem = f"it is the record of {_record_key(record)} (copied to another key)"
        if problem is None and isinstance(record, DrainOrder) and record.expires < time.time():
            problem = "it has expired (an old order written back, or the writer's clock is behind)"
        if problem is not None:
            return self._ignore(record, where, problem)
        if not isinstance(record, DrainOrder) and record.expires < time.time():
            # the store should have dropped it (TTL, lease): one it kept, or a replayed old record, is stale
            log.debug("ignoring the expired %s %s in %s", cls.__name__, where, self.url)
            return None
        return record

    def _ignore(self, record: Any, where: str, problem: str) -> None:
        """Log why `record` is not used: once per record, then at debug (the store is read again every round)."""
        seen = self._warned
        level = logging.DEBUG if (where, record.mac) in seen else logging.WARNING
        if len(seen) >= MAX_WARNED:
            seen.clear()
        seen.add((where, record.mac))
        log.log(level, "ignoring the %s at %s in %s: %s", type(record).__name__, where, self.url, problem)

    def _records(self, prefix: str, cls: type[Any]) -> list[Any]:
        return [r for k, v in self._scan(prefix) if (r := self._decoded(v, cls, k)) is not None]

    def announce(self, record: ServerRecord, ttl_s: float) -> None:
        """Create or renew a server record that the store drops `ttl_s` seconds after its last renewal."""
        self._put(_server_key(record.server_id), wire.encode(self.sealer.seal(record)), ttl_s)

    def servers(self) -> list[ServerRecord]:
        """Every authentic, unexpired server record, by id."""
        return sorted(self._records(SERVERS, ServerRecord), key=lambda r: r.server_id)

    def withdraw(self, server_id: str) -> None:
        """Remove a server record (idempotent)."""
        self._delete(_server_key(server_id))

    def publish(self, record: RankRecord) -> None:
        """Create or replace the record of (record.engine_id, record.rank), renewed until `remove` or `close`."""
        key = _key(record.engine_id, record.rank)
        with self._lock:
            self._write(key, record)
            self._mine[key] = record
            if self._renewer is None and not self._closed.is_set():
                self._renewer = NamedThread(target=self._renew, name="kvbridge-rank-records", daemon=True)
                self._renewer.start()

    def _write(self, key: str, record: RankRecord) -> None:
        stamped = attrs.evolve(record, expires=time.time() + self.rank_ttl_s)
        self._put(key, wire.encode(self.sealer.seal(stamped)), self.rank_ttl_s)

    def _renew(self) -> None:
        while not self._closed.wait(self.rank_ttl_s / 3):
            with self._lock:
                for key, record in self._mine.items():
                    try:
                        self._write(key, record)
                    except KVBridgeError as exc:  # the next round tries again; after a TTL the record is gone
                        log.warning("could not renew %s in %s: %s", key, self.url, exc)

    def lookup(self, engine_id: str, rank: int) -> RankRecord | None:
        """The record, or None when that rank never published (or withdrew, or stopped renewing it)."""
        data = self._get(_key(engine_id, rank))
        return None if data is None else self._decoded(data, RankRecord, _key(engine_id, rank))

    def ranks(self, engine_id: str) -> list[RankRecord]:
        """Every published rank of an engine, by rank."""
        found = self._records(_key(engine_id), RankRecord)
        return sorted((r for r in found if r.engine_id == engine_id), key=lambda r: r.rank)

    def remove(self, engine_id: str, rank: int) -> None:
        """Withdraw a record (idempotent)."""
        with self._lock:
            self._mine.pop(_key(engine_id, rank), None)
            self._delete(_key(engine_id, rank))

    @abc.abstractmethod
    def _put(self, key: str, data: bytes, ttl_s: float) -> None:
        """Write `data` at `key`, dropped by the store `ttl_s` seconds after its last write."""

    @abc.abstractmethod
    def _get(self, key: str) -> bytes | None:
        """The value at `key`, or None."""

    @abc.abstractmethod
    def _scan(self, prefix: str) -> list[tuple[str, bytes]]:
        """Every (key, value) whose key starts with `prefix`."""

    @abc.abstractmethod
    def _delete(self, key: str) -> None:
        """Remove `key` (idempotent)."""

    def order_drain(self, server_id: str, ttl_s: float, incarnation: str = "") -> DrainOrder:
        """Order this run of `server_id` (its record's `incarnation`) to drain: signed, for `ttl_s` s or until taken."""
        order = self.sealer.seal(DrainOrder(server_id, time.time() + ttl_s, incarnation))
        self._put(f"{ORDERS}{server_id}", wire.encode(order), ttl_s)
        return order

    def take_order(self, server_id: str, incarnation: str = "") -> DrainOrder | None:
        """The authentic, unexpired order for this run of `server_id`, removed from the store; None (logged) if none."""
        data = self._get(f"{ORDERS}{server_id}")
        order = None if data is None else self._decoded(data, DrainOrder, f"{ORDERS}{server_id}")
        if order is None or order.incarnation != incarnation:  # written back after its server restarted
            return None if order is None else self._ignore(order, f"{ORDERS}{server_id}", "it is for another run")
        self._delete(f"{ORDERS}{server_id}")  # taken
        return order

    def close(self) -> None:
        """Stop renewing the rank records (the store drops them within `rank_ttl_s`) and release the connection."""
        self._closed.set()
        if self._renewer is not None:
            self._renewer.join(timeout=10)

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


def _record_key(record: RankRecord | ServerRecord | DrainOrder) -> str:
    """Where `record` belongs in the store."""
    if isinstance(record, RankRecord):
        return _key(record.engine_id, record.rank)
    return (SERVERS if isinstance(record, ServerRecord) else ORDERS) + record.server_id


class RedisRegistry(DiscoveryRegistry):
    """Records as redis keys (`kvbridge/ranks/<engine>/<rank>`, ...), each with its time to live."""

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

    def _scan(self, prefix: str) -> list[tuple[str, bytes]]:
        keys = sorted(self._run("scan", self._client.keys, f"{prefix}*"))
        values = self._run("scan", self._client.mget, keys) if keys else []
        return [(k.decode(), v) for k, v in zip(keys, values) if v is not None]

    def _put(self, key: str, data: bytes, ttl_s: float) -> None:
        self._run("put", self._client.set, key, data, None, max(1, int(ttl_s * 1000)))

    def _get(self, key: str) -> bytes | None:
        return self._run("get", self._client.get, key)

    def _delete(self, key: str) -> None:
        self._run("delete", self._client.delete, key)

    def close(self) -> None:
        super().close()
        self._client.close()


class EtcdRegistry(DiscoveryRegistry):
    """Records as etcd v3 keys `kvbridge/ranks/<engine>/<rank>`, via etcd's JSON gateway. See docs/internals.md."""

    def __init__(self, url: str, *, secret: str | bytes | None = None, timeout_s: float = 5.0) -> None:
        parsed = urllib.parse.urlsplit(url)
        scheme = "https" if parsed.scheme in ("etcds", "https") else "http"
        if not parsed.hostname:
            raise ConfigError(f"etcd registry URL {redacted(url)!r} has no host; use etcd://HOST:PORT")
        super().__init__(url, secret)
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

    def _scan(self, prefix: str) -> list[tuple[str, bytes]]:
        # every key that starts with `prefix`: range_end is the prefix with its last byte + 1
        body = {"key": self._b64(prefix), "range_end": self._b64(prefix[:-1] + chr(ord(prefix[-1]) + 1))}
        kvs = self._post("kv/range", body).get("kvs", [])
        return [(base64.b64decode(kv.get("key", "")).decode(), base64.b64decode(kv.get("value", ""))) for kv in kvs]

    def _put(self, key: str, data: bytes, ttl_s: float) -> None:
        # a lease of its own each write: the key goes with the last one (an earlier one expiring leaves it)
        lease = self._post("lease/grant", {"TTL": max(1, round(ttl_s))})["ID"]
        self._post("kv/put", {"key": self._b64(key), "value": self._b64(data), "lease": lease})

    def _get(self, key: str) -> bytes | None:
        kvs = self._post("kv/range", {"key": self._b64(key)}).get("kvs", [])
        return base64.b64decode(kvs[0].get("value", "")) if kvs else None

    def _delete(self, key: str) -> None:
        self._post("kv/deleterange", {"key": self._b64(key)})


def url_problem(url: str) -> str | None:
    """What keeps `url` from naming a server's HTTP API, as a record and the proxy need it (None: nothing)."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (raises on a port that is not one)
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        return f"server {url!r}: write it as http://HOST:PORT or https://HOST:PORT, e.g. http://10.0.0.1:8100"
    # An OpenAI client's base URL ends in /v1: requests then went to /v1/v1/... A path before it is a server behind a
    # path-routing gateway, and is kept.
    path = parts.path.rstrip("/")
    if path.endswith("/v1") or parts.query or parts.fragment:
        base = urllib.parse.urlunsplit(parts._replace(path=path.removesuffix("/v1"), query="", fragment=""))
        return f"server {url!r}: write it as {base}, without /v1, a query or a fragment: /v1/... is added to it"
    return None


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
    """Registry of `redis://…` or `etcd://…`; None for p2p (None, "", "p2p", "P2PHANDSHAKE"). See docs/internals.md."""
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
    """Where rank `rank` of the remote engine in `params` listens. See docs/internals.md."""
    if registry is not None:
        if params.remote_engine_id is None:
            raise ConfigError("kv_transfer_params lack remote_engine_id, which a registry lookup needs")
        return registry.wait_ready(params.remote_engine_id, rank, wait_s).address
    return params.side_channel(rank)
