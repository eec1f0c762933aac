"""The requests a side channel holds: a BeginPull until its request is offered, a QueryStream until its stream moves.

Each is answered the moment what it waits for happens (the request is woken, from any thread) or its wait runs out.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import zmq

from kvbridge.base.errors import KVBridgeError, ProtocolError, described
from kvbridge.control.dispatch import Dispatcher, Hold
from kvbridge.control.messages import (
    BeginPull,
    LeaseState,
    QueryStream,
    Refused,
)

# The side channel's one logger, whichever of its modules logs: one name for operators' filters.
log = logging.getLogger("kvbridge.control.channel")

MAX_PARKED = 4096  # BeginPulls held for their offer at once; beyond it they are answered at once (client retries)


@attrs.define
class Parked:
    """A held request: a BeginPull until its request is offered, a QueryStream until its stream changes.

    A QueryStream is held at most until its wait runs out. Each keeps what its reply needs."""

    envelope: list[bytes]
    reply_to: bytes
    msg: BeginPull | QueryStream
    peer_host: str | None
    since: float  # monotonic
    deadline: float


class HeldRequests:
    """The requests one serving loop holds, and the wake-ups that answer them.

    Only the serving thread holds and answers; `wake` is called from any thread, and wakes the loop through `wake_out`
    (an inproc socket the loop polls) when something waits for the request woken.
    """

    def __init__(
        self, dispatcher: Dispatcher, send: Callable[[list[bytes]], None], wake_out: zmq.Socket, stop: threading.Event
    ) -> None:
        """`send`: how a reply goes out (its envelope and sealed frame); `stop`: set when the server closes."""
        self._dispatcher = dispatcher
        self._send = send
        self._wake_out = wake_out
        self._stop = stop
        self.parked: dict[str, list[Parked]] = {}  # request id -> the requests held for it
        self.nparked = 0
        # (deadline, request id) of every held request, a heap; stale entries (answered) are skipped when popped
        self._due: list[tuple[float, str]] = []
        self._wake_lock = threading.Lock()
        self._woken: set[str] = set()  # requests woken since the serving loop last looked (under _wake_lock)

    def has_room(self) -> bool:
        """Whether another request may be held (past `MAX_PARKED`, it is answered at once)."""
        return self.nparked < MAX_PARKED

    def hold(self, envelope: list[bytes], reply_to: bytes, held: Hold, peer_host: str | None) -> None:
        """Hold a request the dispatcher answered with `held`, until it is answered or its wait runs out."""
        msg, now = held.msg, time.monotonic()
        parked = Parked(envelope, reply_to, msg, peer_host, now, now + msg.wait_ms / 1000)
        self.parked.setdefault(msg.request_id, []).append(parked)
        self.nparked += 1
        heapq.heappush(self._due, (parked.deadline, msg.request_id))

    def take_woken(self) -> set[str]:
        """The requests woken since the last call (the serving loop takes them once a round)."""
        with self._wake_lock:
            woken, self._woken = self._woken, set()
        return woken

    def nudge(self) -> None:
        """Wake the serving loop (it may be asleep for up to its poll interval)."""
        with self._wake_lock, contextlib.suppress(zmq.ZMQError):
            self._wake_out.send(b"", zmq.NOBLOCK)

    def close(self) -> None:
        """Close the wake-up socket: the serving loop has stopped."""
        with self._wake_lock:
            self._wake_out.close(linger=0)

    def wake(self, request_id: str) -> None:
        """Any thread: `request_id` changed (offered, its stream progressed, its lease ended); answer what waits for it.

        A held `QueryStream` is looked at again only when its request is woken or its wait runs out, so whoever answers
        `streams` wakes the request whenever its answer would change (the ledger wakes it when its lease ends, however
        it ends)."""
        with self._wake_lock:
            # Noted even when nothing is held yet: a query being parked right now is looked at again
            # after it is (each round of the loop parks before it takes the woken set, and takes it
            # whether or not anything is held: the set holds a round's wake-ups at most).
            self._woken.add(request_id)
            if request_id not in self.parked:  # a racy read: at worst one needless wake-up
                return
            if not self._stop.is_set():
                with contextlib.suppress(zmq.Again):  # the loop has wake-ups pending already
                    self._wake_out.send(b"", zmq.NOBLOCK)

    def answer_due(self, now: float, woken: set[str]) -> float | None:
        """Answer the held requests that are due; returns the seconds to the next deadline (None: nothing held).

        Due: the held BeginPulls whose request was offered, the held QueryStreams whose request was `woken` and whose
        stream moved, and those whose wait ran out. Only requests `woken` (every offer wakes its request) or past a
        deadline are looked at: looking at every held request each round would cost a round per message times the
        requests held, which grows with the square of the decodes waiting at once."""
        nearest: float | None = None
        due = {rid for rid in woken if rid in self.parked}
        while self._due and self._due[0][0] <= now:
            due.add(heapq.heappop(self._due)[1])
        for rid in due & self.parked.keys():
            held = collections.deque(self.parked.pop(rid))
            waiting: list[Parked] = []
            try:
                while held:
                    p = held[0]
                    reply = self._reply(p, now, rid in woken)
                    if reply is None:
                        waiting.append(held.popleft())
                        nearest = p.deadline - now if nearest is None else min(nearest, p.deadline - now)
                        continue
                    held.popleft()  # answered: out of `parked` before anything else can fail
                    self.nparked -= 1
                    self._send([*p.envelope, self._dispatcher.seal(p.reply_to, reply)])
            finally:  # whatever failed, the entries not answered stay held, each once
                waiting.extend(held)
                if waiting:
                    self.parked[rid] = waiting
        while self._due and self._due[0][1] not in self.parked:  # answered already
            heapq.heappop(self._due)
        if self._due:
            nearest = self._due[0][0] - now if nearest is None else min(nearest, self._due[0][0] - now)
        return nearest

    def _reply(self, p: Parked, now: float, woken: bool) -> Any:
        """The reply to a held request now, or None to keep holding it.

        Never raises: a failing answer (the engine's `streams`, say) costs that request a `Refused`, not the serving
        loop its round."""
        d = self._dispatcher
        assert d.ledger is not None
        try:
            if isinstance(p.msg, QueryStream):
                assert d.streams is not None  # it was held because streams answered it
                if not (woken or now >= p.deadline):
                    return None
                status = d.streams(p.msg.request_id, p.msg.epoch)
                if now >= p.deadline or d.stream_moved(p.msg, status):
                    return attrs.evolve(status, held_ms=round(max(1e-3, (now - p.since) * 1e3), 3))
                return None
            if d.ledger.state(p.msg.request_id) is LeaseState.UNKNOWN and now < p.deadline:
                return None
            return d.begin(p.msg, p.peer_host, waited_s=now - p.since)
        except KVBridgeError as exc:
            log.warning("%s refused a held %s for %s: %s", d.name, type(p.msg).__name__, p.msg.request_id, exc)
            return Refused("protocol" if isinstance(exc, ProtocolError) else "error", str(exc))
        except Exception as exc:  # a bug must cost one reply, not the loop (leases depend on its reaping)
            log.exception("%s: answering a held %s for %s failed", d.name, type(p.msg).__name__, p.msg.request_id)
            return Refused("internal", described(exc))
