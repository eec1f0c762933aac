"""`kvbridge bench --engine vllm-connector`: KVBridgeConnector itself between two engines' ranks, any layouts.

One child process per rank on each side (`kvbridge.bench.connector_rank`). Each allocates its KV
cache as vLLM 0.32 does for its `KVCacheLayout` (or vllm-ascend's `(K, V)` tuples), registers it with
a real `KVBridgeConnector`, and is driven through vLLM's connector API in the engine's order. Prefill
blocks hold fingerprints of (request, layer, head, token, byte); `--verify` checks that every decode
token's K and V equal prefill's, whatever both layouts, block sizes and TP are (exit 1 otherwise).
`--json` reports GB/s, descriptors per request and the verdict.

`ConnectorBench` keeps its rank processes across cases, so a list of layout pairs costs one vLLM
import per rank (the CI test runs all 36 pairs that way).
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvbridge.adapters.vllm.cache import LAYOUT_NAMES
from kvbridge.cli.output import print_json, print_table
from kvbridge.errors import ConfigError
from kvbridge.presets import get_preset
from kvbridge.proc import Child
from kvbridge.testing.ports import free_port
from kvbridge.topology import ParallelConfig

DEFAULT_TOKENS = 1000
CLOSE_TIMEOUT = 60.0


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """Options of `--engine vllm-connector` (--prefill, --decode, --verify are the parallel mode's)."""
    group.add_argument(
        "--prefill-layout",
        default="LBNHC",
        choices=LAYOUT_NAMES,
        help="vLLM KVCacheLayout of the prefill ranks' caches, or ascend-kv-tuple (default LBNHC)",
    )
    group.add_argument(
        "--decode-layout",
        default="LBNHC",
        choices=LAYOUT_NAMES,
        help="vLLM KVCacheLayout of the decode ranks' caches (default LBNHC)",
    )
    group.add_argument(
        "--prefill-block-size",
        type=int,
        default=None,
        metavar="N",
        help="prefill tokens per block (default: the preset's)",
    )
    group.add_argument(
        "--decode-block-size",
        type=int,
        default=None,
        metavar="M",
        help="decode tokens per block (default: the preset's)",
    )


class ConnectorBench:
    """Rank processes for a prefill and a decode engine, reused across cases while they fit."""

    def __init__(self) -> None:
        self.children: dict[tuple[str, int], Child] = {}

    def _child(self, side: str, rank: int) -> Child:
        key = (side, rank)
        if key not in self.children:
            self.children[key] = Child("kvbridge.bench.connector_rank", name=f"bench-{side}-{rank}")
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
        backend: str = "mooncake",
        protocol: str | None = None,
        device: str = "cpu",
        verify: bool = True,
        timeout: float = 300.0,
    ) -> dict[str, Any]:
        p, d = ParallelConfig.parse(prefill), ParallelConfig.parse(decode)
        if p.cp > 1 or d.cp > 1 or p.dp > 1:
            raise ConfigError(
                "the connector bench runs TP and decode DP; PCP/DCP and prefill DP are the parallel "
                "bench's (kvbridge bench --prefill ... --decode ...)"
            )
        spec = get_preset(model)
        pbs, dbs = prefill_block_size or spec.block_size, decode_block_size or spec.block_size
        n_p, n_d = -(-tokens // pbs), -(-tokens // dbs)
        reqs = [{"id": f"req-{i}", "index": i, "tokens": tokens, "decode_dp": i % d.dp} for i in range(requests)]
        # prefill blocks in order from 1; decode blocks reversed in pairs, so runs and gaps both occur
        p_blocks = {r["id"]: list(range(1 + i * n_p, 1 + (i + 1) * n_p)) for i, r in enumerate(reqs)}
        d_blocks = {}
        for i, r in enumerate(reqs):
            ids = list(range(2 + i * n_d, 2 + (i + 1) * n_d))
            d_blocks[r["id"]] = [b for k in range(0, len(ids), 2) for b in ids[k : k + 2][::-1]][::-1]
        common = dict(model=model, backend=backend, protocol=protocol, device=device)
        p_port, d_port = free_port(span=p.world_size), free_port(span=d.world_size)
        sides = [
            ("prefill", p, prefill_layout, pbs, 1 + requests * n_p + 2, p_port),
            ("decode", d, decode_layout, dbs, 2 + requests * n_d + 3, d_port),
        ]
        with ThreadPoolExecutor(p.world_size + d.world_size) as pool:
            setups = [
                pool.submit(
                    self._child(side, r).call,
                    "setup",
                    timeout=timeout,
                    side=side,
                    engine_id=side,
                    layout=layout,
                    tp=cfg.tp,
                    dp=cfg.dp,
                    rank=r,
                    block_size=bs,
                    num_blocks=nb,
                    port=port,
                    **common,
                )
                for side, cfg, layout, bs, nb, port in sides
                for r in range(cfg.world_size)
            ]
            for f in setups:
                f.result()
            filled = [
                pool.submit(
                    self._child("prefill", r).call,
                    "prefill",
                    timeout=timeout,
                    requests=[r_ | {"blocks": p_blocks[r_["id"]]} for r_ in reqs],
                )
                for r in range(p.world_size)
            ]
            params = [f.result() for f in filled][0]
            pulls = [
                pool.submit(
                    self._child("decode", r).call,
                    "decode",
                    timeout=timeout,
                    verify=verify,
                    requests=[
                        r_ | {"blocks": d_blocks[r_["id"]], "params": params[r_["id"]]}
                        for r_ in reqs
                        if r_["decode_dp"] == d.coords(r).dp
                    ],
                )
                for r in range(d.world_size)
            ]
            pulled = [f.result() for f in pulls]
            ids = [r_["id"] for r_ in reqs]
            unsent = [
                pool.submit(self._child("prefill", r).call, "sent", timeout=timeout, ids=ids)
                for r in range(p.world_size)
            ]
            not_released = sorted({i for f in unsent for i in f.result()})
            for side, cfg, *_ in sides:
                for r in range(cfg.world_size):
                    self._child(side, r).call("close", timeout=timeout)
        nbytes = sum(x["bytes"] for x in pulled)
        seconds = max(x["seconds"] for x in pulled)
        descriptors = [n for x in pulled for n in x["descriptors"]]
        bad = {f"decode rank {r}": x["bad"] for r, x in enumerate(pulled) if x["bad"]}
        failed = {
            f"decode rank {r}": x["missing"] + x["load_errors"]
            for r, x in enumerate(pulled)
            if x["missing"] or x["load_errors"]
        }
        layers = spec.layers
        ok = not bad and not failed and not not_released
        return {
            "prefill": str(p),
            "decode": str(d),
            "model": model,
            "prefill_layout": prefill_layout,
            "decode_layout": decode_layout,
            "prefill_block_size": pbs,
            "decode_block_size": dbs,
            "tokens": tokens,
            "requests": requests,
            "bytes": nbytes,
            "seconds": seconds,
            "gbps": nbytes / seconds / 1e9 if seconds else 0.0,
            # per request and decode rank; the bound: 2 x layers x prefill blocks of the request
            "descriptors_per_request": max(descriptors, default=0),
            "descriptor_bound": 2 * layers * n_p,
            "verified": ok if verify else None,
            "bad": bad,
            "failed": failed,
            "not_released": not_released,
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
    with ConnectorBench() as bench:
        r = bench.run(
            prefill=args.prefill or "tp1",
            decode=args.decode or "tp1",
            model=args.model or "tiny-gqa",
            prefill_layout=args.prefill_layout,
            decode_layout=args.decode_layout,
            prefill_block_size=args.prefill_block_size,
            decode_block_size=args.decode_block_size,
            tokens=args.tokens or DEFAULT_TOKENS,
            requests=args.requests or 2,
            backend=args.migration_backend,
            protocol=args.protocol,
            device=getattr(args, "device", "cpu"),
            verify=args.verify,
        )
    if args.json:
        print_json(r)
    else:
        print_table(
            f"kvbridge bench --engine vllm-connector: {r['prefill']} {r['prefill_layout']} "
            f"(block {r['prefill_block_size']}) -> {r['decode']} {r['decode_layout']} "
            f"(block {r['decode_block_size']}), {r['model']}, "
            f"{r['tokens']} tokens x {r['requests']} requests",
            ["MiB", "seconds", "GB/s", "descriptors/request", "bound 2 x layers x blocks", "verified"],
            [
                (
                    f"{r['bytes'] / 2**20:.2f}",
                    f"{r['seconds']:.3f}",
                    f"{r['gbps']:.3f}",
                    r["descriptors_per_request"],
                    r["descriptor_bound"],
                    {None: "not checked", True: "yes", False: "NO"}[r["verified"]],
                )
            ],
        )
    return 1 if r["verified"] is False else 0
