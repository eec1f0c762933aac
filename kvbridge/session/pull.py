"""One pull under way on a decode rank: its `Session` (machine, plan, leases), and how long prefill holds its reads.

Shared by the whole-request pull (`kvbridge.session.pull_control`) and the layer-wise one (`kvbridge.session.layers`).
"""

from __future__ import annotations

import math

import attrs

from kvbridge.agent.kv_agent import RankInfo
from kvbridge.control.client import ControlClient
from kvbridge.control.messages import LeaseStatus
from kvbridge.control.params import KVTransferParams
from kvbridge.plan.topology import Plan
from kvbridge.session.machine import PullMachine

Leases = dict[int, tuple[ControlClient, int, int]]  # prefill rank -> client, lease epoch, release count
Release = list[tuple[ControlClient, int]]  # release-only DONEs: client, release count

# A read counts as covered by the prefill's hold when it ended this much before the deadline its BeginPull
# was told, measured from before the BeginPull was sent (so the side channel's own delays only make the
# check stricter): far more than two hosts' monotonic clocks can drift apart over a lease (NTP keeps
# their rates within 0.05 %).
HOLD_SLACK_S = 0.5
HOLD_SLACK_SHARE = 0.01


def hold_deadline(asked: float, status: LeaseStatus) -> float:
    """Until when the prefill rank holds its blocks for this read; -inf when it promises no hold.

    On this host's monotonic clock; `asked`: before the request `status` answers was sent."""
    if not status.reads_held:
        return -math.inf
    return asked + status.remaining_s * (1 - HOLD_SLACK_SHARE) - HOLD_SLACK_S


@attrs.define
class Session:
    """One pull under way: its machine, plan, the prefill ranks it reads and what they answered."""

    machine: PullMachine
    rid: str  # the prefill engine's request id
    params: KVTransferParams
    plan: Plan
    ranks: list[int]  # prefill ranks this decode rank reads
    notify: Release  # ranks nobody reads, released by the notifier
    leases: Leases = attrs.field(factory=dict)
    clients: dict[int, ControlClient] = attrs.field(factory=dict)
    infos: dict[int, RankInfo] = attrs.field(factory=dict)
    held_until: float = math.inf  # the earliest end of the prefill ranks' holds of the reads (-inf: no hold)

    def hold(self, asked: float, status: LeaseStatus) -> None:
        """Take a prefill rank's hold of the reads (`status` answers a request sent at `asked`)."""
        self.held_until = min(self.held_until, hold_deadline(asked, status))
