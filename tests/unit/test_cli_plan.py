"""`kvbridge plan`: the table and the JSON agree with the planner; bad pairs get one clear line."""

from __future__ import annotations

import json

import pytest

from kvbridge.cli import main


def test_plan_json_matches_the_context_pr_example(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "plan",
            "--prefill",
            "tp8,pcp2,dcp8",
            "--decode",
            "tp8,dcp4,dp2",
            "--model",
            "tiny-mla",
            "--tokens",
            "2500",
            "--json",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["num_blocks"], out["last_block_tokens"]) == (157, 4)
    assert out["release_counts"] == {str(r): 2 for r in range(16)}
    assert out["unpulled"] == []
    # decode rank 0 (cp 0 of 4) reads blocks 0, 4, 8, ... from the four prefill cp ranks 0, 4, 8, 12
    mine = [p for p in out["pulls"] if p["decode_rank"] == 0]
    assert [p["prefill_rank"] for p in mine] == [0, 4, 8, 12]
    assert [(p["first_block"], p["block_step"], p["dst_first"], p["dst_step"]) for p in mine] == [
        (0, 16, 0, 4),
        (4, 16, 1, 4),
        (8, 16, 2, 4),
        (12, 16, 3, 4),
    ]
    assert sum(p["num_blocks"] for p in out["pulls"] if p["decode_rank"] < 8) == 2 * 157


def test_plan_table_shows_pulls_and_unpulled_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--prefill", "tp8", "--decode", "tp4,dcp2", "--model", "tiny-mla", "--tokens", "100"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "7 blocks of 16 (last holds 4)" in out
    assert "0,2..6 (4)" in out  # decode cp rank 0 reads the even blocks
    assert out.count("unpulled: freed at once") == 4


def test_plan_refuses_an_impossible_pair(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--prefill", "tp4", "--decode", "tp3", "--model", "tiny-gqa", "--tokens", "10"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "16 KV heads of tiny-gqa cannot be spread over 3 head shards" in err


def test_plan_reports_the_planning_time_of_a_decode_rank(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--prefill", "tp8", "--decode", "tp4", "--model", "qwen2.5-32b", "--tokens", "1600", "--json"])
    assert rc == 0
    t = json.loads(capsys.readouterr().out)["planning"]
    # decode rank 0 of tp4 holds KV heads 0-1: one head from each of prefill ranks 0 and 1, NHD blocks are
    # cut per token, so 100 blocks x 64 layers x (K, V) x 16 tokens rows per pull
    assert (t["pulls"], t["blocks"], t["layers"], t["order"]) == (2, 100, 64, "NHD")
    assert t["rows"] == 2 * 100 * 64 * 2 * 16
    assert t["warm_ms"] > 0 and t["cold_ms"] > 0
    assert main(["plan", "--prefill", "tp8", "--decode", "tp4", "--model", "qwen2.5-32b", "--tokens", "1600"]) == 0
    assert "planning time of decode rank 0 (2 pulls, 100 fragmented blocks x 64 layers" in capsys.readouterr().out
