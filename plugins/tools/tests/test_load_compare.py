"""The load bench's comparisons: each request counted as vLLM's serve bench counts goodput, and paired intervals."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge_tools.bench.load_compare import comparisons, difference, each_request

SLO = {"ttft": 100.0, "tpot": 10.0}


def result(ttfts_s: list[float], tpots_s: list[float], tokens: int = 5) -> dict:
    """A serve bench result's per-request fields (`--save-detailed`); a TTFT of 0 is a failed request."""
    return {
        "ttfts": ttfts_s,
        "itls": [[tpot] * (tokens - 1) for tpot in tpots_s],
        "output_lens": [tokens if t else 0 for t in ttfts_s],
        "errors": ["" if t else "refused" for t in ttfts_s],
    }


def test_a_request_meets_the_slo_as_the_serve_bench_counts_it() -> None:
    got = each_request(result([0.05, 0.15, 0.05, 0.0, 0.1], [0.005, 0.005, 0.02, 0.005, 0.01]), SLO)
    # within; TTFT over; TPOT over; failed; both exactly at the SLO (the serve bench counts <=)
    assert got["good"] == [True, False, False, False, True]
    assert got["ttft_ms"] == [50.0, 150.0, 50.0, None, 100.0]
    assert got["tpot_ms"] == [5.0, 5.0, 20.0, None, 10.0]
    one = each_request({"ttfts": [0.05], "itls": [[]], "output_lens": [1], "errors": [""]}, SLO)
    assert one["good"] == [True], "one token: no TPOT"


def test_identical_runs_are_as_good_and_a_clear_shortfall_is_worse_beyond_the_noise() -> None:
    rng = np.random.default_rng(1)
    ttft = list(rng.uniform(50, 150, 200))
    same = difference(ttft, ttft, "p99")
    assert (same.value, same.low, same.high) == (0.0, 0.0, 0.0)
    assert same.verdict(higher_is_better=False) == "at most"
    slower = difference([t + 40 for t in ttft], ttft, "p99")
    assert slower.value == pytest.approx(40) and slower.low > 0
    assert slower.verdict(higher_is_better=False) == "worse"
    good = [True] * 150 + [False] * 50
    fewer = difference([False] * 100 + [True] * 100, good, "good")
    assert fewer.value == -50 and fewer.high < 0 and fewer.verdict(higher_is_better=True) == "worse"


def test_one_request_fewer_of_two_hundred_is_within_the_noise() -> None:
    rng = np.random.default_rng(2)
    base = list(rng.random(200) < 0.9)
    worse = list(base)
    worse[base.index(True)] = False
    got = difference(worse, base, "good")
    assert got.value == -1 and got.low < 0 <= got.high
    assert got.verdict(higher_is_better=True) == "worse, within the noise"
    assert difference(base, worse, "good").verdict(higher_is_better=True) == "at least"


def test_a_slower_step_shows_in_the_tpot_median_whether_or_not_the_slo_counts_it() -> None:
    rng = np.random.default_rng(3)
    tpot = list(rng.uniform(5.0, 7.0, 200))
    slower = difference([t + 1.0 for t in tpot], tpot, "p50")
    assert slower.value == pytest.approx(1.0) and slower.low > 0
    assert slower.verdict(higher_is_better=False) == "worse"
    assert difference([None, *tpot[1:]], tpot, "p50").verdict(higher_is_better=False) != "worse"


def test_failed_requests_are_left_out_of_the_p99_and_pairs_must_match() -> None:
    got = difference([10.0, None, 30.0], [10.0, 20.0, 30.0], "p99")
    assert got.value == pytest.approx(0.0)
    with pytest.raises(ValueError, match="paired samples of one length"):
        difference([1.0], [1.0, 2.0], "p99")


def test_every_pd_system_is_held_against_the_reference_at_each_load_it_ran() -> None:
    def row(system: str, load: str, good: list[bool], tpot_ms: float = 6.0) -> dict:
        n = len(good)
        return {
            "system": system,
            "load": load,
            "per_request": {"good": good, "ttft_ms": [50.0] * n, "tpot_ms": [tpot_ms] * n},
        }

    rows = [
        row("colocated", "rate 1", [True] * 4),
        row("NixlConnector (vLLM)", "rate 1", [True] * 4),
        row("KVBridgeConnector", "rate 1", [True, True, True, False], tpot_ms=7.5),
        row("KVBridgeConnector", "rate 2", [True] * 4),  # the reference did not run there
        row("KVBridgeConnector (nixl)", "rate 1", [True] * 3),  # not the same requests
    ]
    [got] = comparisons(rows, "NixlConnector (vLLM)")
    assert (got["system"], got["load"], got["requests"]) == ("KVBridgeConnector", "rate 1", 4)
    assert got["within_slo"]["difference"] == -1 and got["within_slo"]["verdict"].startswith("worse")
    assert got["ttft_p99_ms"] == {"difference": 0.0, "interval": [0.0, 0.0], "verdict": "at most"}
    assert got["tpot_p50_ms"] == {"difference": 1.5, "interval": [1.5, 1.5], "verdict": "worse"}
    del rows[1]["per_request"]["tpot_ms"]  # a row that kept no TPOTs: the other figures still compared
    [older] = comparisons(rows, "NixlConnector (vLLM)")
    assert "tpot_p50_ms" not in older and older["within_slo"] == got["within_slo"]
    assert comparisons(rows, "MooncakeConnector (vLLM)") == []
