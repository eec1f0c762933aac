"""The OS names of threads: what native libraries' threads inherit (kvbridge.base.threadname)."""

from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvbridge.base.threadname import NamedThread, name_in_os, os_thread_name

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names in /proc are Linux's")


def os_name(tid: int | None = None) -> str:
    return Path(f"/proc/self/task/{tid or threading.get_native_id()}/comm").read_text().strip()


def started_name() -> str:
    """The OS name of a thread started now from this one (it inherits it, as a native library's thread would)."""
    seen: list[str] = []
    t = threading.Thread(target=lambda: seen.append(os_name()))
    t.start()
    t.join(10)
    return seen[0]


def test_threads_started_inside_keep_the_name_and_the_caller_gets_its_own_back() -> None:
    before = os_name()
    with os_thread_name("kvbridge-test-a-long-name"):
        assert os_name() == "kvbridge-test-a"  # the kernel keeps 15 bytes
        assert started_name() == "kvbridge-test-a"
    assert os_name() == before and started_name() == before


def test_the_name_comes_back_when_the_block_raises() -> None:
    before = os_name()
    with pytest.raises(RuntimeError), os_thread_name("kvbridge-raised"):
        raise RuntimeError("inside")
    assert os_name() == before


def test_a_pool_thread_named_in_os_gives_its_name_to_the_threads_it_starts() -> None:
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvbridge-pool", initializer=name_in_os) as pool:
        assert pool.submit(os_name).result(10) == "kvbridge-pool_0"
        assert pool.submit(started_name).result(10) == "kvbridge-pool_0"


def test_a_named_thread_carries_its_name_in_the_os_and_gives_it_to_the_threads_it_starts() -> None:
    seen: list[str] = []
    t = NamedThread(target=lambda: seen.extend([os_name(), started_name()]), name="kvbridge-named-thread")
    t.start()
    t.join(10)
    assert seen == ["kvbridge-named-", "kvbridge-named-"]  # 15 bytes
    assert os_name() != "kvbridge-named-"  # the starter keeps its own
