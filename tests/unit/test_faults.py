"""Failure paths surface as documented exceptions.

The faults come from the one injector (`kvbridge.transport.faults`) around the loopback transport: counted ones a test
arms and the rates `kvbridge chaos` sets.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import attrs
import numpy as np
import pytest

import kvbridge
from kvbridge.base.errors import ConfigError, PeerGone, TransferFailed, TransferTimeout
from kvbridge.transport.faults import FaultRates, FaultyBackend
from kvbridge.transport.loopback import LoopbackBackend


@pytest.fixture
def link() -> Iterator[tuple[LoopbackBackend, FaultyBackend, kvbridge.Peer, np.ndarray, np.ndarray]]:
    server = kvbridge.create_backend("loopback")
    client = kvbridge.create_backend("loopback", max_batch=4, fault_injection={})
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros_like(src)
    server.register_memory(src)
    client.register_memory(dst)
    peer = client.connect(server.endpoint_info())
    yield server, client, peer, src, dst
    client.close()
    server.close()


def blocks(dst: np.ndarray, src: np.ndarray, n: int = 16, size: int = 1024) -> np.ndarray:
    """n reversed blocks: no two merge, so max_batch=4 gives n/4 submissions."""
    idx = np.arange(n)
    return np.stack([dst.ctypes.data + idx * size, src.ctypes.data + idx[::-1] * size, np.full(n, size)], axis=1)


def test_failed_submit_raises_transfer_failed_at_once(link) -> None:
    _, client, peer, src, dst = link
    client.inject(fail_submit=1)
    with pytest.raises(TransferFailed, match="injected submit failure") as err:
        client.transfer(peer, blocks(dst, src))
    assert err.value.peer == peer.name


def test_failed_completion_surfaces_on_wait_and_names_the_peer(link) -> None:
    _, client, peer, src, dst = link
    client.inject(fail_completion=1)
    handle = client.transfer(peer, blocks(dst, src))
    with pytest.raises(TransferFailed, match="injected completion failure") as err:
        handle.wait(10)
    assert err.value.peer == peer.name
    # the next transfer succeeds: a failure leaves the backend usable
    client.transfer(peer, blocks(dst, src)).wait(10)
    assert (dst[:1024] == src[15 * 1024 : 16 * 1024]).all()


def test_a_slow_transfer_times_out_and_done_stays_false(link) -> None:
    _, client, peer, src, dst = link
    client.inject(delay=2.0)
    handle = client.transfer(peer, blocks(dst, src, n=1))
    with pytest.raises(TransferTimeout, match="did not finish within 0.2s"):
        handle.wait(0.2)
    assert not handle.done()
    handle.wait(10)
    assert handle.done()


def test_a_peer_that_died_fails_new_transfers_and_connects(link) -> None:
    server, client, peer, src, dst = link
    endpoint = server.endpoint_info()
    server.die()
    with pytest.raises(PeerGone):
        client.transfer(peer, blocks(dst, src)).wait(10)
    with pytest.raises(PeerGone):
        client.connect(endpoint)


def test_batches_are_split_to_the_transport_limit(link) -> None:
    _, client, peer, src, dst = link
    before = client.submissions
    handle = client.transfer(peer, blocks(dst, src, n=16))
    handle.wait(10)
    assert client.submissions - before == 4 and handle.descriptors == 16
    assert (dst[: 16 * 1024].reshape(16, 1024) == src[: 16 * 1024].reshape(16, 1024)[::-1]).all()


def test_one_failing_part_of_a_split_batch_fails_the_whole_transfer(link) -> None:
    _, client, peer, src, dst = link
    client.inject(fail_completion=1)
    with pytest.raises(TransferFailed):
        client.transfer(peer, blocks(dst, src, n=16)).wait(10)


def test_bad_descriptors_are_refused_with_what_to_do(link) -> None:
    _, client, peer, src, dst = link
    with pytest.raises(ConfigError, match="triples or an N x 3 array"):
        client.transfer(peer, [(1, 2)])
    with pytest.raises(ConfigError, match="every length must be positive"):
        client.transfer(peer, [(dst.ctypes.data, src.ctypes.data, 0)])
    with pytest.raises(kvbridge.InvalidDescriptor, match="local memory"):
        client.transfer(peer, [(dst.ctypes.data + len(dst) - 1, src.ctypes.data, 2)])
    with pytest.raises(ConfigError, match="op must be"):
        client.transfer(peer, blocks(dst, src), op="copy")  # type: ignore[arg-type]


def test_close_is_idempotent_and_a_closed_backend_says_so(link) -> None:
    _, client, peer, src, dst = link
    client.close()
    client.close()
    with pytest.raises(ConfigError, match="closed"):
        client.transfer(peer, blocks(dst, src))


def test_long_descriptors_are_cut_to_the_transport_piece_size() -> None:
    server = kvbridge.create_backend("loopback")
    client = kvbridge.create_backend("loopback", fault_injection={})  # counts the submissions
    client.capabilities = attrs.evolve(client.capabilities, max_descriptor_bytes=1000, max_batch=3)
    src = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8)
    dst = np.zeros_like(src)
    server.register_memory(src)
    client.register_memory(dst)
    peer = client.connect(server.endpoint_info())
    try:
        handle = client.transfer(
            peer, [(dst.ctypes.data, src.ctypes.data, 4500), (dst.ctypes.data + 5000, src.ctypes.data + 5000, 5000)]
        )
        handle.wait(10)
        assert handle.descriptors == 5 + 5 and handle.nbytes == 9500
        assert client.submissions == 4  # 10 pieces in batches of 3
        assert (dst[:4500] == src[:4500]).all() and (dst[5000:] == src[5000:]).all() and not dst[4500:5000].any()
    finally:
        client.close()
        server.close()


def test_a_stuck_part_is_resubmitted_once_and_completes_only_when_the_stuck_call_returned(link) -> None:
    """The transfer deadline: the retry succeeds fast, but the handle waits for the stuck first call.

    The stuck call may still write into the destination. The handle counts one retry.
    """
    _, client, peer, src, dst = link
    order: list[str] = []
    delayed = client._delayed

    def recorded(*args):  # type: ignore[no-untyped-def]
        try:
            return delayed(*args)
        finally:
            order.append(f"call {args[3]}s returned")

    client._delayed = recorded  # type: ignore[method-assign]
    client.transfer_deadline_s = 0.2
    client.inject(delay=1.5)
    handle = client.transfer(peer, blocks(dst, src, n=1))
    deadline = time.monotonic() + 10
    while client.submissions < 2 and time.monotonic() < deadline:  # the resubmission, at 0.2 + 0.1 s
        client.inject(delay=0.01)
        time.sleep(0.01)
    handle.add_done_callback(lambda _h: order.append("handle done"))
    handle.wait(10)
    assert client.submissions == 2
    assert order == ["call 0.01s returned", "call 1.5s returned", "handle done"], order
    assert handle.retries == 1
    assert (dst[:1024] == src[:1024]).all()


def test_deadline_alarms_fire_at_their_own_time_and_cancelled_ones_never() -> None:
    """An alarm set after later ones, or after cancelled ones, still fires at its own time; cancelled ones never."""
    from kvbridge.transport.contract import _WATCHDOG

    fired: list[str] = []
    late = _WATCHDOG.after(60.0, lambda: fired.append("late"))
    try:
        for seconds in (0.01, 30.0):  # cancelled alarms due before, then after, the one that must fire
            for alarm in [_WATCHDOG.after(seconds, lambda: fired.append("cancelled")) for _ in range(50)]:
                alarm.cancel()
            soon = threading.Event()
            _WATCHDOG.after(0.05, soon.set)
            assert soon.wait(10), "an alarm set after later or cancelled ones did not fire at its own time"
    finally:
        late.cancel()
    assert fired == []


def test_an_alarm_cancelled_long_ago_far_ahead_does_not_make_each_new_alarm_wake_the_thread() -> None:
    """A far alarm cancelled long ago does not make each nearer alarm cancelled in time wake the thread.

    The far one stands for another backend's longer deadline. The thread wakes for the first near alarm, then
    sleeps until that one's time. Each alarm is given time to be seen (the pause), so that a thread woken for it
    would have counted the wake."""
    from kvbridge.transport.contract import _WATCHDOG

    far = _WATCHDOG.after(60.0, lambda: None)
    far.cancel()
    dropped = threading.Event()
    _WATCHDOG.after(0.01, dropped.set)  # the thread wakes for it, then drops the far one
    assert dropped.wait(10)
    before = _WATCHDOG.wakeups
    for _ in range(20):
        _WATCHDOG.after(5.0, lambda: None).cancel()
        time.sleep(0.02)
    assert _WATCHDOG.wakeups - before <= 2, "each alarm cancelled in time woke the deadlines' thread"


def test_transfers_that_end_in_time_do_not_wake_the_deadlines_thread(link) -> None:
    """Each part arms an alarm; one that ends in time only cancels it, and the thread sleeps on.

    Counted as the thread's returns from its wait: context switches would also count a late wake-up once per
    GIL hand-off while it waits to run."""
    from kvbridge.transport.contract import _WATCHDOG

    _, client, peer, src, dst = link
    client.transfer_deadline_s = 5.0
    client.transfer(peer, blocks(dst, src, n=4)).wait(10)  # the thread runs from the first alarm on
    before = _WATCHDOG.wakeups
    started = time.monotonic()
    for _ in range(50):
        client.transfer(peer, blocks(dst, src, n=4)).wait(10)
    # by design it wakes about once a deadline (5 s + 1 s of grace), whatever the number of transfers
    allowed = 2 + int((time.monotonic() - started) / 5.0)
    assert _WATCHDOG.wakeups - before <= allowed, "the deadlines' thread woke for transfers that ended in time"


def test_a_part_stuck_twice_fails_with_the_deadline_in_its_error(link) -> None:
    _, client, peer, src, dst = link
    client.transfer_deadline_s = 0.1
    client.inject(delay=0.5, fail_completion=2)  # both calls hang past the deadline, then fail
    handle = client.transfer(peer, blocks(dst, src, n=1))
    with pytest.raises(TransferTimeout, match="made no progress within the 0.1s transfer deadline, and so did its"):
        handle.wait(10)
    assert client.submissions == 2 and handle.retries == 1


def test_a_failed_part_is_resubmitted_once_under_a_deadline(link) -> None:
    _, client, peer, src, dst = link
    client.transfer_deadline_s = 5.0
    client.inject(fail_completion=1)
    handle = client.transfer(peer, blocks(dst, src, n=1))
    handle.wait(10)
    assert handle.retries == 1 and (dst[:1024] == src[:1024]).all()
    client.inject(fail_completion=2)
    with pytest.raises(TransferFailed, match="injected completion failure.*and so did its retry|and so did its retry"):
        client.transfer(peer, blocks(dst, src, n=1)).wait(10)


def test_held_submissions_are_cancelled_at_the_deadline_and_the_transfer_fails(link) -> None:
    """`kvbridge chaos`'s slow-peer at the deadline: a clear failure, not a hang.

    It holds submissions before they start: at the deadline the held one is cancelled (it never writes),
    resubmitted, held again, cancelled again. (A cancel runs the attempt's done-callback in the cancelling thread:
    this once deadlocked the deadline.)
    """
    _, client, peer, src, dst = link
    client.transfer_deadline_s = 0.2
    client.inject(rates=FaultRates(slow_peer=1.0, slow_s=30.0))
    handle = client.transfer(peer, blocks(dst, src, n=1))
    with pytest.raises(TransferTimeout, match="made no progress within the 0.2s transfer deadline, and so did its"):
        handle.wait(5)
    assert client.submissions == 2 and handle.retries == 1 and not dst.any()  # held twice, cancelled twice


def test_a_held_submission_whose_retry_fails_fails_the_transfer_at_once(link) -> None:
    """A part held past the deadline (cancelled, it never started), then a retry that fails: a failure, not a hang.

    `kvbridge chaos --faults slow-peer,transfer-error` met it: the part waited for an attempt it had dropped, the
    pull hung for its whole timeout (30 s) and the prefill's lease expired."""
    _, client, peer, src, dst = link
    client.transfer_deadline_s = 0.2
    # a seed whose first roll holds the submission (>= 0.5) and whose second fails the retry (< 0.5)
    seed = next(s for s in range(100) if (r := random.Random(s)).random() >= 0.5 and r.random() < 0.5)
    client.inject(rates=FaultRates(transfer_error=0.5, slow_peer=0.5, slow_s=30.0, seed=seed))
    handle = client.transfer(peer, blocks(dst, src, n=1))
    with pytest.raises(TransferTimeout, match="no progress within the 0.2s transfer deadline, and its retry failed"):
        handle.wait(5)
    assert client.submissions == 2 and handle.retries == 1 and not dst.any()


def test_injected_transfer_errors_fail_inside_the_transport(link) -> None:  # type: ignore[no-untyped-def]
    _, client, peer, src, dst = link
    client.inject(rates=FaultRates(transfer_error=1.0, seed=0))
    with pytest.raises(TransferFailed, match="injected transfer error"):
        client.transfer(peer, blocks(dst, src)).wait(5)
    assert not dst.any()


def test_a_held_transfer_runs_late_and_moves_the_right_bytes() -> None:
    server = kvbridge.create_backend("loopback")
    client = kvbridge.create_backend("loopback", fault_injection={"slow_peer": 1.0, "slow_s": 0.3})
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros_like(src)
    try:
        server.register_memory(src)
        client.register_memory(dst)
        peer = client.connect(server.endpoint_info())
        t = time.monotonic()
        handle = client.transfer(peer, [(dst.ctypes.data, src.ctypes.data, src.nbytes)])
        assert not handle.done()
        handle.wait(10)
        assert time.monotonic() - t >= 0.3
        assert np.array_equal(src, dst)
    finally:
        client.close()
        server.close()


def test_fault_injection_config_is_checked_before_the_transport_starts() -> None:
    with pytest.raises(ConfigError, match="unknown fault_injection keys"):
        kvbridge.create_backend("loopback", fault_injection={"transfer_errors": 0.1})
    with pytest.raises(ConfigError, match="rates must be in"):
        kvbridge.create_backend("loopback", fault_injection={"transfer_error": 0.8, "slow_peer": 0.5})
    with pytest.raises(ConfigError, match="takes numbers"):
        FaultRates.parse({"slow_s": "soon"})
    assert isinstance(kvbridge.create_backend("loopback", fault_injection={}), FaultyBackend)
    assert not isinstance(kvbridge.create_backend("loopback"), FaultyBackend)  # off unless asked
