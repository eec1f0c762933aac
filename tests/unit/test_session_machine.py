"""The decode pull's state machine: forward one state at a time, one end, what each end means."""

from __future__ import annotations

import gc
import logging

import pytest

from kvbridge.base import watchdog
from kvbridge.base.errors import LoadError, TransferFailed
from kvbridge.session.machine import STATE_MARKS, PullMachine, PullState

FORWARD = [PullState.LEASED, PullState.READING, PullState.LANDING, PullState.CONFIRMING]


def test_a_pull_goes_forward_one_state_at_a_time_and_logs_each(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="kvbridge.session.machine")
    m = PullMachine("r1", "pull")
    with pytest.raises(RuntimeError, match="resolving -> reading"):
        m.to(PullState.READING)  # leased skipped
    for state in FORWARD:
        m.to(state)
    with pytest.raises(RuntimeError):
        m.to(PullState.DONE)  # only end() ends a pull
    assert m.end(None) is PullState.DONE
    assert [s.value for s in m.at] == ["resolving", "leased", "reading", "landing", "confirming", "done"]
    marks = m.marks()
    assert set(marks) <= set(STATE_MARKS) and list(marks.values()) == sorted(marks.values())
    said = [r.getMessage() for r in caplog.records]
    assert said[0] == "request r1 (pull): resolving" and said[-1] == "request r1 (pull): confirming -> done"
    assert len(said) == 1 + len(FORWARD) + 1


def test_an_end_with_an_error_is_fenced_for_a_lease_that_did_not_hold_and_failed_otherwise() -> None:
    fenced = PullMachine("r2", "layerwise")
    fenced.to(PullState.LEASED)
    assert fenced.end(LoadError("lease expired", cause="expired")) is PullState.FENCED
    failed = PullMachine("r3", "pull")
    assert failed.end(TransferFailed("gone")) is PullState.FAILED
    assert failed.end(None) is PullState.FAILED, "the first outcome stands"
    early = PullMachine("r4", "pull")
    early.to(PullState.LEASED)
    with pytest.raises(RuntimeError, match="done from leased"):
        early.end(None)  # a pull is done only once confirmed


def test_a_pull_dropped_without_its_end_is_no_longer_watched_for_stalls() -> None:
    """Nor does its thread's next side-channel answer (`progress()`) arm it again.

    Armed, the next second without an answer would dump every stack for a pull long gone."""
    dropped = PullMachine("dropped-r9", "pull")
    dropped.to(PullState.LEASED)
    name = dropped.beat.name
    del dropped
    gc.collect()
    watchdog.progress()  # as the next request this thread sends is answered
    assert name not in {b.name for b in list(watchdog.WATCHDOG._beats)}
