"""Requests arriving at an engine core, told to its worker processes: their idle steps sleep. See docs/internals.md."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import queue
import socket
import threading
import time

from kvbridge.base.threadname import NamedThread

log = logging.getLogger(__name__)


def wake_address(engine_id: str, dp_index: int, pp_rank: int, tp_rank: int) -> bytes:
    """The abstract UNIX socket (in the network namespace of the engine) where that worker rank hears of arrivals."""
    digest = hashlib.sha256(engine_id.encode()).hexdigest()[:24]
    return f"\0kvbridge-arrivals/{digest}/{dp_index}/{pp_rank}/{tp_rank}".encode()


def consumed(inbox: queue.Queue) -> int:
    """How many requests the engine core took from its input queue so far (vLLM never calls `task_done`)."""
    with inbox.mutex:
        return inbox.unfinished_tasks - inbox._qsize()


class ArrivalRelay:
    """In an engine core's process: a datagram to each worker process per request put on the engine's input queue.

    Each carries how many requests were put so far; a step's metadata says how many the engine had taken
    (`consumed`), so a worker knows whether one waits that the step did not see."""

    @classmethod
    def to_ranks(
        cls, inbox: queue.Queue | None, engine_id: str, dp_index: int, pp_size: int, tp_size: int
    ) -> ArrivalRelay | None:
        """A relay to every worker rank of that engine's DP rank (None without an input queue)."""
        ranks = [(pp, tp) for pp in range(pp_size) for tp in range(tp_size)]
        return None if inbox is None else cls(inbox, [wake_address(engine_id, dp_index, *rank) for rank in ranks])

    def __init__(self, inbox: queue.Queue, addresses: list[bytes]) -> None:
        self._inbox = inbox
        self._addresses = addresses
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._closed = False
        self._thread = NamedThread(target=self._run, name="kvbridge-arrivals", daemon=True)
        self._thread.start()
        log.info("requests arriving at this engine core are told to its %d worker process(es)", len(addresses))

    def consumed(self) -> int:
        return consumed(self._inbox)

    def _run(self) -> None:
        cond = self._inbox.not_empty
        with cond:
            put = self._inbox.unfinished_tasks
        self._send(put)  # the first: a worker may sleep long from now on
        while True:
            with cond:
                while not self._closed and self._inbox.unfinished_tasks == put:
                    cond.wait()
                if self._closed:
                    return
                put = self._inbox.unfinished_tasks
                # put() notifies one waiter, which may have been this thread: the engine's own get() hears it too
                cond.notify_all()
            self._send(put)

    def _send(self, put: int) -> None:
        for address in self._addresses:
            # a rank not listening (yet, or any more) misses nothing it needs: it sleeps briefly until it hears one
            with contextlib.suppress(OSError):
                self._sock.sendto(str(put).encode(), address)

    def close(self) -> None:
        with self._inbox.not_empty:
            self._closed = True
            self._inbox.not_empty.notify_all()
        self._thread.join(timeout=5)
        self._sock.close()


class RelayedInbox:
    """In a worker process: its engine core's input queue as the core's `ArrivalRelay` tells of it (an `Inbox`).

    `wait` ends when this rank was nudged since `arm`, or a request was put that the engine had not taken when it
    built this step (`step`). Until the relay was heard, waits last at most `unrelayed_wait_s`."""

    @classmethod
    def for_rank(
        cls, engine_id: str, dp_index: int, pp_rank: int, tp_rank: int, unrelayed_wait_s: float
    ) -> RelayedInbox | None:
        """That worker rank's inbox, or None (logged) where its address is taken."""
        try:
            return cls(wake_address(engine_id, dp_index, pp_rank, tp_rank), unrelayed_wait_s)
        except OSError as exc:  # another worker of this engine id in this network namespace
            log.warning("no relay of the engine's requests to this worker (%s): idle steps sleep briefly", exc)
            return None

    def __init__(self, address: bytes, unrelayed_wait_s: float) -> None:
        self._cond = threading.Condition()
        self._news = False
        self._put = -1  # the most requests put, as the relay last said (-1: not heard yet)
        self._taken = 0  # the requests the engine had taken when it built the current step
        self._unrelayed_wait_s = unrelayed_wait_s
        self._address = address
        self._closed = False
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(address)
        self._thread = NamedThread(target=self._listen, name="kvbridge-arrivals", daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while True:
            data = self._sock.recv(32)
            with self._cond:
                if self._closed:
                    return
                heard = self._put >= 0
                with contextlib.suppress(ValueError):  # anything else in this namespace may write to the socket
                    self._put = max(self._put, int(data))
                    self._cond.notify_all()
                    if not heard:
                        log.info("this worker hears of the requests arriving at its engine core: idle steps sleep")

    def step(self, taken: int) -> None:
        """A step the engine built having taken `taken` requests from its input queue."""
        with self._cond:
            self._taken = max(self._taken, taken)

    def arm(self) -> None:
        with self._cond:
            self._news = False

    def nudge(self) -> None:
        with self._cond:
            self._news = True
            self._cond.notify_all()

    def wait(self, timeout_s: float) -> None:
        with self._cond:
            if self._put < 0:
                timeout_s = min(timeout_s, self._unrelayed_wait_s)
            deadline = time.monotonic() + timeout_s
            while not self._news and self._put <= self._taken:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._cond.wait(remaining)

    def close(self) -> None:
        with self._cond:
            self._closed = True
        with contextlib.suppress(OSError):
            self._sock.sendto(b"", self._address)  # wakes the listener's recv
        self._thread.join(timeout=5)
        self._sock.close()
