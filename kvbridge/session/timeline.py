"""One request's timeline through `kvbridge proxy`: the `x-kvbridge-timing` header and its parts.

The phases are disjoint slices of the request's life, in milliseconds, in order:

- `prefill_ms`: the prefill engine, from the request's arrival to its end (queueing and computing the
  prompt), as that engine reports it in its answer's `kv_transfer_params`;
- `proxy_ms`: the proxy itself, from the prefill's answer to sending the decode request;
- `dispatch_ms`, `queue_ms`, `offer_wait_ms`, `control_ms`, `transfer_ms`, `done_ms`: the decode
  engine's pull, as its workers report it in the answer's `kv_transfer_params` (non-streamed
  answers only: a stream ends before the request does): the engine's step carrying the pull from
  its scheduler to its workers, waiting for a worker thread, waiting for the prefill rank to offer
  the request (its BeginPull held until the offer landed), the rest of the side channel (finding the
  prefill rank, BeginPull), the bytes moving, confirming the read (about nothing when the prefill
  ranks' hold covers it and the DONEs go out after; the fenced DONEs otherwise);
- `decode_first_token_ms`: the rest of the decode request up to its first byte back at the proxy
  (a streamed answer's first token; a whole answer otherwise).

After the phases, `control_ms` in its two parts (not summed again): `contact_ms` (finding each prefill rank's side
channel and its RankInfo: first contact) and `begin_ms` (the BeginPulls, less the wait for the offer).

Beside the phases, the decode's pull states (`kvbridge.session.machine`) as `at_<state>_ms`: when the
slowest rank entered each state, milliseconds after its pull began (`at_done_ms`, or `at_fenced_ms` /
`at_failed_ms` for a pull whose request was then recomputed). They are marks, not slices: they overlap
the pull phases.

`total_ms` is the proxy's own clock, from the request's arrival to the moment the header goes out,
so the phases add up to no more than it. An error answer (503 when no server could take a phase,
499 when the client left, a prefill's error status, 4xx for a bad body) carries the phases known
when it was given; what the proxy cannot see (the network, the HTTP layers
of the servers) is the difference. The KV handover is the pull phases together (`handover()`).
"""

from __future__ import annotations

import attrs

from kvbridge.session.machine import STATE_MARKS

HEADER = "x-kvbridge-timing"
PULL_PHASES = ("dispatch_ms", "queue_ms", "offer_wait_ms", "control_ms", "transfer_ms", "done_ms")
PHASES = ("prefill_ms", "proxy_ms", *PULL_PHASES, "decode_first_token_ms")
CONTROL_PARTS = ("contact_ms", "begin_ms")  # control_ms in parts (`Timeline.parts`, not in the sums)
PULL_REPORT = (*PULL_PHASES, *CONTROL_PARTS, *STATE_MARKS)  # what a decode engine reports of its pull


@attrs.define
class Timeline:
    """A request's phases (and its pull's state marks) as they become known; `header()` is what the proxy sends."""

    request_id: str
    phases: dict[str, float] = attrs.field(factory=dict)
    total_ms: float = 0.0
    marks: dict[str, float] = attrs.field(factory=dict)  # at_<state>_ms: points in time, not slices
    begun: float = attrs.field(default=0.0, eq=False, repr=False)  # the proxy's perf_counter at arrival
    parts: dict[str, float] = attrs.field(factory=dict)  # CONTROL_PARTS: slices of control_ms

    def add(self, reported: dict[str, float] | None, names: tuple[str, ...]) -> None:
        """Take the phases (and marks, parts) `names` from what an engine reported (None: it reported nothing)."""
        for name in names:
            if reported and name in reported:
                where = self.marks if name in STATE_MARKS else self.parts if name in CONTROL_PARTS else self.phases
                where[name] = max(0.0, float(reported[name]))

    def handover_ms(self) -> float | None:
        """The decode's pull, all its phases (None when the decode did not report them)."""
        known = [self.phases[p] for p in PULL_PHASES if p in self.phases]
        return sum(known) if known else None

    def header(self) -> str:
        parts = [f"id={self.request_id}", f"total_ms={self.total_ms:.3f}"]
        parts += [f"{p}={self.phases[p]:.3f}" for p in PHASES if p in self.phases]
        parts += [f"{p}={self.parts[p]:.3f}" for p in CONTROL_PARTS if p in self.parts]
        parts += [f"{m}={self.marks[m]:.3f}" for m in STATE_MARKS if m in self.marks]
        return "; ".join(parts)


def parse(header: str) -> Timeline:
    """A `x-kvbridge-timing` header back as a Timeline; raises ValueError on a malformed one."""
    fields = dict(part.strip().split("=", 1) for part in header.split(";") if part.strip())
    try:
        request_id, total = fields.pop("id"), float(fields.pop("total_ms"))
        values = {k: float(v) for k, v in fields.items()}
        phases = {k: v for k, v in values.items() if k not in STATE_MARKS and k not in CONTROL_PARTS}
        marks = {k: v for k, v in values.items() if k in STATE_MARKS}
        return Timeline(request_id, phases, total, marks, parts={k: v for k, v in values.items() if k in CONTROL_PARTS})
    except KeyError as exc:
        raise ValueError(f"{HEADER} header {header!r} lacks {exc}") from None
