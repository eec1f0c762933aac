"""`kvbridge bench --engine vllm --idle`: decode TTFT of the first request after an idle spell.

KVBridgeConnector over Mooncake TCP, KVBridgeConnector over NIXL and vLLM's NixlConnector each get a
prefill + decode pair on 127.0.0.1 (the launchers of `kvbridge bench --engine vllm`), all running at
once so that the systems can be alternated: per gap and prompt length, each round sleeps the gap with
nothing in flight anywhere, then sends one request to each system in turn, the order rotating by one
every round (so whichever system goes first, onto the quietest box, changes, and drift on the box hits
all alike). Each system's own servers have sat idle at least the gap before its request. A request is
the prefill request (`max_tokens` 1, `do_remote_decode`), then the decode request at once; decode TTFT
is from sending the decode request to its answer, as in `--engine vllm`.

Per (gap, length, system) the report gives decode TTFT median and p90 (interpolated), the difference of
the median to NixlConnector's, and KVBridgeConnector's phases (medians of what its servers report in
`kvbridge_timing`, split as `--engine vllm` splits them). Each pair's first request (its warm-up, the
first contact of a fresh prefill and decode) is reported apart, with whether the decode's log shows a
transport stall ("status frame").

`--nixl-busy-poll off` (of `--load`) starts NixlConnector's NIXL agents without NIXL's busy-polling
progress thread: with all pairs running at once, its poll (a core per server) would take the cores of
the other systems too.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.progress import Progress

from kvbridge.cli.numbers import real
from kvbridge.cli.output import err_console, print_json, print_table
from kvbridge_tools.bench import vllm as pd
from kvbridge_tools.bench.stats import percentile
from kvbridge_tools.bench.vllm_load import LABELS
from kvbridge_tools.harness.run_logs import bench_logs

SYSTEMS = ("kvbridge", "kvbridge-nixl", "nixl")
REFERENCE = "nixl"  # the system every other one is compared to
LENGTHS = (64, 256, 1024, 1900)
GAPS = (1.2,)
LAUNCHERS: dict[str, Callable[..., pd.Pair]] = {
    "kvbridge": pd._kvbridge_pair,
    "kvbridge-nixl": functools.partial(pd._kvbridge_pair, transport="nixl"),
    "nixl": pd._nixl_pair,
}
# KVBridgeConnector's phases, as `--engine vllm` splits its decode TTFT (kvbridge_tools.bench.vllm._breakdown)
PHASES = ("prefill_compute_ms", "offer_wait_ms", "control_ms", "pull_transfer_ms", "decode_step_ms")
STALL = "status frame"  # Mooncake's "failed to read READ status frame": a pull that saw no progress in time


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """Options of `--engine vllm --idle` (it takes --engine vllm's `--lengths`, `--model-dir`, `--executor`)."""
    group.add_argument(
        "--idle",
        action="store_true",
        help="with --engine vllm: decode TTFT of requests that each follow an idle spell (--gaps), "
        "KVBridgeConnector over Mooncake TCP and over NIXL against vLLM's NixlConnector, all three pairs "
        f"running at once and alternated request by request; --lengths defaults to {' '.join(map(str, LENGTHS))} "
        "and --requests (per gap and length) to 20 (kvbridge_tools.bench.vllm_idle)",
    )
    group.add_argument(
        "--gaps",
        type=real(zero=True),
        nargs="+",
        default=None,
        metavar="S",
        help="with --idle: seconds with nothing in flight before each round of requests (default 1.2; "
        "e.g. --gaps 5 30 90 --requests 3 for the long ones)",
    )
    group.add_argument(
        "--idle-systems",
        nargs="+",
        choices=SYSTEMS,
        default=list(SYSTEMS),
        help="with --idle: the systems (default: all; nixl, the reference, is always kept)",
    )


def _request(http: Any, pair: pd.Pair, model: str, text: str) -> dict[str, Any]:
    """One PD request: the prefill request, then the decode request at once; its decode TTFT and phases."""
    base = {"model": model, "temperature": 0, "ignore_eos": True, "prompt": text}
    tid = uuid.uuid4().hex
    _, first = pd._answer(http, pair.prefill.url, {**base, "kv_transfer_params": pair.prefill_params(tid)})
    ttft, answer = pd._answer(http, pair.decode.url, {**base, "kv_transfer_params": pair.decode_params(tid, first)})
    ms = ttft * 1e3
    return {"decode_ttft_ms": ms, **pd._breakdown(ms, pd._timing(first), pd._timing(answer))}


def _summary(system: str, gap: float, n: int, samples: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = [s["decode_ttft_ms"] for s in samples]
    row: dict[str, Any] = {
        "system": LABELS[system],
        "gap_s": gap,
        "prompt_tokens": n,
        "requests": len(samples),
        "decode_ttft_p50_ms": round(statistics.median(ttft), 2),
        "decode_ttft_p90_ms": percentile(ttft, 0.9, 2),
        "decode_ttft_ms": [round(v, 2) for v in ttft],
    }
    phases = {k: round(statistics.median(s[k] for s in samples), 2) for k in PHASES if all(k in s for s in samples)}
    if phases:
        row["phases_p50_ms"] = phases
    return row


def run(args: argparse.Namespace) -> int:
    import httpx

    from kvbridge_tools.bench.pair import frozen_heap
    from kvbridge_tools.harness.tiny_model import given_or_tiny, random_prompt
    from kvbridge_tools.harness.vllm_server import wait_healthy

    systems = [s for s in SYSTEMS if s in set(args.idle_systems) | {REFERENCE}]
    lengths = args.lengths or list(LENGTHS)
    gaps = args.gaps or list(GAPS)
    reps = args.requests or 20
    max_len = max(1024, -(-(max(lengths) + 16) // 256) * 256)
    samples: dict[tuple[float, int, str], list[dict[str, Any]]] = {}
    first: dict[str, dict[str, Any]] = {}
    pairs: dict[str, pd.Pair] = {}
    with (
        tempfile.TemporaryDirectory(prefix="kvbridge-bench-idle-") as tmp,
        bench_logs(args.keep_logs, Path(tmp)) as logs,
        Progress(console=err_console, transient=True, disable=bool(args.json)) as progress,
    ):
        root = Path(tmp)
        model_dir = given_or_tiny(args.model_dir, root, max_len)
        model = str(model_dir)
        http = httpx.Client(timeout=300, trust_env=False)
        try:
            for name in systems:  # all start together: their start-up overlaps
                launch = LAUNCHERS[name]
                if name == "nixl":
                    launch = functools.partial(launch, busy_poll=args.nixl_busy_poll == "on")
                pairs[name] = launch(model_dir, logs, max_len, args.executor)
            wait_healthy([s for p in pairs.values() for s in (p.prefill, p.decode)], timeout=600)
            with frozen_heap():
                for name, pair in pairs.items():  # each fresh pair's first request, then a second to warm it
                    first[LABELS[name]] = _request(http, pair, model, random_prompt(40, 0))
                    _request(http, pair, model, random_prompt(40, 1))
                task = progress.add_task("rounds", total=len(gaps) * len(lengths) * reps)
                rnd = 0
                for gap in gaps:
                    for n in lengths:
                        for i in range(reps):
                            time.sleep(gap)
                            order = systems[rnd % len(systems) :] + systems[: rnd % len(systems)]
                            rnd += 1
                            text = random_prompt(n, seed=n * 1000 + i)
                            for name in order:
                                samples.setdefault((gap, n, name), []).append(_request(http, pairs[name], model, text))
                            progress.advance(task)
            stalls = {
                LABELS[name]: sum(s.log_path.read_text(errors="replace").count(STALL) for s in (p.prefill, p.decode))
                for name, p in pairs.items()
            }
        finally:
            http.close()
            for p in pairs.values():
                p.prefill.stop()
                p.decode.stop()
    rows = []
    for gap in gaps:
        for n in lengths:
            ref = statistics.median(s["decode_ttft_ms"] for s in samples[(gap, n, REFERENCE)])
            for name in systems:
                row = _summary(name, gap, n, samples[(gap, n, name)])
                row["vs_nixl_p50_ms"] = round(row["decode_ttft_p50_ms"] - ref, 2)
                rows.append(row)
    report = {
        "engine": "vllm",
        "mode": "idle",
        "model": args.model_dir or "tiny random Llama (2 layers, 2 KV heads x 64)",
        "executor": args.executor,
        "nixl_busy_poll": args.nixl_busy_poll,
        "gaps_s": gaps,
        "requests": reps,
        "reference": LABELS[REFERENCE],
        "first_request": {
            k: {"decode_ttft_ms": round(v["decode_ttft_ms"], 2), "stall_lines": stalls[k]} for k, v in first.items()
        },
        "load_average": list(os.getloadavg()),
        "rows": rows,
    }
    if args.json:
        print_json(report)
    else:
        print_report(report)
    return 0


def print_report(report: dict[str, Any]) -> None:
    """The human-readable tables."""
    heads = {"offer_wait_ms": "offer wait", "control_ms": "control", "pull_transfer_ms": "transfer"}
    heads |= {"decode_step_ms": "decode step", "prefill_compute_ms": "prefill compute"}
    print_table(
        f"Decode TTFT after idle (NIXL busy poll {report['nixl_busy_poll']}), ms: median / p90 of "
        f"{report['requests']} per gap and length; vs NixlConnector: "
        "difference of medians; phases: KVBridgeConnector's own report, medians",
        ["gap s", "tokens", "system", "decode TTFT", "vs NixlConnector", *heads.values()],
        [
            [
                r["gap_s"],
                r["prompt_tokens"],
                r["system"],
                f"{r['decode_ttft_p50_ms']} / {r['decode_ttft_p90_ms']}",
                "" if r["system"] == report["reference"] else f"{r['vs_nixl_p50_ms']:+.2f}",
                *(r.get("phases_p50_ms", {}).get(k, "") for k in heads),
            ]
            for r in report["rows"]
        ],
    )
    print_table(
        "Each fresh pair's first request (40 tokens), ms; stall lines: 'status frame' in its servers' logs "
        "over the run",
        ["system", "decode TTFT", "stall lines"],
        [[k, v["decode_ttft_ms"], v["stall_lines"]] for k, v in report["first_request"].items()],
    )
