"""A system's slices at one load, added up into one run: `kvbridge bench --engine vllm --load --slices K`.

A load's requests are split into K slices and the systems take turns slice by slice, each slice in an order rotated
by one, so that the box's load changing over the minutes of a load step falls on every system alike instead of on
whichever system's turn it was. What each slice measured (the serve bench's requests, the servers' CPU, their
threads' schedstats, kvbridge's histograms, vLLM's engine steps, the machine's CPU states) adds up in a `Tally`, and
`combined` computes the serve bench's figures over every slice's requests as vLLM's serve bench computes them over
one run's (`vllm.benchmarks.serve.calculate_metrics`): the slices' durations add up, since requests were sent only
while a slice ran. Each slice also keeps a line of its own (`Tally.turns`): when it ran, its TTFT and TPOT medians
and what the box did meanwhile (noise, steal, interrupts), so that a slow stretch of one system's requests can be
told apart from a slow minute of the box.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from kvbridge_tools.bench.load_probes import Histogram

Nested = dict[str, dict[str, float]]


def split(requests: int, slices: int) -> list[int]:
    """`requests` in `slices` near-equal parts, the larger first (none empty)."""
    if not 0 < slices <= requests:
        raise ValueError(f"{requests} requests do not split into {slices} slices")
    return [requests // slices + (1 if j < requests % slices else 0) for j in range(slices)]


def rotated(names: Sequence[str], by: int) -> list[str]:
    """`names` starting at its `by`-th (modulo its length): slice j's order of the systems."""
    k = by % len(names)
    return [*names[k:], *names[:k]]


def combined(results: Sequence[Mapping[str, Any]], percentiles: Sequence[int], metrics: Sequence[str],
             goodput: Mapping[str, float] | None) -> dict[str, Any]:  # fmt: skip
    """One serve-bench result over every request of `results` (each with its per-request fields, `--save-detailed`).

    A request completed when it has no error and some output; TTFT and end-to-end latency over the completed ones,
    TPOT over those with more than one token, ITL over every gap, each percentile as numpy's (vLLM's); goodput counts
    a completed request whose TTFT and TPOT (0 for one token) are within `goodput` (ms)."""
    ttfts, tpots, itls, e2els, good = [], [], [], [], 0
    every: dict[str, list[Any]] = {k: [] for k in ("ttfts", "itls", "output_lens", "errors", "latencies")}
    for r in results:
        for k, v in every.items():
            v.extend(r[k])
    for ttft, itl, tokens, error, latency in zip(*every.values(), strict=True):
        if error or not tokens:
            continue
        tpot = (latency - ttft) / (tokens - 1) if tokens > 1 else 0.0
        if tokens > 1:
            tpots.append(tpot)
        ttfts.append(ttft)
        itls += itl
        e2els.append(latency)
        if goodput and ttft * 1e3 <= goodput.get("ttft", np.inf) and tpot * 1e3 <= goodput.get("tpot", np.inf):
            good += 1
    duration = sum(float(r["duration"]) for r in results)
    out: dict[str, Any] = {
        **every,
        "completed": len(ttfts),
        "failed": len(every["ttfts"]) - len(ttfts),
        "total_output_tokens": sum(t for t, e in zip(every["output_lens"], every["errors"], strict=True) if not e),
        "duration": duration,
        "request_throughput": len(ttfts) / duration,
        "request_goodput": good / duration if goodput else None,
    }
    values = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for m in metrics:
        for p in percentiles:
            out[f"p{p}_{m}_ms"] = float(np.percentile(values[m] or 0, p)) * 1e3
    return out


def turn(result: Mapping[str, Any], *, began: float, wall_s: float, cpu_s: float, noise_cpu_s: float | None,
         cpu_states: Nested) -> dict[str, float | None]:  # fmt: skip
    """One slice's line: when it began, its completed requests' medians, and what took the box's CPUs meanwhile.

    `began` in Unix seconds, TTFT and TPOT in ms; the cores the servers, the noise, the hypervisor (steal: this VM's
    CPUs given to another) and interrupts took, and those left idle."""
    ttfts, tpots = [], []
    fields = ("ttfts", "output_lens", "errors", "latencies")
    for ttft, tokens, error, latency in zip(*(result.get(k, ()) for k in fields), strict=True):
        if error or not tokens:
            continue
        ttfts.append(ttft)
        if tokens > 1:
            tpots.append((latency - ttft) / (tokens - 1))
    wall = max(wall_s, 1e-9)

    def share(*states: str) -> float:
        return round(sum(spent.get(s, 0.0) for spent in cpu_states.values() for s in states) / wall, 3)

    return {
        "began": round(began, 3),
        "requests": len(ttfts),
        "ttft_p50_ms": round(float(np.median(ttfts)) * 1e3, 2) if ttfts else None,
        "tpot_p50_ms": round(float(np.median(tpots)) * 1e3, 3) if tpots else None,
        "server_cores": round(cpu_s / wall, 3),
        "noise_cores": None if noise_cpu_s is None else round(noise_cpu_s / wall, 3),
        "steal_cores": share("steal"),
        "interrupt_cores": share("irq", "softirq"),
        "idle_cores": share("idle", "iowait"),
    }


def _add(into: dict[str, Any], grown: Mapping[str, Any]) -> None:
    """Add nested dicts of numbers key by key (`into` changes)."""
    for k, v in grown.items():
        if isinstance(v, Mapping):
            _add(into.setdefault(k, {}), v)
        else:
            into[k] = into.get(k, 0.0) + v


def minus(after: Nested, before: Nested) -> Nested:
    """What each thread's (or CPU's) counters grew by: after - before (one new since before counts from 0)."""
    return {key: {f: v - before.get(key, {}).get(f, 0.0) for f, v in fields.items()} for key, fields in after.items()}


def grown(after: Mapping[str, Nested], before: Mapping[str, Nested]) -> dict[str, Nested]:
    """`minus`, side by side."""
    return {side: minus(now, before.get(side, {})) for side, now in after.items()}


@attrs.define
class Tally:
    """What a system's slices at one load measured, added up."""

    results: list[dict[str, Any]] = attrs.field(factory=list)  # each slice's serve-bench result
    wall_s: float = 0.0
    cpu_s: float = 0.0  # the servers'
    router_cpu_s: float = 0.0
    noise_cpu_s: float | None = None
    threads: dict[str, Nested] = attrs.field(factory=dict)  # side -> "process/thread" -> schedstat field grown
    histograms: dict[str, dict[str, Histogram]] = attrs.field(factory=dict)  # side -> series -> grown
    steps: dict[str, list[float]] = attrs.field(factory=dict)  # side -> [engine steps, tokens] grown
    cpu_states: Nested = attrs.field(factory=dict)  # cpuN -> state -> seconds grown
    turns: list[dict[str, float | None]] = attrs.field(factory=list)  # each slice's own line, in order (`turn`)

    def add(
        self,
        result: dict[str, Any],
        *,
        wall_s: float,
        cpu_s: float,
        router_cpu_s: float,
        noise_cpu_s: float | None,
        threads: dict[str, Nested],
        histograms: dict[str, dict[str, Histogram]],
        steps: Mapping[str, tuple[float, float]],
        cpu_states: Nested,
        began: float = 0.0,
    ) -> None:
        """One slice's result and what grew while it ran (from `began`, Unix seconds)."""
        self.turns.append(turn(result, began=began, wall_s=wall_s, cpu_s=cpu_s, noise_cpu_s=noise_cpu_s,
                               cpu_states=cpu_states))  # fmt: skip
        self.results.append(result)
        self.wall_s += wall_s
        self.cpu_s += cpu_s
        self.router_cpu_s += router_cpu_s
        if noise_cpu_s is not None:
            self.noise_cpu_s = (self.noise_cpu_s or 0.0) + noise_cpu_s
        _add(self.threads, threads)
        _add(self.cpu_states, cpu_states)
        for side, series in histograms.items():
            mine = self.histograms.setdefault(side, {})
            for name, h in series.items():
                mine[name] = h if name not in mine else mine[name].plus(h)
        for side, (n, tokens) in steps.items():
            total = self.steps.setdefault(side, [0.0, 0.0])
            total[0] += n
            total[1] += tokens

    def result(self, percentiles: Sequence[int], metrics: Sequence[str], goodput: Mapping[str, float] | None) -> Any:
        """The serve bench's result over every slice: the one slice's own where there is one."""
        if len(self.results) == 1:
            return self.results[0]
        return combined(self.results, percentiles, metrics, goodput)
