"""`kvbridge plan`: which decode rank pulls which heads and blocks from which prefill rank."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from kvbridge.base import wire
from kvbridge.base.block_ids import BlockIds, block_array
from kvbridge.cli.numbers import whole
from kvbridge.cli.output import console, print_json, print_table
from kvbridge.plan import topology
from kvbridge.plan.descriptors import pull_descriptors
from kvbridge.plan.layout import vllm_layout
from kvbridge.plan.presets import PRESETS, ModelSpec, get_preset
from kvbridge.plan.topology import HeadPlacement, ParallelConfig, Plan, Pull, plan


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="show who pulls which KV heads and blocks between two parallel configs",
        description=(
            "Plan one request between a prefill and a decode engine with different parallelism: for every decode "
            "rank, the prefill ranks it reads, the head ranges and the blocks; for every prefill rank, how many pulls "
            "it waits for before freeing the request's blocks (0: nobody reads it, it frees at once). "
            "See docs/planning.md."
        ),
        epilog="example: kvbridge plan --prefill tp8,pcp2,dcp8 --decode tp8,dcp4,dp2 --model tiny-mla --tokens 2500",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--prefill",
        required=True,
        metavar="SPEC",
        help="prefill parallelism, e.g. tp8,pcp2,dcp8 (sizes not named are 1)",
    )
    p.add_argument("--decode", required=True, metavar="SPEC", help="decode parallelism, e.g. tp8,dcp4,dp2")
    p.add_argument("--model", required=True, choices=sorted(PRESETS), help="model preset (KV heads, MLA or not)")
    p.add_argument("--tokens", required=True, type=whole(), help="prompt tokens of the request")
    p.add_argument("--prefill-dp", type=whole(0), default=0, help="prefill DP group holding the request (default 0)")
    p.add_argument("--decode-dp", type=whole(0), default=0, help="decode DP group receiving the request (default 0)")
    p.add_argument(
        "--order",
        choices=["NHD", "HND"],
        default="NHD",
        help="block layout (vLLM-style K/V caches) the planning time is measured with (default NHD)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(run=run)


def planning_time(p: Plan, order: str, *, repeat: int = 20) -> dict[str, Any]:
    """What planning the request costs a decode rank: the topology plan and its pulls' descriptors.

    Measured on vLLM-style layouts of the model (one K and one V tensor per layer, at made-up addresses:
    nothing is read) and fragmented block ids: decode's own as a Python list, as an engine passes them, and
    each prefill rank's as `BlockIds`, as the side channel and the parsed transfer params deliver them.
    `cold` is the first request with a peer (its layout tables are built); `warm` the median of the next ones.
    """
    model: ModelSpec = p.model
    heads = {
        side: HeadPlacement.of(model, c, side).per_rank for side, c in (("prefill", p.prefill), ("decode", p.decode))
    }
    rank = p.decode_ranks.start
    pulls = p.pulls_for(rank)
    rng = np.random.default_rng(0)

    def side(name: str, base: int, count: int) -> tuple[Any, list[int]]:
        capacity = 2 * count + 1
        layer_bytes = 2 * capacity * heads[name] * model.block_size * model.head_dim * model.dtype_bytes
        layout = vllm_layout(
            model, heads[name], [base + i * layer_bytes for i in range(model.layers)], capacity, order=order
        )  # type: ignore[arg-type]
        return layout, rng.permutation(capacity)[:count].tolist()

    local, local_ids = side("decode", 1 << 40, p.blocks_on("decode", rank))
    remote = {}
    for x in pulls:
        layout, ids = side("prefill", (2 + x.prefill_rank) << 40, p.blocks_on("prefill", x.prefill_rank))
        remote[x.prefill_rank] = (layout, BlockIds(ids))

    def once() -> tuple[float, int]:
        topology.forget_plans()  # every request plans its topology afresh; only layout tables are reused
        start = time.perf_counter()
        q = plan(p.prefill, p.decode, model, p.tokens, prefill_dp=p.prefill_dp, decode_dp=p.decode_dp)
        ids = block_array(local_ids)
        rows = 0
        for x in q.pulls_for(rank):
            layout, blocks = remote[x.prefill_rank]
            rows += len(pull_descriptors(x, local, layout, ids, blocks))
        return time.perf_counter() - start, rows

    cold, rows = once()
    warm = statistics.median(once()[0] for _ in range(repeat))
    return {
        "decode_rank": rank,
        "pulls": len(pulls),
        "blocks": p.blocks_on("decode", rank),
        "layers": model.layers,
        "order": order,
        "rows": rows,
        "cold_ms": cold * 1e3,
        "warm_ms": warm * 1e3,
    }


def _blocks(first: int, step: int, count: int) -> str:
    """A run of blocks, readable: '3,19..147 (10)'."""
    last = first + step * (count - 1)
    shown = {1: f"{first}", 2: f"{first},{last}"}.get(count, f"{first},{first + step}..{last}")
    return f"{shown} ({count})"


def as_dict(p: Plan) -> dict[str, Any]:
    start = p.prefill_ranks.start
    return {
        "prefill": str(p.prefill),
        "decode": str(p.decode),
        "model": wire.to_dict(p.model),
        "tokens": p.tokens,
        "num_blocks": p.num_blocks,
        "last_block_tokens": p.last_block_tokens,
        "prefill_dp": p.prefill_dp,
        "decode_dp": p.decode_dp,
        "pulls": [wire.to_dict(x) for x in p.pulls],
        "release_counts": {str(start + i): n for i, n in enumerate(p.release_counts)},
        "unpulled": list(p.unpulled),
        "notifier": p.notifier,
    }


def run(args: argparse.Namespace) -> int:
    model = get_preset(args.model)
    prefill, decode = ParallelConfig.parse(args.prefill), ParallelConfig.parse(args.decode)
    p = plan(prefill, decode, model, args.tokens, prefill_dp=args.prefill_dp, decode_dp=args.decode_dp)
    timing = planning_time(p, args.order)
    if args.json:
        print_json({**as_dict(p), "planning": timing})
        return 0
    dst = HeadPlacement.of(model, p.decode, "decode")

    def row(x: Pull) -> list[object]:
        d, s = p.decode.coords(x.decode_rank), p.prefill.coords(x.prefill_rank)
        g = list(dst.heads(d.shard))[slice(*x.dst_heads)]
        return [
            f"{x.decode_rank} cp{d.cp}/s{d.shard}",
            f"{x.prefill_rank} cp{s.cp}/s{s.shard}",
            f"{x.src_heads[0]}:{x.src_heads[1]}>{x.dst_heads[0]}:{x.dst_heads[1]} g{g[0]}:{g[-1] + 1}",
            _blocks(x.first_block, x.block_step, x.num_blocks),
            f"{x.src_first}+{x.src_step}k",
            f"{x.dst_first}+{x.dst_step}k",
        ]

    console.print(
        "decode/prefill: rank, cp rank, head shard; heads: local ranges (g: global heads); blocks: logical "
        "block ids; pos: where the k-th block sits in each rank's block list of the request"
    )
    console.print(
        f"{model.name} ({model.attention}, {dst.kv_heads} KV heads), {p.tokens} tokens = {p.num_blocks} blocks of "
        f"{model.block_size} (last holds {p.last_block_tokens}); prefill {p.prefill} group {p.prefill_dp} -> "
        f"decode {p.decode} group {p.decode_dp}"
    )
    print_table(
        "pulls",
        ["decode", "prefill", "heads src>dst", "logical blocks", "src pos", "dst pos"],
        [row(x) for x in p.pulls],
    )
    start = p.prefill_ranks.start
    print_table(
        "prefill release counts",
        ["prefill rank", "pulls to wait for", "note"],
        [
            (start + i, n, f"unpulled: freed at once (told by decode rank {p.notifier})" if n == 0 else "")
            for i, n in enumerate(p.release_counts)
        ],
    )
    console.print(
        f"planning time of decode rank {timing['decode_rank']} ({timing['pulls']} pulls, {timing['blocks']} "
        f"fragmented blocks x {timing['layers']} layers, {timing['order']}, {timing['rows']} descriptor rows, kept "
        f"factored): {timing['warm_ms']:.3f} ms per request ({timing['cold_ms']:.3f} ms for the first with a peer)"
    )
    return 0
