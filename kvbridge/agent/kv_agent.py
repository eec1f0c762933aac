"""`KVAgent`: one per engine rank; registers its KV cache, publishes it, pulls its requests. See docs/internals.md."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from kvbridge.agent.landing import LandingBuffers
from kvbridge.base import wire
from kvbridge.base.block_ids import block_array
from kvbridge.base.errors import ConfigError, KVBridgeError, LoadError, TopologyError, TransferTimeout
from kvbridge.base.memory import RegionIndex, total_bytes
from kvbridge.base.options import env_flag
from kvbridge.plan.descriptors import pull_descriptors
from kvbridge.plan.layout import KVLayout, check_compatible
from kvbridge.plan.topology import ParallelConfig, Plan, heads_per_rank, plan
from kvbridge.plugin.placement import for_device, tensor_device
from kvbridge.plugin.registry import create_backend, get_device
from kvbridge.transport import staging
from kvbridge.transport.contract import MigrationBackend, Peer, TransferHandle, wait_all

log = logging.getLogger(__name__)


class _IdArrays:
    """Block id lists as int64 arrays, each converted once (by identity) however many pulls use it."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[Any, np.ndarray]] = {}

    def __call__(self, blocks: Sequence[int] | np.ndarray) -> np.ndarray:
        hit = self._seen.get(id(blocks))
        if hit is None:
            hit = self._seen[id(blocks)] = (blocks, block_array(blocks))  # keeps `blocks` alive
        return hit[1]


@attrs.frozen
class RankInfo:
    """What a rank publishes: who it is, its parallelism, its KV layout and its transport endpoint."""

    engine_id: str
    rank: int
    parallel: ParallelConfig
    layout: KVLayout
    endpoint: bytes  # the backend's endpoint_info()

    def encode(self) -> bytes:
        return wire.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> RankInfo:
        return wire.decode(data, cls)

    def digest(self) -> str:
        """Names this registration: a rank that registers other memory (its process restarted) has another digest."""
        return hashlib.blake2b(self.encode(), digest_size=8).hexdigest()


@attrs.frozen
class PullResult:
    """How one pull ended; docs/internals.md says what the control plane does with it."""

    request_id: str
    pulled: tuple[tuple[str, int], ...]
    notify: tuple[tuple[str, int], ...]
    nbytes: int
    descriptors: int
    error: BaseException | None = None
    retries: int = 0  # resubmissions its transfers needed (`TransferHandle.retries`), failed or not
    prepare_ms: float = 0.0  # building and checking its descriptors until the transport had them all
    land_ms: float = 0.0  # copying what landed in a buffer into the cache, after the transport ended


class PullHandle:
    """The transfers of one pull. `wait` raises the first transfer error; `done` never blocks.

    `after(ok, use)` lands what was read once every transfer ended (`use`: not `abandon`ed); `buffered`: only it can."""

    def __init__(
        self,
        result: PullResult,
        handles: list[TransferHandle],
        on_done: Callable[[PullResult], None] | None,
        after: Callable[[bool, bool], None],
        *,
        buffered: bool = False,
    ) -> None:
        self.request_id = result.request_id
        self.handles = handles
        self._result = result
        self._on_done = on_done
        self._after, self._buffered, self._abandoned = after, buffered, False
        self._landing = threading.Lock()  # held while `after` may copy into the cache
        self._finished = threading.Event()
        self._left = len(handles)
        self._lock = threading.Lock()
        if not handles:
            self._finish()
        for h in handles:
            h.add_done_callback(self._one_done)

    def _one_done(self, _h: TransferHandle) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        error = next((e for e in (h.exception() for h in self.handles) if e is not None), None)
        began = time.perf_counter()
        try:
            with self._landing:
                self._after(error is None, not self._abandoned)
                if self._abandoned and error is None:  # nothing landed: the pull's outcome says so
                    error = LoadError(f"request {self.request_id}: its read was given up", request=self.request_id)
        except Exception as exc:  # e.g. the rearrangement of landed blocks: the pull failed, recompute
            log.exception("request %s: finishing the pull failed", self.request_id)
            error = error or exc
        land_ms, retries = (time.perf_counter() - began) * 1e3, sum(h.retries for h in self.handles)
        self._result = attrs.evolve(self._result, error=error, retries=retries, land_ms=land_ms)
        if self._on_done is not None:
            try:
                self._on_done(self._result)
            except Exception:  # a broken callback must not take the transport thread with it
                log.exception("on_done callback for request %s failed", self.request_id)
        self._finished.set()  # after the callback: wait() returning means it has run

    def done(self) -> bool:
        return self._finished.is_set()

    def abandon(self) -> bool:
        """Copy nothing more into the cache; False while a direct read may still write it (wait for its handles)."""
        with self._landing:  # a copy under way ends first
            self._abandoned = True
        return self._buffered or all(h.done() for h in self.handles)

    def wait(self, timeout: float | None = None) -> PullResult:
        """Block until every transfer finished and `on_done` ran; raise the first transfer error (once both hold)."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        try:
            wait_all(self.handles, timeout)
        except KVBridgeError:
            self._finished.wait(left())  # a failed transfer: `on_done` runs once every transfer ended
            raise
        if not self._finished.wait(left()):
            raise TransferTimeout(
                f"request {self.request_id}: completion callback still running after {timeout}s",
                request=self.request_id,
                cause="timeout",
            )
        return self._result

    @property
    def result(self) -> PullResult | None:
        return self._result if self._finished.is_set() else None


class KVAgent:
    """One engine rank's KV cache, reachable by peers, and the pulls of its share of requests."""

    def __init__(
        self,
        engine_id: str,
        rank: int,
        parallel: ParallelConfig,
        layout: KVLayout,
        tensors: Any,
        *,
        backend: str | MigrationBackend = "mooncake",
        device: str | None = None,
        stage: bool = False,
        probe: bool | None = None,
        landing: Sequence[Sequence[Any]] | None = None,
        **backend_options: Any,
    ) -> None:
        """Build the agent: `device`, `backend`, `stage`, `landing` say how the cache moves. See docs/internals.md."""
        self.engine_id = engine_id
        self.rank = rank
        self.parallel = parallel
        self.coords = parallel.coords(rank)
        self.layout = layout
        expected = heads_per_rank(layout.model, parallel)
        if layout.heads != expected:
            raise TopologyError(
                f"rank {rank} of {parallel} holds {expected} KV heads of {layout.model.name}, but its layout says "
                f"{layout.heads}; build the layout with heads={expected}"
            )
        found = tensor_device(tensors)
        self.device = get_device(device) if device is not None else found or get_device("cpu")
        if found is not None and found is not self.device:
            raise ConfigError(
                f"rank {rank}: the KV tensors are {found.name} memory, but device={device!r} "
                f"was given; pass device={found.name!r} or leave it out"
            )
        self._own_backend = isinstance(backend, str)
        inner = create_backend(backend, **backend_options) if isinstance(backend, str) else backend
        # The probe's backends talk within this process: on loopback (no guard to pass), and never on the agent's port.
        name, options = backend, {**{k: v for k, v in backend_options.items() if k != "port"}, "hostname": "127.0.0.1"}
        # Off unless asked: the probe times two endpoints of this process, which need not be the path between hosts,
        # and starts two more transport engines (docs/transfer-strategies.md).
        probe = env_flag("KVBRIDGE_PATH_PROBE") if probe is None else probe
        make = (lambda: create_backend(name, **options)) if probe and isinstance(name, str) else None
        # A wrapper around a caller's backend is never closed here (it would close theirs): close() unregisters.
        self.backend: MigrationBackend = staging.attach(inner, self.device, force=stage, probe=make)
        self._peers: dict[tuple[str, int], tuple[bytes, Peer]] = {}  # (engine id, rank) -> its endpoint, connected
        self.landing_buffers: LandingBuffers | None = None
        self._lock = threading.Lock()
        self._registered: list[Any] = []
        try:
            self._registered = self.backend.register_memory(for_device(tensors, self.device))
            self._check_registered()
            self._published = self._layout_for_peers()
            # the devices `record` marks (once here: it runs in the engine's forward, once per layer)
            self._device_ids = sorted({r.device_id for r in self.backend.registered if r.device_id >= 0})
            if landing is not None:
                self.landing_buffers = LandingBuffers(self.backend, layout, landing, self.device)
        except BaseException:
            self.close()
            raise

    def _layout_for_peers(self) -> KVLayout:
        """The layout with the addresses peers use (the host mirrors' where the memory is staged)."""
        bases = self.backend.peer_addresses([r.addr for r in self.layout.regions])
        regions = [attrs.evolve(r, addr=int(a)) for r, a in zip(self.layout.regions, bases.tolist())]
        paged = self.layout.paged
        if paged is not None:  # a peer that lands whole blocks (kvbridge.agent.landing) reads from these
            planes = [
                attrs.evolve(p, layer_addrs=self.backend.peer_addresses(list(p.layer_addrs)).tolist())
                for p in paged.planes
            ]
            paged = attrs.evolve(paged, planes=planes)
        return attrs.evolve(self.layout, regions=regions, paged=paged)

    def _check_registered(self) -> None:
        spans = np.array([r.span for r in self.layout.regions], dtype=np.int64)
        bad = RegionIndex(self.backend.registered).outside(spans[:, 0], spans[:, 1] - spans[:, 0])
        if len(bad):
            r = self.layout.regions[int(bad[0])]
            raise ConfigError(
                f"layout region layer {r.layer} {r.kind} [{r.span[0]:#x}, {r.span[1]:#x}) is outside the tensors "
                "given to the agent; pass the tensors the layout was built from"
            )

    def info(self) -> RankInfo:
        return RankInfo(self.engine_id, self.rank, self.parallel, self._published, self.backend.endpoint_info())

    @property
    def publish_is_free(self) -> bool:
        """Publishing needs nothing (host memory the transport reads directly). See docs/internals.md."""
        return type(self.backend).publish is MigrationBackend.publish

    def publish(self, blocks: Sequence[int], layers: Sequence[int] | None = None, *, waited: bool = False) -> None:
        """On a prefill rank: make these computed blocks readable by peers, before offering. See docs/internals.md."""
        ids = np.asarray(blocks, dtype=np.int64).reshape(-1)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.layout.num_blocks):
            raise ConfigError(f"block ids must lie in [0, {self.layout.num_blocks}), got {blocks!r}")
        if len(ids) == 0 or self.publish_is_free:
            return
        ranges = np.concatenate(
            [
                np.stack([r.addr + ids * r.block_stride, np.full(len(ids), r.block_bytes, dtype=np.int64)], axis=1)
                for r in self.layout.regions
                if layers is None or r.layer in layers
            ]
        )
        if waited:
            self.backend.publish(ranges, waited=True)
        else:  # without the keyword: a third-party transport's `publish` that predates it keeps working
            self.backend.publish(ranges)

    def record(self) -> Any:
        """On a prefill rank: mark the device work queued on this rank's cache; no wait. See docs/internals.md."""
        if self.publish_is_free:
            return None
        marks = [self.device.record(i) for i in self._device_ids or [self.device.current_id()]]
        return None if any(m is None for m in marks) else marks

    def wait_recorded(self, marks: Any) -> None:
        """Block until the work `record` marked finished (on any thread)."""
        for mark in marks:
            self.device.wait_recorded(mark)

    def connect(self, remote: RankInfo, *, check: bool = True) -> Peer:
        """Check the remote layout against ours and connect to its endpoint (once per rank and endpoint)."""
        key = (remote.engine_id, remote.rank)
        with self._lock:
            known = self._peers.get(key)
        if known is not None and known[0] == remote.endpoint:
            return known[1]
        if check:
            check_compatible(self.layout, remote.layout)
        peer = self.backend.connect(remote.endpoint)
        with self._lock:
            gone, self._peers[key] = self._peers.get(key), (remote.endpoint, peer)
        if gone is not None:  # the rank registered other memory under its engine id (it restarted): never read it
            log.info("rank %s/%d has a new endpoint: %s replaces %s", *key, peer.name, gone[1].name)
            self.backend.disconnect(gone[1])
        return peer

    def plan(self, prefill: ParallelConfig, tokens: int, prefill_dp: int = 0) -> Plan:
        """The plan of a request this (decode) rank's DP group pulls from `prefill_dp`."""
        return plan(prefill, self.parallel, self.layout.model, tokens, prefill_dp=prefill_dp, decode_dp=self.coords.dp)

    def release_count(self, decode: ParallelConfig, tokens: int, decode_dp: int = 0) -> int:
        """On a prefill rank: how many pulls of a request to wait for before freeing its blocks."""
        p = plan(self.parallel, decode, self.layout.model, tokens, prefill_dp=self.coords.dp, decode_dp=decode_dp)
        return p.release_count(self.rank)

    def pull(
        self,
        request_id: str,
        remote: Sequence[RankInfo],
        remote_blocks: Mapping[int, Sequence[int]] | Sequence[int],
        local_blocks: Sequence[int],
        tokens: int,
        *,
        prefill_dp: int | None = None,
        on_done: Callable[[PullResult], None] | None = None,
        plan: Plan | None = None,
    ) -> PullHandle:
        """Read this rank's share of a request from the prefill ranks that hold it. See docs/internals.md.

        `plan`: the request's plan where the caller made it already (`PullControl`); it is used when it is the plan
        these RankInfos call for, and made again otherwise."""
        began = time.perf_counter()
        if not remote:
            raise ConfigError(f"request {request_id}: no prefill RankInfos given")
        prefill = remote[0].parallel
        if any(r.parallel != prefill or r.engine_id != remote[0].engine_id for r in remote):
            raise TopologyError(f"request {request_id}: RankInfos from different engines or parallel configs")
        if prefill_dp is None:
            groups = {prefill.coords(r.rank).dp for r in remote}
            if len(groups) != 1:
                raise TopologyError(
                    f"request {request_id}: prefill RankInfos span DP groups {sorted(groups)}; say which group "
                    "holds the request with prefill_dp="
                )
            prefill_dp = groups.pop()
        p = self._plan_of(prefill, tokens, prefill_dp, plan)
        need = p.blocks_on("decode", self.rank)
        if len(local_blocks) < need:
            raise ConfigError(
                f"request {request_id}: decode rank {self.rank} holds {need} blocks of {tokens} tokens, "
                f"got {len(local_blocks)} block ids"
            )
        by_rank = {r.rank: r for r in remote}
        work = []  # everything is checked and built before the first byte moves
        landed: list[Any] = []  # pulls landing elsewhere, rearranged on this device afterwards
        try:
            self._build(request_id, p, by_rank, remote_blocks, local_blocks, tokens, work, landed)
        except BaseException:
            for land in landed:
                land.finish(False, moved=False)
            raise
        handles = [self.backend.transfer(peer, desc, "read") for _info, peer, desc in work]
        pulled = [(info.engine_id, info.rank) for info, _peer, _desc in work]
        nbytes = sum(total_bytes(desc) for *_, desc in work)
        ndesc = sum(len(desc) for *_, desc in work)
        notify = tuple((remote[0].engine_id, r) for r in p.unpulled) if self.rank == p.notifier else ()
        log.debug("request %s: rank %d pulls %d bytes from %d ranks", request_id, self.rank, nbytes, len(pulled))
        result = PullResult(
            request_id, tuple(pulled), notify, nbytes, ndesc, prepare_ms=(time.perf_counter() - began) * 1e3
        )

        # Each handle completes once its bytes are on the device, synchronized; landed bytes still need
        # their rearrangement into this rank's cache.
        def after(ok: bool, use: bool) -> None:
            for land in landed:  # an abandoned read is not copied in; its buffer is retired only if it failed
                land.finish(ok and use, moved=not ok)

        return PullHandle(result, handles, on_done, after, buffered=len(landed) == len(work))

    def _plan_of(self, prefill: ParallelConfig, tokens: int, prefill_dp: int, g: Plan | None) -> Plan:
        """The plan of a request this rank pulls: `g` when it was made from the same inputs, else a new one."""
        inputs = (prefill, self.parallel, self.layout.model, tokens, prefill_dp, self.coords.dp)
        if g is not None and (g.prefill, g.decode, g.model, g.tokens, g.prefill_dp, g.decode_dp) == inputs:
            return g
        return self.plan(prefill, tokens, prefill_dp=prefill_dp)

    def _build(
        self,
        request_id: str,
        p: Plan,
        by_rank: Mapping[int, RankInfo],
        remote_blocks: Mapping[int, Sequence[int]] | Sequence[int],
        local_blocks: Sequence[int],
        tokens: int,
        work: list[Any],
        landed: list[Any],
    ) -> None:
        ids = _IdArrays()  # each list of block ids becomes an array once, not once per pull
        for pull in p.pulls_for(self.rank):
            info = by_rank.get(pull.prefill_rank)
            if info is None:
                raise ConfigError(f"request {request_id}: no RankInfo for prefill rank {pull.prefill_rank}")
            if isinstance(remote_blocks, Mapping):
                if pull.prefill_rank not in remote_blocks:
                    raise ConfigError(f"request {request_id}: no block ids for prefill rank {pull.prefill_rank}")
                blocks = remote_blocks[pull.prefill_rank]
            else:
                blocks = remote_blocks
            if self.landing_buffers is not None and self.landing_buffers.lands(info.layout, pull):
                land = self.landing_buffers.prepare(request_id, pull, info.layout, blocks, local_blocks, tokens)
                landed.append(land)
                work.append((info, self.connect(info, check=False), land.descriptors))
            else:
                peer = self.connect(info)
                desc = pull_descriptors(pull, self.layout, info.layout, ids(local_blocks), ids(blocks))
                work.append((info, peer, desc))

    def close(self) -> None:
        """Disconnect peers and unregister the KV tensors; close the backend if the agent created it."""
        if self.landing_buffers is not None:
            self.landing_buffers.close()
        with self._lock:
            peers, self._peers = [peer for _endpoint, peer in self._peers.values()], {}
            registered, self._registered = self._registered, []
        for peer in peers:
            self.backend.disconnect(peer)
        if self._own_backend:
            self.backend.close()
        elif registered:
            self.backend.unregister_memory(registered)

    def __enter__(self) -> KVAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
