"""Where the time goes: the slow line, and a stall watchdog that dumps every thread's stack. See docs/internals.md."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Mapping
from pathlib import Path

import attrs

from kvbridge.options import option, parse

log = logging.getLogger(__name__)
ENV = {"slow_ms": "KVBRIDGE_SLOW_MS", "stall_s": "KVBRIDGE_STALL_S", "stall_dir": "KVBRIDGE_STALL_DIR"}


@attrs.frozen
class WatchOptions:
    slow_ms: float = option(250.0, "a side-channel request or handover whose parts add up to this logs one line", min=0)
    stall_s: float = option(1.0, "a serving loop or pull busy this long without progress dumps every stack", min=0.01)
    stall_dir: str | None = option(None, "a directory that gets a file per stall (besides the log)")


def options() -> WatchOptions:
    """The options the environment sets now."""
    given = {k: os.environ[v] for k, v in ENV.items() if os.environ.get(v)}
    return parse(WatchOptions, given, what=f"the environment ({', '.join(ENV.values())})")


SLOW_MS = options().slow_ms  # read once: checked on every request


def slow(logger: logging.Logger, what: str, parts: Mapping[str, float]) -> None:
    """One line when `parts` (ms) add up to SLOW_MS or more: `slow WHAT: TOTAL ms (part ms, ...)`."""
    total = sum(parts.values())
    if total >= SLOW_MS:
        logger.warning("slow %s: %.1f ms (%s)", what, total, ", ".join(f"{k} {v:.1f}" for k, v in parts.items()))


class Beat:
    """What a watched loop or pull updates; `since` None: idle (waiting, not stalled)."""

    __slots__ = ("__weakref__", "dumped", "name", "since")

    def __init__(self, name: str) -> None:
        self.name = name
        self.since: float | None = time.monotonic()
        self.dumped: float | None = None  # the `since` of the stall already dumped

    def busy(self) -> float:
        self.since = now = time.monotonic()
        return now

    def idle(self) -> None:
        self.since = None


class Watchdog:
    """The process's one watcher thread, started with the first beat (again in a forked child)."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self.stalls = 0  # dumps so far
        self.checked = 0.0  # monotonic time of the last look
        self._beats: weakref.WeakSet[Beat] = weakref.WeakSet()  # a pull dropped without its end is gone too
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, name: str) -> Beat:
        beat = Beat(name)
        with self._lock:
            self._beats.add(beat)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="kvbridge-watchdog", daemon=True)
                self._thread.start()
        return beat

    def forget(self, beat: Beat) -> None:
        with self._lock:
            self._beats.discard(beat)

    def _run(self) -> None:
        while True:
            time.sleep(self.stall_s / 2)  # the watchdog's own period: a beat is never waited on
            try:
                self.check()
            except Exception:  # the watchdog must outlive a failed dump (a full disk)
                log.exception("stall watchdog failed")

    def check(self) -> None:
        """Dump once for the beats stalled now that were not dumped for this stall."""
        now = time.monotonic()
        with self._lock:
            beats = list(self._beats)
        stalled = []
        for b in beats:
            since = b.since
            if since is not None and now - since >= self.stall_s and b.dumped != since:
                b.dumped = since
                stalled.append(f"{b.name} ({now - since:.1f} s)")
        if stalled:
            self.stalls += 1
            self._dump(stalled)
        self.checked = now

    def _dump(self, stalled: list[str]) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        head = f"kvbridge stall in pid {os.getpid()}: no progress in {', '.join(stalled)}; every thread's stack:"
        stacks = [
            f"Thread {names.get(ident, '?')} ({ident}):\n{''.join(traceback.format_stack(frame))}"
            for ident, frame in sys._current_frames().items()
        ]
        text = "\n".join([head, *stacks])
        log.warning("%s", text)
        where = options().stall_dir
        if where:
            path = Path(where, f"stall-{os.getpid()}-{self.stalls}-{time.strftime('%H%M%S')}.txt")
            path.parent.mkdir(parents=True, exist_ok=True)
            # Whole or absent: whoever watches the folder (an operator's tail, a test) never reads half a dump.
            partial = path.with_name(f".{path.name}.partial")
            partial.write_text(text + "\n")
            os.replace(partial, path)
            log.warning("stall stacks written to %s", path)


WATCHDOG = Watchdog(options().stall_s)
_local = threading.local()


def watch(name: str, *, this_thread: bool = False) -> Beat:
    """A beat of this process's watchdog, busy from now (`WATCHDOG.forget` it when done, or drop it).

    `this_thread`: the calling thread's beat from now on, for `progress()`."""
    beat = WATCHDOG.watch(name)
    if this_thread:
        _local.beat = beat
    return beat


def progress() -> None:
    """The calling thread's beat (if any) moved on."""
    beat = getattr(_local, "beat", None)
    if beat is not None:
        beat.busy()
