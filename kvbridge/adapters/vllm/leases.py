"""Prefill side: which finished requests still hold blocks, until their pullers' DONE or lease expiry.

A DONE may arrive before the worker hears from its scheduler that the request finished (decode is
quick); it is kept and counted when the offer comes. A DONE after expiry is answered `ok=False`,
since the blocks may already be reused: decode then reports a load error and recomputes.
"""

from __future__ import annotations

import logging
import threading
import time

import attrs

from kvbridge.adapters.vllm.channel import Done, DoneAck

log = logging.getLogger(__name__)


@attrs.define
class _Entry:
    deadline: float | None = None  # None until offered
    expected: int = 1
    ranks: set[int] = attrs.Factory(set)
    seen: float = attrs.Factory(time.monotonic)


class Leases:
    """Thread-safe: `done` runs on the side-channel thread, the rest on vLLM's worker thread."""

    def __init__(self, lease_s: float, clock=time.monotonic) -> None:
        self.lease_s = lease_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._released: set[str] = set()
        self._expired: dict[str, float] = {}  # request -> when; answers late DONEs, pruned after a lease

    def offer(self, request_id: str) -> None:
        """The request finished prefill; hold its blocks for `lease_s` at most."""
        with self._lock:
            entry = self._entries.setdefault(request_id, _Entry())
            entry.deadline = self._clock() + self.lease_s
            self._settle(request_id, entry)

    def done(self, msg: Done) -> DoneAck:
        with self._lock:
            if msg.request_id in self._expired:
                return DoneAck(ok=False, reason=f"lease of {msg.request_id} expired before DONE")
            entry = self._entries.setdefault(msg.request_id, _Entry())
            entry.ranks.add(msg.decode_rank)
            entry.expected = msg.expected
            self._settle(msg.request_id, entry)
            return DoneAck(ok=True)

    def _settle(self, request_id: str, entry: _Entry) -> None:
        if entry.deadline is not None and len(entry.ranks) >= entry.expected:
            del self._entries[request_id]
            self._released.add(request_id)

    def take_released(self) -> set[str]:
        """Requests whose blocks can be freed now: every DONE arrived, or the lease ran out."""
        now = self._clock()
        with self._lock:
            for rid, entry in list(self._entries.items()):
                if entry.deadline is not None and now >= entry.deadline:
                    log.warning("lease of %s expired after %.0fs with %d/%d DONEs: blocks freed",
                                rid, self.lease_s, len(entry.ranks), entry.expected)
                    del self._entries[rid]
                    self._expired[rid] = now
                    self._released.add(rid)
                elif entry.deadline is None and now - entry.seen > self.lease_s:
                    del self._entries[rid]  # a DONE for a request this rank never held
            for rid, when in list(self._expired.items()):
                if now - when > self.lease_s:
                    del self._expired[rid]
            out, self._released = self._released, set()
        return out

    def held(self) -> int:
        with self._lock:
            return sum(1 for e in self._entries.values() if e.deadline is not None)
