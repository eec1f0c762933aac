"""`kvbridge bench --scale`: what kvbridge costs as the deployment grows, from a few ranks to hundreds.

P prefill and D decode ranks (`scale_rank`, many to a process) with real side channels, ledgers, leases, a real
redis or etcd registry holding a record per rank and per server, and a real transport moving one small block per
pull. Every decode rank pulls from a spread of prefill ranks, as a proxy's round-robin would send it requests:

- first contact: each decode rank's first pull from each prefill rank of its spread, one pull at a time in the
  whole deployment (the control time includes GetInfo, the transport's connection and the BeginPull; on 2 cores,
  pulls at once would measure the queue for the cores);
- all at once: every decode rank pulls from its whole spread at the same moment (control p99 under a herd);
- cost per connected peer: resident memory, file descriptors and threads of each side's processes before and
  after, divided by the peers each side's ranks talk to;
- membership: a real `kvbridge proxy` following the registry with `--records` server records in it: how long a
  server that joins takes to be routed to, and how long one health round takes.

What grows faster than the peers is the finding; docs/measurements/scale.md has the curves and the arithmetic.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import http.server
import json
import logging
import math
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.progress import Progress

from kvbridge.base.errors import ConfigError
from kvbridge.cli.numbers import whole
from kvbridge.cli.output import err_console, print_json, print_table
from kvbridge.control import open_registry
from kvbridge.control.discovery import ServerRecord
from kvbridge.session.pull_control import CONTROL_TIMEOUT_S, DONE_ATTEMPTS
from kvbridge_tools.bench.load_probes import MEMORY_MARGIN_GIB, memory_available_gib
from kvbridge_tools.bench.plot import check_path, write_chart
from kvbridge_tools.bench.scale_rank import BLOCKS
from kvbridge_tools.bench.stats import percentile
from kvbridge_tools.harness.etcd import etcd_server
from kvbridge_tools.harness.hosts import OWN_GROUP
from kvbridge_tools.harness.ports import free_port
from kvbridge_tools.harness.proc import Child
from kvbridge_tools.harness.redis import redis_server
from kvbridge_tools.harness.redis import stop as stop_process

log = logging.getLogger(__name__)

DEFAULT_SIZES = "1x4,4x16,16x64,64x256"
TOKENS = 16  # one block of the ranks' cache
# a rank process's resident memory, and each rank's share with its peers' connections, rounded up from what the runs
# measured (60-67 MiB a process, 79 with 16 prefill ranks of 16 peers each; docs/measurements/scale.md)
PROCESS_MIB = 64
RANK_MIB = 2


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--scale",
        action="store_true",
        help="simulate deployments of growing size on this machine and report kvbridge's cost per peer (this mode)",
    )
    group.add_argument(
        "--sizes",
        type=_sizes,
        default=_sizes(DEFAULT_SIZES),
        metavar="PxD,...",
        help=f"prefill x decode ranks, one run each (default {DEFAULT_SIZES})",
    )
    group.add_argument(
        "--spread", type=whole(), default=4, metavar="N", help="prefill ranks each decode rank pulls from (default 4)"
    )
    group.add_argument(
        "--ranks-per-process", type=whole(), default=16, metavar="N", help="ranks packed in one process (default 16)"
    )
    group.add_argument(
        "--records",
        type=whole(0),
        default=1000,
        metavar="N",
        help="server records in the registry while a join is timed (default 1000; 0 skips the proxy)",
    )
    group.add_argument(
        "--registry-kind",
        choices=["redis", "etcd"],
        default="redis",
        help="the registry the ranks and the proxy use, started for the run (default redis)",
    )


def _sizes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        p, _, d = item.strip().lower().partition("x")
        try:
            size = (int(p), int(d))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected sizes like 4x16,64x256, got {item!r}") from None
        if min(size) < 1:
            raise argparse.ArgumentTypeError(f"a size needs at least one prefill and one decode rank, got {item!r}")
        out.append(size)
    return out


def _check_fits(sizes: list[tuple[int, int]], per_process: int) -> None:
    """Refuse, before any process starts, a size whose rank processes would not fit in the memory free now."""

    def mib(size: tuple[int, int]) -> int:
        return sum(math.ceil(n / per_process) * PROCESS_MIB + n * RANK_MIB for n in size)

    largest = max(sizes, key=mib)
    need, have = mib(largest) / 1024 + MEMORY_MARGIN_GIB, memory_available_gib()
    if need > have:
        p, d = largest
        raise ConfigError(
            f"--sizes {p}x{d} needs about {need:.1f} GiB for its rank processes ({per_process} ranks to a process) and "
            f"this machine has {have:.1f} GiB available: ask for fewer ranks"
        )


class _Side:
    """The processes that host one role's ranks."""

    def __init__(self, role: str, count: int, per_process: int, setup: dict[str, Any]) -> None:
        self.role = role
        self.children: list[Child] = []
        self.where: list[tuple[int, int]] = []  # global rank -> (child, index in child)
        self.addresses: list[tuple[str, str, int]] = []
        try:
            for first in range(0, count, per_process):
                n = min(per_process, count - first)
                child = Child("kvbridge_tools.bench.scale_rank", name=f"scale-{role}-{first}")
                self.children.append(child)
                for j, (engine, host, port) in enumerate(
                    child.call("setup", timeout=300, role=role, first=first, count=n, **setup)
                ):
                    self.where.append((len(self.children) - 1, j))
                    self.addresses.append((engine, host, port))
        except BaseException:
            self.close()
            raise

    def stats(self) -> list[dict[str, Any]]:
        return [c.call("stats") for c in self.children]

    def close(self) -> None:
        for c in self.children:
            with contextlib.suppress(Exception):
                c.call("close", timeout=60)
            c.close()


def _spread(d: int, prefills: int, spread: int) -> list[int]:
    """The prefill ranks decode rank `d` pulls from: consecutive from a start that walks the prefill ranks."""
    n = min(spread, prefills)
    return [(d * n + j) % prefills for j in range(n)]


def _warm_up_pairs(prefill: _Side, decode: _Side) -> list[tuple[int, int]]:
    """Pairs that give every process one pull before the first-contact round.

    No process then pays its first pull's one-time costs (lazy imports, first sockets) in the first-contact figures."""
    dp, pp = ([side.where.index((c, 0)) for c in range(len(side.children))] for side in (decode, prefill))
    return [(dp[i % len(dp)], pp[i % len(pp)]) for i in range(max(len(dp), len(pp)))]


def _round(
    prefill: _Side, decode: _Side, pairs: list[tuple[int, int]], tag: str, concurrency: int | None
) -> list[dict[str, Any]]:
    """Each (decode rank, prefill rank) pair pulls once; returns every pull's figures, with its pair."""
    offers: dict[int, list[list[Any]]] = {}
    jobs: dict[int, list[list[Any]]] = {}
    which: dict[int, list[tuple[int, int]]] = {}  # decode child -> the (decode rank, prefill rank) of each job
    by_decode: dict[int, list[int]] = {}
    for d, p in pairs:
        by_decode.setdefault(d, []).append(p)
    for d, spread in by_decode.items():
        dc, di = decode.where[d]
        for block, p in enumerate(spread):
            pc, pi = prefill.where[p]
            rid = f"{tag}-d{d}-p{p}"
            offers.setdefault(pc, []).append([pi, rid])
            engine, host, port = prefill.addresses[p]
            params = {
                "do_remote_prefill": True,
                "remote_engine_id": engine,
                "remote_request_id": rid,
                "remote_block_ids": [0],
                "remote_host": host,
                "remote_port": port,
                "remote_num_tokens": TOKENS,
            }
            jobs.setdefault(dc, []).append([di, block % BLOCKS, params])
            which.setdefault(dc, []).append((d, p))
    for pc, reqs in offers.items():
        prefill.children[pc].call("offer", requests=reqs)
    results: list[dict[str, Any]] = []
    lock = threading.Lock()

    def run(dc: int) -> None:
        n = len(jobs[dc]) if concurrency is None else concurrency
        got = decode.children[dc].call("pull", timeout=600, jobs=jobs[dc], concurrency=n)
        for pair, result in zip(which[dc], got):
            result["pair"] = pair
        with lock:
            results.extend(got)

    if concurrency is not None:  # one pull at a time in the whole deployment: what a pull costs, not a queue for cores
        for dc in jobs:
            run(dc)
        return results
    threads = [threading.Thread(target=run, args=(dc,), name=f"scale-round-{dc}") for dc in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _per_peer(before: list[dict[str, Any]], after: list[dict[str, Any]], peers: int) -> dict[str, Any]:
    grow = {k: sum(a[k] for a in after) - sum(b[k] for b in before) for k in ("rss_kib", "fds", "threads")}
    kinds: collections.Counter[str] = collections.Counter()
    for a in after:
        kinds.update(a["python_threads"])
    return (
        {f"{k}_per_peer": round(v / max(1, peers), 3) for k, v in grow.items()}
        | {f"{k}_total": sum(a[k] for a in after) for k in ("rss_kib", "fds", "threads")}
        | {"python_threads": dict(kinds.most_common())}
    )


def _releases(prefill: _Side, pulled: int) -> int:
    """The leases the prefill ranks released, once the last pulls' DONEs came in (or their bound passed).

    A pull is reported once its read landed; its DONE, which releases the lease, follows off the request's path, so
    right after a round some may still be on their way. They come within the DONE's tries (`DONE_ATTEMPTS` of at most
    `CONTROL_TIMEOUT_S` each)."""
    deadline = time.monotonic() + DONE_ATTEMPTS * CONTROL_TIMEOUT_S + 1.0
    while True:
        released = sum(s["released"] for s in prefill.stats())
        if released >= pulled or time.monotonic() > deadline:
            return released
        time.sleep(0.05)


def measure_size(p: int, d: int, args: argparse.Namespace, setup: dict[str, Any]) -> dict[str, Any]:
    """One deployment size: start the ranks, run the two rounds, read the costs, stop everything."""
    prefill = _Side("prefill", p, args.ranks_per_process, setup)
    try:
        decode = _Side("decode", d, args.ranks_per_process, setup)
        try:
            before_p, before_d = prefill.stats(), decode.stats()
            warm = _warm_up_pairs(prefill, decode)
            spread = [(dd, pp) for dd in range(d) for pp in _spread(dd, p, args.spread)]
            warmed = _round(prefill, decode, warm, "warm-up", concurrency=1)
            first_all = _round(prefill, decode, spread, "first", concurrency=1)
            first = [r for r in first_all if r["pair"] not in warm]
            # every pair connected: the cost per peer, before the herd's own threads and buffers come and go
            after_p, after_d = prefill.stats(), decode.stats()
            herd = _round(prefill, decode, spread, "herd", concurrency=None)
            pulled = sum(1 for r in warmed + first_all + herd if not r["error"])
            released = _releases(prefill, pulled)
        finally:
            decode.close()
    finally:
        prefill.close()
    pairs = set(spread) | set(warm)
    failed = [r["error"] for r in warmed + first_all + herd if r["error"]]
    out: dict[str, Any] = {
        "prefill_ranks": p,
        "decode_ranks": d,
        "pairs": len(pairs),
        "pulls": len(warmed) + len(first_all) + len(herd),
        "first_contacts": len(first),
        "failed": len(failed),
        "errors": failed[:5],
        "first_contact_p50_ms": percentile([r["control_ms"] for r in first], 0.5, 2),
        "first_contact_p99_ms": percentile([r["control_ms"] for r in first], 0.99, 2),
        "herd_control_p50_ms": percentile([r["control_ms"] for r in herd], 0.5, 2),
        "herd_control_p99_ms": percentile([r["control_ms"] for r in herd], 0.99, 2),
        "herd_pull_p99_ms": percentile([r["total_ms"] for r in herd], 0.99, 2),
        "released": released,
    }
    # a prefill rank's peers are the decode ranks that pulled from it, and the other way round: both count the pairs
    out["prefill"] = _per_peer(before_p, after_p, len(pairs))
    out["decode"] = _per_peer(before_d, after_d, len(pairs))
    return out


class _Health(http.server.BaseHTTPRequestHandler):
    """Stands in for every announced server's `/health` (the proxy probes each record's URL)."""

    def do_GET(self) -> None:  # noqa: N802  # the standard library's name
        self.send_response(200 if self.path.endswith("/health") else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_args: Any) -> None:  # its access log would drown the bench's
        pass


class _HealthServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 4096  # every record is probed at once: the default backlog (5) drops SYNs, 1 s retries


@contextlib.contextmanager
def _health_server() -> Iterator[str]:
    server = _HealthServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, name="scale-health", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _instances(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/instances", timeout=5) as resp:  # noqa: S310  # loopback
        return dict(json.load(resp))


def measure_membership(registry: str, secret: str, records: int, interval: float) -> dict[str, Any]:
    """A real proxy following `registry` with `records` servers in it: join time and health-round time."""
    reg = open_registry(registry, secret=secret)
    assert reg is not None
    port = free_port()
    log_path = Path(tempfile.mkdtemp(prefix="kvbridge-scale-")) / "proxy.log"
    with _health_server() as base:

        def record(i: int, role: str) -> ServerRecord:
            return ServerRecord(f"server{i}", role, f"{base}/s{i}", time.time() + 600)

        t0 = time.perf_counter()
        for i in range(records):
            reg.announce(record(i, "prefill" if i % 4 == 0 else "decode"), 600)
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        listed = len(reg.servers())
        read_ms = (time.perf_counter() - t0) * 1e3
        env = dict(os.environ, KVBRIDGE_SECRET=secret, NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
        argv = [sys.executable, "-m", "kvbridge", "proxy", "--port", str(port), "--registry", registry]
        argv += ["--health-interval", str(interval), "--no-warm-up", "--expose-internals"]
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, **OWN_GROUP)
        try:
            deadline = time.monotonic() + 120
            state: dict[str, Any] = {}
            while sum(len(state.get(r, [])) for r in ("prefill", "decode")) < records:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise ConfigError(f"the proxy did not take {records} servers from the registry; see {log_path}")
                with contextlib.suppress(OSError):
                    state = _instances(port)
                time.sleep(0.2)  # polling a live proxy, bounded by the deadline above
            rounds0, t0 = state["health_rounds"], time.perf_counter()
            time.sleep(max(3.0, 5 * interval))  # rounds counted over a window
            rounds = _instances(port)["health_rounds"] - rounds0
            round_s = (time.perf_counter() - t0) / max(1, rounds)
            joined = f"{base}/s{records}"
            t0 = time.perf_counter()
            reg.announce(record(records, "decode"), 600)
            while not any(e["url"] == joined for e in _instances(port).get("decode", [])):
                if time.perf_counter() - t0 > 60:
                    raise ConfigError(f"a joining server was not seen by the proxy within 60 s; see {log_path}")
                time.sleep(0.01)  # polling the proxy's view, bounded above
            join_ms = (time.perf_counter() - t0) * 1e3
        finally:
            stop_process(proc)
            with contextlib.suppress(Exception):
                for i in range(records + 1):
                    reg.withdraw(f"server{i}")
            reg.close()
    shutil.rmtree(log_path.parent, ignore_errors=True)  # kept only where an error above names it
    return {
        "records": listed,
        "announce_ms_per_record": round(write_s * 1e3 / max(1, records), 3),
        "registry_read_ms": round(read_ms, 1),
        "health_round_ms": round(round_s * 1e3 - interval * 1e3, 1),
        "health_interval_s": interval,
        "join_seen_ms": round(join_ms, 1),
    }


def _table(rows: list[dict[str, Any]], membership: dict[str, Any] | None) -> None:
    print_table(
        "kvbridge at scale: control time (ms)",
        ["P x D", "pairs", "pulls", "failed", "first contact p50/p99", "herd control p50/p99", "herd pull p99"],
        [
            [
                f"{r['prefill_ranks']} x {r['decode_ranks']}",
                r["pairs"],
                r["pulls"],
                r["failed"],
                f"{r['first_contact_p50_ms']} / {r['first_contact_p99_ms']}",
                f"{r['herd_control_p50_ms']} / {r['herd_control_p99_ms']}",
                r["herd_pull_p99_ms"],
            ]
            for r in rows
        ],
    )
    print_table(
        "cost per connected peer (growth divided by pairs)",
        ["P x D", "side", "RSS KiB", "fds", "threads", "RSS KiB total", "fds total", "threads total"],
        [
            [f"{r['prefill_ranks']} x {r['decode_ranks']}", side]
            + [r[side][f"{k}_per_peer"] for k in ("rss_kib", "fds", "threads")]
            + [r[side][f"{k}_total"] for k in ("rss_kib", "fds", "threads")]
            for r in rows
            for side in ("prefill", "decode")
        ],
    )
    if membership:
        print_table("membership: a real proxy following the registry", list(membership), [list(membership.values())])


def run(args: argparse.Namespace) -> int:
    if args.spread > BLOCKS:  # (the options' types keep each at least 1, --records at least 0)
        raise ConfigError(f"--spread must be 1 to {BLOCKS} (a decode rank's pulls land in blocks of their own)")
    _check_fits(args.sizes, args.ranks_per_process)
    if args.plot:
        check_path(args.plot)
    backend = "tcp" if args.migration_backend == "mooncake" and args.sizes[-1][1] > 64 else args.migration_backend
    if backend != args.migration_backend:
        log.warning("--scale past 64 decode ranks runs the tcp transport: a Mooncake engine per rank does not fit")
    secret = secrets.token_hex(16)
    rows: list[dict[str, Any]] = []
    membership: dict[str, Any] | None = None
    start = etcd_server if args.registry_kind == "etcd" else redis_server
    with tempfile.TemporaryDirectory(prefix="kvbridge-scale-") as tmp, start(Path(tmp)) as registry:
        setup = {"backend": backend, "secret": secret, "registry": registry, "host": "127.0.0.1"}
        with Progress(console=err_console, transient=True, disable=bool(args.json)) as progress:
            task = progress.add_task("deployments", total=len(args.sizes) + (1 if args.records else 0))
            for p, d in args.sizes:
                progress.update(task, description=f"{p} x {d} ranks")
                rows.append(measure_size(p, d, args, setup))
                progress.advance(task)
            if args.records:
                progress.update(task, description=f"a proxy and {args.records} records")
                membership = measure_membership(registry, secret, args.records, interval=0.5)
                progress.advance(task)
    report = {
        "transport": backend,
        "registry": args.registry_kind,
        "spread": args.spread,
        "sizes": rows,
        "membership": membership,
    }
    if args.json:
        print_json(report)
    else:
        _table(rows, membership)
    if args.plot:
        x = [r["decode_ranks"] * r["prefill_ranks"] for r in rows]
        series = {
            "first contact p99 ms": [(xi, r["first_contact_p99_ms"]) for xi, r in zip(x, rows)],
            "herd control p99 ms": [(xi, r["herd_control_p99_ms"]) for xi, r in zip(x, rows)],
            "decode threads per peer": [(xi, r["decode"]["threads_per_peer"]) for xi, r in zip(x, rows)],
            "prefill fds per peer": [(xi, r["prefill"]["fds_per_peer"]) for xi, r in zip(x, rows)],
        }
        write_chart(
            args.plot, "kvbridge cost as the deployment grows", "prefill x decode ranks", "value", series, log_y=True
        )
    return 1 if any(r["failed"] for r in rows) else 0
