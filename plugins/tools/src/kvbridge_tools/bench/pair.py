"""`kvbridge bench` pair mode: one prefill process, one decode process, one transport.

Each round measures the raw transport (one descriptor of a request's bytes, per request) and
then kvbridge's migration of every request, and verifies every byte on the decode side. The
migration is direct (one descriptor per block, merged where blocks are contiguous on both sides)
or gathered (prefill packs the blocks into a staging region, decode pulls it in chunks and
scatters), as the transport's declared cost model picks (`kvbridge_tools.strategy`) or `--strategy` says.
Both pools are laid out as one vLLM KV cache layout (`--layout`, `kvbridge_tools.bench.pool_layout`), which
decides how many descriptors a block costs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import statistics
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
from rich.progress import Progress

from kvbridge.adapters.vllm.cache import LAYOUT_NAMES
from kvbridge.base.errors import ConfigError, PluginUnavailable
from kvbridge.base.options import as_dict
from kvbridge.cli.numbers import seconds
from kvbridge.cli.output import err_console, print_json, print_table
from kvbridge.plan.presets import get_preset
from kvbridge.plugin.registry import get_device, registry
from kvbridge_tools.bench.bootstrap import central, resamples
from kvbridge_tools.bench.link import Link, Placed, placed, report
from kvbridge_tools.bench.pool_layout import DEFAULT_LAYOUT, describe
from kvbridge_tools.harness.proc import Child
from kvbridge_tools.strategy import GATHER_CHUNK_BYTES, STRATEGIES, Choice, TransferCost, choose

DEFAULT_MODEL = "small"
DEFAULT_TOKENS = 2048
DEFAULT_REQUESTS = 8


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--fragmented",
        action="store_true",
        help="shuffle block ids on both sides (worst case: no two blocks adjacent, so no run spans two blocks); "
        "pair mode and --engine vllm-connector",
    )
    group.add_argument(
        "--layout",
        choices=LAYOUT_NAMES,
        default=DEFAULT_LAYOUT,
        metavar="LAYOUT",
        help="vLLM KV cache layout of both pools (vllm.v1.kv_cache_layout.KVCacheLayout): "
        + "; ".join(describe(n) for n in LAYOUT_NAMES)
        + f". Default {DEFAULT_LAYOUT}: what KVBridgeConnector asks vLLM for on a CUDA deployment in pull mode "
        "(docs/vllm.md); vLLM's own default on CUDA is LBNHC",
    )
    group.add_argument(
        "--strategy",
        choices=["auto", *STRATEGIES],
        default="auto",
        help="how requests move: direct (the planned descriptors), gather (sending side gathers into a staging "
        "region, pipelined in chunks with the wire and the receiving side's scatter), or auto: the "
        "transport's declared cost model picks (kvbridge_tools.strategy); default auto",
    )
    group.add_argument("--device", default="cpu", help="device plugin that holds both KV caches (default: cpu)")
    group.add_argument(
        "--stage",
        action="store_true",
        help="copy through host memory even where the transport reaches the device's memory, to "
        "measure staging (it is automatic where the transport cannot, e.g. tcp for cuda)",
    )
    group.add_argument("--seed", type=int, default=0, help="seed for --fragmented block ids")
    group.add_argument("--timeout", type=seconds, default=120.0, help="seconds one request may take")
    group.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        type=_option,
        help="transport option passed to create_backend on both sides, repeatable; e.g. "
        "--option max_descriptor_bytes=4194304 (`kvbridge plugins NAME` lists them)",
    )


def _option(text: str) -> tuple[str, str]:
    """Split an option's KEY=VALUE, keeping the value as given (a string).

    The plugin's option schema converts the value to the type it declares (a secret of digits stays a string,
    `insecure=1` a bool).
    """
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    if key == "protocol":
        raise argparse.ArgumentTypeError("the protocol is --protocol's, not an option")
    if key in ("hostname", "metadata_server", "device_name"):
        raise argparse.ArgumentTypeError(f"the bench sets {key} itself; it is not a transport option")
    return key, value


def plan_blocks(
    requests: int, per_request: int, capacity: int, fragmented: bool, rng: np.random.Generator
) -> list[list[int]]:
    """Block ids of each request in a pool of `capacity` blocks: packed from 0, or shuffled."""
    order = rng.permutation(capacity) if fragmented else np.arange(capacity)
    return [order[r * per_request : (r + 1) * per_request].tolist() for r in range(requests)]


def descriptor_count(src: list[int], dst: list[int], units: int, unit_bytes: int, piece: int | None) -> int:
    """Descriptors the direct strategy sends for one request.

    They are runs of blocks consecutive on both sides, for each of a block's `units` runs of `unit_bytes` in the
    layout, cut into the transport's pieces.
    """
    s, d = np.asarray(src), np.asarray(dst)
    starts = np.flatnonzero(np.concatenate(([True], (np.diff(s) != 1) | (np.diff(d) != 1))))
    lengths = np.diff(np.append(starts, len(s))) * unit_bytes
    per = -(-lengths // piece) if piece else np.ones_like(lengths)
    return int(per.sum()) * units


def _check_backend(name: str, given: dict[str, str]) -> dict[str, Any]:
    """The transport's `given` options converted by its schema (refused before any process starts)."""
    entry = registry().backend_entry(name)
    parsed = as_dict(entry.parse_options(given))
    reason = entry.unavailable_reason()
    if reason:
        raise PluginUnavailable("backend", entry.name, reason, entry.install_hint)
    if entry.name == "loopback":
        raise ConfigError(
            "the loopback transport works inside one process only; the bench runs prefill and "
            "decode in two processes: pick tcp, mooncake or another cross-process transport"
        )
    return {k: parsed[k] for k in given}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    options = _check_backend(args.migration_backend, dict(args.option))
    get_device(args.device)  # an unavailable device (no GPU here) says why before any process starts
    spec = get_preset(args.model or DEFAULT_MODEL)
    tokens = args.tokens or DEFAULT_TOKENS
    requests = args.requests or DEFAULT_REQUESTS
    per_request = math.ceil(tokens / spec.block_size)
    prefill_blocks = requests * per_request
    decode_blocks = prefill_blocks + max(1, prefill_blocks // 4)  # asymmetric capacity, as in real pairs
    rng = np.random.default_rng(args.seed)
    src_plan = plan_blocks(requests, per_request, prefill_blocks, args.fragmented, rng)
    dst_plan = plan_blocks(requests, per_request, decode_blocks, args.fragmented, rng)
    common = dict(
        backend=args.migration_backend,
        protocol=args.protocol,
        device=args.device,
        model=spec.name,
        options=options,
        stage=args.stage,
        layout=args.layout,
    )
    request_bytes = per_request * spec.bytes_per_token() * spec.block_size

    link = getattr(args, "link", None) or Link()
    with contextlib.ExitStack() as stack:
        where = (
            stack.enter_context(placed(link, engine_cores=args.engine_cores)) if getattr(args, "hosts", False) else None
        )
        result = _measure(
            args, where, common, requests, request_bytes, prefill_blocks, decode_blocks, src_plan, dst_plan
        )
    if where is not None:
        result["hosts"] = report(link, where.address, result["kvbridge"]["gbps"], result["raw"]["gbps"])
    return result


def _measure(
    args: argparse.Namespace,
    where: Placed | None,
    common: dict[str, Any],
    requests: int,
    request_bytes: int,
    prefill_blocks: int,
    decode_blocks: int,
    src_plan: list[list[int]],
    dst_plan: list[list[int]],
) -> dict[str, Any]:
    spec = get_preset(common["model"])
    tokens = args.tokens or DEFAULT_TOKENS
    options = common["options"]

    def child(name: str) -> Child:
        if where is None:
            return Child("kvbridge_tools.bench.pair_rank", name=name)
        return Child("kvbridge_tools.bench.pair_rank", name=name, prefix=where.prefix[name], env=where.env)

    # Native transport logs: kept to warnings by the CLI (kvbridge.base.nativelog), routed by Child (harness.nativelog).
    prefill = child("prefill")
    decode = child("decode")
    try:
        host = {} if where is None else {"prefill": where.address["prefill"], "decode": where.address["decode"]}
        src = prefill.call("init", blocks=prefill_blocks, hostname=host.get("prefill"), **common)
        decode.call("init", blocks=decode_blocks, hostname=host.get("decode"), **common)
        if where is not None:
            prefill.call("admit", host=host["decode"])
            decode.call("admit", host=host["prefill"])
        prefill.call("fill", requests=src_plan, timeout=600)
        cost = TransferCost(**src["cost"])
        choice = choose(
            cost,
            descriptor_count(src_plan[0], dst_plan[0], src["units_per_block"], src["unit_bytes"], cost.piece_bytes),
            request_bytes,
            copy_bytes_per_s=src["copy_bytes_per_s"],
            # host copies run on the cores a TCP transport keeps busy (the raw read alone fills both here)
            copies_overlap=args.device != "cpu",
        )
        if args.strategy != "auto":
            choice = Choice(args.strategy, choice.direct_s, choice.gather_s, "chosen with --strategy")
        elif choice.strategy == "gather" and not src["can_gather"]:
            reason = "the bench gathers host memory the transport reaches directly only (a GPU's is a device kernel)"
            choice = Choice("direct", choice.direct_s, choice.gather_s, reason)
        staged: dict[str, Any] = {}
        if choice.strategy == "gather":
            staged = prefill.call("stage", nbytes=request_bytes)
            decode.call("stage", nbytes=request_bytes)
        decode.call("connect", endpoint=staged["endpoint"] if choice.strategy == "gather" else src["endpoint"])
        raw_s: list[float] = []
        kv_s: list[float] = []
        latencies: list[float] = []
        verified = True
        problems: list[str] = []
        descriptors = descriptors_in = runs = chunks_done = 0
        phases: dict[str, list[float]] = {}

        def raw_round() -> float:
            return sum(
                decode.call(
                    "raw",
                    src_base=src["base"],
                    nbytes=request_bytes,
                    wait_s=args.timeout,
                    timeout=args.timeout + 30,
                )["seconds"]
                for _ in range(requests)
            )

        with Progress(console=err_console, transient=True, disable=bool(getattr(args, "json", False))) as progress:
            task = progress.add_task("migrating", total=args.repeat * requests)
            for n in range(args.repeat):
                # Counterbalanced: odd rounds run kvbridge first, so whatever the first of a pair pays (a cold
                # cache, a neighbour's burst) falls on both sides of the ratio alike.
                raw_first = n % 2 == 0
                raw_time = raw_round() if raw_first else 0.0
                decode.call("zero", timeout=600)
                kv_round = 0.0
                for src_blocks, dst_blocks in zip(src_plan, dst_plan):
                    if choice.strategy == "gather":
                        r = _gathered(prefill, decode, staged["addr"], src_blocks, dst_blocks, chunks_done, args)
                        chunks_done += r["chunks"]
                        descriptors_in, runs = len(src_blocks) * src["units_per_block"], r["chunks"]
                    else:
                        r = decode.call(
                            "migrate",
                            src=src,
                            src_blocks=src_blocks,
                            dst_blocks=dst_blocks,
                            wait_s=args.timeout,
                            timeout=args.timeout + 30,
                        )
                        descriptors_in, runs = r["descriptors_in"], r["runs"]
                    descriptors = r["descriptors"]
                    kv_round += r["seconds"]
                    latencies.append(r["seconds"])
                    for phase in GATHER_PHASES if choice.strategy == "gather" else ():
                        phases.setdefault(phase, []).append(r[phase])
                    progress.advance(task)
                check = decode.call("verify", requests=dst_plan, timeout=600)
                verified &= check["verified"]
                problems += check["problems"]
                raw_s.append(raw_time if raw_first else raw_round())
                kv_s.append(kv_round)
        for side in (prefill, decode):
            side.call("close")
    finally:
        prefill.close()
        decode.close()

    total = request_bytes * requests
    kv_gbps = total / statistics.median(kv_s) / 1e9
    raw_gbps = total / statistics.median(raw_s) / 1e9
    lat_ms = sorted(s * 1e3 for s in latencies)
    return {
        "config": {
            "migration_backend": args.migration_backend,
            "protocol": args.protocol,
            "device": args.device,
            "stage": args.stage,
            "model": spec.name,
            "tokens": tokens,
            "requests": requests,
            "fragmented": args.fragmented,
            "layout": args.layout,
            "repeat": args.repeat,
            "bytes_per_request": request_bytes,
            "options": options,
            "strategy": choice.strategy,
        },
        "strategy": {
            "used": choice.strategy,
            "asked": args.strategy,
            "reason": choice.reason,
            "predicted_direct_ms": None if choice.direct_s is None else choice.direct_s * 1e3,
            "predicted_gather_ms": None if choice.gather_s is None else choice.gather_s * 1e3,
            # gather: median ms per request the prefill spent gathering (overlapped) and the decode spent
            # polling for ready chunks, waiting on the wire, and scattering
            "phases_ms": {k: statistics.median(v) * 1e3 for k, v in phases.items()},
        },
        "kvbridge": {
            "gbps": kv_gbps,
            "latency_ms": {
                "median": statistics.median(lat_ms),
                "p99": lat_ms[min(len(lat_ms) - 1, math.ceil(0.99 * len(lat_ms)) - 1)],
            },
            "descriptors_per_request": descriptors_in,  # the layout's runs: units_per_block x blocks
            "units_per_block": src["units_per_block"],
            "unit_bytes": src["unit_bytes"],
            "merged_runs_per_request": runs,
            "submitted_descriptors_per_request": descriptors,
        },
        "raw": {"gbps": raw_gbps, "descriptors_per_request": 1},
        **paired_ratio(raw_s, kv_s),
        "verified": bool(verified),
        "problems": problems[:10],
    }


GATHER_PHASES = ("gather", "poll", "wire_wait", "scatter")


def _gathered(
    prefill: Child, decode: Child, staged: int, src_blocks: list[int], dst_blocks: list[int], before: int, args: Any
) -> dict[str, Any]:
    """One request by the gather strategy: prefill gathers while decode pulls and scatters, concurrently.

    Timed from whichever side started first to the last scatter (one monotonic clock for both processes),
    so the gather's first chunk is inside the time as it is inside a real handover's.
    """
    out: dict[str, Any] = {}
    side = threading.Thread(
        target=lambda: out.update(
            prefill.call("gather", blocks=src_blocks, chunk_bytes=GATHER_CHUNK_BYTES, timeout=args.timeout + 30)
        )
    )
    side.start()
    try:
        r = decode.call(
            "migrate_gathered",
            src_addr=staged,
            dst_blocks=dst_blocks,
            chunk_bytes=GATHER_CHUNK_BYTES,
            ready_before=before,
            wait_s=args.timeout,
            timeout=args.timeout + 30,
        )
    finally:
        side.join()
    if "start" not in out:
        raise ConfigError("the prefill side's gather failed; see its log above")
    return {**r, "gather": out["gather"], "seconds": r["end"] - min(r["start"], out["start"])}


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Collect once, then keep every live object out of the collector's way (`gc.freeze`) until the block ends.

    A bench process that built its model holds torch and transformers: a full collection then takes hundreds of ms,
    and one landing inside a timed request adds that much to its time (docs/measurements/vllm.md). Unfrozen after:
    objects still frozen at exit are never freed, and triton's bindings then print hundreds of "nanobind: leaked" lines.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def paired_ratio(raw_s: list[float], kv_s: list[float]) -> dict[str, Any]:
    """kvbridge's speed as a fraction of raw: the median and range over rounds of raw time / kvbridge time.

    Paired by round: each round's raw and kvbridge times are taken back to back, in alternating order,
    so the machine's drift between rounds (large on a shared VM) cancels out of the ratio.
    """
    ratios = [r / k for r, k in zip(raw_s, kv_s)]
    return {
        "ratio": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
        "ratio_ci90": median_interval(ratios),
    }


def median_interval(samples: list[float], confidence: float = 0.9, rounds: int = 4000) -> list[float]:
    """A bootstrap interval of the median of `samples` (percentile method, fixed seed: same samples, same interval).

    With few samples on a noisy host it says when a median cannot tell two sides apart: an interval that holds 1.0 is
    a tie at this noise, whichever side of 1.0 the median fell.
    """
    x = np.asarray(samples, dtype=np.float64)
    if len(x) < 2:
        return [float(x[0]), float(x[0])] if len(x) else [math.nan, math.nan]
    return list(central(np.median(x[resamples(len(x), rounds)], axis=1), confidence))


def ratio_cell(result: dict[str, Any]) -> str:
    """A `paired_ratio` as a table cell: the median and the per-round range, e.g. "92% (81%-113%)"."""
    low, high = result["ratio_range"]
    return f"{result['ratio']:.0%} ({low:.0%}-{high:.0%})"


def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One measurement per --sweep-tokens length (or the one --tokens run)."""
    lengths = getattr(args, "sweep_tokens", None) or [args.tokens]
    return [measure(argparse.Namespace(**{**vars(args), "tokens": n})) for n in lengths]


def plot(path: str, results: list[dict[str, Any]]) -> None:
    """GB/s against request size, raw and kvbridge, for the run's transport."""
    from kvbridge_tools.bench.plot import write_chart

    c = results[0]["config"]
    name = c["migration_backend"]
    series = {
        f"raw {name}": [(r["config"]["tokens"], r["raw"]["gbps"]) for r in results],
        f"kvbridge {name}": [(r["config"]["tokens"], r["kvbridge"]["gbps"]) for r in results],
    }
    write_chart(
        path,
        f"kvbridge bench: {c['model']}, {c['requests']} requests, "
        f"{'fragmented' if c['fragmented'] else 'contiguous'} blocks",
        "prompt tokens per request",
        "GB/s",
        series,
    )


def run(args: argparse.Namespace) -> int:
    if getattr(args, "plot", None):
        from kvbridge_tools.bench.plot import check_path

        check_path(args.plot)
    results = sweep(args)
    if getattr(args, "plot", None):
        plot(args.plot, results)
    if args.json:
        print_json(results[0] if len(results) == 1 else results)
    else:
        for result in results:
            _print_result(result)
    return 0 if all(r["verified"] for r in results) else 1


def _print_result(result: dict[str, Any]) -> None:
    c, k, r = result["config"], result["kvbridge"], result["raw"]
    print_table(
        f"kvbridge bench: {c['migration_backend']} {c['model']} {c['tokens']} tokens x {c['requests']} requests "
        f"({'fragmented' if c['fragmented'] else 'contiguous'} blocks, {c['bytes_per_request'] / 2**20:.1f} MiB "
        f"per request, layout {c['layout']}: {k['units_per_block']} x {k['unit_bytes'] / 2**10:.0f} KiB per block)",
        ["path", "GB/s", "of raw (per-round range)", "median ms", "p99 ms", "descriptors per request"],
        [
            ("raw transport (1 descriptor)", f"{r['gbps']:.2f}", "100%", "", "", "1"),
            (
                f"kvbridge migration ({result['strategy']['used']})",
                f"{k['gbps']:.2f}",
                ratio_cell(result),
                f"{k['latency_ms']['median']:.1f}",
                f"{k['latency_ms']['p99']:.1f}",
                f"{k['descriptors_per_request']} x {k['unit_bytes'] / 2**10:.0f} KiB -> {k['merged_runs_per_request']} "
                f"{'chunks' if result['strategy']['used'] == 'gather' else 'runs'} -> "
                f"{k['submitted_descriptors_per_request']} sent",
            ),
        ],
    )
    st = result["strategy"]
    predicted = ", ".join(
        f"{name} {st[f'predicted_{name}_ms']:.0f} ms" for name in STRATEGIES if st[f"predicted_{name}_ms"] is not None
    )
    print(f"strategy: {st['used']} ({st['reason']}{'; predicted ' + predicted if predicted else ''})")
    if st["phases_ms"]:
        print("gather phases, median ms per request: " + ", ".join(f"{k} {v:.0f}" for k, v in st["phases_ms"].items()))
    if "hosts" in result:
        h = result["hosts"]
        shares = (
            f"; share of the link: kvbridge {h['kvbridge_share_of_link']:.0%}, raw {h['raw_share_of_link']:.0%}"
            if h["link"]["rate_bits"]
            else ""
        )
        print(f"hosts: prefill {h['prefill']}, decode {h['decode']}, link {h['link']['described']}{shares}")
    status = (
        "verified: every byte on the decode side is correct"
        if result["verified"]
        else ("VERIFICATION FAILED: " + "; ".join(result["problems"]))
    )
    print(status)
