"""A transport's native threads are named as kvbridge's (not after their starter, nor by their library), and dumped.

Mooncake's I/O threads are C++ threads: each carries the OS name of the thread that started it. Without the plugin
naming them (UCX's event thread names itself `async`), a bench's per-thread CPU (and `top -H`) counts them with the
engine's model thread, or with nobody. A stall dump's kernel view is the only view of them there is: state, wait
channel, syscall.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from kvbridge_nixl.spec import NATIVE_THREAD_NAME as NIXL_THREAD_NAME

import kvbridge
from kvbridge.base.threadname import os_thread_name
from kvbridge.base.watchdog import kernel_view
from kvbridge_mooncake.spec import NATIVE_THREAD_NAME

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names in /proc are Linux's")


def os_names() -> dict[int, str]:
    names = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            names[int(task.name)] = (task / "comm").read_text().strip()
        except OSError:
            continue  # a thread that just ended
    return names


def threads_started(transport: str, protocol: str) -> tuple[dict[int, str], list[str]]:
    """The OS names of the native threads two backends start and read with, started from an engine's model thread.

    By thread id; and a stall dump's kernel view, taken before the backends close."""
    before = set(os_names())
    with os_thread_name("engine-main"):  # as the engine's model thread would be named
        a = kvbridge.create_backend(transport, protocol=protocol)
        b = kvbridge.create_backend(transport, protocol=protocol)
        try:
            src, dst = np.full(1 << 20, 7, dtype=np.uint8), np.zeros(1 << 20, dtype=np.uint8)
            a.register_memory(dst)
            b.register_memory(src)
            peer = a.connect(b.endpoint_info())
            a.transfer(peer, [(dst.ctypes.data, src.ctypes.data, src.nbytes)], "read").wait(30)
            assert (dst == 7).all()
            python = {t.native_id for t in threading.enumerate()}  # kvbridge's own threads are Python's
            started = {tid: name for tid, name in os_names().items() if tid not in before and tid not in python}
            return started, kernel_view().splitlines()  # what a stall dump shows of threads with no Python stack
        finally:
            a.close()
            b.close()


def test_mooncake_threads_carry_kvbridge_names_from_start_and_first_transfer() -> None:
    started, kernel = threads_started("mooncake", "tcp")
    assert started, "the backends started no thread"
    assert "engine-main" not in started.values(), started
    assert NATIVE_THREAD_NAME in started.values(), started
    # each Mooncake thread in the stall dump's kernel view, as native, with its state and where it waits
    # (this test's threads only: an earlier test in the same process may have started Mooncake threads of its own)
    mine = {tid for tid, name in started.items() if name == NATIVE_THREAD_NAME}
    io = [line for line in kernel if line.startswith(f"  {NATIVE_THREAD_NAME} (") and ", native): " in line]
    io = [line for line in io if int(line.split("(", 1)[1].split(",", 1)[0]) in mine]
    assert len(io) == len(mine), kernel
    assert all(line.split("): ", 1)[1][0] in "RSD" for line in io), io


def test_nixl_threads_carry_kvbridge_names_even_where_ucx_names_its_own() -> None:
    # UCX names its event thread `async` itself: named after its starter, it would still be nobody's.
    started, _ = threads_started("nixl", "ucx")
    assert started, "the backends started no native thread"
    assert set(started.values()) == {NIXL_THREAD_NAME}, started
