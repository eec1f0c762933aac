"""`Lanes`: blocking calls grouped by peer, at most `per_key` of a peer at once, on threads of its own."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError

import pytest
from control_helpers import wait_for

from kvbridge.base.lanes import Lanes


def test_a_key_runs_at_most_per_key_calls_at_once_and_another_key_runs_beside_them() -> None:
    lanes = Lanes(2, "test-lane")
    release = threading.Event()
    running: list[str] = []
    lock = threading.Lock()

    def call(name: str) -> str:
        with lock:
            running.append(name)
        assert release.wait(30)
        return name

    try:
        held = [lanes.submit("a", lambda i=i: call(f"a{i}")) for i in range(3)]
        other = lanes.submit("b", lambda: "b")
        assert other.result(30) == "b", "b's call ran while a's lane was full"
        wait_for(lambda: len(running) == 2, what="two of a's calls to start")
        assert sorted(running) == ["a0", "a1"] and not held[2].running(), "a's third waits for a thread of a's"
        release.set()
        assert [f.result(30) for f in held] == ["a0", "a1", "a2"]
    finally:
        release.set()
        lanes.shutdown()


def test_threads_start_on_demand_and_end_when_idle() -> None:
    lanes = Lanes(4, "test-lane", idle_s=0.05)
    try:
        assert lanes.threads == 0
        assert [lanes.submit(k, lambda k=k: k).result(30) for k in ("a", "b", "a")] == ["a", "b", "a"]
        wait_for(lambda: lanes.threads == 0, what="the idle threads to end")
        assert lanes.submit("a", lambda: 1).result(30) == 1, "a lane whose threads ended takes calls again"
    finally:
        lanes.shutdown()


def test_an_exception_reaches_the_future_and_the_lane_goes_on() -> None:
    lanes = Lanes(1, "test-lane")
    try:

        def fail() -> None:
            raise ValueError("boom")

        with pytest.raises(ValueError, match="boom"):
            lanes.submit("a", fail).result(30)
        assert lanes.submit("a", lambda: 2).result(30) == 2
    finally:
        lanes.shutdown()


def test_shutdown_cancels_the_queued_calls_lets_the_running_one_end_and_refuses_more() -> None:
    lanes = Lanes(1, "test-lane")
    started, release = threading.Event(), threading.Event()

    def blocking() -> str:
        started.set()
        assert release.wait(30)
        return "ran"

    running = lanes.submit("a", blocking)
    queued = lanes.submit("a", lambda: "never")
    assert started.wait(30)
    closer = threading.Thread(target=lambda: lanes.shutdown(wait=True, cancel_futures=True))
    closer.start()
    with pytest.raises(CancelledError):
        queued.result(30)
    release.set()
    closer.join(30)
    assert not closer.is_alive() and running.result(0) == "ran" and lanes.threads == 0
    with pytest.raises(RuntimeError, match="after shutdown"):
        lanes.submit("a", lambda: None)
