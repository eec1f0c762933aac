"""The OS names of threads: what native libraries' threads inherit (kvbridge.base.threadname)."""

from __future__ import annotations

import ast
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import kvbridge
from kvbridge.base.threadname import NamedThread, name_in_os, os_thread_name

REPO = Path(__file__).resolve().parents[2]

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


def thread_starts(root: Path) -> list[str]:
    """Where the code under `root` starts a thread the OS would not know by name.

    That is a `threading.Thread(...)`, or a `ThreadPoolExecutor(...)` with no initializer (`name_in_os`)."""
    found = []
    for file in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if not isinstance(node, ast.Call):
                continue
            called = ast.unparse(node.func)
            pool = called.endswith("ThreadPoolExecutor") and not any(k.arg == "initializer" for k in node.keywords)
            if called == "threading.Thread" or pool:
                found.append(f"{file.relative_to(root.parent)}:{node.lineno} {called}")
    return found


def test_every_thread_the_library_and_its_plugins_start_is_named_in_the_os() -> None:
    roots = [Path(kvbridge.__file__).parent] + [
        p for p in (REPO / "plugins").glob("*/src/kvbridge_*") if p.name not in ("kvbridge_tools",) and p.is_dir()
    ]
    found = [where for root in roots for where in thread_starts(root) if "/testing/" not in where]
    assert not found, "start these as NamedThread, or give the pool initializer=name_in_os:\n" + "\n".join(found)
