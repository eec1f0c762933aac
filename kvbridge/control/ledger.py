"""Prefill-side block lifetime: leases, DONE counting, expiry and abort. See docs/internals.md."""

from __future__ import annotations

import heapq
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

import attrs
import numpy as np

from kvbridge.base.block_ids import BlockIds
from kvbridge.base.errors import ConfigError, ProtocolError
from kvbridge.control.messages import MAX_BLOCKS, LeaseState, LeaseStatus

_V = TypeVar("_V")
MAX_LEASE_S = 86_400.0  # a day: blocks pinned longer are a leak, not a lease
# How long an answer that holds reads promises the blocks for (at most the lease's remaining time). A lease that ends
# while a rank still reads waits for that rank's DONE or for the last promise given, not for the lease's deadline: a
# decode that died mid-read then ties the blocks up this long, not `lease_s`. A read is milliseconds; one that ends past
# its promise takes the fenced path (its DONE's answer decides), which costs it only a round trip.
READ_HOLD_S = 10.0

log = logging.getLogger(__name__)


@attrs.frozen
class Lease:
    """A request's prefill blocks, held until `expected_pulls` decode ranks said DONE."""

    request_id: str
    epoch: int
    blocks: BlockIds = attrs.field(converter=BlockIds)
    expected_pulls: int | None  # None: the decode side states it
    deadline: float  # on the ledger's clock (monotonic seconds)
    offer_id: str = ""  # names one offer: a second offer with the same id is the same lease
    # The engine reuses the blocks only after `on_release`, so a reader's hold is a promise (False: the
    # engine may free them by itself, e.g. vLLM preempting a request streamed layer by layer).
    holds_reads: bool = True


@attrs.define
class _Entry:
    lease: Lease
    expected: int | None = None
    state: LeaseState = LeaseState.ACTIVE
    done: set[str] = attrs.field(factory=set)
    watchers: dict[str, Hashable] = attrs.field(factory=dict)  # decode rank -> its side channel
    readers: set[str] = attrs.field(factory=set)  # decode ranks that began a pull and have not said DONE
    # readers whose release-only DONE (epoch 0) ended their read: it vouched for nothing, so their fenced
    # DONE after it is not valid (a replayed release-only DONE must not let a read that overlapped the
    # release pass as whole)
    unvouched: set[str] = attrs.field(factory=set)
    forget_at: float = 0.0
    promised_until: float = 0.0  # the latest hold an answer promised a reader (the ledger's clock)


ReleaseCallback = Callable[[Lease, LeaseState], None]
OfferCallback = Callable[[Lease], None]
FinishCallback = Callable[[Lease, LeaseState], None]
ReadingCallback = Callable[[int], None]


class Ledger:
    """Thread-safe lease table of one prefill rank. See docs/internals.md."""

    def __init__(
        self,
        on_release: ReleaseCallback,
        *,
        timeout_s: float = 120.0,
        read_hold_s: float = READ_HOLD_S,
        tombstone_s: float = 600.0,
        max_tombstones: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        _check_seconds("lease timeout", timeout_s)
        _check_seconds("read hold", read_hold_s)
        self._on_release = on_release
        self.timeout_s = timeout_s
        self.read_hold_s = read_hold_s
        self._tombstone_s = tombstone_s
        self._max_tombstones = max_tombstones
        self._clock = clock
        self._lock = threading.Lock()
        self._active: dict[str, _Entry] = {}
        self._finished: OrderedDict[str, _Entry] = OrderedDict()
        # (deadline, epoch, request id) of every offer; stale rows (finished leases) are skipped when
        # popped, so a reap costs O(expired log n) however many leases are active.
        self._deadlines: list[tuple[float, int, str]] = []
        # Release-only DONEs (epoch 0) for requests not offered yet: the plan's notifier may get
        # there before this rank's offer. request id -> (forget at, {decode rank: stated count}).
        self._early: OrderedDict[str, tuple[float, dict[str, int]]] = OrderedDict()
        # Aborts for requests not offered yet (a decode engine may drop a request before this rank's
        # offer): request id -> forget at. The offer then releases at once.
        self._early_aborts: OrderedDict[str, float] = OrderedDict()
        # Finished leases whose blocks a decode rank may still be reading: (request id, epoch) -> entry,
        # released at the readers' last DONE or at the last hold promised them (a row in `_deadlines`).
        self._held: dict[tuple[str, int], _Entry] = {}
        # Epochs are unique per ledger and start at a random point, so a restarted prefill
        # never confirms a lease its previous life handed out.
        self._next_epoch = int.from_bytes(os.urandom(5), "little") + 1
        self._offer_callbacks: list[OfferCallback] = []
        self._finish_callbacks: list[FinishCallback] = []
        self._reading: set[tuple[str, int]] = set()  # (request id, epoch): begun to be read, blocks not released
        self._reading_callbacks: list[ReadingCallback] = []

    def on_offer(self, callback: OfferCallback) -> None:
        """Call `callback(lease)` for every new lease (a side channel wakes the pulls waiting for it)."""
        self._offer_callbacks.append(callback)

    def on_finish(self, callback: FinishCallback) -> None:
        """Call `callback(lease, state)` when a lease ends, however (a side channel answers held queries at once)."""
        self._finish_callbacks.append(callback)

    def on_reading(self, callback: ReadingCallback) -> None:
        """Call `callback(count)`, lock held, when the count of leases read (first BeginPull to release) changes.

        It must not block or call the ledger: a transport serves reads promptly while any is (`expect_reads`)."""
        self._reading_callbacks.append(callback)

    def _count_reading(self, key: tuple[str, int], reading: bool) -> None:
        """Add or drop one lease being read; tell the listeners if the count changed (lock held)."""
        before = len(self._reading)
        (self._reading.add if reading else self._reading.discard)(key)
        for callback in self._reading_callbacks if len(self._reading) != before else ():
            try:
                callback(len(self._reading))
            except Exception:  # a listener failing must not wedge the ledger
                log.exception("on_reading callback failed for lease %s", key[0])

    # -- prefill side ---------------------------------------------------------------------

    def offer(
        self,
        request_id: str,
        blocks: Sequence[int],
        expected_pulls: int | None = None,
        *,
        timeout_s: float | None = None,
        offer_id: str = "",
        holds_reads: bool = True,
    ) -> Lease:
        """Hold `blocks` for `request_id` until `expected_pulls` decode ranks sent DONE. See docs/internals.md."""
        if expected_pulls is not None and expected_pulls < 0:
            raise ConfigError(f"expected_pulls must be >= 0, got {expected_pulls} for request {request_id!r}")
        _check_size(request_id, len(blocks))
        if timeout_s is not None:
            _check_seconds("lease timeout", timeout_s)
        self.reap()
        now = self._clock()
        with self._lock:
            known = self._active.get(request_id) or self._finished.get(request_id)
            if offer_id and known is not None and known.lease.offer_id == offer_id:
                if known.lease.blocks != BlockIds(blocks):
                    raise ConfigError(
                        f"offer {offer_id!r} of request {request_id!r} names other blocks than its lease epoch "
                        f"{known.lease.epoch}; one offer id names one set of blocks"
                    )
                return known.lease
            if request_id in self._active:
                raise ConfigError(
                    f"request {request_id!r} already holds lease epoch {self._active[request_id].lease.epoch}; "
                    "abort or release it before offering it again"
                )
            lease = Lease(
                request_id,
                self._next_epoch,
                BlockIds(blocks),
                expected_pulls,
                now + (timeout_s or self.timeout_s),
                offer_id,
                holds_reads,
            )
            self._next_epoch += 1
            self._finished.pop(request_id, None)
            entry = _Entry(lease, expected_pulls)
            self._active[request_id] = entry
            heapq.heappush(self._deadlines, (lease.deadline, lease.epoch, request_id))
            forget_at, early = self._early.pop(request_id, (0.0, {}))
            for rank, stated in early.items() if forget_at > now else ():
                entry.done.add(rank)
                self._expect(entry, stated, rank)
            aborted = self._early_aborts.pop(request_id, 0.0) > now
            last = entry.expected is not None and len(entry.done) >= entry.expected
        log.debug(
            "lease %s epoch %d: %d blocks, %s pulls expected",
            request_id,
            lease.epoch,
            len(lease.blocks),
            expected_pulls,
        )
        for callback in self._offer_callbacks:
            try:
                callback(lease)
            except Exception:  # a listener failing must not lose the offer
                log.exception("on_offer callback failed for request %s", request_id)
        if aborted:
            self._finish(entry, LeaseState.ABORTED)
        elif last:
            self._finish(entry, LeaseState.RELEASED)
        return lease

    def extend(self, request_id: str, blocks: Sequence[int]) -> bool:
        """Add `blocks` to an active lease; False, and nothing changed, when the request holds no active lease.

        A request streamed while prefill computes it gets its blocks chunk by chunk."""
        with self._lock:
            entry = self._active.get(request_id)
            if entry is None:
                return False
            new = BlockIds(blocks).array
            added = new[~np.isin(new, entry.lease.blocks.array)]
            _check_size(request_id, len(entry.lease.blocks) + len(added))
            if len(added):
                entry.lease = attrs.evolve(entry.lease, blocks=entry.lease.blocks + added)
        return True

    def hold_reads(self, request_id: str) -> bool:
        """From now on the engine frees the active lease's blocks only through `on_release`. See docs/internals.md."""
        with self._lock:
            entry = self._active.get(request_id)
            if entry is None:
                return False
            entry.lease = attrs.evolve(entry.lease, holds_reads=True)
        return True

    def abort(self, request_id: str) -> list[Hashable]:
        """End the request's lease now; returns the side channels of decode ranks that began. See docs/internals.md."""
        with self._lock:
            entry = self._active.get(request_id)
            if entry is None and request_id not in self._finished:
                self._stash_abort(request_id)
        if entry is None or not self._finish(entry, LeaseState.ABORTED):
            return []
        return list(entry.watchers.values())

    def reap(self) -> int:
        """Expire every lease past its deadline; returns how many expired."""
        now = self._clock()
        due, unheld = [], []
        with self._lock:
            while self._deadlines and self._deadlines[0][0] <= now:
                _deadline, epoch, request_id = heapq.heappop(self._deadlines)
                entry = self._active.get(request_id)
                if entry is not None and entry.lease.epoch == epoch:
                    due.append(entry)
                held = self._held.pop((request_id, epoch), None)
                if held is not None:  # its readers never said DONE: the hold promised them ended
                    unheld.append(held)
        for entry in unheld:
            self._release(entry)
        return sum(self._finish(e, LeaseState.EXPIRED) for e in due)

    def next_deadline_s(self) -> float | None:
        """Seconds until the earliest lease deadline `reap` may act on (None: no lease has one)."""
        with self._lock:
            if not self._deadlines:
                return None
            return max(0.0, self._deadlines[0][0] - self._clock())

    @property
    def active(self) -> list[str]:
        with self._lock:
            return list(self._active)

    def held(self) -> tuple[int, int]:
        """How many leases hold blocks now (active, or ended with a reader still reading), and how many blocks."""
        with self._lock:
            entries = [*self._active.values(), *self._held.values()]
            return len(entries), sum(len(e.lease.blocks) for e in entries)

    def state(self, request_id: str) -> LeaseState:
        with self._lock:
            entry = self._active.get(request_id) or self._finished.get(request_id)
            return entry.state if entry else LeaseState.UNKNOWN

    # -- decode side (through the side channel) ------------------------------------------------

    def begin(
        self,
        request_id: str,
        decode_rank: str,
        watcher: Hashable | None = None,
        expected_pulls: int = 0,
        *,
        blocks: Sequence[int] = (),
    ) -> LeaseStatus:
        """A decode rank is about to read `blocks`: the lease as it stands. See docs/internals.md."""
        self.reap()
        with self._lock:
            entry = self._active.get(request_id)
            if entry is not None:
                _check_begin(entry, decode_rank, blocks)
                if watcher is not None:
                    entry.watchers[decode_rank] = watcher
                entry.readers.add(decode_rank)
                self._count_reading((request_id, entry.lease.epoch), True)
                self._expect(entry, expected_pulls, decode_rank)
        return self.query(request_id)

    def query(self, request_id: str, epoch: int = 0) -> LeaseStatus:
        """The lease's state; `valid` means ACTIVE (with that epoch, if given) right now."""
        self.reap()
        with self._lock:
            entry = self._active.get(request_id) or self._finished.get(request_id)
            if entry is None:
                return LeaseStatus(request_id, LeaseState.UNKNOWN)
            return self._status(entry, valid=entry.state is LeaseState.ACTIVE and epoch in (0, entry.lease.epoch))

    def done(self, request_id: str, decode_rank: str, epoch: int = 0, expected_pulls: int = 0) -> LeaseStatus:
        """Count a DONE (idempotent per decode rank). `valid`: blocks not released before it. See docs/internals.md."""
        self.reap()
        with self._lock:
            unheld = self._end_read(request_id, decode_rank, epoch)
        for held in unheld:
            self._release(held)
        with self._lock:
            entry = self._active.get(request_id)
            if entry is None:
                old = self._finished.get(request_id)
                if old is None:
                    if epoch == 0:
                        self._stash(request_id, decode_rank, expected_pulls)
                    return LeaseStatus(request_id, LeaseState.UNKNOWN)
                counted = old.state is LeaseState.RELEASED and decode_rank in old.done
                vouched = epoch == 0 or decode_rank not in old.unvouched
                return self._status(old, valid=counted and vouched and epoch in (0, old.lease.epoch))
            if epoch not in (0, entry.lease.epoch) or (epoch and decode_rank in entry.unvouched):
                return self._status(entry, valid=False)
            if epoch == 0 and decode_rank in entry.readers:
                entry.unvouched.add(decode_rank)
            entry.readers.discard(decode_rank)
            entry.done.add(decode_rank)
            self._expect(entry, expected_pulls, decode_rank)
            last = entry.expected is not None and len(entry.done) >= entry.expected
        finished = last and self._finish(entry, LeaseState.RELEASED)
        with self._lock:  # released: on_release ran (not held for a rank still reading)
            held = (request_id, entry.lease.epoch) in self._held
            return self._status(entry, valid=True, released=finished and not held)

    # -- internals ----------------------------------------------------------------------------

    def _stash(self, request_id: str, decode_rank: str, expected_pulls: int) -> None:
        """Keep a release-only DONE that came before the offer, for `timeout_s` (lock held)."""
        now = self._clock()
        _evict(self._early, self._max_tombstones - 1, lambda early: early[0], now)  # room for this one
        _, ranks = self._early.setdefault(request_id, (now + self.timeout_s, {}))
        ranks[decode_rank] = expected_pulls

    def _stash_abort(self, request_id: str) -> None:
        """Keep an abort that came before the offer, for `timeout_s` (lock held)."""
        now = self._clock()
        _evict(self._early_aborts, self._max_tombstones - 1, lambda forget_at: forget_at, now)
        self._early_aborts[request_id] = now + self.timeout_s

    def _expect(self, entry: _Entry, expected_pulls: int, decode_rank: str) -> None:
        """Take the release count a decode rank states, if the lease has none yet (lock held)."""
        if expected_pulls <= 0:
            return
        if entry.expected is None:
            entry.expected = expected_pulls
        elif entry.expected != expected_pulls:
            log.warning(
                "request %s: decode rank %s states %d pulls, the lease expects %d; keeping %d",
                entry.lease.request_id,
                decode_rank,
                expected_pulls,
                entry.expected,
                entry.expected,
            )

    def _end_read(self, request_id: str, decode_rank: str, epoch: int) -> list[_Entry]:
        """A DONE from `decode_rank`: its read of the held leases it names ended.

        Returns those no longer read by anyone, taken out of `_held` (lock held)."""
        unheld = []
        for key in [(request_id, epoch)] if epoch else [k for k in self._held if k[0] == request_id]:
            held = self._held.get(key)
            if held is not None:
                if not epoch and decode_rank in held.readers:
                    held.unvouched.add(decode_rank)
                held.readers.discard(decode_rank)
                if not held.readers:
                    unheld.append(self._held.pop(key))
        return unheld

    def _status(self, entry: _Entry, *, valid: bool, released: bool = False) -> LeaseStatus:
        """The lease as the asker sees it; one that holds reads promises its blocks for `remaining_s` (lock held)."""
        lease, now = entry.lease, self._clock()
        remaining = max(0.0, lease.deadline - now) if entry.state is LeaseState.ACTIVE else 0.0
        held = valid and lease.holds_reads and entry.state is LeaseState.ACTIVE
        if held:
            remaining = min(remaining, self.read_hold_s)
            entry.promised_until = max(entry.promised_until, now + remaining)
        return LeaseStatus(
            lease.request_id, entry.state, valid, lease.epoch, lease.blocks, remaining, released, reads_held=held
        )

    def _finish(self, entry: _Entry, state: LeaseState) -> bool:
        """Move an active lease to `state` (published first), then call `on_release`; False if already finished.

        While decode ranks are still reading it (not at expiry), hold it until their DONEs or the end of the last hold
        promised them, whichever comes first."""
        now = self._clock()
        with self._lock:
            if self._active.get(entry.lease.request_id) is not entry:
                return False
            del self._active[entry.lease.request_id]
            entry.state = state
            entry.forget_at = now + self._tombstone_s
            self._finished[entry.lease.request_id] = entry
            _evict(self._finished, self._max_tombstones, lambda finished: finished.forget_at, now)
            until = min(entry.promised_until, entry.lease.deadline)
            hold = state is not LeaseState.EXPIRED and bool(entry.readers) and until > now
            if hold:  # released by their last DONE, or by reap() when the promise ends
                self._held[(entry.lease.request_id, entry.lease.epoch)] = entry
                heapq.heappush(self._deadlines, (until, entry.lease.epoch, entry.lease.request_id))
        for callback in self._finish_callbacks:
            try:
                callback(entry.lease, state)
            except Exception:  # a listener failing must not keep the blocks from their release
                log.exception("on_finish callback failed for request %s", entry.lease.request_id)
        if entry.readers and state is not LeaseState.EXPIRED:  # (a read past its hold is fenced by its DONE)
            log.info(
                "lease %s epoch %d %s while %s still read it: its %d blocks are released %s",
                entry.lease.request_id,
                entry.lease.epoch,
                state.value,
                sorted(entry.readers),
                len(entry.lease.blocks),
                f"at their DONE or in {until - now:.1f}s" if hold else "now: no hold promised them runs",
            )
        if hold:
            return True
        self._release(entry)
        return True

    def _release(self, entry: _Entry) -> None:
        """Hand a finished lease's blocks back to the engine (`on_release`, outside the lock)."""
        with self._lock:
            self._count_reading((entry.lease.request_id, entry.lease.epoch), False)
        state = entry.state
        if state is not LeaseState.RELEASED:
            log.info(
                "lease %s epoch %d %s with %d of %s DONEs; releasing %d blocks",
                entry.lease.request_id,
                entry.lease.epoch,
                state.value,
                len(entry.done),
                entry.expected,
                len(entry.lease.blocks),
            )
        try:
            self._on_release(entry.lease, state)
        except Exception:  # the engine's callback failing must not wedge the ledger or the server
            log.exception("on_release callback failed for request %s", entry.lease.request_id)


def _check_begin(entry: _Entry, decode_rank: str, blocks: Sequence[int]) -> None:
    """Refuse a BeginPull of `entry` (leaving it as it was) that is stale or names blocks outside the lease."""
    request_id = entry.lease.request_id
    if decode_rank in entry.done:  # its DONE came first: a BeginPull it gave up on, served late
        raise ProtocolError(
            f"BeginPull of request {request_id!r} from {decode_rank} came after that rank's DONE of "
            f"lease epoch {entry.lease.epoch}: refused as stale; a rank reads a lease once"
        )
    asked = BlockIds(blocks).array
    foreign = np.unique(asked[~np.isin(asked, entry.lease.blocks.array)]).tolist()
    if foreign:
        log.warning(
            "request %s: decode rank %s named blocks %s outside lease epoch %d: refused, lease left as it was",
            request_id,
            decode_rank,
            foreign[:8],
            entry.lease.epoch,
        )
        raise ProtocolError(
            f"BeginPull of request {request_id!r} names {len(foreign)} blocks that its lease does not "
            f"hold (e.g. {foreign[:4]}): refused; pass the remote_block_ids the prefill "
            "engine returned for this request"
        )


def _check_seconds(what: str, seconds: float) -> None:
    """A lease's times are positive and at most MAX_LEASE_S: NaN would never expire, inf overflows a timer."""
    if not 0 < seconds <= MAX_LEASE_S:
        raise ConfigError(f"{what} must be positive seconds, at most {MAX_LEASE_S:g}, got {seconds}")


def _check_size(request_id: str, nblocks: int) -> None:
    """A lease's blocks must fit in one side-channel message (its LeaseStatus)."""
    if nblocks > MAX_BLOCKS:
        raise ConfigError(
            f"request {request_id!r} would hold {nblocks} blocks, more than the {MAX_BLOCKS} one side-channel "
            "message carries; use larger KV blocks or shorter prompts"
        )


def _evict(table: OrderedDict[str, _V], keep: int, forget_at: Callable[[_V], float], now: float) -> None:
    """Drop the oldest entries (insertion order) while more than `keep` remain or the oldest is due."""
    while table and (len(table) > keep or forget_at(next(iter(table.values()))) <= now):
        table.popitem(last=False)
