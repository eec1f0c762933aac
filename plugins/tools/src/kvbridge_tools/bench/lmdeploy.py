"""`kvbridge bench --engine lmdeploy`: kvbridge's LMDeploy backend against LMDeploy 0.18's strategy.

A prefill and a decode process (`kvbridge_tools.bench.lmdeploy_rank`) hold LMDeploy-layout pools
(one uint8 tensor (layers, blocks, bytes), different block counts). The decode side migrates
the same requests three ways over Mooncake TCP on 127.0.0.1, verifying every byte each time:

- kvbridge, sync and async: `p2p_migrate` of kvbridge's backend, resolved as LMDeploy resolves
  `--migration-backend Mooncake` (through `MIGRATION_BACKENDS`);
- per-instruct: one synchronous `transfer_sync_read` per (layer, block) instruct on a raw TCP
  TransferEngine, as lmdeploy 0.18's MooncakeBackend does (which itself only runs over RDMA).
"""

from __future__ import annotations

import argparse
import logging
import statistics
from typing import Any

import numpy as np

from kvbridge.base.errors import ConfigError
from kvbridge.plan.presets import get_preset
from kvbridge_tools.harness.proc import Child

log = logging.getLogger(__name__)

RANK = "kvbridge_tools.bench.lmdeploy_rank"
PATTERNS = ("contiguous", "scattered")


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--lmdeploy-pattern",
        choices=(*PATTERNS, "both"),
        default="both",
        help="block placement: contiguous runs per request, scattered blocks, or both (default)",
    )


def block_pairs(pattern: str, blocks: int, requests: int, seed: int = 0) -> tuple[list[list[int]], int, int]:
    """(prefill block, decode block) pairs for `requests` requests of `blocks` blocks, and both pool sizes."""
    n = blocks * requests
    p_total, d_total = n + requests + max(8, n // 8), n + max(16, n // 4)  # different capacities on each side
    if pattern == "contiguous":
        # Each request holds one run of blocks on each side, at different places; a free block
        # between requests on the prefill side keeps requests from merging into one run.
        prefill = np.concatenate([np.arange(blocks) + r * (blocks + 1) for r in range(requests)])
        decode = np.concatenate([np.arange(blocks) + r * blocks + (d_total - n) // 2 for r in range(requests)])
    else:
        rng = np.random.default_rng(seed)
        prefill = rng.permutation(p_total)[:n]
        decode = rng.permutation(d_total)[:n]
    return np.stack([prefill, decode], axis=1).tolist(), p_total, d_total


def _handshake(prefill: Child, decode: Child, p_total: int, d_total: int, block_size: int) -> None:
    p_ep = prefill.call(
        "initialize", remote_engine_id="decode", remote_blocks=d_total, block_size=block_size, protocol="TCP"
    )
    d_ep = decode.call(
        "initialize", remote_engine_id="prefill", remote_blocks=p_total, block_size=block_size, protocol="TCP"
    )
    decode.call("connect", remote_engine_id="prefill", endpoint=p_ep)
    prefill.call("connect", remote_engine_id="decode", endpoint=d_ep)
    decode.call("raw_connect", **prefill.call("raw_setup"))
    decode.call("raw_setup")


def _measure(prefill: Child, decode: Child, pattern: str, args: argparse.Namespace, spec: Any) -> list[dict[str, Any]]:
    blocks = -(-args.tokens // spec.block_size)
    pairs, p_total, d_total = block_pairs(pattern, blocks, args.requests)
    block_bytes = spec.kv_tensors * spec.block_size * spec.kv_heads * spec.head_dim * spec.dtype_bytes
    for child, name, total, fill in ((prefill, "prefill", p_total, True), (decode, "decode", d_total, False)):
        child.call(
            "setup",
            engine_id=name,
            layers=spec.layers,
            blocks=total,
            block_bytes=block_bytes,
            fill=fill,
            backend="Mooncake",
        )
    _handshake(prefill, decode, p_total, d_total, spec.block_size)
    rows = []
    runs = {
        "kvbridge (sync)": lambda: decode.call(
            "migrate", remote_engine_id="prefill", pairs=pairs, async_op=False, ticker=False
        ),
        "kvbridge (async)": lambda: decode.call(
            "migrate", remote_engine_id="prefill", pairs=pairs, async_op=True, ticker=False
        ),
        "per-instruct (lmdeploy 0.18)": lambda: decode.call(
            "raw_migrate", remote_engine_id="prefill", pairs=pairs, timeout=600
        ),
    }
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    last: dict[str, dict[str, Any]] = {}
    verified = dict.fromkeys(runs, True)
    # Round-robin over strategies, so load from elsewhere on the machine hits all of them alike.
    for _ in range(args.repeat):
        for strategy, run in runs.items():
            decode.call("reset")
            last[strategy] = run()
            check = decode.call("verify", pairs=pairs)
            if check["wrong_blocks"] or check["stray_blocks"]:
                log.error("%s on %s blocks delivered wrong data: %s", strategy, pattern, check)
                verified[strategy] = False
            seconds[strategy].append(last[strategy]["seconds"])
    for strategy, result in last.items():
        nbytes, median = result["bytes"], statistics.median(seconds[strategy])
        rows.append(
            {
                "pattern": pattern,
                "strategy": strategy,
                "instructs": result["instructs"],
                "descriptors": result.get("descriptors") or result["instructs"],
                "bytes": nbytes,
                "seconds_median": median,
                "gbps_median": nbytes / median / 1e9,
                "gbps_best": nbytes / min(seconds[strategy]) / 1e9,
                "verified": verified[strategy],
            }
        )
    base = rows[-1]["gbps_median"]
    for row in rows:
        row["speedup"] = row["gbps_median"] / base
    return rows


def run(args: argparse.Namespace) -> int:
    spec = get_preset(args.model or "small")
    args.tokens = args.tokens or 4096
    args.requests = args.requests or 4
    if args.repeat < 1:
        raise ConfigError("--repeat must be at least 1")
    if (args.protocol or "tcp") != "tcp":
        raise ConfigError(
            "the LMDeploy bench runs over TCP on 127.0.0.1 (the baseline is Mooncake TCP); "
            "drop --protocol or pass --protocol tcp"
        )
    env = {
        "KVBRIDGE_LMDEPLOY_TRANSPORT": args.migration_backend,
        "KVBRIDGE_LMDEPLOY_HOSTNAME": "127.0.0.1",
        "KVBRIDGE_LMDEPLOY": "1",
    }
    patterns = PATTERNS if args.lmdeploy_pattern == "both" else (args.lmdeploy_pattern,)
    rows: list[dict[str, Any]] = []
    for pattern in patterns:
        prefill = Child(RANK, env=env, name="lmdeploy-prefill")
        decode = Child(RANK, env=env, name="lmdeploy-decode")
        try:
            rows += _measure(prefill, decode, pattern, args, spec)
        finally:
            prefill.close()
            decode.close()
    _report(rows, args, spec)
    return 0 if all(r["verified"] for r in rows) else 1


def _report(rows: list[dict[str, Any]], args: argparse.Namespace, spec: Any) -> None:
    from kvbridge.cli.output import print_json, print_table

    if args.json:
        print_json(
            {
                "engine": "lmdeploy",
                "model": spec.name,
                "tokens": args.tokens,
                "requests": args.requests,
                "transport": args.migration_backend,
                "baseline_transport": "mooncake",
                "rows": rows,
            }
        )
        return
    print_table(
        f"LMDeploy migration, {spec.name}, {args.requests} x {args.tokens} tokens, "
        f"kvbridge on {args.migration_backend} vs per-instruct on Mooncake TCP (127.0.0.1), bytes verified",
        [
            "pattern",
            "strategy",
            "instructs",
            "descriptors",
            "MiB",
            "GB/s (median)",
            "GB/s (best)",
            "vs per-instruct",
            "verified",
        ],
        [
            [
                r["pattern"],
                r["strategy"],
                r["instructs"],
                r["descriptors"],
                f"{r['bytes'] / 2**20:.0f}",
                f"{r['gbps_median']:.2f}",
                f"{r['gbps_best']:.2f}",
                f"{r['speedup']:.1f}x",
                "yes" if r["verified"] else "NO",
            ]
            for r in rows
        ],
    )
