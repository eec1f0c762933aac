"""The prefill ledger on its own: DONE counting, leases, expiry, fencing, abort (a manual clock)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.base.errors import ConfigError, ProtocolError
from kvbridge.control import Lease, LeaseState, LeaseStatus, Ledger


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def released() -> list[tuple[str, LeaseState, tuple[int, ...]]]:
    return []


@pytest.fixture
def ledger(clock: Clock, released: list) -> Ledger:
    return Ledger(
        lambda lease, why: released.append((lease.request_id, why, lease.blocks)), timeout_s=10.0, clock=clock
    )


def test_done_releases_exactly_at_the_last_expected_done(ledger: Ledger, released: list) -> None:
    lease = ledger.offer("r1", [4, 5, 6], expected_pulls=3)
    for i, rank in enumerate(["d0", "d1"]):
        status = ledger.done("r1", rank, lease.epoch)
        assert status.valid and status.state is LeaseState.ACTIVE and not status.released
        assert released == [], f"released after {i + 1} of 3 DONEs"
    last = ledger.done("r1", "d2", lease.epoch)
    assert last.valid and last.released and last.state is LeaseState.RELEASED
    assert released == [("r1", LeaseState.RELEASED, (4, 5, 6))]
    assert ledger.active == []


def test_duplicate_done_is_counted_once_and_stays_harmless(ledger: Ledger, released: list) -> None:
    lease = ledger.offer("r1", [1], expected_pulls=2)
    for _ in range(3):
        assert ledger.done("r1", "d0", lease.epoch).valid
    assert released == [], "three DONEs from one decode rank must count as one"
    assert ledger.done("r1", "d1", lease.epoch).released
    # Duplicates after the release: still valid for the rank that was counted, no second release.
    again = ledger.done("r1", "d1", lease.epoch)
    assert again.valid and not again.released and again.state is LeaseState.RELEASED
    assert len(released) == 1


def test_late_done_from_an_uncounted_rank_after_release_is_invalid(ledger: Ledger) -> None:
    lease = ledger.offer("r1", [1], expected_pulls=1)
    assert ledger.done("r1", "d0", lease.epoch).released
    late = ledger.done("r1", "d9", lease.epoch)
    assert not late.valid, "a read reported after the release may have seen reused blocks"


def test_done_from_first_decode_rank_releases_an_unpulled_rank(ledger: Ledger, released: list) -> None:
    ledger.offer("r1", [7, 8], expected_pulls=1)  # the planner's release count for a rank nobody reads
    status = ledger.done("r1", "decode/0")  # epoch 0: this DONE reports no read
    assert status.released and released == [("r1", LeaseState.RELEASED, (7, 8))]


def test_done_zero_expected_pulls_releases_at_offer(ledger: Ledger, released: list) -> None:
    lease = ledger.offer("r1", [3], expected_pulls=0)
    assert released == [("r1", LeaseState.RELEASED, (3,))]
    assert ledger.state("r1") is LeaseState.RELEASED and lease.expected_pulls == 0


def test_lease_expires_and_releases_once(ledger: Ledger, clock: Clock, released: list) -> None:
    ledger.offer("r1", [1, 2], expected_pulls=2)
    clock.now += 9.9
    assert ledger.reap() == 0 and released == []
    clock.now += 0.2
    assert ledger.reap() == 1
    assert ledger.reap() == 0
    assert released == [("r1", LeaseState.EXPIRED, (1, 2))]
    assert ledger.query("r1").state is LeaseState.EXPIRED


def test_lease_fencing_done_after_expiry_is_invalid(ledger: Ledger, clock: Clock, released: list) -> None:
    lease = ledger.offer("r1", [1], expected_pulls=2)
    begun = ledger.begin("r1", "d0")
    assert begun.valid and begun.epoch == lease.epoch and begun.blocks == (1,)
    clock.now += 11  # the read is slow; the lease runs out meanwhile (no reap has run yet)
    status = ledger.done("r1", "d0", lease.epoch)
    assert not status.valid and status.state is LeaseState.EXPIRED
    assert released == [("r1", LeaseState.EXPIRED, (1,))], "expiry is published before the DONE is answered"


def test_lease_fencing_epoch_of_an_older_offer_is_refused(ledger: Ledger) -> None:
    old = ledger.offer("r1", [1], expected_pulls=1)
    ledger.abort("r1")
    new = ledger.offer("r1", [2], expected_pulls=1)  # the same request id offered again
    assert new.epoch != old.epoch
    stale = ledger.done("r1", "d0", old.epoch)
    assert not stale.valid and ledger.state("r1") is LeaseState.ACTIVE, "a stale epoch must not count"
    assert ledger.query("r1", old.epoch).valid is False and ledger.query("r1", new.epoch).valid


def test_abort_releases_and_returns_watchers(ledger: Ledger, released: list) -> None:
    ledger.offer("r1", [5], expected_pulls=3)
    ledger.offer("r2", [6], expected_pulls=2)
    ledger.begin("r1", "d0", watcher=("127.0.0.1", 5000))
    ledger.begin("r1", "d1", watcher=("127.0.0.1", 5001))
    for rank in ("d0", "d1"):  # their reads ended
        ledger.done("r1", rank)
    assert sorted(ledger.abort("r1")) == [("127.0.0.1", 5000), ("127.0.0.1", 5001)]
    assert released == [("r1", LeaseState.ABORTED, (5,))], "nobody reads it: released at once"
    assert ledger.abort("r1") == [] and len(released) == 1, "a second abort is a no-op"
    assert ledger.abort("r2") == [] and released[-1] == ("r2", LeaseState.ABORTED, (6,))


def test_abort_holds_the_blocks_of_a_read_in_flight_until_its_done(ledger: Ledger, released: list) -> None:
    # A decode rank that began a pull may still be reading when prefill aborts: the abort is published at
    # once (the DONE is answered invalid), but the blocks stay until that rank's DONE.
    lease = ledger.offer("r1", [5], expected_pulls=2)
    begun = ledger.begin("r1", "d0")
    assert begun.valid and begun.reads_held and begun.remaining_s == 10.0
    ledger.begin("r1", "d1")
    ledger.abort("r1")
    assert ledger.state("r1") is LeaseState.ABORTED and released == []
    assert not ledger.begin("r1", "d2").valid, "no new read of an aborted lease"
    assert not ledger.done("r1", "d0", lease.epoch).valid and released == [], "d1 still reads"
    assert ledger.done("r1", "d9", lease.epoch).valid is False and released == [], "not a reader"
    assert not ledger.done("r1", "d1", lease.epoch).valid
    assert released == [("r1", LeaseState.ABORTED, (5,))]
    assert ledger.done("r1", "d1", lease.epoch).valid is False and len(released) == 1


def test_a_read_never_confirmed_holds_an_aborted_lease_until_its_deadline(
    ledger: Ledger, released: list, clock: Clock
) -> None:
    old = ledger.offer("r1", [5], expected_pulls=1)
    ledger.begin("r1", "d0")
    ledger.abort("r1")
    new = ledger.offer("r1", [7], expected_pulls=1)  # the id offered again: another lease, another hold
    assert ledger.done("r1", "d0", new.epoch).released, "a DONE of the new epoch ends only that read"
    assert released == [("r1", LeaseState.RELEASED, (7,))]
    clock.now += 9.9
    ledger.reap()
    assert len(released) == 1, "the decode rank that read the aborted lease may still be reading"
    clock.now += 0.1  # the deadline that rank was told: no read can outlive it
    ledger.reap()
    assert released[-1] == ("r1", LeaseState.ABORTED, (5,)) and old.epoch != new.epoch


def test_a_reader_that_died_ties_the_blocks_up_for_the_hold_it_was_told_not_for_the_lease(
    clock: Clock, released: list
) -> None:
    # A decode rank that died mid-read never says DONE. The proxy sends the request to another decode, whose DONE
    # reaches the count: the blocks wait for the dead reader only as long as an answer promised, not for lease_s.
    ledger = Ledger(lambda lease, why: released.append((lease.request_id, why)), timeout_s=120.0, clock=clock)
    lease = ledger.offer("r1", [5], expected_pulls=1)
    first = ledger.begin("r1", "d0")
    assert first.reads_held and first.remaining_s == ledger.read_hold_s == 10.0, "a read's hold, not the lease's"
    clock.now += 3.0  # d0 died; the request is sent to another decode
    assert ledger.begin("r1", "d1").remaining_s == 10.0
    assert ledger.done("r1", "d1", lease.epoch).valid and released == [], "d0 may still be reading"
    clock.now += 9.9
    ledger.reap()
    assert released == [], "d1's hold, promised 9.9 s ago, still runs"
    clock.now += 0.1
    ledger.reap()
    assert released == [("r1", LeaseState.RELEASED)] and ledger.held() == (0, 0)
    assert not ledger.done("r1", "d0", lease.epoch).valid, "a read that outlived its hold is not confirmed"


def test_an_abort_after_every_readers_hold_ended_releases_at_once(clock: Clock, released: list) -> None:
    ledger = Ledger(lambda lease, why: released.append((lease.request_id, why)), timeout_s=120.0, clock=clock)
    lease = ledger.offer("r1", [5], expected_pulls=1)
    ledger.begin("r1", "d0")
    clock.now += 10.0  # the proxy learns that d0 died and releases the lease
    ledger.abort("r1")
    assert released == [("r1", LeaseState.ABORTED)] and ledger.held() == (0, 0)
    assert not ledger.done("r1", "d0", lease.epoch).valid
    ledger.offer("r2", [6], expected_pulls=1)
    ledger.begin("r2", "d0")
    clock.now += 9.0
    assert ledger.query("r2").remaining_s == 10.0, "a query renews the promise"
    clock.now += 9.0
    ledger.abort("r2")
    assert released[-1] == ("r1", LeaseState.ABORTED) and ledger.held() == (1, 1), "held for the renewed promise"
    clock.now += 1.0
    ledger.reap()
    assert released[-1] == ("r2", LeaseState.ABORTED) and ledger.held() == (0, 0)


@pytest.mark.parametrize("hold", [0.0, -1.0, float("nan"), 1e9])
def test_a_read_hold_outside_what_a_lease_can_be_is_refused(hold: float) -> None:
    with pytest.raises(ConfigError, match="read hold must be positive seconds"):
        Ledger(lambda lease, why: None, read_hold_s=hold)


def test_a_count_reached_while_another_rank_reads_holds_until_its_done(ledger: Ledger, released: list) -> None:
    lease = ledger.offer("r1", [5], expected_pulls=1)  # the count is wrong: two ranks read
    ledger.begin("r1", "d0")
    ledger.begin("r1", "d1")
    assert ledger.done("r1", "d0", lease.epoch).valid
    assert ledger.state("r1") is LeaseState.RELEASED and released == []
    assert not ledger.done("r1", "d1", lease.epoch).valid, "its read may not be confirmed: it was not counted"
    assert released == [("r1", LeaseState.RELEASED, (5,))]


def test_a_readers_release_only_done_vouches_for_no_read_of_its_own(ledger: Ledger, released: list) -> None:
    # A release-only DONE (epoch 0) goes to ranks a decode rank does not read; one that reaches a rank it
    # reads (a frame signed for another rank, replayed) ends its read and may release the blocks under it,
    # so that rank's own fenced DONE after it must not confirm the read.
    lease = ledger.offer("r1", [5], expected_pulls=1)
    ledger.begin("r1", "d0")
    ledger.done("r1", "d0", 0, expected_pulls=1)
    assert released == [("r1", LeaseState.RELEASED, (5,))]
    assert not ledger.done("r1", "d0", lease.epoch).valid, "the read overlapped the release"
    other = ledger.offer("r2", [6], expected_pulls=2)  # still active after the release-only DONE
    ledger.begin("r2", "d0")
    ledger.done("r2", "d0", 0, expected_pulls=2)
    assert ledger.state("r2") is LeaseState.ACTIVE and not ledger.done("r2", "d0", other.epoch).valid
    third = ledger.offer("r3", [7], expected_pulls=2)  # a rank that only releases stays valid
    assert ledger.done("r3", "d1", 0, expected_pulls=2).valid and ledger.done("r3", "d0", third.epoch).valid


def test_a_beginpull_served_after_its_ranks_done_reads_nothing(ledger: Ledger, released: list) -> None:
    # A decode rank gave up on a BeginPull its prefill left unanswered (stopped) and sent its release-only DONE; the
    # prefill, running again, may serve the two in either order. Served second, the BeginPull must not make the rank
    # a reader again: the lease would then be held for it after the other ranks' DONEs, until its deadline.
    lease = ledger.offer("r1", [5], expected_pulls=2)
    ledger.done("r1", "d0", 0, expected_pulls=2)
    with pytest.raises(ProtocolError, match="stale"):
        ledger.begin("r1", "d0", expected_pulls=2)
    ledger.begin("r1", "d1", expected_pulls=2)
    assert ledger.done("r1", "d1", lease.epoch).released
    assert released == [("r1", LeaseState.RELEASED, (5,))]


def test_a_lease_the_engine_may_free_by_itself_promises_no_hold(ledger: Ledger, released: list) -> None:
    ledger.offer("s1", [5], expected_pulls=1, holds_reads=False)  # e.g. a stream vLLM may preempt
    begun = ledger.begin("s1", "d0")
    assert begun.valid and not begun.reads_held


def test_a_lease_that_starts_holding_reads_holds_an_abort_for_its_readers(ledger: Ledger, released: list) -> None:
    lease = ledger.offer("s1", [5], expected_pulls=1, holds_reads=False)  # a stream, still preemptible
    ledger.begin("s1", "d0")
    assert not ledger.query("s1").reads_held
    assert ledger.hold_reads("s1") and ledger.query("s1").reads_held  # its request can no longer be preempted
    assert ledger.query("s1", lease.epoch).remaining_s == 10.0, "the deadline is the one readers were told"
    ledger.abort("s1")
    assert released == [], "d0 began reading: the blocks wait for its DONE"
    ledger.done("s1", "d0", lease.epoch)
    assert released == [("s1", LeaseState.ABORTED, (5,))]
    assert not ledger.hold_reads("s1") and not ledger.hold_reads("never-offered"), "only an active lease"


def test_a_lease_is_counted_as_read_from_its_first_begin_to_the_release_of_its_blocks(
    ledger: Ledger, clock: Clock, released: list
) -> None:
    # A transport serves reads promptly only while this count is above 0 (MigrationBackend.expect_reads).
    counts: list[int] = []
    ledger.on_reading(counts.append)
    a = ledger.offer("a", [1], expected_pulls=2)
    ledger.offer("b", [2], expected_pulls=1)
    ledger.offer("c", [3], expected_pulls=1)
    assert counts == [], "an offer nobody began to read is not read"
    ledger.begin("a", "d0")
    ledger.begin("a", "d1")
    ledger.begin("b", "d0")
    assert counts == [1, 2], "one count per lease, not per reader"
    ledger.done("a", "d0", a.epoch)
    assert counts == [1, 2], "d1 still reads a"
    ledger.abort("a")  # d1 reads on: the blocks stay, and so does the count
    assert counts == [1, 2] and released == []
    ledger.done("a", "d1", a.epoch)
    assert counts == [1, 2, 1] and released == [("a", LeaseState.ABORTED, (1,))]
    clock.now += 10.0  # b's reader never said DONE: its deadline releases the blocks
    ledger.reap()
    assert counts == [1, 2, 1, 0] and {r[0] for r in released} == {"a", "b", "c"}


def test_done_for_an_unknown_request_is_invalid_and_harmless(ledger: Ledger, released: list) -> None:
    status = ledger.done("never-offered", "d0", 123)
    assert status.state is LeaseState.UNKNOWN and not status.valid and released == []


def test_offer_twice_while_active_is_refused(ledger: Ledger) -> None:
    ledger.offer("r1", [1], expected_pulls=1)
    with pytest.raises(ConfigError, match="already holds lease"):
        ledger.offer("r1", [2], expected_pulls=1)
    with pytest.raises(ConfigError, match="expected_pulls"):
        ledger.offer("r2", [2], expected_pulls=-1)


def test_lease_release_callback_failure_does_not_wedge_the_ledger(clock: Clock) -> None:
    def boom(lease: object, why: object) -> None:
        raise RuntimeError("engine callback bug")

    ledger = Ledger(boom, timeout_s=1.0, clock=clock)
    ledger.offer("r1", [1], expected_pulls=1)
    assert ledger.done("r1", "d0").released
    ledger.offer("r2", [1], expected_pulls=1)
    clock.now += 2
    assert ledger.reap() == 1 and ledger.active == []


def test_lease_tombstones_are_bounded(clock: Clock) -> None:
    ledger = Ledger(lambda lease, why: None, timeout_s=1.0, max_tombstones=10, clock=clock)
    for i in range(50):
        ledger.offer(f"r{i}", [i], expected_pulls=0)
    assert ledger.state("r49") is LeaseState.RELEASED
    assert ledger.state("r0") is LeaseState.UNKNOWN
    assert len(ledger._finished) == 10


def test_done_count_stated_by_the_decode_side(ledger: Ledger, released: list) -> None:
    lease = ledger.offer("r1", [1, 2], expected_pulls=None)  # prefill does not know the decode config
    assert ledger.done("r1", "d0", lease.epoch).valid and released == [], "no count yet: nothing to release"
    ledger.begin("r1", "d1", expected_pulls=3)  # the decode side's plan: three ranks read this one
    ledger.done("r1", "d1", lease.epoch, expected_pulls=3)
    assert released == []
    ledger.done("r1", "d2", lease.epoch, expected_pulls=5)  # a disagreeing count is logged, the first kept
    assert released == [("r1", LeaseState.RELEASED, (1, 2))]


def test_done_open_count_lease_still_expires(ledger: Ledger, clock: Clock, released: list) -> None:
    ledger.offer("r1", [1], expected_pulls=None)
    clock.now += 11
    assert ledger.reap() == 1 and released == [("r1", LeaseState.EXPIRED, (1,))]


def test_lease_reoffered_request_keeps_its_own_deadline(ledger: Ledger, clock: Clock, released: list) -> None:
    ledger.offer("r1", [1], expected_pulls=1)  # deadline now + 10
    ledger.abort("r1")
    ledger.offer("r1", [2], expected_pulls=1, timeout_s=100)
    clock.now += 11
    assert ledger.reap() == 0 and ledger.state("r1") is LeaseState.ACTIVE, "the old offer's deadline must not count"
    clock.now += 90
    assert ledger.reap() == 1 and released[-1] == ("r1", LeaseState.EXPIRED, (2,))


def test_done_release_only_before_the_offer_counts_when_it_comes(ledger: Ledger, clock: Clock, released: list) -> None:
    # The plan's notifier releases an unread rank before that rank offered the request.
    early = ledger.done("r1", "decode/0", 0, expected_pulls=1)
    assert early.state is LeaseState.UNKNOWN and released == []
    ledger.offer("r1", [9], expected_pulls=None)
    assert released == [("r1", LeaseState.RELEASED, (9,))]
    # A read DONE (epoch != 0) is never kept; a kept DONE is forgotten after the lease timeout.
    ledger.done("r2", "decode/0", 12345, expected_pulls=1)
    ledger.done("r3", "decode/0", 0, expected_pulls=1)
    clock.now += 11
    ledger.offer("r2", [1], expected_pulls=None)
    ledger.offer("r3", [1], expected_pulls=None)
    assert released == [("r1", LeaseState.RELEASED, (9,))] and sorted(ledger.active) == ["r2", "r3"]


def test_abort_before_the_offer_releases_the_offer_at_once(ledger: Ledger, clock: Clock, released: list) -> None:
    # vLLM: a decode engine drops the request (or needs none of its KV) before this prefill rank's
    # worker hears of its own scheduler's offer.
    assert ledger.abort("r1") == [] and released == []
    lease = ledger.offer("r1", [4, 5], expected_pulls=None)
    assert released == [("r1", LeaseState.ABORTED, (4, 5))] and ledger.active == []
    assert not ledger.done("r1", "d0", lease.epoch).valid, "nothing may be read from an aborted offer"
    # A kept abort is used once, and forgotten after the lease timeout.
    ledger.abort("r2")
    clock.now += 11
    ledger.offer("r1", [6], expected_pulls=1)
    ledger.offer("r2", [7], expected_pulls=1)
    assert len(released) == 1 and sorted(ledger.active) == ["r1", "r2"]
    # An abort of a finished lease is not kept: the id may be offered again as a new request.
    ledger.done("r1", "d0", 0)
    ledger.abort("r1")
    ledger.offer("r1", [8], expected_pulls=1)
    assert ledger.state("r1") is LeaseState.ACTIVE


ops = st.lists(
    st.one_of(
        st.tuples(st.just("offer"), st.sampled_from("abc"), st.sampled_from([None, 0, 1, 2, 3])),
        st.tuples(st.just("begin"), st.sampled_from("abc"), st.sampled_from(["d0", "d1", "d2"]), st.integers(0, 3)),
        st.tuples(
            st.just("done"),
            st.sampled_from("abc"),
            st.sampled_from(["d0", "d1", "d2"]),
            st.integers(0, 3),
            st.booleans(),
        ),
        st.tuples(st.just("abort"), st.sampled_from("abc")),
        st.tuples(st.just("query"), st.sampled_from("abc")),
        st.tuples(st.just("advance"), st.floats(0, 6)),
    ),
    max_size=40,
)


@settings(max_examples=1000, deadline=None, derandomize=True)
@given(ops)
def test_lease_fuzz_ledger_invariants(script: list) -> None:
    """Random offer/begin/done/abort/time sequences keep the ledger's leases and fencing.

    A lease is released once; after an expiry or abort no DONE of that epoch is answered valid, and after a release
    only the duplicates of DONEs counted before it are (fencing). Its blocks are never handed back while a rank that
    began a pull may read them within a hold an answer promised; and once every lease's time is past, none is held.
    """
    clock = Clock()
    log: list[tuple] = []  # ("release", epoch, reason), ("valid", epoch, rank), ("early", request, rank)
    readers: dict[int, set[str]] = {}  # epoch -> ranks whose BeginPull found it active, no DONE since
    promised: dict[int, float] = {}  # epoch -> the latest end of a hold an answer promised

    def promise(status: LeaseStatus) -> None:
        if status.reads_held:
            promised[status.epoch] = max(promised.get(status.epoch, 0.0), clock.now + status.remaining_s)

    def release(lease: Lease, why: LeaseState) -> None:
        if readers.get(lease.epoch) and clock.now < promised.get(lease.epoch, 0.0):
            log.append(("under a read", lease.epoch, sorted(readers[lease.epoch])))
        log.append(("release", lease.epoch, why))

    ledger = Ledger(release, timeout_s=10.0, read_hold_s=4.0, clock=clock)
    reading: list[int] = []  # what on_reading said, in order
    ledger.on_reading(reading.append)
    begins: set[int] = set()  # epochs a BeginPull found active
    epochs: dict[str, int] = {}
    request_of: dict[int, str] = {}
    for op in script:
        if op[0] == "offer":
            try:
                lease = ledger.offer(op[1], [1], expected_pulls=op[2])
                epochs[op[1]] = lease.epoch
                request_of[epochs[op[1]]] = op[1]
            except ConfigError:
                assert ledger.state(op[1]) is LeaseState.ACTIVE
        elif op[0] == "begin":
            try:
                begun = ledger.begin(op[1], op[2], expected_pulls=op[3])
            except ProtocolError:  # a rank reads a lease once: after its DONE, a BeginPull is stale
                assert ledger.state(op[1]) is LeaseState.ACTIVE
                continue
            promise(begun)
            if begun.valid:
                readers.setdefault(begun.epoch, set()).add(op[2])
                begins.add(begun.epoch)
        elif op[0] == "done":
            epoch = epochs.get(op[1], 0) if op[4] else 0
            for e, ranks in readers.items():  # the read it names ends before the DONE is sent
                if e == epoch or (epoch == 0 and request_of.get(e) == op[1]):
                    ranks.discard(op[2])
            status = ledger.done(op[1], op[2], epoch, expected_pulls=op[3])
            promise(status)
            if status.valid and status.released:  # this DONE was counted, then released the lease
                log.insert(log.index(("release", status.epoch, LeaseState.RELEASED)), ("valid", status.epoch, op[2]))
            elif status.valid:
                log.append(("valid", status.epoch, op[2]))
            elif status.state is LeaseState.UNKNOWN and epoch == 0:
                log.append(("early", op[1], op[2]))
        elif op[0] == "abort":
            ledger.abort(op[1])
        elif op[0] == "query":
            promise(ledger.query(op[1]))
        else:
            clock.now += op[1]
            ledger.reap()
        unreleased = begins - {e[1] for e in log if e[0] == "release"}
        assert (reading[-1] if reading else 0) == len(unreleased), "leases being read, miscounted"
    assert not [e for e in log if e[0] == "under a read"], "blocks released while a decode rank read them"
    clock.now += 10.0
    ledger.reap()
    assert ledger.held() == (0, 0), "a lease held its blocks past its deadline"
    releases = [e for e in log if e[0] == "release"]
    assert len({e[1] for e in releases}) == len(releases), "a lease was released twice"
    for entry in releases:
        _, epoch, reason = entry
        at = log.index(entry)
        later = {e[2] for e in log[at + 1 :] if e[0] == "valid" and e[1] == epoch}
        if reason is not LeaseState.RELEASED:
            assert not later, f"a DONE was answered valid after the lease {reason.value}"
        else:
            counted = {
                e[2]
                for e in log[:at]
                if (e[0] == "valid" and e[1] == epoch) or (e[0] == "early" and e[1] == request_of[epoch])
            }
            assert later <= counted, "a DONE not counted before the release was answered valid"


def test_offer_with_the_same_offer_id_is_one_lease(ledger: Ledger, released: list, clock: Clock) -> None:
    # The scheduler's early offer and the engine step's offer of one finished request, in either order,
    # before or after the decode released it: one lease, one release, never a second hold of the blocks.
    offered: list[int] = []
    ledger.on_offer(lambda lease: offered.append(lease.epoch))
    first = ledger.offer("r1", [1, 2], offer_id="o-1")
    assert ledger.offer("r1", (1, 2), offer_id="o-1") == first and offered == [first.epoch]
    with pytest.raises(ConfigError, match="names other blocks"):
        ledger.offer("r1", [1, 3], offer_id="o-1")
    with pytest.raises(ConfigError, match="already holds lease"):
        ledger.offer("r1", [1, 2], offer_id="o-2")  # another offer while this one is active
    assert ledger.done("r1", "d0", first.epoch, expected_pulls=1).released
    assert ledger.offer("r1", [1, 2], offer_id="o-1") == first  # the step's offer after the release
    assert ledger.active == [] and released == [("r1", LeaseState.RELEASED, (1, 2))] and offered == [first.epoch]
    clock.now += 100
    assert ledger.reap() == 0 and len(released) == 1
    again = ledger.offer("r1", [1, 2], offer_id="o-3")  # a new request with the same id: a new lease
    assert again.epoch != first.epoch and offered == [first.epoch, again.epoch]


def test_a_lease_holds_no_more_blocks_than_one_message_carries(ledger: Ledger) -> None:
    from kvbridge.control.messages import MAX_BLOCKS

    with pytest.raises(ConfigError, match=f"more than the {MAX_BLOCKS} one side-channel message carries"):
        ledger.offer("r1", range(MAX_BLOCKS + 1))
    ledger.offer("r2", range(MAX_BLOCKS - 1))
    with pytest.raises(ConfigError, match="one side-channel message carries"):
        ledger.extend("r2", [MAX_BLOCKS, MAX_BLOCKS + 1])
    assert len(ledger.query("r2").blocks) == MAX_BLOCKS - 1, "the refused extension changed nothing"
