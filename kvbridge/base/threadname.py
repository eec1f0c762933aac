"""Threads named in the OS, and the threads native libraries start from them.

Python 3.11 keeps a `threading.Thread`'s name to itself: in the OS (`/proc/self/task/TID/comm`, `top -H`, `ps -L`)
every thread of an engine process carries the process's name, so kvbridge's threads (`NamedThread`, pools with
`name_in_os` as their initializer) name themselves there. A thread a C++ library starts carries the OS name of the
thread that started it: a transport's native I/O threads started from an engine's main thread would be counted with
the model (`os_thread_name`). Linux only: elsewhere this does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvbridge.base import placement

log = logging.getLogger(__name__)

_PR_SET_NAME, _PR_GET_NAME = 15, 16
_NAME_BYTES = 16  # the kernel's TASK_COMM_LEN, the terminating NUL included


@functools.cache
def _prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


@contextlib.contextmanager
def os_thread_name(name: str) -> Iterator[None]:
    """Run the block with this thread's OS name set to `name` (its first 15 bytes), restored after.

    Threads started meanwhile, by native code too, keep `name`."""
    prctl = _prctl()
    if prctl is None:
        yield
        return
    was = ctypes.create_string_buffer(_NAME_BYTES)
    if prctl(_PR_GET_NAME, was, 0, 0, 0) != 0:
        log.debug("could not read this thread's OS name (errno %d): not renamed", ctypes.get_errno())
        yield
        return
    prctl(_PR_SET_NAME, name.encode()[: _NAME_BYTES - 1], 0, 0, 0)
    try:
        yield
    finally:
        prctl(_PR_SET_NAME, was.value, 0, 0, 0)


def thread_ids() -> list[int]:
    """This process's threads as the kernel lists them, Python's and native ones (empty without /proc)."""
    try:
        return sorted(int(t) for t in os.listdir("/proc/self/task"))
    except OSError:
        return []


def python_names() -> dict[int, str]:
    """The `threading` name of each thread Python started, by its kernel thread id."""
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


def name_of(tid: int, names: dict[int, str]) -> str:
    """A thread's name: Python's (`names`, from `python_names`), else the kernel's (a transport's C++ I/O thread)."""
    if tid in names:
        return names[tid]
    try:
        return Path(f"/proc/self/task/{tid}/comm").read_text().strip() or str(tid)
    except OSError:  # ended meanwhile
        return str(tid)


@contextlib.contextmanager
def native_threads_named(name: str) -> Iterator[None]:
    """`os_thread_name(name)` for the block; then a thread it started that named itself is given `name` too.

    Some libraries name their own threads (UCX's `async`): without this they are counted with nobody's."""
    before = set(thread_ids())
    with os_thread_name(name):
        yield
    for tid in set(thread_ids()) - before:
        with contextlib.suppress(OSError):  # ended meanwhile
            comm = Path(f"/proc/self/task/{tid}/comm")
            if not comm.read_text().startswith("kvbridge"):
                comm.write_text(name[: _NAME_BYTES - 1])


def name_in_os() -> None:
    """Give the calling thread its `threading` name in the OS too (a pool's initializer), for the threads it starts.

    It is one of kvbridge's: it also moves to kvbridge's CPUs (`placement.place_io_thread`)."""
    placement.place_io_thread()
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_NAME, threading.current_thread().name.encode()[: _NAME_BYTES - 1], 0, 0, 0)


class NamedThread(threading.Thread):
    """A `threading.Thread` whose name (its first 15 bytes) the OS knows too, as the threads it starts do."""

    def run(self) -> None:
        name_in_os()
        super().run()
