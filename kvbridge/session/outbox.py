"""What one rank tells its engine between steps, and the idle wait. See docs/internals.md."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Protocol

log = logging.getLogger(__name__)


class Inbox(Protocol):
    """An engine's input queue, waited on together with this rank's news (vLLM: `EngineInbox`)."""

    def arm(self) -> None: ...

    def nudge(self) -> None: ...

    def wait(self, timeout_s: float) -> None: ...


class Recorder(Protocol):
    """Where a rank records its transfers and leases for the engine's metrics."""

    def record(
        self, transport: str, peer: str, transfer_s: float, control_s: float, nbytes: int, descriptors: int
    ) -> None: ...

    def record_failure(self, transport: str, peer: str, error: BaseException) -> None: ...

    def record_retries(self, transport: str, peer: str, retries: int) -> None: ...

    def record_lease(self, event: str, leases: int, blocks: int) -> None: ...

    def record_phase(self, phase: str, transport: str, peer: str, seconds: float) -> None: ...

    def record_request(self, kind: str, queued_s: float, wait_s: float, handler_s: float) -> None: ...


class Outbox:
    """One rank's reports to its engine; every method may be called from any thread."""

    def __init__(self, inbox: Inbox | None, *, idle_wait_s: float, stream_idle_wait_s: float) -> None:
        self.inbox = inbox
        self.idle_wait_s = idle_wait_s
        self.stream_idle_wait_s = stream_idle_wait_s
        self._lock = threading.Lock()
        self._news = threading.Condition(self._lock)  # notified whenever there is something new to report
        self._sent: set[str] = set()
        self._recved: set[str] = set()
        self._load_errors: set[int] = set()
        self._timings: dict[str, dict[str, float]] = {}  # finished pulls' phases (ms), for the engine
        self._pulls = 0  # in flight
        self._streams = 0
        log.info(
            "idle engine steps %s",
            f"sleep up to {stream_idle_wait_s * 1e3:g} ms while transfers are in flight and end when a request "
            "arrives (the engine's input queue is watched)"
            if inbox is not None
            else f"sleep at most {idle_wait_s * 1e3:g} ms while pulls are in flight and "
            f"{stream_idle_wait_s * 1e3:g} ms while only streams are (no engine input queue here)",
        )

    def _tell(self) -> None:
        """Wake an idle step waiting in `take` (caller holds the lock)."""
        self._news.notify_all()
        if self.inbox is not None:
            self.inbox.nudge()

    def sent(self, request_id: str) -> None:
        """The request's blocks may be freed."""
        with self._lock:
            self._sent.add(request_id)
            self._tell()

    def recved(
        self,
        request_id: str,
        *,
        report: bool = True,
        failed: Iterable[int] = (),
        timing: dict[str, float] | None = None,
    ) -> None:
        """A pull ended: record its failed blocks and timing, and report the request received. See docs/internals.md."""
        with self._lock:
            self._load_errors.update(failed)
            if timing:
                self._timings[request_id] = timing
            if report:
                self._recved.add(request_id)
                self._tell()

    def nudge(self) -> None:
        """Something else the engine should look at (a finished stream): end an idle wait."""
        with self._lock:
            self._tell()

    def begin(self, stream: bool) -> None:
        """A pull (or a layer-wise stream) is in flight: an idle step may sleep longer (docs/internals.md)."""
        with self._lock:
            if stream:
                self._streams += 1
            else:
                self._pulls += 1

    def end(self, stream: bool) -> None:
        with self._lock:
            if stream:
                self._streams -= 1
            else:
                self._pulls -= 1

    def take(self, idle: bool, pending: bool = False) -> tuple[set[str], set[str]]:
        """The requests sending and receiving finished since the last call.

        In an `idle` step with nothing to report (nor `pending` elsewhere), wait first (docs/internals.md)."""
        with self._lock:
            if idle and not (self._sent or self._recved or pending):
                self._idle_wait()
            sending, self._sent = self._sent, set()
            recving, self._recved = self._recved, set()
        return sending, recving

    def _idle_wait(self) -> None:
        """Sleep an idle step (caller holds the lock) until something is reported."""
        short, long = self.idle_wait_s, self.stream_idle_wait_s
        streams_only = bool(self._streams) and not self._pulls
        watched = self.inbox is not None and bool(self._streams or self._pulls)
        if long <= short or not (streams_only or watched):
            self._news.wait(short)
        elif self.inbox is None:  # only streams, and no way to see a request arrive
            self._news.wait(long)
        else:
            # Armed under the lock: whatever is reported from now on comes after the caller looked, and nudges.
            self.inbox.arm()
            self._lock.release()
            try:
                self.inbox.wait(long)
            finally:
                self._lock.acquire()

    def take_load_errors(self) -> set[int]:
        with self._lock:
            out, self._load_errors = self._load_errors, set()
        return out

    def take_timings(self) -> dict[str, dict[str, float]]:
        with self._lock:
            out, self._timings = self._timings, {}
        return out
