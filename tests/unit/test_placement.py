"""`cpu_affinity`: the CPUs the model thread and kvbridge's threads get (real affinity calls, own threads)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest

from kvbridge.adapters.vllm.settings import Settings
from kvbridge.base import placement
from kvbridge.base.errors import ConfigError
from kvbridge.base.threadname import NamedThread


def test_a_cpu_list_reads_as_linux_writes_it() -> None:
    assert placement.parse_cpus("3") == {3}
    assert placement.parse_cpus("0-2,5,7-8") == {0, 1, 2, 5, 7, 8}
    for bad in ("", "a", "1,", "3-1", "1 2"):
        with pytest.raises(ValueError, match="cpu_affinity"):
            placement.parse_cpus(bad)


def test_reserved_is_the_last_allowed_cpu_of_each_numa_node() -> None:
    nodes = {0: {0, 1, 2, 3}, 1: {4, 5, 6, 7}}
    assert placement.reserved_cpus(set(range(8)), nodes) == {3, 7}
    assert placement.reserved_cpus({0, 1, 4}, nodes) == {1, 4}  # only where this process may run
    assert placement.reserved_cpus({0, 1}, {}) == {1}  # no NUMA listing: the host is one node


def test_a_bad_value_is_refused_when_the_config_is_read() -> None:
    with pytest.raises(ConfigError, match="cpu_affinity must be 'reserved' or a CPU list"):
        Settings.from_extra_config({"cpu_affinity": "last", "insecure": True})
    assert Settings.from_extra_config({"cpu_affinity": "reserved", "insecure": True}).cpu_affinity == "reserved"


def _on_a_thread(body: object) -> object:
    """Run `body()` on a thread of its own (pinning the test's thread would pin the rest of the session)."""
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(body()))  # type: ignore[operator]
    thread.start()
    thread.join(30)
    assert out, "the thread did not finish"
    return out[0]


def test_pinning_holds_for_the_thread_and_the_threads_it_starts_after() -> None:
    allowed = os.sched_getaffinity(0)

    def pin_then_start() -> tuple[set[int] | None, set[int], set[int]]:
        cpus = placement.pin_this_thread("reserved", placement.MODEL)
        child: list[set[int]] = []
        started = threading.Thread(target=lambda: child.append(os.sched_getaffinity(0)))
        started.start()
        started.join(30)
        return cpus, os.sched_getaffinity(0), child[0]

    cpus, mine, childs = _on_a_thread(pin_then_start)  # type: ignore[misc]
    assert cpus == placement.reserved_cpus(allowed, placement.numa_nodes())
    assert mine == cpus and childs == cpus
    assert os.sched_getaffinity(0) == allowed, "the test's own thread was pinned too"


def test_cpus_this_process_may_not_use_are_refused_and_nothing_changes() -> None:
    allowed = os.sched_getaffinity(0)
    outside = max(allowed) + 1

    def try_pin() -> str:
        try:
            placement.pin_this_thread(str(outside), placement.MODEL)
        except ConfigError as exc:
            assert os.sched_getaffinity(0) == allowed
            return str(exc)
        return "pinned"

    assert f"names CPUs [{outside}] this process may not run on" in _on_a_thread(try_pin)  # type: ignore[operator]


@pytest.fixture
def io_apart() -> Iterator[None]:
    yield
    placement._io = None  # the process's placement of kvbridge's threads, set by a pin: not left for other tests


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="kvbridge's threads apart from the model need 2 CPUs")
def test_io_cpus_others_puts_kvbridges_threads_and_the_native_ones_they_start_off_the_models_cpus(
    io_apart: None,
) -> None:
    allowed = os.sched_getaffinity(0)

    def affinity_of(start: type[threading.Thread]) -> set[int]:
        seen: list[set[int]] = []
        thread = start(target=lambda: seen.append(os.sched_getaffinity(0)))
        thread.start()
        thread.join(30)
        return seen[0]

    def pin_then_start() -> dict[str, set[int]]:
        cpus = placement.pin_this_thread("reserved", placement.OTHERS)
        assert cpus is not None
        out = {
            "model": os.sched_getaffinity(0),
            "kvbridge": affinity_of(NamedThread),
            "other": affinity_of(threading.Thread),
        }
        with placement.on_io_cpus():  # as a transport starts its native threads: they inherit the starter's CPUs
            out["native"] = affinity_of(threading.Thread)
        out["after"] = os.sched_getaffinity(0)
        return out

    seen = _on_a_thread(pin_then_start)
    model = placement.reserved_cpus(allowed, placement.numa_nodes())
    assert seen == {
        "model": model,
        "kvbridge": allowed - model,
        "other": model,
        "native": allowed - model,
        "after": model,
    }


def test_io_cpus_model_keeps_kvbridges_threads_with_the_model_and_a_bad_value_is_refused(io_apart: None) -> None:
    def pin_then_start() -> set[int]:
        placement.pin_this_thread("reserved", placement.MODEL)
        seen: list[set[int]] = []
        thread = NamedThread(target=lambda: seen.append(os.sched_getaffinity(0)))
        thread.start()
        thread.join(30)
        return seen[0]

    assert _on_a_thread(pin_then_start) == placement.reserved_cpus(os.sched_getaffinity(0), placement.numa_nodes())
    assert Settings.from_extra_config({"insecure": True}).io_cpus == placement.OTHERS  # the default: apart
    with pytest.raises(ConfigError, match="io_cpus must be 'model', 'others' or a CPU list"):
        Settings.from_extra_config({"io_cpus": "elsewhere", "insecure": True})
