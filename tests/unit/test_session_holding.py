"""Holding: what a draining engine still holds for readers, said every few seconds, by lease."""

from __future__ import annotations

import logging
import threading

import pytest

from kvbridge.session.holding import DRAIN_REPORT_S, Holding


def test_a_drain_names_the_oldest_hold_every_few_seconds_until_none_is_left(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    holding = Holding(clock=lambda: now[0])
    assert holding.finished("r1", True, {"remote_request_id": "t1"}) == (True, {"remote_request_id": "t1"})
    assert holding.finished("r2", False, None) == (False, None), "freed at once: nothing held"
    now[0] += 1.0
    holding.finished("r3", True, None)  # a move's cut: its lease is the move's
    draining = threading.Event()
    holding.draining = draining
    with caplog.at_level(logging.INFO, logger="kvbridge.session.holding"):
        holding.report()
        assert not caplog.records, "not draining: nothing said"
        draining.set()
        now[0] += 2.0
        holding.report()
        holding.report()  # the next step: not again yet
        now[0] += DRAIN_REPORT_S
        holding.freed(["r1", "unknown"])
        holding.report()
        holding.freed(["r3"])
        now[0] += DRAIN_REPORT_S
        holding.report()
    assert [r.getMessage() for r in caplog.records] == [
        "draining: 2 finished request(s) still hold blocks for a reader; the oldest, r1 (lease t1), for 3.0 s",
        "draining: 1 finished request(s) still hold blocks for a reader; the oldest, r3, for 7.0 s",
    ]
