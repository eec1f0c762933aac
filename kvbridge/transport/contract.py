"""The transport contract: `MigrationBackend`, its peers and its transfer handles. See docs/internals.md."""

from __future__ import annotations

import abc
import heapq
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, ClassVar, Literal

import attrs
import numpy as np

from kvbridge.base import wire
from kvbridge.base.errors import ConfigError, KVBridgeError, PeerGone, TransferFailed, TransferTimeout
from kvbridge.base.lanes import Lanes
from kvbridge.base.memory import (
    Descriptors,
    FactoredDescriptors,
    RegionIndex,
    as_descriptors,
    as_regions,
    merge_runs,
    split_large,
    total_bytes,
)
from kvbridge.base.options import BackendOptions, checked
from kvbridge.base.threadname import NamedThread
from kvbridge.base.types import BackendCapabilities, BackendConfig, EndpointInfo, MemoryRegion

log = logging.getLogger(__name__)

Op = Literal["read", "write"]


@attrs.define(eq=False)
class Peer:
    """A connected remote endpoint. `handle` is whatever the transport needs to reach it."""

    endpoint: EndpointInfo
    handle: Any = None
    regions: RegionIndex = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.regions = RegionIndex(self.endpoint.regions)

    @property
    def name(self) -> str:
        return f"{self.endpoint.backend}://{self.endpoint.address}"


class TransferHandle:
    """A submitted transfer. `wait` raises the transport's error; `done` never blocks. See docs/internals.md."""

    def __init__(self, future: Future, *, peer: str, descriptors: int, nbytes: int) -> None:
        self._future = future
        self.peer = peer
        self.descriptors = descriptors
        self.nbytes = nbytes

    @classmethod
    def completed(cls, *, peer: str, descriptors: int = 0, nbytes: int = 0) -> TransferHandle:
        fut: Future = Future()
        fut.set_result(None)
        return cls(fut, peer=peer, descriptors=descriptors, nbytes=nbytes)

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the transfer finished; raise TransferTimeout or the transport's TransferError."""
        try:
            self._future.result(timeout=timeout)
        except TimeoutError:
            if self._future.done():  # the transport's own timeout (a TransferTimeout) says what timed out
                raise
            raise TransferTimeout(
                f"transfer of {self.nbytes} bytes in {self.descriptors} descriptors with {self.peer} "
                f"did not finish within {timeout}s; check that the peer is alive and reachable",
                peer=self.peer,
                cause="timeout",
            ) from None

    def add_done_callback(self, fn: Callable[[TransferHandle], None]) -> None:
        self._future.add_done_callback(lambda _f: fn(self))

    def exception(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None

    @property
    def retries(self) -> int:
        """Resubmissions this transfer needed (the transport's own and deadline retries); 0 until done."""
        return _retries_of(self._future) if self._future.done() else 0


class MigrationBackend(abc.ABC):
    """A transport that moves bytes between registered memory of two processes. See docs/internals.md."""

    name: ClassVar[str]
    capabilities: ClassVar[BackendCapabilities]
    #: What `options` is an instance of where none is passed (a backend built directly, not by the registry): it
    #: takes them from `config.options`.
    options_class: ClassVar[type[BackendOptions]] = BackendOptions
    # Seconds a part may take before it is resubmitted once (see the module doc); None: no deadline.
    transfer_deadline_s: float | None = None
    DEADLINE_BYTES_PER_S = 1 << 30  # the slowest rate that still counts as progress

    def __init__(self, config: BackendConfig, options: BackendOptions | None = None) -> None:
        self.config = config
        self.options = options if options is not None else checked(self.options_class, config.options)
        self.protocol = config.protocol or self.capabilities.protocols[0]
        if self.protocol not in self.capabilities.protocols:
            raise ConfigError(
                f"backend {self.name!r} does not support protocol {self.protocol!r}; "
                f"choose one of {list(self.capabilities.protocols)}"
            )
        self._lock = threading.RLock()
        self._local = RegionIndex()
        self._closed = False
        # named in the OS as well: a thread a native transport starts from one of these is named after it
        self._lanes = Lanes(self.options.workers, f"kvbridge-{self.name}")

    def _spawn(self, peer: Peer, fn: Callable[[], Any]) -> Future:
        """Run a blocking transport call with `peer` on that peer's threads (`workers` of them at most).

        A peer whose calls hang holds its own threads only (`kvbridge.base.lanes`)."""
        return self._lanes.submit(peer.name, fn)

    # -- what transports implement ---------------------------------------------------------

    @abc.abstractmethod
    def _register(self, regions: Sequence[MemoryRegion]) -> None:
        """Make these regions readable/writable by peers (one call for the whole batch)."""

    @abc.abstractmethod
    def _unregister(self, regions: Sequence[MemoryRegion]) -> None:
        """Undo `_register`."""

    @abc.abstractmethod
    def _address(self) -> str:
        """The transport address peers connect to."""

    @abc.abstractmethod
    def _connect(self, endpoint: EndpointInfo) -> Any:
        """Open whatever reaches the peer; the result is stored as `Peer.handle`."""

    @abc.abstractmethod
    def _submit(self, peer: Peer, desc: Descriptors, op: Op) -> Future:
        """Start moving `desc` (bounds-checked, at most `max_batch` rows, merged if possible). See docs/internals.md."""

    def _disconnect(self, peer: Peer) -> None:
        """Release what `_connect` opened (optional)."""

    def _regions(self, x: Any) -> list[MemoryRegion]:
        """What `register_memory` was given, as regions (host memory; a device-bound wrapper asks its device)."""
        return as_regions(x)

    def _shutdown(self) -> None:
        """Stop threads and release the engine (optional)."""

    # -- public API ------------------------------------------------------------------------

    def register_memory(self, x: Any) -> list[MemoryRegion]:
        """Register a tensor, list of tensors, numpy array or (address, length) pairs, once each."""
        self._check_open()
        regions = self._regions(x)
        if not regions:
            raise ConfigError("register_memory() got nothing to register")
        for r in regions:
            if r.kind not in self.capabilities.memory_kinds:
                raise ConfigError(
                    f"backend {self.name!r} cannot reach {r.kind.value} memory; "
                    f"it reaches {sorted(k.value for k in self.capabilities.memory_kinds)}. "
                    "Pick a transport that reaches it, or stage through host memory"
                )
        with self._lock:
            known = {r.addr for r in self._local.regions}
            fresh = [r for r in regions if r.addr not in known]
            if fresh:
                self._register(fresh)
                self._local.add(fresh)
        log.debug("%s registered %d regions (%d new)", self.name, len(regions), len(fresh))
        return regions

    def unregister_memory(self, x: Any) -> None:
        """Unregister what `register_memory` registered."""
        with self._lock:
            removed = self._local.remove(r.addr for r in self._regions(x))
            if removed:
                self._unregister(removed)

    @property
    def registered(self) -> tuple[MemoryRegion, ...]:
        return self._local.regions

    def publish(self, ranges: Any = None, *, waited: bool = False) -> None:
        """Make local bytes current for peers that read them: call before offering blocks. See docs/internals.md."""

    def accept(self, ranges: Any = None) -> None:
        """Make bytes a peer wrote into local memory visible to compute (same `ranges` as `publish`).

        Nothing to do for host memory; local reads need no call: their handle completes after this."""

    def expect_reads(self, leases: int) -> None:
        """How many leases on this side's memory peers are reading now (0: none; the ledger's `on_reading` calls it).

        A transport whose passive side must make progress for a peer's read to advance (NIXL over UCX TCP) serves
        promptly while it is above 0, and only now and then otherwise. Must not block. Nothing to do for the rest."""

    def peer_addresses(self, addrs: Any) -> np.ndarray:
        """Where peers address these local addresses (the same, unless memory is staged through host mirrors)."""
        return np.asarray(addrs, dtype=np.int64).reshape(-1)

    def endpoint(self) -> EndpointInfo:
        return EndpointInfo(
            backend=self.name, protocol=self.protocol, address=self._address(), regions=self._local.regions
        )

    def endpoint_info(self) -> bytes:
        """This endpoint, versioned and self-describing: what a peer passes to `connect`."""
        self._check_open()
        return wire.encode(self.endpoint())

    def connect(self, info: bytes | EndpointInfo) -> Peer:
        """Connect to a peer described by its `endpoint_info()`."""
        self._check_open()
        endpoint = info if isinstance(info, EndpointInfo) else wire.decode(info, EndpointInfo)
        if endpoint.backend != self.name:
            raise ConfigError(
                f"peer endpoint is for backend {endpoint.backend!r}, this is {self.name!r}; "
                "both sides must select the same migration backend"
            )
        if endpoint.protocol != self.protocol:
            raise ConfigError(
                f"peer {endpoint.address} speaks {endpoint.protocol!r}, this side {self.protocol!r}; "
                "start both sides with the same protocol"
            )
        return Peer(endpoint=endpoint, handle=self._connect(endpoint))

    def disconnect(self, peer: Peer) -> None:
        self._disconnect(peer)

    def transfer(self, peer: Peer, descriptors: Any, op: Op = "read") -> TransferHandle:
        """Move (local_addr, remote_addr, length) descriptors as one transfer. See docs/internals.md."""
        self._check_open()
        if op not in ("read", "write"):
            raise ConfigError(f"op must be 'read' or 'write', got {op!r}")
        if not getattr(self.capabilities, op):
            raise ConfigError(f"backend {self.name!r} does not support {op}")
        desc = self._checked(peer, descriptors)
        if len(desc) == 0:
            return TransferHandle.completed(peer=peer.name)
        return self._send(peer, desc, op)

    def _checked(self, peer: Peer, descriptors: Any) -> Descriptors | FactoredDescriptors:
        """Descriptors normalized, merged and bounds-checked against both sides' registrations."""
        if isinstance(descriptors, FactoredDescriptors):
            spans = [descriptors.spans(remote=False), descriptors.spans(remote=True)]
            # One range per region holds all its rows; where it is not inside one registration (it spans
            # two tensors, or a hole), check the rows themselves.
            if len(self._local.outside(*spans[0])) or len(peer.regions.outside(*spans[1])):
                return self._checked(peer, descriptors.expand())
            return descriptors
        return self._in_bounds(peer, merge_runs(as_descriptors(descriptors)))

    def _in_bounds(self, peer: Peer, desc: Descriptors) -> Descriptors:
        """`desc`, once every row is inside the local registration and the peer's published regions."""
        self._local.check(desc[:, 0], desc[:, 2], side="local", peer="")
        peer.regions.check(desc[:, 1], desc[:, 2], side="remote", peer=peer.name)
        return desc

    def _send(self, peer: Peer, desc: Descriptors | FactoredDescriptors, op: Op) -> TransferHandle:
        """Cut checked descriptors to the transport's piece size and batch limit; submit each. See docs/internals.md."""
        nbytes = total_bytes(desc)
        cap = self.capabilities
        step = cap.max_batch or len(desc)
        chunks = desc.chunks(step) if isinstance(desc, FactoredDescriptors) else [desc]
        parts, sent, through = [], 0, 0
        for chunk in chunks:
            if cap.max_descriptor_bytes:
                chunk = split_large(chunk, cap.max_descriptor_bytes)
            for i in range(0, len(chunk), step):
                part = chunk[i : i + step]
                through += int(part[:, 2].sum())
                # A transport may run the parts one after another: each part's deadline allows for those before it.
                parts.append(self._submit_part(peer, part, op, through))
            sent += len(chunk)
        future = parts[0] if len(parts) == 1 else _gather(parts)
        return TransferHandle(future, peer=peer.name, descriptors=sent, nbytes=nbytes)

    def _submit_part(self, peer: Peer, desc: Descriptors, op: Op, through: int) -> Future:
        """Submit one part under the deadline; `through`: bytes of this transfer up to the end of this part."""
        first = self._submit(peer, desc, op)
        if not self.transfer_deadline_s:
            return first
        deadline = self.transfer_deadline_s + through / self.DEADLINE_BYTES_PER_S
        return _DeadlineRetry(self, peer, desc, op, first, deadline).future

    def raw_transfer(
        self, peer: Peer, local_addr: int, remote_addr: int, length: int, op: Op = "read"
    ) -> TransferHandle:
        """One descriptor handed straight to the transport: no merging, cutting or batching. See docs/internals.md."""
        self._check_open()
        desc = self._in_bounds(peer, as_descriptors([(local_addr, remote_addr, length)]))
        return TransferHandle(self._submit(peer, desc, op), peer=peer.name, descriptors=1, nbytes=int(length))

    def close(self) -> None:
        """Unregister memory and stop the transport; safe to call twice or after a peer died."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            regions = self._local.regions
            self._local = RegionIndex()
        try:
            if regions:
                self._unregister(regions)
        except KVBridgeError as exc:
            log.warning("%s: unregistering on close failed: %s", self.name, exc)
        finally:
            self._lanes.shutdown(wait=True, cancel_futures=True)
            self._shutdown()

    def __enter__(self) -> MigrationBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError(f"backend {self.name!r} is closed; create a new one")


class WrappingBackend(MigrationBackend):
    """A transport that adds to another (`backend`, owned): every contract hook goes to it. See docs/internals.md."""

    def __init__(
        self, backend: MigrationBackend, capabilities: BackendCapabilities, options: BackendOptions | None = None
    ) -> None:
        self.backend = backend
        self.name = backend.name  # type: ignore[misc]
        self.capabilities = capabilities  # type: ignore[misc]
        super().__init__(attrs.evolve(backend.config, protocol=backend.protocol), options)

    def _register(self, regions: Sequence[MemoryRegion]) -> None:
        self.backend.register_memory(list(regions))

    def _unregister(self, regions: Sequence[MemoryRegion]) -> None:
        self.backend.unregister_memory(list(regions))

    def _address(self) -> str:
        return self.backend.endpoint().address

    def endpoint(self) -> EndpointInfo:
        return self.backend.endpoint()  # the transport's own (a token it publishes included)

    def _connect(self, endpoint: EndpointInfo) -> Any:
        return self.backend.connect(endpoint)

    def _disconnect(self, peer: Peer) -> None:
        self.backend.disconnect(peer.handle)

    def expect_reads(self, leases: int) -> None:
        self.backend.expect_reads(leases)

    def _shutdown(self) -> None:
        self.backend.close()


@attrs.define(eq=False)
class _Alarm:
    fn: Callable[[], None]
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


class _Watchdog:
    """One thread runs the transfer deadlines' alarms: a thread per transfer would cost more than a small transfer.

    Nearly every alarm is cancelled (its transfer ended in time), and a wake-up per transfer would cost the engine's
    threads the CPU and the GIL for nothing. So the thread sleeps until a time it sets itself (`_wake_at`), and
    `after` wakes it only for an alarm due before then. When it wakes it drops the cancelled alarms at the head,
    due or not; if that empties the heap it still sleeps until the latest time among those it dropped this time, so
    the next transfer's alarm (due later) does not wake it either. It then wakes about once a deadline, not once a
    transfer. Only this time's: a far alarm cancelled long ago (another backend's longer deadline) would otherwise
    keep it sleeping past every new alarm, and each would wake it.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, _Alarm]] = []
        self._seq = 0
        self._thread: threading.Thread | None = None
        self._wake_at: float | None = None  # when the thread wakes by itself; None: only when notified
        self.wakeups = 0  # how often the thread came back from a wait

    def after(self, seconds: float, fn: Callable[[], None]) -> _Alarm:
        alarm = _Alarm(fn)
        due = time.monotonic() + seconds
        with self._cond:
            self._seq += 1
            heapq.heappush(self._heap, (due, self._seq, alarm))
            if self._thread is None:
                self._thread = NamedThread(target=self._run, name="kvbridge-deadlines", daemon=True)
                self._thread.start()
            elif self._wake_at is None or due < self._wake_at:
                self._cond.notify()
        return alarm

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    horizon = 0.0  # the latest due time among the cancelled alarms dropped early at this wake
                    while self._heap and self._heap[0][2].cancelled:
                        horizon = max(horizon, heapq.heappop(self._heap)[0])
                    now = time.monotonic()
                    if self._heap and self._heap[0][0] <= now:
                        break
                    self._wake_at = self._heap[0][0] if self._heap else (horizon if horizon > now else None)
                    self._cond.wait(None if self._wake_at is None else self._wake_at - now)
                    self.wakeups += 1
                _, _, alarm = heapq.heappop(self._heap)
            if not alarm.cancelled:
                try:
                    alarm.fn()
                except Exception:  # an alarm's bug must not stop every other deadline
                    log.exception("transfer deadline handler failed")


_WATCHDOG = _Watchdog()


class _DeadlineRetry:
    """One part of a transfer under the deadline (see the module doc). See docs/internals.md."""

    def __init__(
        self, backend: MigrationBackend, peer: Peer, desc: Descriptors, op: Op, first: Future, deadline: float
    ) -> None:
        self.future: Future = Future()
        self._backend, self._peer, self._desc, self._op = backend, peer, desc, op
        self._deadline = deadline
        # re-entrant: cancelling a pending attempt runs its done-callback (`_settle`) in the cancelling thread
        self._lock = threading.RLock()
        self._attempts = [first]
        self._retried = self._timed_out = self._stuck = False
        self._resubmitting = False  # between a retry's decision and its attempt joining `_attempts`
        self._timer = self._arm()
        first.add_done_callback(self._settle)

    def _arm(self) -> _Alarm:
        # a grace past the deadline: a transport's own watchdog (whole seconds) fails a stuck call first
        return _WATCHDOG.after(self._deadline + min(1.0, self._deadline / 2), self._on_deadline)

    def _on_deadline(self) -> None:
        with self._lock:
            if any(_succeeded(a) for a in self._attempts) or all(a.done() for a in self._attempts):
                return
            if self._retried:  # the retry made no progress within the deadline either
                self._timed_out = True
                self._attempts[-1].cancel()  # not started: it never will
        if self._timed_out:
            self._settle(None)
        else:
            self._stuck = True
            self._retry("made no progress within the transfer deadline")

    def _retry(self, why: str) -> None:
        with self._lock:
            if self._retried:
                return
            self._retried = self._resubmitting = True
            if self._attempts[0].cancel():  # not started (held in a queue): it never will
                self._attempts.clear()
            self._timer.cancel()
        log.warning(
            "%s %s of %d descriptors with %s %s (deadline %.1fs); resubmitting it once",
            self._backend.name,
            self._op,
            len(self._desc),
            self._peer.name,
            why,
            self._deadline,
        )
        try:
            again = self._backend._submit(self._peer, self._desc, self._op)
        except Exception as exc:  # noqa: BLE001 - becomes the part's outcome
            again = Future()
            again.set_exception(exc)
        with self._lock:
            self._attempts.append(again)
            self._resubmitting = False
            self._timer = self._arm()
        again.add_done_callback(self._settle)  # runs at once where `again` already ended

    def _settle(self, _f: Future | None) -> None:
        """Retry a first attempt that failed; complete the part once every attempt has returned."""
        with self._lock:
            if self.future.done() or not self._attempts or not all(a.done() for a in self._attempts):
                return
            ok = [a for a in self._attempts if _succeeded(a)]
            gone = any(not a.cancelled() and isinstance(a.exception(), PeerGone) for a in self._attempts)
            retry_now = not ok and not self._retried and not gone  # nothing serves there: a retry cannot succeed
            if self._resubmitting:
                return  # the first attempt ended while its retry is being submitted: settled once that one ends
        if retry_now:
            self._retry(f"failed ({self._attempts[0].exception()})")
            return
        with self._lock:
            if self.future.done():
                return
            self._timer.cancel()
            retries = int(self._retried) + sum(_retries_of(a) for a in self._attempts if not a.cancelled())
            if ok:
                self.future.set_result(retries)
                return
            last = next((a.exception() for a in reversed(self._attempts) if not a.cancelled()), None)
            if gone and not self._retried:
                self.future.set_exception(last)  # not retried: the transport's own words
                return
            ended = [a.exception() for a in self._attempts if not a.cancelled()]
            stalled = self._timed_out or all(isinstance(e, TransferTimeout) for e in ended)  # by the transport's, too
            stuck = self._stuck or stalled
            how = f"made no progress within the {self._deadline:.1f}s transfer deadline" if stuck else "failed"
            # a stuck part's retry may have failed outright rather than stalled as well
            retry = "its retry failed" if stuck and not stalled and last is not None else "so did its retry"
            error = (TransferTimeout if stuck else TransferFailed)(
                f"{self._backend.name} {self._op} of {len(self._desc)} descriptors "
                f"({int(self._desc[:, 2].sum())} bytes) with {self._peer.name} {how}, and {retry}"
                + (f" ({last})" if last is not None else "")
                + "; check that the peer is alive, not stalled, and its memory is registered (the engine "
                "recomputes or fails the request)",
                peer=self._peer.name,
                cause="no progress within the transfer deadline" if stuck else getattr(last, "cause", str(last)),
                retries=retries,
            )
            self.future.set_exception(error)


def _succeeded(f: Future) -> bool:
    return f.done() and not f.cancelled() and f.exception() is None


def _retries_of(f: Future) -> int:
    error = f.exception()
    return int(getattr(error, "retries", 0)) if error is not None else int(f.result() or 0)


def _gather(parts: list[Future]) -> Future:
    """A future that resolves when all parts have, with the first error, or to their retries summed."""
    out: Future = Future()
    remaining = [len(parts)]
    lock = threading.Lock()

    def _one_done(_f: Future) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            errors = [p.exception() for p in parts if p.exception() is not None]
            retries = sum(_retries_of(p) for p in parts)
            if errors:
                errors[0].retries = retries  # type: ignore[attr-defined]
                out.set_exception(errors[0])
            else:
                out.set_result(retries)

    for p in parts:
        p.add_done_callback(_one_done)
    return out


def wait_all(handles: Sequence[TransferHandle], timeout: float | None = None) -> None:
    """Wait for several handles against one deadline."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for h in handles:
        h.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))


def settle(handles: Sequence[TransferHandle], warn_after_s: float, what: str) -> None:
    """Wait until every transfer ended, failed ones included (`wait_all` stops at the first error).

    Never gives up: a direct read still running may write the blocks it was given, so they are not anyone's to reuse
    until it ends, which the transport's own timeout bounds. A read still running every `warn_after_s` is logged."""
    began = time.monotonic()
    for h in handles:
        while not h.done():
            try:
                h.wait(warn_after_s)
            except KVBridgeError:
                if not h.done():
                    log.warning(
                        "%s: a read from %s still runs after %.1fs; its blocks stay held until it ends (the "
                        "transport's transfer timeout ends it)",
                        what,
                        h.peer,
                        time.monotonic() - began,
                    )
