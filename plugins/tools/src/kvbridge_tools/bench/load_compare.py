"""The load bench's comparisons against NixlConnector, each with the run's own noise: paired bootstrap intervals.

The serve bench sends every system the same prompts at the same offsets (one seed per load), so request i of one
system's round and request i of another's at that load are a pair. Resampling the pairs gives, for each difference
(requests within the SLO, p99 TTFT, p50 TPOT), an interval that shows how much of it the run's noise alone could make.
A difference whose 95% interval holds 0 does not tell the two systems apart. The TPOT difference says what a goodput
difference is made of: where the SLO's TPOT falls near both systems' p50, a small difference in step time moves many
requests across it, and the same difference costs nothing where the SLO lies above both.
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
    """Each request's TTFT and TPOT (ms; None where it failed) and whether it met the SLO (as goodput counts it).

    `result`: the serve bench's result with its per-request fields (`--save-detailed`). A request meets the SLO when
    its TTFT and its TPOT ((latency - TTFT) / (tokens - 1), 0 for one token) are at most the SLO's."""
    ttft_ms: list[float | None] = []
    tpot_ms: list[float | None] = []
    good: list[bool] = []
    for ttft, itl, tokens, error in zip(result["ttfts"], result["itls"], result["output_lens"], result["errors"]):
        if error or not tokens:
            ttft_ms.append(None)
            tpot_ms.append(None)
            good.append(False)
            continue
        tpot = sum(itl) / (tokens - 1) * 1e3 if tokens > 1 else 0.0
        ttft_ms.append(round(ttft * 1e3, 3))
        tpot_ms.append(round(tpot, 3))
        good.append(ttft * 1e3 <= slo.get("ttft", np.inf) and tpot <= slo.get("tpot", np.inf))
    return {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms, "good": good}


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


def _p50(pairs: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.nanmedian(a[pairs], axis=-1) - np.nanmedian(b[pairs], axis=-1)


def difference(
    a: Sequence[Any], b: Sequence[Any], statistic: str, *, rounds: int = RESAMPLES, seed: int = 0
) -> Difference:
    """`statistic` of `a` minus that of `b`, paired: "good" (requests within the SLO), "p99" or "p50".

    The percentiles leave failed requests (None) out."""
    if len(a) != len(b) or not len(a):
        raise ValueError(f"paired samples of one length needed, got {len(a)} and {len(b)}")
    of = {"good": _good, "p99": _p99, "p50": _p50}[statistic]
    x, y = (np.array([np.nan if v is None else v for v in s], dtype=float) for s in (a, b))
    value = float(of(np.arange(len(x))[None, :], x, y)[0])
    with warnings.catch_warnings():  # a resample of failed requests alone has no p99: it is left out
        warnings.simplefilter("ignore", RuntimeWarning)
        spread = of(bootstrap.resamples(len(x), rounds, seed), x, y)
    return Difference(value, *bootstrap.central(spread, LEVEL))


def comparisons(rows: Sequence[Mapping[str, Any]], against: str) -> list[dict[str, Any]]:
    """Every other P/D system against `against` at each load its rows share: within the SLO, p99 TTFT, p50 TPOT.

    The TPOT only where both rows kept their TPOTs. Empty where `against` did not run, or no row kept its requests
    (`each_request`)."""
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
        compared = {
            "system": r["system"],
            "against": against,
            "load": r["load"],
            "requests": len(mine["good"]),
            "within_slo": good.described(higher_is_better=True, digits=0),
            "ttft_p99_ms": p99.described(higher_is_better=False, digits=1),
        }
        if "tpot_ms" in mine and "tpot_ms" in other:
            tpot = difference(mine["tpot_ms"], other["tpot_ms"], "p50")
            compared["tpot_p50_ms"] = tpot.described(higher_is_better=False, digits=2)
        out.append(compared)
    return out
