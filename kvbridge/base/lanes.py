"""Blocking calls run in lanes, one per peer, so that a peer whose calls hang holds only its own threads.

A shared pool of a few threads is head-of-line blocked by one stalled peer: its calls take every thread while
they wait, and the calls to healthy peers queue behind them until the stalled ones time out (a queued read even
counts the wait against its own transfer deadline, and fails). Here each key (a peer) runs at most `per_key` of
its calls at once, on threads of its own. They start on demand and end after `idle_s` without work, so the
threads a process holds follow what is in flight, not how many peers it ever met.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

import attrs

from kvbridge.base.threadname import NamedThread

IDLE_S = 30.0


@attrs.define(eq=False)
class _Lane:
    ready: threading.Condition
    pending: collections.deque[tuple[Future, Callable[[], Any]]] = attrs.field(factory=collections.deque)
    threads: int = 0
    busy: int = 0


class Lanes:
    """A pool whose calls are grouped by key: at most `per_key` of one key run at once, on that key's threads."""

    def __init__(self, per_key: int, name: str, *, idle_s: float = IDLE_S) -> None:
        if per_key < 1:
            raise ValueError(f"per_key must be at least 1, got {per_key}")
        self.per_key, self.name, self.idle_s = per_key, name, idle_s
        self._lock = threading.Lock()
        self._lanes: dict[Hashable, _Lane] = {}
        self._threads: set[threading.Thread] = set()
        self._count = 0
        self._closed = False

    def submit(self, key: Hashable, fn: Callable[[], Any]) -> Future:
        """Run `fn()` in `key`'s lane; its result or exception goes to the returned future."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: cannot submit after shutdown")
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = _Lane(threading.Condition(self._lock))
            lane.pending.append((future, fn))
            if lane.busy + len(lane.pending) > lane.threads and lane.threads < self.per_key:
                lane.threads += 1
                self._count += 1
                thread = NamedThread(
                    target=self._work, args=(key, lane), name=f"{self.name}_{self._count}", daemon=True
                )
                self._threads.add(thread)
                thread.start()
            else:
                lane.ready.notify()
        return future

    def _work(self, key: Hashable, lane: _Lane) -> None:
        try:
            while True:
                with self._lock:
                    while not lane.pending:
                        if self._closed or (not lane.ready.wait(self.idle_s) and not lane.pending):
                            lane.threads -= 1
                            if not lane.threads and self._lanes.get(key) is lane:
                                del self._lanes[key]
                            return
                    future, fn = lane.pending.popleft()
                    lane.busy += 1
                try:
                    if future.set_running_or_notify_cancel():
                        try:
                            future.set_result(fn())
                        except BaseException as exc:  # the caller's to see, through the future
                            future.set_exception(exc)
                finally:
                    with self._lock:
                        lane.busy -= 1
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    @property
    def threads(self) -> int:
        """Threads alive now, over every lane."""
        with self._lock:
            return sum(lane.threads for lane in self._lanes.values())

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Take no more calls; cancel the queued ones (`cancel_futures`) or let them run; join (`wait`)."""
        with self._lock:
            self._closed = True
            for lane in self._lanes.values():
                if cancel_futures:
                    while lane.pending:
                        lane.pending.popleft()[0].cancel()
                lane.ready.notify_all()
            threads = list(self._threads)
        if wait:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()
