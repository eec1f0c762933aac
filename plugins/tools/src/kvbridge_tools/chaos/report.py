"""What one chaos run found: per-request outcomes summed into the figures `kvbridge chaos` reports."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from kvbridge.base.watchdog import SLOW_MS
from kvbridge.session import timeline
from kvbridge_tools.bench.stats import percentile
from kvbridge_tools.chaos.bound import HandoverBound

# Outcomes of one request.
MATCHED = "matched"  # completed, output equal to the colocated server's greedy output
DIFFERENT = "different"  # completed with other output: KV was lost or corrupted (must be 0)
FAILED = "failed"  # an error answer with a status and a reason
UNCLEAR = "failed_unclear"  # an error with no reason a client could act on (must be 0)
HUNG = "hung"  # no answer within the bound (must be 0)
DROPPED = "dropped"  # the client itself gave up (disconnect/abort faults): nothing to check


# The proxy's line for each stream it moved (--live-moves): `Moves._moved` in kvbridge_proxy.moves (logger .app).
MOVE_LINE = re.compile(
    r"stream \S+ \(request (\S+)\) moved from (\S+) to (\S+) after (\d+) tokens \((.+), (precopied|pulled|recomputed)\)"
)


# The proxy's lines for a decode that failed a request before its first event (the request then goes to another).
LOST_DECODE_LINE = re.compile(
    r"decode server (\S+) failed (?:before the first event of|after taking request) (\S+?)(?: \(|$)", re.MULTILINE
)
# The proxy's line for each request at the first byte of its decode's answer (`Metrics.finish`, `-v`): its phases.
TIMING_LINE = re.compile(r"kvbridge-timing (id=[^\n]*?)(?: \(answered \d+\))?$", re.MULTILINE)
SLOWEST = 5  # the requests whose time to first token the report breaks down
# The proxy's line naming the id the servers know a request by (its P/D request, `Handovers.open`).
PD_LINE = re.compile(r"request (\S+): P/D request (kvbridge-[0-9a-f]+)$", re.MULTILINE)
# A decode's line for a pull (or its DONEs) whose phases added up to SLOW_MS (`watchdog.slow`):
# vLLM's id for it is cmpl-<the P/D request id>-<choice>-<suffix>.
SLOW_PULL_LINE = re.compile(
    r"slow (handover|DONEs) of request cmpl-(kvbridge-[0-9a-f]+)-\S+ .*?: ([\d.]+ ms \([^)]*\))$", re.MULTILINE
)
# A decode's line for a pull that failed (its request then recomputed): `DecodeSide._pull`.
FAILED_PULL_LINE = re.compile(
    r"request cmpl-(kvbridge-[0-9a-f]+)-\S+: (pull) from \S+ failed: (.{0,200})", re.MULTILINE
)


def timings(proxy_log: str) -> dict[str, str]:
    """Each request's phases as the proxy logged them (`x-kvbridge-timing`, prefill to first token), by request id."""
    out = {}
    for header in TIMING_LINE.findall(proxy_log):
        try:
            out[timeline.parse(header).request_id] = header
        except ValueError:  # a line cut short by a killed proxy: nothing to break down
            continue
    return out


def slow_pulls(proxy_log: str, server_logs: Iterable[str]) -> dict[str, list[str]]:
    """Each request's slow or failed pulls as its decodes logged them, by the id the client sent it with.

    A decode logs a pull whose handover took SLOW_MS or more phase by phase (`watchdog.slow`), and a pull that failed
    with its error; a pull that went well and faster has no line."""
    ids = {pd: rid for rid, pd in PD_LINE.findall(proxy_log)}
    out: dict[str, list[str]] = {}
    for text in server_logs:
        said = [(what, pd, line) for what, pd, line in SLOW_PULL_LINE.findall(text)]
        said += [(what, pd, f"failed: {line}") for pd, what, line in FAILED_PULL_LINE.findall(text)]
        for what, pd, line in said:
            if pd in ids:
                out.setdefault(ids[pd], []).append(f"{what} {line}")
    return out


def lost_decodes(proxy_log: str) -> dict[str, list[str]]:
    """Each request whose decode failed before its first event (killed under it, say), the decodes' URLs in order."""
    out: dict[str, list[str]] = {}
    for url, rid in LOST_DECODE_LINE.findall(proxy_log):
        out.setdefault(rid, []).append(url)
    return out


def moves(proxy_log: str) -> dict[str, list[str]]:
    """Each request the proxy moved, from its log: `"moved A -> B after k tokens (why, outcome)"` per move."""
    out: dict[str, list[str]] = {}
    for rid, a, b, k, why, outcome in MOVE_LINE.findall(proxy_log):
        out.setdefault(rid, []).append(f"moved {a} -> {b} after {k} tokens ({why}, {outcome})")
    return out


@attrs.frozen
class Outcome:
    index: int
    kind: str
    fault: str = ""
    status: int | None = None
    reason: str = ""
    ttft_s: float | None = None
    prompt_tokens: int = 0
    handover_s: float | None = None  # control + transfer + DONE phases (non-streamed answers carry them)
    sent_at: float | None = None  # time.monotonic() as it was sent (with ttft_s: the window a fault may overlap)


@attrs.define
class Report:
    outcomes: list[Outcome] = attrs.field(factory=list)
    # server -> KV blocks in use after the drain (-1: its metrics could not be read)
    blocks_held: dict[str, float] = attrs.field(factory=dict)
    holding: dict[str, str] = attrs.field(factory=dict)  # server -> what it runs, waits on and leases, if it holds any
    leases_expired: int = 0
    retries: int = 0  # transfer batches resubmitted (kvbridge_transfer_retries_total of every server)
    pulls_failed: int = 0  # pulls that failed and were recomputed (kvbridge_transfer_failures_total)
    faults_injected: dict[str, int] = attrs.field(factory=dict)
    not_injected: list[str] = attrs.field(factory=list)  # asked for, never injected (`Runner.run` says why)
    restarts: int = 0
    stalls: list[str] = attrs.field(factory=list)  # the stall watchdog's dumps (every thread's stack) under the logs
    elapsed_s: float = 0.0
    handover_bound: HandoverBound | None = None  # None: no bound checked
    network: dict[str, Any] | None = None  # --hosts: the network faults injected
    # elastic faults: the servers drained for good (Deployment.Drained.as_dict) and those that joined mid-run
    drained: list[dict[str, Any]] = attrs.field(factory=list)
    drains_unclean: int = 0  # drained servers that did not exit 0 by themselves within the bound, holding nothing
    joined: list[dict[str, Any]] = attrs.field(factory=list)
    live_moves: dict[str, float] | None = None  # the proxy's kvbridge_proxy_live_moves_total by outcome
    moves: dict[str, list[str]] = attrs.field(factory=dict)  # request id -> the proxy's moves of it (`moves()`)
    slowest_ttft: list[str] = attrs.field(factory=list)  # `slowest()`: where the longest times to first token went

    def name_moves(self, request_id: Callable[[int], str]) -> None:
        """Say in each failed or different outcome's reason that the proxy moved that request, and how.

        `request_id(index)`: the id the request was sent with. A moved stream's reason then names its moves (each
        pulled or recomputed) where it said "no fault"."""
        for n, o in enumerate(self.outcomes):
            said = self.moves.get(request_id(o.index))
            if not said or o.kind not in (DIFFERENT, FAILED, UNCLEAR):
                continue
            how = "; ".join(said)
            plain = ", no fault)" in o.reason
            reason = o.reason.replace(", no fault)", f", {how})") if plain else f"{o.reason} [{how}]"
            self.outcomes[n] = attrs.evolve(o, reason=reason)

    def slowest(
        self,
        request_id: Callable[[int], str],
        phases_of: dict[str, str],
        during: Callable[[float, float], list[str]] = lambda _start, _end: [],
        pulls_of: dict[str, list[str]] | None = None,
        all_run: Sequence[str] = (),
        lost: dict[str, list[str]] | None = None,
    ) -> list[str]:
        """The SLOWEST longest times to first token, each with its fault and its phases (`timings()`).

        `during(start, end)`: the network faults in place while it waited for its first token, named beside its own.
        `pulls_of` (`slow_pulls()`): what its decode logged of a slow or failed pull, which splits a stream's time on
        the decode (its timing has no pull phases) into the pull and the rest; None where the servers' logs were not
        read. `all_run`: the faults on for the whole run (`faults.ALL_RUN`), named after its own (a read held by
        slow-peer during a partition is either's). `lost` (`lost_decodes()`): the decodes that failed it before its
        first event (killed by another fault, say)."""
        timed = sorted((o for o in self.outcomes if o.ttft_s is not None), key=lambda o: -(o.ttft_s or 0.0))
        out = []
        for o in timed[:SLOWEST]:
            assert o.ttft_s is not None
            rid = request_id(o.index)
            phases = phases_of.get(rid, "the proxy logged no phases of it")
            faults = [o.fault] if o.fault else []
            if o.sent_at is not None:
                faults += during(o.sent_at, o.sent_at + o.ttft_s)
            faults += [f"its decode {url} failed before its first event" for url in (lost or {}).get(rid, [])]
            named = faults or ["no fault of its own" if all_run else "no fault"]
            if all_run:
                named.append(f"all run: {', '.join(all_run)}")
            line = f"{rid}: {o.ttft_s * 1e3:.0f} ms ({'; '.join(named)}): {phases}"
            if pulls_of is not None:
                pulls = pulls_of.get(rid)
                quick = f" | no slow pull logged (one under {SLOW_MS:.0f} ms, or none)"
                line += f" | its decode logged: {'; '.join(pulls)}" if pulls else quick
            out.append(line)
        return out

    def handovers_over_bound(self) -> int:
        if self.handover_bound is None:
            return 0
        return sum(1 for o in self.outcomes if o.handover_s is not None and o.handover_s > self.handover_bound.seconds)

    def counts(self) -> Counter:
        return Counter(o.kind for o in self.outcomes)

    def must_be_zero(self) -> dict[str, float]:
        c = self.counts()
        return {
            DIFFERENT: c[DIFFERENT],
            HUNG: c[HUNG],
            UNCLEAR: c[UNCLEAR],
            "blocks_held": sum(abs(v) for v in self.blocks_held.values()),
            "handovers_over_bound": self.handovers_over_bound(),
            "drains_unclean": self.drains_unclean,
        }

    @property
    def ok(self) -> bool:
        return not any(self.must_be_zero().values())

    def as_dict(self) -> dict[str, Any]:
        c = self.counts()
        ttft = [o.ttft_s for o in self.outcomes if o.ttft_s is not None]
        handover = [o.handover_s for o in self.outcomes if o.handover_s is not None]
        failures = Counter(  # a stream cut off mid-answer has no status of its own
            f"{'no status' if o.status is None else o.status} {o.reason[:120]}"
            for o in self.outcomes
            if o.kind in (FAILED, UNCLEAR)
        )
        return {
            "ok": self.ok,
            "requests": len(self.outcomes),
            "completed_equal": c[MATCHED],
            "completed_different": c[DIFFERENT],
            "failed_clear": c[FAILED],
            "failed_unclear": c[UNCLEAR],
            "hung": c[HUNG],
            "dropped_by_client": c[DROPPED],
            "failures": dict(failures.most_common(10)),
            # request id, servers, fault, both outputs: what to look for in the logs (--logs)
            "different": [o.reason for o in self.outcomes if o.kind == DIFFERENT][:10],
            "blocks_held_after_drain": self.blocks_held,
            "holding": self.holding,
            "leases_expired": self.leases_expired,
            "retries": self.retries,
            "pulls_failed_recomputed": self.pulls_failed,
            "faults_injected": self.faults_injected,
            "faults_not_injected": self.not_injected,
            "server_restarts": self.restarts,
            "stall_dumps": self.stalls,
            "ttft_ms": {
                k: None if v is None else round(v * 1e3, 1)
                for k, v in {
                    "p50": percentile(ttft, 0.5),
                    "p99": percentile(ttft, 0.99),
                    "max": max(ttft) if ttft else None,
                }.items()
            },
            "slowest_ttft": self.slowest_ttft,
            "handover_ms": {
                "measured": len(handover),
                "p50": None if not handover else round(percentile(handover, 0.5) * 1e3, 1),
                "max": None if not handover else round(max(handover) * 1e3, 1),
                **(self.handover_bound.as_dict() if self.handover_bound else {"bound_ms": None}),
            },
            "network": self.network,
            "elastic": None
            if not (self.drained or self.joined)
            else {
                "joined": self.joined,
                "drained": self.drained,
                "live_moves": self.live_moves,
                # the streams whose next decode computed what it should have pulled: exact, but a pull failed
                "recomputed": sorted(f"{rid}: {m}" for rid, ms in self.moves.items() for m in ms if "recomputed)" in m)[
                    :20
                ],
            },
            "elapsed_s": round(self.elapsed_s, 1),
            "must_be_zero": self.must_be_zero(),
        }
