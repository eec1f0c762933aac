"""A whole-request read begun before its BeginPulls are answered: when it may, and how it waits for them.

A prefill rank admits a reader's transport addresses while a lease the reader proved lasts, and for the admission's
grace after it (docs/security.md); each valid BeginPull answer says for how long at least (`admitted_s`). Within that
time a decode rank's next read of the rank needs no answer to be let in, so it starts with its BeginPull in flight,
and what it read is used only once the answer says the lease held: the blocks were then held from the offer on, the
read's whole time. See docs/internals.md."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from kvbridge.agent.kv_agent import PullResult
from kvbridge.control.messages import LeaseStatus
from kvbridge.session.pull import HOLD_SLACK_S, HOLD_SLACK_SHARE

# A read starts first only while the rank admits this reader this much longer at least: a read opens its
# connections at its start, and takes milliseconds.
READ_FIRST_MARGIN_S = 1.0


class Admitted:
    """Until when each prefill rank (by side channel url) admits this reader, on this host's monotonic clock."""

    def __init__(self) -> None:
        self._until: dict[str, float] = {}
        self._lock = threading.Lock()

    def answered(self, url: str, asked: float, status: LeaseStatus) -> None:
        """`status` answers a BeginPull sent at `asked`: as strict as a read's hold (`hold_deadline`)."""
        if status.admitted_s > 0:
            until = asked + status.admitted_s * (1 - HOLD_SLACK_SHARE) - HOLD_SLACK_S
            with self._lock:
                self._until[url] = max(until, self._until.get(url, -math.inf))

    def admits(self, url: str) -> bool:
        with self._lock:
            return self._until.get(url, -math.inf) > time.monotonic() + READ_FIRST_MARGIN_S

    def forget(self, url: str | None = None) -> None:
        """Nothing known of `url` (every rank, when None): another engine there, or a failure."""
        with self._lock:
            if url is None:
                self._until.clear()
            else:
                self._until.pop(url, None)


class HeldRead:
    """A read begun first: `landed` runs when it ends, `confirm` once the BeginPulls are answered too.

    A failed BeginPull (`failed`) leaves the read nobody's: neither runs after it."""

    def __init__(self, landed: Callable[[PullResult], None], confirm: Callable[[PullResult], None]) -> None:
        self._landed, self._confirm = landed, confirm
        self._lock = threading.Lock()
        self._result: PullResult | None = None
        self._leased = self._failed = False

    def read(self, result: PullResult) -> None:
        """The read ended (on the transport's thread)."""
        with self._lock:
            if self._failed:
                return
            self._landed(result)
            self._result, go = result, self._leased
        if go:
            self._confirm(result)

    def leased(self) -> None:
        """Every BeginPull was answered, each lease valid."""
        with self._lock:
            self._leased, result = True, self._result
        if result is not None:
            self._confirm(result)

    def failed(self) -> None:
        with self._lock:
            self._failed = True
