"""An engine core's relay of arriving requests to its worker processes (kvbridge.session.arrivals).

Real queues, threads and abstract UNIX sockets; a worker's wait must end for a request the step did not see, and
only then, and the engine's own get() must still hear every put."""

from __future__ import annotations

import queue
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from kvbridge.session.arrivals import ArrivalRelay, RelayedInbox, consumed, wake_address
from kvbridge_tools.harness.fixtures import wait_for

LONG_S = 60.0  # a wait that only an arrival or a nudge ends within a test's time


@pytest.fixture
def address() -> bytes:
    return wake_address(f"engine-{uuid.uuid4()}", 0, 0, 0)


@pytest.fixture
def inbox(address: bytes) -> Iterator[RelayedInbox]:
    box = RelayedInbox(address, unrelayed_wait_s=0.001)
    yield box
    box.close()


def _waiter(inbox: RelayedInbox, timeout_s: float = LONG_S) -> threading.Thread:
    inbox.arm()
    t = threading.Thread(target=inbox.wait, args=(timeout_s,), daemon=True)
    t.start()
    return t


def _relay(engine: queue.Queue, address: bytes, inbox: RelayedInbox) -> ArrivalRelay:
    relay = ArrivalRelay(engine, [address])
    wait_for(lambda: inbox._put >= 0, what="the relay's first datagram")
    # and the relay waits on the queue's condition before the test goes on
    wait_for(lambda: len(engine.not_empty._waiters) == 1, what="the relay waiting")  # type: ignore[attr-defined]
    return relay


def test_a_request_put_ends_a_worker_wait_and_still_reaches_the_engine(address: bytes, inbox: RelayedInbox) -> None:
    engine: queue.Queue = queue.Queue()
    relay = _relay(engine, address, inbox)
    try:
        got: list[object] = []
        # the engine core waits in get() behind the relay: put() notifies one waiter, the relay; the engine hears it too
        getter = threading.Thread(target=lambda: got.append(engine.get(timeout=LONG_S)), daemon=True)
        getter.start()
        wait_for(lambda: len(engine.not_empty._waiters) == 2, what="the engine waiting")  # type: ignore[attr-defined]
        inbox.step(consumed(engine))
        waiter = _waiter(inbox)
        engine.put("request")
        waiter.join(timeout=30)
        getter.join(timeout=30)
        assert not waiter.is_alive() and not getter.is_alive() and got == ["request"]
    finally:
        relay.close()


def test_requests_the_step_saw_do_not_end_a_wait_but_a_later_one_does(address: bytes, inbox: RelayedInbox) -> None:
    engine: queue.Queue = queue.Queue()
    relay = _relay(engine, address, inbox)
    try:
        engine.put("seen")
        wait_for(lambda: inbox._put == 1, what="the relay's datagram for the first request")
        assert engine.get_nowait() == "seen"
        inbox.step(consumed(engine))  # the engine took it before building this step
        begun = time.monotonic()
        inbox.arm()
        inbox.wait(0.3)
        assert time.monotonic() - begun >= 0.3  # slept its whole wait: nothing new arrived
        engine.put("new")  # arrived after the step was built: the worker must not sleep on it
        begun = time.monotonic()
        inbox.arm()
        wait_for(lambda: inbox._put == 2, what="the relay's datagram for the second request")
        inbox.wait(LONG_S)
        assert time.monotonic() - begun < LONG_S / 2
    finally:
        relay.close()


def test_until_a_relay_is_heard_a_wait_is_short(inbox: RelayedInbox) -> None:
    waiter = _waiter(inbox)
    waiter.join(timeout=LONG_S / 2)
    assert not waiter.is_alive()


def test_a_nudge_ends_a_wait_and_arm_forgets_it(address: bytes, inbox: RelayedInbox) -> None:
    engine: queue.Queue = queue.Queue()
    relay = _relay(engine, address, inbox)
    try:
        inbox.step(consumed(engine))
        waiter = _waiter(inbox)
        inbox.nudge()
        waiter.join(timeout=30)
        assert not waiter.is_alive()
        inbox.nudge()
        begun = time.monotonic()
        inbox.arm()  # the nudge came before the caller looked: forgotten
        inbox.wait(0.2)
        assert time.monotonic() - begun >= 0.2
    finally:
        relay.close()


def test_anything_else_written_to_the_socket_is_ignored(address: bytes, inbox: RelayedInbox) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(b"not a count", address)
        s.sendto(b"", address)
    engine: queue.Queue = queue.Queue()
    relay = _relay(engine, address, inbox)  # the listener is still there
    relay.close()


def test_a_relay_to_nobody_and_closing_both_sides(address: bytes) -> None:
    engine: queue.Queue = queue.Queue()
    relay = ArrivalRelay(engine, [address])  # no worker listens: its datagrams go nowhere
    engine.put("request")
    assert engine.get(timeout=30) == "request"
    relay.close()
    assert not relay._thread.is_alive()
    box = RelayedInbox(address, unrelayed_wait_s=0.001)
    box.close()
    assert not box._thread.is_alive()


def test_each_rank_of_each_engine_has_its_own_address() -> None:
    ranks = [(dp, pp, tp) for dp in (0, 1) for pp in (0, 1) for tp in (0, 7)]
    addresses = {wake_address(engine, *rank) for engine in ("a", "b" * 500) for rank in ranks}
    assert len(addresses) == 16 and all(a.startswith(b"\0") and len(a) <= 107 for a in addresses)
