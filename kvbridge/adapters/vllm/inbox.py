"""The engine core's input queue: idle steps sleep until a transfer ends or a request is in. See docs/internals.md."""

from __future__ import annotations

import queue
import sys
import time

ENGINE_CLASS = "EngineCoreProc"


class EngineInbox:
    """An engine core's input queue, waited on together with the worker's own news. See docs/internals.md."""

    def __init__(self, inbox: queue.Queue) -> None:
        self._queue = inbox
        self._news = False  # nudged since the last arm (under the queue's mutex)

    def arm(self) -> None:
        """Forget earlier nudges: call before looking at whether there is anything to report."""
        with self._queue.mutex:
            self._news = False

    def nudge(self) -> None:
        """Any thread: there is something to report; ends a `wait` (now, or the next one before `arm`)."""
        with self._queue.not_empty:
            self._news = True
            # Whoever waits in the queue's own get() wakes too, sees it empty and waits again.
            self._queue.not_empty.notify_all()

    def wait(self, timeout_s: float) -> None:
        """Until a request is in the queue, `nudge` was called since `arm`, or `timeout_s` passed."""
        deadline = time.monotonic() + timeout_s
        with self._queue.not_empty:
            while not self._news and not self._queue._qsize():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._queue.not_empty.wait(remaining)


def find_engine_inbox() -> EngineInbox | None:
    """The input queue of the vLLM engine core being built up the call stack, or None."""
    inbox = engine_input_queue()
    return EngineInbox(inbox) if inbox is not None else None


def engine_input_queue() -> queue.Queue | None:
    """The `queue.Queue` of requests of the vLLM engine core being built up the call stack, or None."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if owner is not None and any(
            c.__name__ == ENGINE_CLASS and c.__module__.startswith("vllm.") for c in type(owner).__mro__
        ):
            inbox = getattr(owner, "__dict__", {}).get("input_queue")
            return inbox if isinstance(inbox, queue.Queue) else None
        frame = frame.f_back
    return None
