"""PullControl in one process over the loopback transport (real memmoves, injected faults).

The cases: a lease expiring during the read, a failed transfer, a prefill rank that is not ready, a read reported
before its DONE is answered, an abort on the prefill side during a read.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import numpy as np
import pytest
from control_helpers import wait_for

from kvbridge.agent.kv_agent import KVAgent
from kvbridge.base.errors import ConfigError, LoadError, TransferFailed, TransferTimeout
from kvbridge.control import ControlServer, KVTransferParams, LeaseState, Ledger
from kvbridge.plan.layout import vllm_layout
from kvbridge.plan.presets import PRESETS
from kvbridge.plan.topology import ParallelConfig
from kvbridge.session.machine import PullMachine, PullState
from kvbridge.session.pull_control import PullControl

MODEL = PRESETS["tiny-gqa"]
TOKENS = 40


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _agent(engine: str, heads: int, blocks: int) -> tuple[KVAgent, np.ndarray]:
    layer = 2 * blocks * heads * MODEL.block_size * MODEL.head_dim * MODEL.dtype_bytes
    buf = np.zeros(MODEL.layers * layer, dtype=np.uint8)
    layout = vllm_layout(MODEL, heads, [buf.ctypes.data + i * layer for i in range(MODEL.layers)], blocks)
    return KVAgent(engine, 0, ParallelConfig(tp=1), layout, buf, backend="loopback", fault_injection={}), buf


class SlowDoneLedger(Ledger):
    """A real ledger whose DONEs wait until `answer` is set (a prefill rank busy or far away)."""

    answer = threading.Event()

    def done(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        assert self.answer.wait(10)
        return super().done(*args, **kwargs)


class Pair:
    def __init__(
        self, *, ledger: type[Ledger] = Ledger, lease_s: float = 60, clock: Callable[[], float] | None = None
    ) -> None:
        self.clock = Clock()
        self.released: list[tuple[str, LeaseState]] = []
        self.ledger = ledger(
            lambda lease, why: self.released.append((lease.request_id, why)),
            timeout_s=lease_s,
            clock=clock or self.clock,
        )
        self.prefill, self.p_buf = _agent("prefill", MODEL.kv_heads, 8)
        self.decode, self.d_buf = _agent("decode", MODEL.kv_heads, 8)
        self.p_buf[:] = np.arange(self.p_buf.size, dtype=np.uint64).astype(np.uint8)
        self.p_server = ControlServer("prefill", 0, ledger=self.ledger, poll_interval_s=0.01)
        self.d_server = ControlServer("decode", 0)
        self.d_server.register(self.decode.info())
        self.control = PullControl(self.decode, self.d_server, ready_timeout_s=0.3)
        self.outcomes: list[tuple[str, BaseException | None]] = []

    def params(self, rid: str) -> KVTransferParams:
        host, port = self.p_server.address
        return KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id="prefill",
            remote_request_id=rid,
            remote_block_ids=[[1, 2, 3]],
            remote_host=host,
            remote_port=port,
            tp_size=1,
            remote_num_tokens=TOKENS,
        )

    def start(self, rid: str, machine: PullMachine | None = None):  # noqa: ANN201
        return self.control.start(
            f"local-{rid}", self.params(rid), [4, 5, 6], lambda r, e: self.outcomes.append((r, e)), machine
        )

    def close(self) -> None:
        self.control.close()
        for x in (self.p_server, self.d_server, self.prefill, self.decode):
            x.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def test_done_decode_control_pulls_and_releases(pair: Pair) -> None:
    pair.p_server.register(pair.prefill.info())
    pair.ledger.offer("r1", [1, 2, 3], expected_pulls=None)
    machine = PullMachine("local-r1", "pull")
    pair.start("r1", machine).wait(10)
    assert pair.outcomes == [("local-r1", None)]
    assert machine.state is PullState.DONE and list(machine.at) == list(PullState)[:6], "every state, in order"
    # the transfer's parts of kvbridge's own, reported beside it: the descriptors built, a landed read's copy (none)
    assert machine.parts["prepare_ms"] > 0 and "land_ms" in machine.parts
    # the DONE follows the report; the count (1) came from the decode side's plan
    wait_for(lambda: pair.released == [("r1", LeaseState.RELEASED)], what="release")
    assert pair.d_buf.any() and pair.control.local_id("r1") is None


def test_lease_expiring_during_the_read_is_a_load_error() -> None:
    pair = Pair(lease_s=1.0, clock=time.monotonic)  # both sides on the real clock
    try:
        pair.p_server.register(pair.prefill.info())
        pair.ledger.offer("r2", [1, 2, 3], expected_pulls=1)
        pair.decode.backend.inject(delay=2.0)  # a slow read...
        machine = PullMachine("local-r2", "pull")
        handle = pair.start("r2", machine)
        assert pair.control.local_id("r2") == "local-r2" and machine.state is PullState.READING
        # ...outlives the lease: the prefill side expires it (its server reaps) and may reuse the blocks
        wait_for(lambda: pair.released == [("r2", LeaseState.EXPIRED)], what="expiry")
        assert not handle.done(), "expiry must come during the read"
        handle.wait(10)
        ((rid, err),) = pair.outcomes
        assert rid == "local-r2" and isinstance(err, LoadError) and "recompute" in str(err)
        assert machine.state is PullState.FENCED and machine.error is err
    finally:
        pair.close()


def test_a_read_within_the_lease_is_reported_before_its_done_is_answered() -> None:
    # The prefill rank holds the blocks for this read until its DONE (or the deadline): the read is
    # reported as soon as its bytes landed, and the DONE, which frees the prefill blocks, follows.
    SlowDoneLedger.answer.clear()
    pair = Pair(ledger=SlowDoneLedger)
    try:
        pair.p_server.register(pair.prefill.info())
        pair.ledger.offer("r9", [1, 2, 3], expected_pulls=1)
        machine = PullMachine("local-r9", "pull")
        handle = pair.control.start(
            "local-r9", pair.params("r9"), [4, 5, 6], lambda r, e: pair.outcomes.append((r, e)), machine
        )
        handle.wait(10)
        assert pair.outcomes == [("local-r9", None)] and pair.d_buf.any()
        assert pair.ledger.state("r9") is LeaseState.ACTIVE and pair.released == [], "its DONE is not answered yet"
        assert machine.state is PullState.DONE
        assert machine.at[PullState.READING] <= machine.at[PullState.LANDING] <= machine.at[PullState.DONE]
        SlowDoneLedger.answer.set()
        wait_for(lambda: pair.released == [("r9", LeaseState.RELEASED)], what="the DONE sent after the report")
    finally:
        SlowDoneLedger.answer.set()
        pair.close()


def test_prefill_abort_during_a_read_frees_the_blocks_only_after_its_done(pair: Pair) -> None:
    pair.p_server.register(pair.prefill.info())
    pair.ledger.offer("r10", [1, 2, 3], expected_pulls=1)
    pair.decode.backend.inject(delay=0.5)
    handle = pair.start("r10")
    pair.p_server.abort("r10", reason="prefill engine dropped it")
    assert pair.ledger.state("r10") is LeaseState.ABORTED and pair.released == [], "the read still runs"
    handle.wait(10)
    assert pair.outcomes == [("local-r10", None)], "the blocks were held for the read: its bytes are intact"
    wait_for(lambda: pair.released == [("r10", LeaseState.ABORTED)], what="release at the DONE")


def test_done_after_a_failed_transfer_still_releases_the_prefill_blocks(pair: Pair) -> None:
    pair.p_server.register(pair.prefill.info())
    pair.ledger.offer("r3", [1, 2, 3], expected_pulls=1)
    pair.decode.backend.inject(fail_completion=1)
    machine = PullMachine("local-r3", "pull")
    with pytest.raises(TransferFailed):
        pair.start("r3", machine).wait(10)
    ((rid, err),) = pair.outcomes
    assert isinstance(err, TransferFailed) and machine.state is PullState.FAILED
    assert pair.released == [("r3", LeaseState.RELEASED)], "the decode side recomputes; prefill need not wait"


def test_pull_from_a_rank_that_never_becomes_ready_fails_clearly(pair: Pair) -> None:
    pair.ledger.offer("r4", [1, 2, 3], expected_pulls=1)
    with pytest.raises(TransferTimeout, match="has not registered its KV cache"):
        pair.start("r4")
    assert pair.outcomes == [] and pair.released == []


def test_abort_through_decode_control_frees_the_prefill_lease(pair: Pair) -> None:
    pair.p_server.register(pair.prefill.info())
    pair.ledger.offer("r5", [1, 2, 3], expected_pulls=1)
    assert pair.control.abort(pair.params("r5"), reason="client went away") == 1
    wait_for(lambda: pair.released == [("r5", LeaseState.ABORTED)], what="abort at prefill")


def test_done_sent_when_the_pull_fails_before_moving_bytes(pair: Pair) -> None:
    pair.p_server.register(pair.prefill.info())
    pair.ledger.offer("r6", [1, 2, 3], expected_pulls=1)
    machine = PullMachine("local-r6", "pull")
    with pytest.raises(ConfigError, match="holds 3 blocks"):
        pair.control.start("local-r6", pair.params("r6"), [4], None, machine)  # too few local blocks: nothing read
    assert machine.state is PullState.FAILED and PullState.LANDING not in machine.at
    assert pair.released == [("r6", LeaseState.RELEASED)], "the announced lease is released at once"
    assert pair.control.local_id("r6") is None


def test_stale_engine_id_is_a_load_error_and_still_releases(pair: Pair) -> None:
    pair.p_server.register(pair.prefill.info())
    pair.ledger.offer("r7", [1, 2, 3], expected_pulls=None)
    stale = attrs.evolve(pair.params("r7"), remote_engine_id="restarted-prefill")
    with pytest.raises(LoadError, match="serves engine 'prefill', not 'restarted-prefill'"):
        pair.control.start("local-r7", stale, [4, 5, 6])
    assert not pair.d_buf.any(), "nothing is read from another engine's blocks"
    assert pair.released == [("r7", LeaseState.RELEASED)], "the rank it was to read is released at once"
    # The same failure before the prefill rank offered the request: the release is kept until the offer.
    with pytest.raises(LoadError, match="restarted-prefill"):
        pair.control.start("local-r8", attrs.evolve(pair.params("r8"), remote_engine_id="restarted-prefill"), [4, 5, 6])
    pair.ledger.offer("r8", [1, 2, 3], expected_pulls=None)
    assert pair.released[-1] == ("r8", LeaseState.RELEASED)


@contextlib.contextmanager
def _restarted_prefill(pair: Pair, engine_id: str) -> Iterator[tuple[Ledger, list[tuple[str, LeaseState]]]]:
    """The pair's prefill, closed after one request was pulled from it, and engine `engine_id` at its port.

    The new engine has other memory (every byte 7). Yields its ledger and the releases that ledger reports."""
    pair.p_server.register(pair.prefill.info())
    pair.ledger.offer("r9", [1, 2, 3], expected_pulls=None)
    pair.start("r9").wait(10)  # the decode side now knows engine "prefill" at this address, and is admitted
    wait_for(lambda: pair.released == [("r9", LeaseState.RELEASED)], what="release")
    _host, port = pair.p_server.address
    pair.p_server.close()
    agent, buf = _agent(engine_id, MODEL.kv_heads, 8)
    try:
        buf[:] = 7
        released: list[tuple[str, LeaseState]] = []
        ledger = Ledger(lambda lease, why: released.append((lease.request_id, why)), timeout_s=60)
        server = ControlServer(engine_id, 0, ledger=ledger, port=port, poll_interval_s=0.01)
        try:
            server.register(agent.info())
            yield ledger, released
        finally:
            server.close()
    finally:
        agent.close()


def _read_the_restarted_memory(pair: Pair) -> bool:
    """Whether the decode's block 4 holds the restarted engine's bytes."""
    block = pair.d_buf.size // MODEL.layers // 2 // 8  # one block of one plane of one layer
    return bool((pair.d_buf[4 * block : 5 * block] == 7).all())


def test_a_request_of_a_restarted_prefill_fails_at_once_and_the_new_engine_serves() -> None:
    """A prefill restarted on its address is another engine, and the new engine's requests pull.

    A BeginPull for the old engine's request is not re-addressed to the new one (which would hold it for the whole
    offer wait, `ready_timeout_s`, for a request it never had: the 30 s TTFTs of a chaos run that killed prefills).
    """
    pair = Pair()
    pair.control.ready_timeout_s = 60.0  # the wait a re-addressed BeginPull would sit out
    try:
        with _restarted_prefill(pair, "prefill-2") as (new_ledger, _released):
            begun = time.monotonic()
            with pytest.raises(LoadError, match="now serves engine 'prefill-2'"):
                pair.start("r10")  # the old engine's request: its KV went with it
            assert time.monotonic() - begun < 30, "refused at once, not after the offer wait"
            new_ledger.offer("r11", [1, 2, 3], expected_pulls=None)
            params = attrs.evolve(pair.params("r11"), remote_engine_id="prefill-2")
            pair.control.start("local-r11", params, [4, 5, 6]).wait(10)
            assert _read_the_restarted_memory(pair)
    finally:
        pair.close()


@pytest.mark.parametrize("read_first", [True, False])
def test_a_prefill_restarted_under_the_same_engine_id_is_never_read_with_its_old_rank_info(read_first: bool) -> None:
    """An engine id pinned in the config survives a restart; the memory the old RankInfo names does not.

    The old prefill's buffer stays allocated here, so a read with the stale RankInfo would succeed and land its
    bytes, not the restarted engine's: silently wrong KV. A read begun first with it is discarded (recompute); one
    not begun yet reads with the new RankInfo."""
    pair = Pair()
    pair.control.read_first = read_first
    try:
        with _restarted_prefill(pair, "prefill") as (new_ledger, released):  # the same engine id, other memory
            new_ledger.offer("r10", [1, 2, 3], expected_pulls=None)
            if read_first:
                with pytest.raises(LoadError, match="registered other memory"):
                    pair.start("r10").wait(10)
                wait_for(lambda: released == [("r10", LeaseState.RELEASED)], what="the lease's release by its DONE")
                new_ledger.offer("r11", [1, 2, 3], expected_pulls=None)
                pair.start("r11").wait(10)  # the RankInfo was fetched again
            else:
                pair.start("r10").wait(10)
            assert _read_the_restarted_memory(pair)
    finally:
        pair.close()


def _moved(pair: Pair, rid: str) -> KVTransferParams:
    """What a decode resuming a moved request gets: the lease id, the tokens, no block ids."""
    return attrs.evolve(pair.params(rid), remote_block_ids=(), kvbridge_move_id=rid)


def test_a_move_pull_names_no_blocks_and_reads_the_lease_prefix() -> None:
    """BeginPull without blocks: the blocks come from the lease (which holds one more), bytes as a named pull's."""
    named, moving = Pair(), Pair()
    try:
        for p in (named, moving):
            p.p_server.register(p.prefill.info())
        named.ledger.offer("r1", [1, 2, 3], expected_pulls=None)
        named.start("r1").wait(10)
        moving.ledger.offer("M1", [1, 2, 3, 7], expected_pulls=None)  # the source computed one step past the cut
        params = _moved(moving, "M1")
        assert params.lease_blocks and not len(params.block_ids)
        done: list[BaseException | None] = []
        moving.control.start("local-M1", params, [4, 5, 6], lambda r, e: done.append(e)).wait(10)
        assert done == [None] and named.outcomes == [("local-r1", None)]
        assert moving.d_buf.any() and np.array_equal(moving.d_buf, named.d_buf)
        wait_for(lambda: moving.released == [("M1", LeaseState.RELEASED)], what="release")
    finally:
        named.close()
        moving.close()


def test_a_move_pull_skips_the_blocks_decode_holds(pair: Pair) -> None:
    """With `skip`, the lease's leading blocks are not read: the first local block gets the lease's second."""
    pair.p_server.register(pair.prefill.info())
    pair.ledger.offer("M2", [1, 2, 3], expected_pulls=None)
    params = attrs.evolve(_moved(pair, "M2"), remote_num_tokens=TOKENS - MODEL.block_size)
    pair.control.start("local-M2", params, [5, 6], lambda r, e: pair.outcomes.append((r, e)), skip=1).wait(10)
    assert pair.outcomes == [("local-M2", None)]
    assert not pair.d_buf.reshape(MODEL.layers, 2, 8, -1)[:, :, 4].any(), "block 4 (held locally) untouched"
    wait_for(lambda: pair.released == [("M2", LeaseState.RELEASED)], what="release")


def test_a_move_lease_shorter_than_the_read_is_a_load_error_and_released(pair: Pair) -> None:
    """A lease holding fewer blocks than decode reads: LoadError (recompute), and the lease still ends by DONE."""
    pair.p_server.register(pair.prefill.info())
    pair.ledger.offer("M3", [1, 2], expected_pulls=None)
    with pytest.raises(LoadError, match="lease short|reads blocks 0..2"):
        pair.control.start("local-M3", _moved(pair, "M3"), [4, 5, 6])
    wait_for(lambda: pair.released == [("M3", LeaseState.RELEASED)], what="release")
    assert pair.control.local_id("M3") is None


def test_a_move_lease_never_offered_is_a_load_error(pair: Pair) -> None:
    """The source never offered (not draining, or gone): after the BeginPull's wait, LoadError, nothing read."""
    pair.p_server.register(pair.prefill.info())
    with pytest.raises(LoadError, match="no active lease"):
        pair.control.start("local-M4", _moved(pair, "M4"), [4, 5, 6])
    assert not pair.d_buf.any() and pair.control.local_id("M4") is None


def test_a_read_that_makes_no_progress_gets_every_stack_dumped_once(
    pair: Pair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVBRIDGE_STALL_DIR", str(tmp_path))
    pair.p_server.register(pair.prefill.info())
    pair.ledger.offer("r9", [1, 2, 3], expected_pulls=None)
    # A read held longer than a stall (1 s) and a few of the watchdog's looks (each 0.5 s): one dump, not one a look.
    pair.decode.backend.inject(delay=4.0)
    machine = PullMachine("local-r9", "pull")
    handle = pair.start("r9", machine)

    def dumps() -> list[str]:
        texts = [p.read_text() for p in tmp_path.glob("stall-*.txt")]
        return [t for t in texts if "pull of local-r9" in t.splitlines()[0]]

    wait_for(dumps, what="the stalled read to be dumped")
    handle.wait(30)
    assert pair.outcomes == [("local-r9", None)] and machine.state is PullState.DONE
    (dump,) = dumps()
    assert "in _delayed" in dump and "time.sleep(delay)" in dump, "the frame the read waits in is named"


class HeldBeginLedger(Ledger):
    """A real ledger whose BeginPulls wait while `answer` is clear (a prefill rank busy or far away)."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.answer = threading.Event()
        self.answer.set()

    def begin(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        assert self.answer.wait(10)
        return super().begin(*args, **kwargs)


def _pulled(pair: Pair, rid: str) -> PullMachine:
    """Offer `rid`, pull it, wait for its release: the pair is warm."""
    pair.ledger.offer(rid, [1, 2, 3], expected_pulls=1)
    machine = PullMachine(f"local-{rid}", "pull")
    pair.start(rid, machine).wait(10)
    wait_for(lambda: (rid, LeaseState.RELEASED) in pair.released, what="release")
    return machine


def test_a_read_from_a_rank_that_admits_the_reader_starts_before_its_begin_pull_is_answered() -> None:
    """First contact waits for the answer; the next read starts with its BeginPull in flight.

    It is reported only once the answer says the lease held."""
    pair = Pair(ledger=HeldBeginLedger)
    try:
        pair.p_server.register(pair.prefill.info())
        first = _pulled(pair, "r1")
        assert PullState.LEASED in first.at, "nothing admitted this reader yet: the answer first"
        pair.d_buf[:] = 0
        pair.ledger.offer("r2", [1, 2, 3], expected_pulls=1)
        pair.ledger.answer.clear()
        second = PullMachine("local-r2", "pull")
        handles: list = []
        starter = threading.Thread(target=lambda: handles.append(pair.start("r2", second)))
        starter.start()
        wait_for(lambda: second.state is PullState.LANDING, what="the read to land while its BeginPull waits")
        assert pair.d_buf.any() and pair.outcomes == [("local-r1", None)], "landed, not reported before the answer"
        pair.ledger.answer.set()
        starter.join(10)
        handles[0].wait(10)
        assert pair.outcomes[-1] == ("local-r2", None) and second.state is PullState.DONE
        assert PullState.LEASED not in second.at and second.read_first and second.parts["begin_ms"] > 0
        wait_for(lambda: ("r2", LeaseState.RELEASED) in pair.released, what="release")
    finally:
        pair.ledger.answer.set()
        pair.close()


def test_a_read_begun_first_whose_lease_did_not_hold_is_recomputed_after_it_ended(pair: Pair) -> None:
    pair.p_server.register(pair.prefill.info())
    _pulled(pair, "r1")
    pair.d_buf[:] = 0
    pair.ledger.offer("r2", [1, 2, 3], expected_pulls=1)
    pair.p_server.abort("r2", reason="prefill engine dropped it")  # its blocks may be reused from now
    pair.decode.backend.inject(delay=0.5)  # the read outlasts the answer
    machine = PullMachine("local-r2", "pull")
    with pytest.raises(LoadError, match="no active lease"):
        pair.start("r2", machine)
    assert pair.d_buf.any(), "the failure is reported only once the read begun first has ended"
    assert machine.state is PullState.FENCED and PullState.READING in machine.at and PullState.LEASED not in machine.at
    assert pair.outcomes == [("local-r1", None)], "what it read is never reported as loaded"
    assert pair.control.local_id("r2") is None


def test_a_reader_reads_first_only_while_it_is_surely_admitted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the time the last answer said the rank admits this reader, or with `read_first` off: the answer first.

    That time is the lease's end plus the admission's grace (`admit_grace`)."""
    from kvbridge.session.read_first import READ_FIRST_MARGIN_S
    from kvbridge.transport import netguard

    monkeypatch.setattr(netguard.ADMISSION, "grace_s", 3.0)
    pair = Pair()
    try:
        pair.p_server.register(pair.prefill.info())
        _pulled(pair, "r1")
        url = pair.control.clients.get(*pair.p_server.address).url
        assert PullState.LEASED not in _pulled(pair, "r2").at
        wait_for(
            lambda: time.monotonic() > pair.control._admitted._until[url] - READ_FIRST_MARGIN_S,
            what="the admission to near its end",
        )
        assert PullState.LEASED in _pulled(pair, "r3").at, "admission may end during the read: the answer first"
        assert PullState.LEASED not in _pulled(pair, "r4").at, "r3's answer admitted it again"
        pair.control.read_first = False
        assert PullState.LEASED in _pulled(pair, "r5").at
        assert [e for _r, e in pair.outcomes] == [None] * 5
    finally:
        pair.close()


def test_a_prefill_whose_side_channel_stalls_holds_none_of_the_pulls_from_another() -> None:
    """More pulls than a decode runs at once from one peer wait on its silent side channel; another peer's still run.

    With one pool of threads for every peer, they held them all until their answers timed out."""
    from kvbridge.session.decode_side import PULLS_PER_PEER, DecodeSide
    from kvbridge.session.metrics import KEYS, TransferRecord
    from kvbridge.session.outbox import Outbox
    from kvbridge.session.tasks import PullTask

    stalled = Pair(ledger=HeldBeginLedger)
    ledger = Ledger(lambda *_: None)
    healthy, h_buf = _agent("prefill-b", MODEL.kv_heads, 8)
    h_buf[:] = 7
    h_server = ControlServer("prefill-b", 0, ledger=ledger, poll_interval_s=0.01)
    h_server.register(healthy.info())
    stalled.p_server.register(stalled.prefill.info())
    outbox = Outbox(None, idle_wait_s=0.01, stream_idle_wait_s=0.01)
    # the answer stalls 10 s (HeldBeginLedger), well within this wait: the pulls wait for it, not time out
    control = PullControl(stalled.decode, stalled.d_server, ready_timeout_s=30, timeout_s=30)
    metrics = TransferRecord()
    metrics.data, metrics._lock = {k: [] for k in KEYS}, threading.Lock()
    decode = DecodeSide(control, outbox, metrics, tp_rank=0, pp_rank=0, pp_size=1, pull_timeout_s=30, layerwise=False)
    reported: set[str] = set()

    def take() -> set[str]:
        reported.update(outbox.take(idle=False)[1])
        return reported

    try:
        stalled.ledger.answer.clear()
        for i in range(PULLS_PER_PEER + 1):
            stalled.ledger.offer(f"a{i}", [1, 2, 3], expected_pulls=1)
            decode.pull(PullTask(f"local-a{i}", stalled.params(f"a{i}"), [4, 5, 6], report=True), time.time())
        ledger.offer("b0", [1, 2, 3], expected_pulls=1)
        host, port = h_server.address
        params = attrs.evolve(stalled.params("b0"), remote_engine_id="prefill-b", remote_host=host, remote_port=port)
        decode.pull(PullTask("local-b0", params, [1, 2, 3], report=True), time.time())
        wait_for(lambda: "local-b0" in take(), what="the healthy prefill's pull")
        assert reported == {"local-b0"}, "the stalled prefill's pulls are still waiting for their answers"
        assert not outbox.take_load_errors(), "the healthy prefill's pull did not fail"
        assert [p[1] for p in metrics.data["pulls"]] == [f"{host}:{port}"] and not metrics.data["failures"]
        block = stalled.d_buf.size // MODEL.layers // 2 // 8  # one block of one layer's K
        assert (stalled.d_buf[block : 4 * block] == 7).all(), "its blocks came from the healthy prefill"
        stalled.ledger.answer.set()
        wait_for(lambda: len(take()) == PULLS_PER_PEER + 2, what="the stalled prefill's pulls, once it answers")
        assert not outbox.take_load_errors()
    finally:
        stalled.ledger.answer.set()
        decode.close()
        stalled.close()
        for x in (h_server, healthy):
            x.close()
