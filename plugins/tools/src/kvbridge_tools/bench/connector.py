"""`kvbridge bench --engine vllm-connector`: KVBridgeConnector itself between two engines' ranks, any layouts.

One child process per rank on each side (`kvbridge_tools.bench.connector_rank`). Each allocates its KV
cache as vLLM 0.32 does for its `KVCacheLayout` (or vllm-ascend's `(K, V)` tuples), registers it with
a real `KVBridgeConnector`, and is driven through vLLM's connector API in the engine's order. Prefill
blocks hold fingerprints of (request, layer, head, token, byte); `--verify` checks that every decode
token's K and V equal prefill's, whatever both layouts, block sizes and TP are (exit 1 otherwise).
`--json` reports GB/s, descriptors per request and the verdict.

Each case runs a warm-up round (connections, landing buffers; verified, not timed), then `--repeat`
measured rounds of fresh requests. A round times the raw transport first (each decode rank reads
the same bytes as its pulls, one descriptor per request, from a prefill rank of its stage) and then
the connector (from `start_load_kv` to `get_finished` reporting every request); the ratio is the
median over rounds of raw time / connector time (`kvbridge_tools.bench.pair.paired_ratio`).
Pipeline parallelism is written into the parallel spec (``tp2,pp2``): every stage pulls its layers
from the same stage of prefill, and both sides need the same PP size.

`ConnectorBench` keeps its rank processes across cases, so a list of layout pairs costs one vLLM
import per rank (the CI test runs all 36 pairs that way).
"""

from __future__ import annotations

import argparse
import itertools
import re
import statistics
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvbridge.adapters.vllm.cache import FP8_CACHE_DTYPES, LAYOUT_NAMES
from kvbridge.base.errors import ConfigError
from kvbridge.cli.numbers import whole
from kvbridge.cli.output import print_json, print_table
from kvbridge.plan.presets import get_preset
from kvbridge.plan.topology import ParallelConfig
from kvbridge.plugin.registry import get_device
from kvbridge_tools.bench.pair import paired_ratio, plan_blocks, ratio_cell
from kvbridge_tools.harness.ports import free_port
from kvbridge_tools.harness.proc import Child

DEFAULT_TOKENS = 1000
CLOSE_TIMEOUT = 60.0


def parse_spec(spec: str) -> tuple[ParallelConfig, int]:
    """A side's parallel spec with an optional pipeline size (``tp2,pp2``): its ParallelConfig and PP size."""
    pp = 1
    m = re.search(r"(?:^|[,/\s])pp=?(\d+)", spec.lower())
    if m:
        pp = int(m.group(1))
        spec = (spec[: m.start()] + spec[m.end() :]).strip(",/ ") or "tp1"
    if pp < 1:
        raise ConfigError(f"pipeline parallel size must be positive in {spec!r}")
    return ParallelConfig.parse(spec), pp


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """Options of `--engine vllm-connector` (--prefill, --decode, --verify are the parallel mode's)."""
    group.add_argument(
        "--prefill-layout",
        default="LBNHC",
        choices=(*LAYOUT_NAMES, "all"),
        help="vLLM KVCacheLayout of the prefill ranks' caches, or ascend-kv-tuple; all: each in turn (default LBNHC)",
    )
    group.add_argument(
        "--decode-layout",
        default="LBNHC",
        choices=(*LAYOUT_NAMES, "all"),
        help="vLLM KVCacheLayout of the decode ranks' caches; all: each vLLM layout in turn (default LBNHC)",
    )
    group.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", *FP8_CACHE_DTYPES),
        help="vLLM's kv_cache_dtype on both sides (fp8 ones: one byte per element; default: the model's dtype)",
    )
    group.add_argument(
        "--prefill-block-size",
        type=whole(),
        default=None,
        metavar="N",
        help="prefill tokens per block (default: the preset's)",
    )
    group.add_argument(
        "--decode-block-size",
        type=whole(),
        default=None,
        metavar="M",
        help="decode tokens per block (default: the preset's)",
    )


def block_ids(
    requests: int, n_p: int, n_d: int, *, fragmented: bool = False, seed: int = 0
) -> tuple[list[list[int]], list[list[int]]]:
    """Each request's prefill and decode block ids (`n_p`, `n_d` of them), prefill's from 1 and decode's from 2.

    Fragmented: both pools shuffled, as an engine's blocks are after a while (about a descriptor a block). Else
    prefill's in order and decode's reversed in pairs, so runs and gaps both occur."""
    if fragmented:
        rng = np.random.default_rng(seed)
        return (
            [[1 + b for b in ids] for ids in plan_blocks(requests, n_p, requests * n_p, True, rng)],
            [[2 + b for b in ids] for ids in plan_blocks(requests, n_d, requests * n_d, True, rng)],
        )
    p_blocks = [list(range(1 + i * n_p, 1 + (i + 1) * n_p)) for i in range(requests)]
    d_blocks = []
    for i in range(requests):
        ids = list(range(2 + i * n_d, 2 + (i + 1) * n_d))
        d_blocks.append([b for k in range(0, len(ids), 2) for b in ids[k : k + 2][::-1]][::-1])
    return p_blocks, d_blocks


class ConnectorBench:
    """Rank processes for a prefill and a decode engine, reused across cases while they fit."""

    def __init__(self) -> None:
        self.children: dict[tuple[str, int], Child] = {}

    def _child(self, side: str, rank: int) -> Child:
        key = (side, rank)
        if key not in self.children:
            self.children[key] = Child("kvbridge_tools.bench.connector_rank", name=f"bench-{side}-{rank}")
        return self.children[key]

    def run(
        self,
        *,
        prefill: str = "tp1",
        decode: str = "tp1",
        model: str = "tiny-gqa",
        prefill_layout: str = "LBNHC",
        decode_layout: str = "LBNHC",
        prefill_block_size: int | None = None,
        decode_block_size: int | None = None,
        tokens: int = DEFAULT_TOKENS,
        requests: int = 2,
        repeat: int = 1,
        backend: str = "mooncake",
        protocol: str | None = None,
        device: str = "cpu",
        kv_cache_dtype: str = "auto",
        verify: bool = True,
        timeout: float = 300.0,
        fragmented: bool = False,
        seed: int = 0,
    ) -> dict[str, Any]:
        (p, p_pp), (d, d_pp) = parse_spec(prefill), parse_spec(decode)
        if p.cp > 1 or d.cp > 1 or p.dp > 1:
            raise ConfigError(
                "the connector bench runs TP, PP and decode DP; PCP/DCP and prefill DP are the parallel "
                "bench's (kvbridge bench --prefill ... --decode ...)"
            )
        if repeat < 1 or requests < 1 or tokens < 1:
            raise ConfigError("--repeat, --requests and --tokens must be positive")
        get_device(device)  # an unavailable device (no GPU here) says why before any process starts
        spec = get_preset(model)
        pbs, dbs = prefill_block_size or spec.block_size, decode_block_size or spec.block_size
        n_p, n_d = -(-tokens // pbs), -(-tokens // dbs)
        p_blocks, d_blocks = block_ids(requests, n_p, n_d, fragmented=fragmented, seed=seed)
        # a decode rank reads at most every head of its stage's layers for a request: the raw buffers' size
        dtype_bytes = 1 if kv_cache_dtype in FP8_CACHE_DTYPES else spec.dtype_bytes
        stage_layers = spec.layers // p_pp
        request_bytes = n_p * pbs * stage_layers * spec.kv_tensors * spec.kv_heads * spec.head_dim * dtype_bytes
        common = dict(model=model, backend=backend, protocol=protocol, device=device, cache_dtype=kv_cache_dtype)
        p_port, d_port = free_port(span=p.world_size * p_pp), free_port(span=d.world_size * d_pp)
        # (side, parallel, pp, layout, block size, blocks, port, raw bytes); rank processes by (stage, rank)
        sides = [
            ("prefill", p, p_pp, prefill_layout, pbs, 1 + requests * n_p + 2, p_port, request_bytes),
            ("decode", d, d_pp, decode_layout, dbs, 2 + requests * n_d + 3, d_port, requests * request_bytes),
        ]
        ranks = {side: [(s, r) for s in range(pp) for r in range(cfg.world_size)] for side, cfg, pp, *_ in sides}
        slots = {("prefill", k): i for i, k in enumerate(ranks["prefill"])}
        slots |= {("decode", k): len(slots) + i for i, k in enumerate(ranks["decode"])}

        def child(side: str, key: tuple[int, int]) -> Child:
            return self._child(side, key[0] * 1000 + key[1])

        raw_s: list[float] = []
        kv_s: list[float] = []
        nbytes = 0
        descriptors: list[int] = []
        thread_s: Counter[str] = Counter()  # CPU seconds of kvbridge's decode-side threads by kind, measured rounds
        bad: dict[str, Any] = {}
        failed: dict[str, Any] = {}
        not_released: set[str] = set()
        with ThreadPoolExecutor(len(ranks["prefill"]) + len(ranks["decode"])) as pool:
            setups = {
                (side, key): pool.submit(
                    child(side, key).call,
                    "setup",
                    timeout=timeout,
                    side=side,
                    engine_id=side,
                    layout=layout,
                    tp=cfg.tp,
                    dp=cfg.dp,
                    rank=key[1],
                    pp=pp,
                    pp_rank=key[0],
                    block_size=bs,
                    num_blocks=nb,
                    port=port,
                    device_slot=slots[(side, key)],
                    raw_bytes=raw,
                    **common,
                )
                for side, cfg, pp, layout, bs, nb, port, raw in sides
                for key in ranks[side]
            }
            info = {k: f.result() for k, f in setups.items()}
            sizes: dict[tuple[int, int], list[int]] = {}
            for round_ in range(1 + repeat):  # round 0 warms up (connections, landing buffers); not timed
                reqs = [
                    {"id": f"req-{round_}-{i}", "index": round_ * requests + i, "tokens": tokens, "decode_dp": i % d.dp}
                    for i in range(requests)
                ]
                filled = [
                    pool.submit(
                        child("prefill", key).call,
                        "prefill",
                        timeout=timeout,
                        requests=[r | {"blocks": p_blocks[i]} for i, r in enumerate(reqs)],
                    )
                    for key in ranks["prefill"]
                ]
                params = [f.result() for f in filled][0]  # every rank's scheduler derives the same params
                mine = {
                    key: [i for i, r in enumerate(reqs) if r["decode_dp"] == d.coords(key[1]).dp]
                    for key in ranks["decode"]
                }
                if round_:
                    raws = [
                        pool.submit(
                            child("decode", key).call,
                            "raw",
                            timeout=timeout,
                            sources=[
                                {
                                    "bytes": n,
                                    "endpoint": info[("prefill", src)]["endpoint"],
                                    "raw_addr": info[("prefill", src)]["raw_addr"],
                                }
                                for n in sizes[key]
                            ],
                        )
                        for key in ranks["decode"]
                        for src in [(key[0], d.coords(key[1]).tp % p.tp)]
                        if sizes[key]
                    ]
                    if raws:  # none where no pull succeeded (a failed case still reports its verdict)
                        raw_s.append(max(f.result()["seconds"] for f in raws))
                pulls = {
                    key: pool.submit(
                        child("decode", key).call,
                        "decode",
                        timeout=timeout,
                        verify=verify,
                        requests=[
                            reqs[i] | {"blocks": d_blocks[i], "params": params[reqs[i]["id"]]} for i in mine[key]
                        ],
                    )
                    for key in ranks["decode"]
                }
                pulled = {key: f.result() for key, f in pulls.items()}
                ids = [r["id"] for r in reqs]
                unsent = [
                    pool.submit(child("prefill", key).call, "sent", timeout=timeout, ids=ids)
                    for key in ranks["prefill"]
                ]
                not_released |= {i for f in unsent for i in f.result()}
                for key, x in pulled.items():
                    name = f"decode stage {key[0]} rank {key[1]}" if d_pp > 1 else f"decode rank {key[1]}"
                    if x["bad"]:
                        bad.setdefault(name, {}).update(x["bad"])
                    if x["missing"] or x["load_errors"]:
                        failed.setdefault(name, []).extend(x["missing"] + x["load_errors"])
                if round_ == 0:
                    sizes = {key: x["sizes"] for key, x in pulled.items()}
                    continue
                nbytes = sum(x["bytes"] for x in pulled.values())
                kv_s.append(max(x["seconds"] for x in pulled.values()))
                descriptors += [n for x in pulled.values() for n in x["descriptors"]]
                for x in pulled.values():
                    thread_s.update(x["thread_cpu_s"])
            for side, *_ in sides:
                for key in ranks[side]:
                    child(side, key).call("close", timeout=timeout)
        ok = not bad and not failed and not not_released
        measured = bool(nbytes and raw_s and len(raw_s) == len(kv_s))
        kv_med = statistics.median(kv_s)
        raw_med = statistics.median(raw_s) if measured else 0.0
        return {
            "prefill": f"{p},pp{p_pp}" if p_pp > 1 else str(p),
            "decode": f"{d},pp{d_pp}" if d_pp > 1 else str(d),
            "model": model,
            "kv_cache_dtype": kv_cache_dtype,
            "device": device,
            "prefill_layout": prefill_layout,
            "decode_layout": decode_layout,
            "prefill_block_size": pbs,
            "decode_block_size": dbs,
            "tokens": tokens,
            "fragmented": fragmented,
            "requests": requests,
            "repeat": repeat,
            "bytes": nbytes,  # one round, every decode rank
            "seconds": kv_med,
            "gbps": nbytes / kv_med / 1e9,
            "raw": {
                "gbps": nbytes / raw_med / 1e9 if measured else 0.0,
                "seconds": raw_med,
                "descriptors_per_request": 1,
            },
            **(paired_ratio(raw_s, kv_s) if measured else {"ratio": 0.0, "ratio_range": [0.0, 0.0]}),
            # per request and decode rank; the bound: 2 x layers (of a stage) x prefill blocks of the request
            "descriptors_per_request": max(descriptors, default=0),
            "descriptor_bound": 2 * stage_layers * n_p,
            # CPU of kvbridge's own threads on the decode ranks per pull (one request on one rank), by thread kind
            "decode_thread_cpu_ms_per_pull": {
                kind: round(sec * 1e3 / max(len(descriptors), 1), 3) for kind, sec in sorted(thread_s.items())
            },
            "verified": ok if verify else None,
            "bad": bad,
            "failed": failed,
            "not_released": sorted(not_released),
        }

    def close(self) -> None:
        with ThreadPoolExecutor(max(1, len(self.children))) as pool:
            list(pool.map(lambda c: c.close(timeout=CLOSE_TIMEOUT), self.children.values()))
        self.children = {}

    def __enter__(self) -> ConnectorBench:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run(args: argparse.Namespace) -> int:
    vllm_layouts = [n for n in LAYOUT_NAMES if n != "ascend-kv-tuple"]
    prefill_layouts = LAYOUT_NAMES if args.prefill_layout == "all" else (args.prefill_layout,)
    decode_layouts = vllm_layouts if args.decode_layout == "all" else (args.decode_layout,)
    results = []
    with ConnectorBench() as bench:  # one set of rank processes for every pair
        for p_layout, d_layout in itertools.product(prefill_layouts, decode_layouts):
            results.append(
                bench.run(
                    prefill=args.prefill or "tp1",
                    decode=args.decode or "tp1",
                    model=args.model or "tiny-gqa",
                    prefill_layout=p_layout,
                    decode_layout=d_layout,
                    prefill_block_size=args.prefill_block_size,
                    decode_block_size=args.decode_block_size,
                    tokens=args.tokens or DEFAULT_TOKENS,
                    requests=args.requests or 2,
                    repeat=args.repeat,
                    backend=args.migration_backend,
                    protocol=args.protocol,
                    fragmented=args.fragmented,
                    seed=args.seed,
                    device=getattr(args, "device", "cpu"),
                    kv_cache_dtype=args.kv_cache_dtype,
                    verify=args.verify,
                )
            )
    if args.json:
        print_json(results[0] if len(results) == 1 else results)
    else:
        r = results[0]
        print_table(
            f"kvbridge bench --engine vllm-connector: {r['prefill']} (block {r['prefill_block_size']}) -> "
            f"{r['decode']} (block {r['decode_block_size']}), {r['model']} (kv {r['kv_cache_dtype']}, "
            f"{r['device']}), {r['tokens']} tokens x {r['requests']} requests"
            f"{' (fragmented blocks)' if r['fragmented'] else ''}, {r['bytes'] / 2**20:.2f} MiB "
            f"per round, median of {r['repeat']} rounds",
            [
                "prefill -> decode layout",
                "raw GB/s",
                "GB/s",
                "of raw (per-round range)",
                "descriptors/request",
                "bound 2 x layers x blocks",
                "kvbridge CPU ms/pull (decode)",
                "verified",
            ],
            [
                (
                    f"{r['prefill_layout']} -> {r['decode_layout']}",
                    f"{r['raw']['gbps']:.3f}",
                    f"{r['gbps']:.3f}",
                    ratio_cell(r),
                    r["descriptors_per_request"],
                    r["descriptor_bound"],
                    f"{sum(r['decode_thread_cpu_ms_per_pull'].values()):.2f}",
                    {None: "not checked", True: "yes", False: "NO"}[r["verified"]],
                )
                for r in results
            ],
        )
    return 1 if any(r["verified"] is False for r in results) else 0
