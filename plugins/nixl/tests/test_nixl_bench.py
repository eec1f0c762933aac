"""NIXL as a user meets it: listed by `kvbridge plugins`, and benched beside Mooncake.

One `kvbridge bench --compare-transports` run moves a verified migration between two processes over NIXL, beside
Mooncake.
"""

from __future__ import annotations

import json
import subprocess
import sys

QUICK = ["--model", "small", "--tokens", "256", "--requests", "2", "--repeat", "1"]


def kvbridge(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "kvbridge", *args], capture_output=True, text=True, timeout=600)
    if check and out.returncode != 0:
        raise AssertionError(f"kvbridge {' '.join(args)} exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
    return out


def test_plugins_lists_nixl_with_its_backends() -> None:
    rows = {(r["kind"], r["name"]): r for r in json.loads(kvbridge("plugins", "--json").stdout)}
    nixl = rows[("backend", "nixl")]
    assert nixl["available"], nixl
    assert nixl["distribution"] == "kvbridge-nixl"
    assert nixl["detail"]["protocols"][0] == "ucx" and "libfabric" in nixl["detail"]["protocols"]


def test_compare_transports_verifies_both_side_by_side() -> None:
    # separate K and V pages per layer: 4 x 2 x 16 of 32 KiB per request, worth gathering on Mooncake TCP (the
    # default BLHNC's 16 blocks of 256 KiB are not, on any transport)
    layout = ["--layout", "ascend-kv-tuple"]
    out = json.loads(kvbridge("bench", "--compare-transports", "mooncake,nixl", *QUICK, *layout, "--json").stdout)
    seen = {(r["config"]["migration_backend"], r["config"]["fragmented"]) for r in out["results"]}
    assert seen == {("mooncake", False), ("mooncake", True), ("nixl", False), ("nixl", True)}
    assert out["verified"] is True
    for r in out["results"]:
        assert r["verified"] is True and r["kvbridge"]["gbps"] > 0 and r["raw"]["gbps"] > 0, r
        runs = r["kvbridge"]["merged_runs_per_request"]
        if r["strategy"]["used"] == "gather":  # a transport whose declared cost makes scattered blocks cheaper gathered
            assert r["config"]["fragmented"] and runs == 1, r  # one staged chunk
        else:
            assert runs > 4 * 2 if r["config"]["fragmented"] else runs == 4 * 2, r  # (layer, K/V) tensors
    # Mooncake TCP declares a per-descriptor cost, NIXL none: only Mooncake gathers the fragmented blocks.
    used = {
        (r["config"]["migration_backend"], r["config"]["fragmented"]): r["strategy"]["used"] for r in out["results"]
    }
    assert used[("mooncake", True)] == "gather" and used[("nixl", True)] == "direct", used


def test_compare_transports_refuses_bad_lists() -> None:
    out = kvbridge("bench", "--compare-transports", "nixl", *QUICK, check=False)
    assert out.returncode != 0 and "two or more" in out.stderr
    out = kvbridge("bench", "--compare-transports", "mooncake,nixl", "--option", "retries=1", *QUICK, check=False)
    assert out.returncode != 0 and "one at a time" in out.stderr
