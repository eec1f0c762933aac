"""One request's timeline through `kvbridge proxy`: the `x-kvbridge-timing` header. See docs/internals.md."""

from __future__ import annotations

import attrs

from kvbridge.session.machine import STATE_MARKS

HEADER = "x-kvbridge-timing"
PULL_PHASES = ("dispatch_ms", "queue_ms", "offer_wait_ms", "control_ms", "transfer_ms", "done_ms")
# the proxy opening a TCP connection to an upstream for the request (none when it reused a kept-alive one)
CONNECT_PHASES = ("prefill_connect_ms", "decode_connect_ms")
# a decode that failed before the client got anything, from its request's send until the proxy sent the request on
FAILOVER_PHASE = "decode_failed_ms"
PHASES = (
    "prefill_connect_ms",
    "prefill_ms",
    "proxy_ms",
    FAILOVER_PHASE,
    "decode_connect_ms",
    *PULL_PHASES,
    "decode_first_token_ms",
)
# control_ms and transfer_ms in parts (`Timeline.parts`, not in the sums): contact, BeginPulls; descriptors, landing
PARTS = ("contact_ms", "begin_ms", "prepare_ms", "land_ms")
PULL_REPORT = (*PULL_PHASES, *PARTS, *STATE_MARKS)  # what a decode engine reports of its pull


@attrs.define
class Timeline:
    """A request's phases (and its pull's state marks) as they become known; `header()` is what the proxy sends."""

    request_id: str
    phases: dict[str, float] = attrs.field(factory=dict)
    total_ms: float = 0.0
    marks: dict[str, float] = attrs.field(factory=dict)  # at_<state>_ms: points in time, not slices
    begun: float = attrs.field(default=0.0, eq=False, repr=False)  # the proxy's perf_counter at arrival
    parts: dict[str, float] = attrs.field(factory=dict)  # PARTS: slices of control_ms and transfer_ms

    def add(self, reported: dict[str, float] | None, names: tuple[str, ...]) -> None:
        """Take the phases (and marks, parts) `names` from what an engine reported (None: it reported nothing)."""
        for name in names:
            if reported and name in reported:
                where = self.marks if name in STATE_MARKS else self.parts if name in PARTS else self.phases
                where[name] = max(0.0, float(reported[name]))

    def handover_ms(self) -> float | None:
        """The decode's pull, all its phases (None when the decode did not report them)."""
        known = [self.phases[p] for p in PULL_PHASES if p in self.phases]
        return sum(known) if known else None

    def header(self) -> str:
        parts = [f"id={self.request_id}", f"total_ms={self.total_ms:.3f}"]
        parts += [f"{p}={self.phases[p]:.3f}" for p in PHASES if p in self.phases]
        parts += [f"{p}={self.parts[p]:.3f}" for p in PARTS if p in self.parts]
        parts += [f"{m}={self.marks[m]:.3f}" for m in STATE_MARKS if m in self.marks]
        return "; ".join(parts)


def parse(header: str) -> Timeline:
    """A `x-kvbridge-timing` header back as a Timeline; raises ValueError on a malformed one."""
    fields = dict(part.strip().split("=", 1) for part in header.split(";") if part.strip())
    try:
        request_id, total = fields.pop("id"), float(fields.pop("total_ms"))
        values = {k: float(v) for k, v in fields.items()}
        phases = {k: v for k, v in values.items() if k not in STATE_MARKS and k not in PARTS}
        marks = {k: v for k, v in values.items() if k in STATE_MARKS}
        return Timeline(request_id, phases, total, marks, parts={k: v for k, v in values.items() if k in PARTS})
    except KeyError as exc:
        raise ValueError(f"{HEADER} header {header!r} lacks {exc}") from None
