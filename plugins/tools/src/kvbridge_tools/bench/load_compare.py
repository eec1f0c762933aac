"""The load bench's comparisons against NixlConnector, each with the run's own noise: paired bootstrap intervals.

The serve bench sends every system the same prompts at the same offsets (one seed per load), so request i of one
system's round and request i of another's at that load are a pair. Resampling the pairs gives, for each difference
(requests within the SLO, p99 TTFT), an interval that shows how much of it the run's noise alone could make. A
difference whose 95% interval holds 0 does not tell the two systems apart.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from kvbridge_tools.bench import bootstrap

RESAMPLES = 2000
LEVEL = 0.95


def each_request(result: Mapping[str, Any], slo: Mapping[str, float]) -> dict[str, list[Any]]:
    """Each request's TTFT (ms; None where it failed) and whether it met the SLO, as vLLM's serve bench counts goodput.

    `result`: the serve bench's result with its per-request fields (`--save-detailed`). A request meets the SLO when
    its TTFT and its TPOT ((latency - TTFT) / (tokens - 1), 0 for one token) are at most the SLO's."""
    ttft_ms: list[float | None] = []
    good: list[bool] = []
    for ttft, itl, tokens, error in zip(result["ttfts"], result["itls"], result["output_lens"], result["errors"]):
        if error or not tokens:
            ttft_ms.append(None)
            good.append(False)
            continue
        tpot_ms = sum(itl) / (tokens - 1) * 1e3 if tokens > 1 else 0.0
        ttft_ms.append(round(ttft * 1e3, 3))
        good.append(ttft * 1e3 <= slo.get("ttft", np.inf) and tpot_ms <= slo.get("tpot", np.inf))
    return {"ttft_ms": ttft_ms, "good": good}


@attrs.frozen
class Difference:
    """One figure of a system minus the same figure of the system it is held against, with its bootstrap interval."""

    value: float
    low: float
    high: float

    def verdict(self, *, higher_is_better: bool) -> str:
        """'at least' ('at most' where lower is better) as good; else 'worse', or 'worse, within the noise'."""
        worse = self.value < 0 if higher_is_better else self.value > 0
        if not worse:
            return "at least" if higher_is_better else "at most"
        within = self.high >= 0 if higher_is_better else self.low <= 0
        return "worse, within the noise" if within else "worse"

    def described(self, *, higher_is_better: bool, digits: int) -> dict[str, Any]:
        return {
            "difference": round(self.value, digits),
            "interval": [round(self.low, digits), round(self.high, digits)],
            "verdict": self.verdict(higher_is_better=higher_is_better),
        }


def _good(pairs: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a[pairs].sum(axis=-1) - b[pairs].sum(axis=-1)).astype(float)


def _p99(pairs: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.nanpercentile(a[pairs], 99, axis=-1) - np.nanpercentile(b[pairs], 99, axis=-1)


def difference(
    a: Sequence[Any], b: Sequence[Any], statistic: str, *, rounds: int = RESAMPLES, seed: int = 0
) -> Difference:
    """`statistic` ("good": requests within the SLO; "p99": p99 TTFT in ms) of `a` minus that of `b`, paired."""
    if len(a) != len(b) or not len(a):
        raise ValueError(f"paired samples of one length needed, got {len(a)} and {len(b)}")
    of = {"good": _good, "p99": _p99}[statistic]
    x, y = (np.array([np.nan if v is None else v for v in s], dtype=float) for s in (a, b))
    value = float(of(np.arange(len(x))[None, :], x, y)[0])
    with warnings.catch_warnings():  # a resample of failed requests alone has no p99: it is left out
        warnings.simplefilter("ignore", RuntimeWarning)
        spread = of(bootstrap.resamples(len(x), rounds, seed), x, y)
    return Difference(value, *bootstrap.central(spread, LEVEL))


def comparisons(rows: Sequence[Mapping[str, Any]], against: str) -> list[dict[str, Any]]:
    """Every other P/D system against `against` at each load its rows share: requests within the SLO and p99 TTFT.

    Empty where `against` did not run, or no row kept its requests (`each_request`)."""
    base = {r["load"]: r for r in rows if r["system"] == against and r.get("per_request")}
    out = []
    for r in rows:
        theirs = base.get(r["load"])
        if r["system"] in (against, "colocated") or theirs is None or not r.get("per_request"):
            continue
        mine, other = r["per_request"], theirs["per_request"]
        if len(mine["good"]) != len(other["good"]):
            continue  # (not the same requests: nothing to pair)
        good = difference(mine["good"], other["good"], "good")
        p99 = difference(mine["ttft_ms"], other["ttft_ms"], "p99")
        out.append(
            {
                "system": r["system"],
                "against": against,
                "load": r["load"],
                "requests": len(mine["good"]),
                "within_slo": good.described(higher_is_better=True, digits=0),
                "ttft_p99_ms": p99.described(higher_is_better=False, digits=1),
            }
        )
    return out
