"""Leak checks for tests: what a piece of work leaves held, apart from what CPython keeps anyway."""

from __future__ import annotations

import contextlib
import gc
import linecache
import logging
import tracemalloc
from collections.abc import Callable, Iterator, Mapping, Sequence

import attrs


class Counted(logging.Handler):
    """Counts warnings and keeps the last one's message, nothing more: thousands of refusals cost no memory."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0
        self.last = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        self.last = record.getMessage()


@contextlib.contextmanager
def only_to(handlers: Mapping[str, logging.Handler]) -> Iterator[None]:
    """Each named logger's records go to its handler alone, for the block.

    pytest's capture keeps every record it sees, and a record the frames of its exception: in a leak check they
    would be counted as the code's growth. Use it inside the test: at each test's start pytest adds its handlers to
    every logger that does not propagate."""
    saved = {name: (logging.getLogger(name).handlers, logging.getLogger(name).propagate) for name in handlers}
    for name, handler in handlers.items():
        logging.getLogger(name).handlers, logging.getLogger(name).propagate = [handler], False
    try:
        yield
    finally:
        for name, (kept, propagate) in saved.items():
            logging.getLogger(name).handlers, logging.getLogger(name).propagate = kept, propagate


@attrs.frozen
class Growth:
    """Bytes allocated during a piece of work and still held after it, and the lines that hold most of them."""

    bytes: int
    top: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.bytes} bytes more ({'; '.join(self.top)})"


def held_after(work: Callable[[], None], skip: Sequence[str] = (), top: int = 5) -> Growth:
    """Run `work` under tracemalloc and say what it left held (cycles collected).

    Left out: tracemalloc's own snapshots; linecache, the source lines any stack dump or traceback in this process
    reads (a stall watchdog's dump once counted 95 KB); and the files matching `skip` (fnmatch patterns)."""
    filters = [tracemalloc.Filter(False, f) for f in (tracemalloc.__file__, linecache.__file__, *skip)]
    gc.collect()
    linecache.clearcache()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot().filter_traces(filters)
        work()
        gc.collect()
        diff = tracemalloc.take_snapshot().filter_traces(filters).compare_to(before, "lineno")
    finally:
        tracemalloc.stop()
    return Growth(sum(d.size_diff for d in diff), tuple(str(d) for d in diff[:top]))
