"""`KVBridgeLMDeployBackend`: LMDeploy's `MigrationBackendImpl` on any kvbridge transport. See docs/internals.md."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import attrs
from lmdeploy.pytorch.disagg.backend.base import MigrationBackendImpl
from lmdeploy.pytorch.disagg.config import DistServeEngineConfig
from lmdeploy.pytorch.disagg.conn.protocol import (
    DistServeInitRequest,
    DistServeKVTransferEndpointInfo,
    MigrationProtocol,
)
from lmdeploy.pytorch.disagg.messages import DistServeRegisterMRMessage, MigrationAssignment

from kvbridge.adapters.lmdeploy.metrics import TransferMetrics
from kvbridge.adapters.lmdeploy.plan import InstructPlan, describe, instruct_array, plan
from kvbridge.adapters.lmdeploy.settings import PROTOCOL_ENV, TRANSPORT_ENV, AdapterSettings
from kvbridge.base import wire
from kvbridge.base.errors import (
    ConfigError,
    KVBridgeError,
    ProtocolError,
    TransferError,
    TransferFailed,
    TransferTimeout,
)
from kvbridge.base.secret import LMDEPLOY, derive
from kvbridge.base.types import EndpointInfo, MemoryKind, MemoryRegion
from kvbridge.device.contract import Device
from kvbridge.plugin.placement import local_device
from kvbridge.plugin.registry import create_backend, get_device, registry
from kvbridge.transport import netguard, staging
from kvbridge.transport.contract import MigrationBackend, Peer, TransferHandle, settle

log = logging.getLogger(__name__)

ENDPOINT_VERSION = 3  # 3: names its engine and the one it is for, expires, carries a nonce; signed with a secret
ENDPOINT_TTL_S = 60.0  # a signed endpoint is taken once, within this long of its signing (clocks in sync: NTP)
PROTOCOLS = {MigrationProtocol.TCP: "tcp", MigrationProtocol.RDMA: "rdma", MigrationProtocol.NVLINK: "nvlink"}
# a failed migration whose read still runs says so this often while it waits for it (`_settle`)
SETTLE_WARN_S = 5.0


@attrs.define(eq=False)
class Link:
    """One remote engine as this worker sees it. LMDeploy reads `remote_engine_config`."""

    remote_engine_id: str
    local_engine_id: str
    local_engine_config: DistServeEngineConfig
    remote_engine_config: DistServeEngineConfig
    protocol: MigrationProtocol
    transport: MigrationBackend
    local_regions: dict[int, MemoryRegion] = attrs.field(factory=dict)
    local_offsets: dict[int, int] = attrs.field(factory=dict)
    remote_regions: dict[int, MemoryRegion] = attrs.field(factory=dict)
    peer: Peer | None = None
    migrations: int = 0  # p2p_migrate calls on this link now
    after_migrations: list[Callable[[], None]] = attrs.field(factory=list)  # teardown their reads must not see


class KVBridgeLMDeployBackend(MigrationBackendImpl):
    """LMDeploy migration backend that moves KV blocks over a kvbridge transport. See docs/internals.md."""

    def __init__(self, settings: AdapterSettings | None = None) -> None:
        self.settings = settings or AdapterSettings.from_env()
        self.device: Device = get_device(self.settings.device) if self.settings.device else local_device()
        self._links: dict[str, Link] = {}
        self._transports: dict[str, MigrationBackend] = {}
        self._region_users: dict[tuple[str, int], set[Link]] = {}  # (protocol, addr) -> links
        self._waiting: set[Link] = set()  # links whose teardown waits for their migrations to end
        self._lock = threading.RLock()
        self._key = derive(self.settings.secret, LMDEPLOY)  # endpoints' own key: docs/security.md
        self._taken: dict[str, float] = {}  # nonce -> expiry of each signed endpoint taken: a replay is refused
        self.metrics = TransferMetrics()  # kvbridge_transfer_* series: see kvbridge.adapters.lmdeploy.metrics

    @property
    def links(self) -> Mapping[str, Link]:
        return MappingProxyType(self._links)

    @property
    def transports(self) -> Mapping[str, MigrationBackend]:
        """The open transports by protocol (one serves every link of that protocol)."""
        return MappingProxyType(self._transports)

    # -- setup -------------------------------------------------------------------------------

    def _protocol(self, protocol: MigrationProtocol) -> str:
        if self.settings.protocol:
            return self.settings.protocol
        try:
            return PROTOCOLS[MigrationProtocol(protocol)]
        except (KeyError, ValueError):
            raise ConfigError(
                f"LMDeploy migration protocol {protocol!r} has no kvbridge equivalent; "
                f"use one of {[p.name for p in PROTOCOLS]}"
            ) from None

    def _transport(self, protocol: MigrationProtocol, rank: int | None) -> MigrationBackend:
        name = self._protocol(protocol)
        with self._lock:
            if name not in self._transports:
                s = self.settings
                try:
                    declared = {o.name for o in registry().backend_entry(s.transport).option_infos()}
                    auth = {k: v for k, v in {"secret": s.secret, "insecure": s.insecure}.items() if k in declared}
                    transport = create_backend(
                        s.transport,
                        protocol=name,
                        hostname=s.hostname,
                        metadata_server=s.metadata_server,
                        device_name=s.device_for(rank),
                        fault_injection=s.fault_injection,
                        **auth,
                    )
                except ConfigError as exc:
                    raise ConfigError(
                        f"{exc}. LMDeploy asked for MigrationProtocol.{MigrationProtocol(protocol).name}"
                        f"; set {PROTOCOL_ENV} to a protocol the {s.transport!r} transport speaks, "
                        f"or {TRANSPORT_ENV} to another transport"
                    ) from exc
                self._transports[name] = staging.attach(transport, self.device)
                log.info(
                    "kvbridge LMDeploy backend: %s/%s transport up for %s memory",
                    s.transport,
                    name,
                    self.device.memory_kind.value,
                )
            return self._transports[name]

    def _link(self, remote_engine_id: str, what: str, protocol: MigrationProtocol | None = None) -> Link:
        """The link to a remote engine; with `protocol`, checked to be the one the link was initialized with."""
        link = self._links.get(remote_engine_id)
        if link is None:
            raise ConfigError(
                f"{what}: no link to remote engine {remote_engine_id!r} (linked: {sorted(self._links) or 'none'}); "
                "call p2p_initialize for it first"
            )
        if protocol is not None and MigrationProtocol(protocol) != link.protocol:
            raise ConfigError(
                f"{what} for remote engine {link.remote_engine_id!r} uses MigrationProtocol."
                f"{MigrationProtocol(protocol).name}, but the link was initialized with "
                f"MigrationProtocol.{link.protocol.name}; use one protocol per link"
            )
        return link

    def p2p_initialize(self, init_request: DistServeInitRequest) -> None:
        """Open (or reuse) the transport for the request's protocol and create the link."""
        rid = init_request.remote_engine_id
        if rid in self._links:
            log.info("re-initializing the link to remote engine %s", rid)
            self.p2p_drop_connect(rid)
        transport = self._transport(init_request.protocol, init_request.rank)
        with self._lock:
            self._links[rid] = Link(
                remote_engine_id=rid,
                local_engine_id=init_request.local_engine_id,
                local_engine_config=init_request.local_engine_config,
                remote_engine_config=init_request.remote_engine_config,
                protocol=MigrationProtocol(init_request.protocol),
                transport=transport,
            )

    def register_memory_region(self, register_mr_request: DistServeRegisterMRMessage) -> None:
        """Register one cache pool with the transport (once per address, whatever the links)."""
        req = register_mr_request
        link = self._link(req.remote_engine_id, f"register_memory_region(mr_key={req.mr_key})", req.protocol)
        region = self.device.region(req.addr, req.length)  # the pool's real kind and device id
        with self._lock:
            fresh = not any(r.addr == region.addr for r in link.transport.registered)
            link.transport.register_memory(region)
            if fresh and link.transport.peer_addresses([region.addr])[0] != region.addr:
                log.warning(
                    "mr_key %d (%s memory) is staged through host memory over %s: peers read a mirror "
                    "that publish() refreshes, and LMDeploy never calls it; serve with a protocol that "
                    "reaches %s memory directly",
                    req.mr_key,
                    region.kind.value,
                    self._protocol(link.protocol),
                    self.device.name,
                )
            old = link.local_regions.get(req.mr_key)
            if old is not None and old.addr != region.addr:  # a pool moved: the old one may still be read into
                self._after_migrations(link, lambda: self._release(link, old))
            link.local_regions[req.mr_key] = region
            link.local_offsets[req.mr_key] = req.offset
            users = self._region_users.setdefault((self._protocol(link.protocol), region.addr), set())
            users.add(link)

    def endpoint_info(self, remote_engine_id: str, protocol: MigrationProtocol) -> dict[str, Any]:
        """What the peer's `p2p_connect` needs: the transport endpoint and the cache pools by mr_key."""
        link = self._link(remote_engine_id, "endpoint_info", protocol)
        info = {
            "kvbridge": ENDPOINT_VERSION,
            "engine": link.local_engine_id,
            "for": remote_engine_id,
            "expires": time.time() + ENDPOINT_TTL_S,
            "nonce": os.urandom(16).hex(),
            "host": self.settings.hostname,
            "transport": wire.to_dict(link.transport.endpoint()),
            "mr_info": {
                str(k): {
                    "addr": int(link.transport.peer_addresses([r.addr])[0]),
                    "length": r.length,
                    "offset": link.local_offsets[k],
                    "kind": r.kind.value,
                }
                for k, r in sorted(link.local_regions.items())
            },
        }
        if self._key:
            info["mac"] = _signature(self._key, info)
        return info

    def publish(self, remote_engine_id: str | None = None) -> None:
        """Make this worker's pools current for peers' reads (one link's, or every link's).

        Waits for the device and, where the transport stages, copies the pools to the host mirrors peers read."""
        with self._lock:
            links = [self._link(remote_engine_id, "publish")] if remote_engine_id else list(self._links.values())
            for link in links:
                ranges = [(r.addr, r.length) for r in link.local_regions.values()]
                if ranges:
                    link.transport.publish(ranges)

    def memory_kinds(self) -> dict[int, MemoryKind]:
        """Each registered pool's memory kind by mr_key (the device's: `vram` for CUDA pools, `npu`, ...)."""
        with self._lock:
            return {k: r.kind for link in self._links.values() for k, r in link.local_regions.items()}

    def p2p_connect(self, remote_engine_id: str, conn_req: DistServeKVTransferEndpointInfo) -> None:
        """Connect to the remote engine described by its `endpoint_info`."""
        link = self._link(remote_engine_id, "p2p_connect", conn_req.protocol)
        with self._lock:
            endpoint, regions, host = _parse_endpoint(link, conn_req.endpoint_info, self._key, self._taken)
        if self._key:  # it proved the secret: its transport may reach ours
            netguard.admit(host, f"signed endpoint of LMDeploy engine {remote_engine_id}")
        peer = link.transport.connect(endpoint)
        with self._lock:
            old, link.peer = link.peer, peer
            if old is not None:
                self._after_migrations(link, lambda: link.transport.disconnect(old))
            link.remote_regions = regions
        log.info("connected to remote engine %s at %s (%d regions)", remote_engine_id, peer.name, len(regions))

    # -- migration ---------------------------------------------------------------------------

    async def p2p_migrate(self, assignment: MigrationAssignment, async_op: bool = False) -> None:
        """Read every instruct's remote bytes into local memory; returns when all have landed. See docs/internals.md."""
        rid = assignment.remote_engine_id
        with self._lock:
            link = self._link(rid, "p2p_migrate", assignment.protocol)
            link.migrations += 1
        try:
            await self._migrate(link, assignment, async_op)
        finally:
            self._migration_ended(link)

    async def _migrate(self, link: Link, assignment: MigrationAssignment, async_op: bool) -> None:
        rid = link.remote_engine_id
        if link.peer is None:
            raise ConfigError(
                f"p2p_migrate: remote engine {rid!r} is initialized but not connected; "
                "call p2p_connect with its endpoint_info first"
            )
        p = plan(instruct_array(assignment.batch), link.local_regions, link.remote_regions, engine=rid)
        if len(p.descriptors) == 0:
            return
        begun = time.perf_counter()
        submitted: list[tuple[TransferHandle, int, int]] = []
        try:
            submitted = self._submit(link, p)
            if async_op or self.settings.async_migration:
                await self._wait_async(rid, p, submitted)
            else:
                self._wait(rid, p, submitted)
        except KVBridgeError as exc:
            self.metrics.record_failure(link.transport.name, rid, exc)
            raise
        finally:
            self.metrics.record_retries(link.transport.name, rid, sum(h.retries for h, _, _ in submitted))
        # LMDeploy's engine did the control part (assignment, endpoints) before this call: control_s is 0
        self.metrics.record(link.transport.name, rid, time.perf_counter() - begun, 0.0, p.nbytes, len(p.descriptors))

    def _submit(self, link: Link, p: InstructPlan) -> list[tuple[TransferHandle, int, int]]:
        assert link.peer is not None
        size = link.transport.capabilities.max_batch or len(p.descriptors)
        out = []
        for desc, first, count in p.batches(size):
            try:
                handle = link.transport.transfer(link.peer, desc, op="read")
            except TransferError as exc:
                raise _failed(link.remote_engine_id, p, first, count, exc) from exc
            out.append((handle, first, count))
        return out

    def _wait(self, rid: str, p: InstructPlan, submitted: list[tuple[TransferHandle, int, int]]) -> None:
        """Block until every batch settled (one deadline for all), then raise the first failure.

        A failure is raised only once no read of the migration still runs (`_settle`)."""
        timeout = self.settings.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        failure: KVBridgeError | None = None
        for handle, first, count in submitted:
            try:
                handle.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except TransferTimeout:
                failure = failure or _late(rid, p, first, count, timeout)
            except TransferError as exc:
                failure = failure or _failed(rid, p, first, count, exc)
        if failure is not None:
            _settle(rid, submitted)
            raise failure

    async def _wait_async(self, rid: str, p: InstructPlan, submitted: list[tuple[TransferHandle, int, int]]) -> None:
        """Yield to the event loop until every batch settled, then raise the first failure (as `_wait`)."""
        loop = asyncio.get_running_loop()
        waiters = [_on_loop(loop, handle) for handle, _, _ in submitted]
        try:
            await asyncio.wait_for(asyncio.gather(*waiters), self.settings.timeout)
        except asyncio.TimeoutError:
            _, first, count = next((s for s in submitted if not s[0].done()), submitted[-1])
            await asyncio.to_thread(_settle, rid, submitted)
            raise _late(rid, p, first, count, self.settings.timeout) from None
        self._wait(rid, p, submitted)  # every handle is done: this only collects errors

    # -- teardown ----------------------------------------------------------------------------

    def p2p_drop_connect(self, remote_engine_id: Any) -> None:
        """Disconnect a remote engine and unregister memory no other link uses, once its migrations end.

        See docs/internals.md."""
        rid = getattr(remote_engine_id, "remote_engine_id", remote_engine_id)
        with self._lock:
            link = self._links.pop(rid, None)
            if link is None:
                return
            if link.migrations:
                log.info("dropping the link to remote engine %s once its %d migrations end", rid, link.migrations)
            self._after_migrations(link, lambda: self._tear_down(link))

    def _tear_down(self, link: Link) -> None:
        if link.peer is not None:
            link.transport.disconnect(link.peer)
        for region in link.local_regions.values():
            self._release(link, region)
        log.info("dropped the link to remote engine %s", link.remote_engine_id)

    def _after_migrations(self, link: Link, action: Callable[[], None]) -> None:
        """Run `action` (under the lock) once no migration of `link` runs: its reads keep their peer and memory."""
        if link.migrations:
            link.after_migrations.append(action)
            self._waiting.add(link)
        else:
            action()

    def _migration_ended(self, link: Link) -> None:
        with self._lock:
            link.migrations -= 1
            if link.migrations == 0:
                self._waiting.discard(link)
                actions, link.after_migrations = link.after_migrations, []
                for action in actions:
                    action()

    def _release(self, link: Link, region: MemoryRegion) -> None:
        key = (self._protocol(link.protocol), region.addr)
        users = self._region_users.get(key, set())
        users.discard(link)
        if not users:
            self._region_users.pop(key, None)
            link.transport.unregister_memory(region)

    def close(self) -> None:
        """Drop every link and close the transports; a migration still running then fails."""
        for rid in list(self._links):
            self.p2p_drop_connect(rid)
        with self._lock:
            transports, self._transports = self._transports, {}
            for link in self._waiting:  # closing their transport releases their peers and memory
                link.after_migrations.clear()
            self._waiting.clear()
        for t in transports.values():
            t.close()

    def store(self, assignment: MigrationAssignment, async_op: bool = False) -> None:
        raise ConfigError(_no_store("store", self.settings.transport))

    def load(self, assignment: MigrationAssignment, async_op: bool = False) -> None:
        raise ConfigError(_no_store("load", self.settings.transport))


def _no_store(what: str, transport: str) -> str:
    return (
        f"{what}() is not supported: kvbridge's LMDeploy backend migrates KV peer to peer only, and the "
        f"{transport!r} transport has no KV store; use p2p_migrate"
    )


def _settle(rid: str, submitted: list[tuple[TransferHandle, int, int]]) -> None:
    """Wait until every read of a failed migration ended; the transport's own transfer deadline bounds the wait.

    LMDeploy frees the blocks on the error, and a read still running would write them after it did."""
    settle([h for h, _, _ in submitted], SETTLE_WARN_S, f"KV migration from remote engine {rid!r}")


def _on_loop(loop: asyncio.AbstractEventLoop, handle: TransferHandle) -> asyncio.Future:
    """An asyncio future on `loop` that resolves when `handle` finishes (success or failure)."""
    fut = loop.create_future()

    def settle() -> None:
        if not fut.done():
            fut.set_result(None)

    def done(_h: TransferHandle) -> None:
        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop closed: nobody is waiting any more
            pass

    handle.add_done_callback(done)
    return fut


def _failed(rid: str, p: InstructPlan, first: int, count: int, exc: BaseException) -> KVBridgeError:
    text = (
        f"KV migration from remote engine {rid!r} failed: a batch of {count} instructs starting at "
        f"{describe(p.instructs, first)} did not complete: {exc}"
    )
    if isinstance(exc, TransferTimeout):
        return TransferTimeout(text, peer=rid, cause="timeout")
    return TransferFailed(text, peer=rid, cause=getattr(exc, "cause", "") or str(exc))


def _late(rid: str, p: InstructPlan, first: int, count: int, timeout: float | None) -> KVBridgeError:
    """The failure of a batch that did not finish within the migration timeout."""
    return _failed(rid, p, first, count, TransferTimeout(f"not finished within {timeout}s", peer=rid, cause="timeout"))


def _signature(key: bytes, info: Mapping[str, Any]) -> str:
    body = json.dumps({k: v for k, v in info.items() if k != "mac"}, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def _parse_endpoint(
    link: Link, text: str, key: bytes | None, taken: dict[str, float]
) -> tuple[EndpointInfo, dict[int, MemoryRegion], str]:
    """The transport endpoint, regions and host `link`'s remote engine sent in its `endpoint_info`.

    Only one from that engine for this one; with a secret, only once, unexpired, and when its signature holds."""
    rid = link.remote_engine_id
    try:
        data = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"endpoint_info from remote engine {rid!r} is not JSON: {exc}") from None
    if not isinstance(data, dict) or "kvbridge" not in data:
        got = f"keys {sorted(data)}" if isinstance(data, dict) else type(data).__name__
        raise ProtocolError(
            f"remote engine {rid!r} did not send a kvbridge endpoint (got {got}); "
            "install kvbridge-lmdeploy on both prefill and decode engines"
        )
    if data["kvbridge"] != ENDPOINT_VERSION:
        raise ProtocolError(
            f"remote engine {rid!r} sent endpoint version {data['kvbridge']!r}, this side speaks "
            f"{ENDPOINT_VERSION}; install the same kvbridge-lmdeploy release on both sides"
        )
    if key is not None:
        mac = data.get("mac")
        if not isinstance(mac, str) or not hmac.compare_digest(mac, _signature(key, data)):
            how = "unsigned" if mac is None else "signed with another secret"
            raise ProtocolError(
                f"endpoint_info from remote engine {rid!r} is {how}; "
                "set the same KVBRIDGE_SECRET (or KVBRIDGE_SECRET_FILE) on every prefill and decode engine"
            )
    now, expires, nonce = time.time(), data.get("expires"), str(data.get("nonce"))
    for n in [n for n, t in taken.items() if t < now]:  # expired: refused on its expiry alone from now on
        del taken[n]
    fresh = isinstance(expires, float) and now <= expires <= now + 2 * ENDPOINT_TTL_S and nonce not in taken
    if (data.get("engine"), data.get("for")) != (rid, link.local_engine_id) or key is not None and not fresh:
        raise ProtocolError(
            f"endpoint_info given for remote engine {rid!r} was made by {data.get('engine')!r} for {data.get('for')!r} "
            f"(this is {link.local_engine_id!r}), expires at {expires!r} (now {now:.3f}), taken before: "
            f"{nonce in taken}; refused as misrouted, stale or replayed (keep clocks in sync with NTP)"
        )
    if key is not None and isinstance(expires, float):
        taken[nonce] = expires
    host = data.get("host")
    if not isinstance(host, str) or not host:
        raise ProtocolError(f"endpoint_info from remote engine {rid!r} names no host")
    endpoint = wire.from_dict(data.get("transport"), EndpointInfo)
    try:
        regions = {
            int(k): MemoryRegion(v["addr"], v["length"], v.get("kind", "dram")) for k, v in data["mr_info"].items()
        }
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ProtocolError(f"malformed mr_info from remote engine {rid!r}: {exc!r}") from None
    return endpoint, regions, host
