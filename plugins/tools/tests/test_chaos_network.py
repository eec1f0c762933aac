"""`kvbridge chaos --hosts`: the network faults between hosts, and the bound a handover is held to."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest

from kvbridge_tools.chaos.bound import HandoverBound, transport_bound
from kvbridge_tools.chaos.network import NetworkFaults
from kvbridge_tools.chaos.report import MATCHED, Outcome, Report
from kvbridge_tools.harness.hosts import Hosts

NAMES = {"prefill": ["prefill0"], "decode": ["decode0", "decode1"], "proxy": "proxy"}


def _rules(hosts: Hosts) -> str:
    return subprocess.run(
        ["ip", "netns", "exec", hosts.switch, "nft", "list", "table", "bridge", "kvb_faults"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip


def test_the_bound_adds_the_side_channel_waits_the_transfer_attempts_and_the_fault() -> None:
    bound = transport_bound("mooncake", {}, fault_s=3.0, pull_timeout_s=30.0)
    # Mooncake's defaults: a 2 s deadline (+1 s grace) per attempt, one retry after 0.05 s; 5 s per message.
    assert bound == HandoverBound(control_s=5.0, transfer_deadline_s=2.0, retries=1, retry_backoff_s=0.05, fault_s=3.0)
    assert bound.seconds == pytest.approx(2 * 5.0 + 2 * 3.0 + 0.05 + 3.0)
    longer = transport_bound("mooncake", {"transfer_deadline": 5, "retries": 2}, fault_s=0.0, pull_timeout_s=30.0)
    assert longer.transfer_s == pytest.approx(3 * 6.0 + 0.05 + 0.1)
    # kvbridge's tcp transport declares a deadline too (30 s, no retry of its own)
    assert transport_bound("tcp", {}, fault_s=0.0, pull_timeout_s=60.0).transfer_deadline_s == 30.0
    # NIXL declares none: the decode's pull timeout ends a transfer that makes no progress
    nixl = transport_bound("nixl", {}, fault_s=2.0, pull_timeout_s=20.0)
    assert nixl.transfer_s == 20.0 and nixl.seconds == pytest.approx(2 * 5.0 + 20.0 + 2.0)


def test_a_handover_over_the_bound_fails_the_run_and_both_are_reported() -> None:
    bound = HandoverBound(control_s=1.0, transfer_deadline_s=1.0, retries=0, retry_backoff_s=0.0, fault_s=0.0)
    within = [Outcome(0, MATCHED, handover_s=0.2), Outcome(1, MATCHED, handover_s=3.4)]
    report = Report(outcomes=within, handover_bound=bound)
    assert report.ok
    out = report.as_dict()["handover_ms"]
    assert (out["measured"], out["max"], out["bound_ms"]) == (2, 3400.0, 3500.0)
    late = Report(outcomes=[*within, Outcome(2, MATCHED, handover_s=3.6)], handover_bound=bound)
    assert not late.ok and late.must_be_zero()["handovers_over_bound"] == 1


def test_network_faults_take_turns_heal_and_are_recorded(hosts_factory: Callable[..., Hosts]) -> None:
    hosts = hosts_factory(["prefill0", "decode0", "decode1", "proxy"])
    faults = NetworkFaults(
        hosts, NAMES["prefill"], NAMES["decode"], NAMES["proxy"],
        ["partition", "loss", "bandwidth-drop", "kill-decode"], fault_s=0.2, every_s=0.3, seed=1,
    )  # fmt: skip
    assert faults.faults == ["partition", "loss", "bandwidth-drop"]  # process faults are not its job
    faults.start()
    assert "numgen random" in _rules(hosts)  # loss on every link, each way, for the whole run
    # Bounded wait for three turns (partition prefill<->decode, bandwidth drop, partition decode<->proxy).
    for _ in range(200):
        if len([i for i in faults.injected if i.fault != "loss"]) >= 3:
            break
        faults._stop.wait(0.05)
    faults.stop()
    turns = [i for i in faults.injected if i.fault != "loss"]
    assert [t.fault for t in turns[:3]] == ["partition", "bandwidth-drop", "partition"]
    assert "prefill0" in turns[0].between and "proxy" in turns[2].between
    assert all(0.2 <= t.seconds < 5 for t in turns), turns
    assert faults.counts()["loss"] == 2 * (2 + 2)  # 2 prefill-decode and 2 decode-proxy links, both ways
    assert all(
        0.01 <= float(i.between.split()[-1].rstrip("%")) / 100 <= 0.05 for i in faults.injected if i.fault == "loss"
    )
    # Healed: no rule left, no shaper left.
    assert "drop" not in _rules(hosts)
    for d in NAMES["decode"]:
        assert hosts.rate(d) is None
    assert faults.longest_s() == max(t.seconds for t in turns)


def test_network_faults_need_hosts() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvbridge", "chaos", "--faults", "partition,kill-decode"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode != 0 and "add --hosts" in done.stdout + done.stderr
