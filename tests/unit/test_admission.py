"""The listener guard's admitted hosts: held, released, kept for the grace, and at a cost that does not grow with load.

An `Admission` of its own per test (no guard attached, so no filter is touched): what it admits is `hosts()`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from typing import Any

import pytest

from kvbridge.transport.netguard import Admission

A, B = "198.51.100.7", "198.51.100.8"
GRACE_S = 0.05


def admitted(adm: Admission) -> set[str]:
    return {str(a) for a in adm.hosts()}


def gone(adm: Admission, host: str) -> bool:
    return adm.wait_until(lambda hosts: ipaddress.ip_address(host) not in hosts, timeout=10.0)


@pytest.fixture
def adm() -> Admission:
    admission = Admission()
    admission.grace_s = GRACE_S
    return admission


def test_a_host_stays_while_any_hold_names_it_and_goes_a_grace_after_the_last(adm: Admission) -> None:
    adm.hold("lease 1", [A], "a reader")
    adm.hold("lease 2", [A, B], "another reader")
    assert admitted(adm) == {A, B}
    adm.release("lease 1")
    assert not adm.wait_until(lambda hosts: len(hosts) < 2, timeout=4 * GRACE_S), "lease 2 still holds A"
    adm.release("lease 2")
    assert gone(adm, A) and gone(adm, B)


def test_a_hold_taken_again_after_its_release_is_not_ended_by_the_release(adm: Admission) -> None:
    adm.hold("peer", [A], "a relation")
    adm.release("peer")
    adm.hold("peer", [A], "the relation again")  # no ttl: held until released again
    assert not adm.wait_until(lambda hosts: not hosts, timeout=4 * GRACE_S), "the first release's end was kept"
    assert admitted(adm) == {A}
    adm.release("peer")
    assert gone(adm, A)


def test_a_hold_with_a_ttl_ends_by_itself_and_one_extended_lasts_longer(adm: Admission) -> None:
    adm.hold("short", [A], "a relation", ttl=0.0)
    adm.hold("long", [B], "a relation", ttl=0.0)
    adm.hold("long", [B], "a relation", ttl=3600.0)
    assert gone(adm, A)
    assert admitted(adm) == {B}


class _CountingDict(dict):
    """A dict that counts the passes made over it."""

    passes = 0

    def values(self) -> Any:
        type(self).passes += 1
        return super().values()

    def items(self) -> Any:
        type(self).passes += 1
        return super().items()

    def __iter__(self) -> Iterator[Any]:
        type(self).passes += 1
        return super().__iter__()


def test_holding_and_releasing_among_thousands_of_holds_makes_no_pass_over_them(adm: Admission) -> None:
    # A loaded prefill keeps a hold per request of the last grace (30 s by default): each pull's hold and release
    # must cost what it changes, not a pass over every hold (which made the cost per request grow with the load).
    adm.grace_s = 3600.0
    adm._holds = _CountingDict()  # type: ignore[assignment]
    for i in range(2000):
        adm.hold(f"lease {i}", [A], "a reader")
        adm.release(f"lease {i}")
    adm.hold("lease new", [B], "a reader")  # a new host: the filters change
    assert admitted(adm) == {A, B}
    assert _CountingDict.passes == 0, f"{_CountingDict.passes} passes over the holds for 4,001 steps"
