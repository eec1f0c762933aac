"""The factored planner (`pull_descriptors`) moves exactly the bytes the row-by-row planner it replaced moved.

For many shapes, its rows in canonical form (local address order, runs merged) equal what the old planner
returned. The old planner is kept here, verbatim in its arithmetic, as the reference.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.base.memory import Descriptors, canonical, merge_runs
from kvbridge.plan.descriptors import pull_descriptors, region_table
from kvbridge.plan.layout import KVLayout, KVRegion, lmdeploy_layout, vllm_layout
from kvbridge.plan.presets import ModelSpec
from kvbridge.plan.topology import HeadPlacement, ParallelConfig, Pull, plan

STYLES = ["split-NHD", "split-HND", "joint-NHD", "joint-HND", "perhead-HND", "lmdeploy", "blockouter-HND"]


def reference(pull: Pull, local: KVLayout, remote: KVLayout, local_blocks: np.ndarray, remote_blocks: np.ndarray):
    """The row-by-row planner before issue 14: one row per (region, block, piece), sorted and merged."""
    dst = np.asarray(local_blocks, dtype=np.int64)[pull.dst_positions()]
    src = np.asarray(remote_blocks, dtype=np.int64)[pull.src_positions()]
    whole = pull.src_heads == (0, remote.heads) and pull.dst_heads == (0, local.heads)
    n_heads = pull.src_heads[1] - pull.src_heads[0]
    lt, rt = region_table(local), region_table(remote)
    zero = np.zeros(len(lt), dtype=np.int64)
    if whole:
        table = np.stack([lt[:, 0], lt[:, 1], zero, zero, rt[:, 0], rt[:, 1], zero, zero, lt[:, 4], zero + 1], axis=1)
    else:
        table = np.stack(
            [
                lt[:, 0],
                lt[:, 1],
                lt[:, 2],
                pull.dst_heads[0] * lt[:, 3],
                rt[:, 0],
                rt[:, 1],
                rt[:, 2],
                pull.src_heads[0] * rt[:, 3],
                n_heads * lt[:, 3],
                lt[:, 5],
            ],
            axis=1,
        )
    parts = []
    for pieces in np.unique(table[:, 9]):
        t = table[table[:, 9] == pieces]
        k = np.arange(pieces, dtype=np.int64)[None, None, :]
        col = lambda j, t=t: t[:, j, None, None]  # noqa: E731
        local_addr = col(0) + dst[None, :, None] * col(1) + k * col(2) + col(3)
        remote_addr = col(4) + src[None, :, None] * col(5) + k * col(6) + col(7)
        length = np.broadcast_to(col(8), local_addr.shape)
        parts.append(np.stack([local_addr.ravel(), remote_addr.ravel(), length.ravel()], axis=1))
    desc: Descriptors = np.concatenate(parts)
    return merge_runs(desc[np.argsort(desc[:, 0], kind="stable")])


def layout(model: ModelSpec, heads: int, num_blocks: int, style: str, base: int) -> KVLayout:
    """A layout at a made-up address (nothing is read or written: only addresses are compared)."""
    per_block = model.kv_tensors * heads * model.block_size * model.head_dim * model.dtype_bytes
    layer_bytes = num_blocks * per_block
    if style == "lmdeploy":
        return lmdeploy_layout(model, heads, base, num_blocks, order="NHD")
    if style == "blockouter-HND":  # every layer's K and V of a block side by side (vLLM's BLHNC)
        kinds = ("latent",) if model.attention == "mla" else ("k", "v")
        bb = per_block // len(kinds)
        head = model.block_size * model.head_dim * model.dtype_bytes
        stride = model.layers * per_block
        return KVLayout(
            model,
            heads,
            [
                KVRegion(
                    layer,
                    kind,
                    base + (layer * len(kinds) + i) * bb,
                    num_blocks,
                    stride,
                    bb,
                    heads=heads,
                    head_bytes=head,
                )
                for layer in range(model.layers)
                for i, kind in enumerate(kinds)
            ],
        )
    kv, order = style.split("-")
    kv = {"perhead": "per-head"}.get(kv, kv)
    addrs = [base + i * layer_bytes for i in range(model.layers)]
    return vllm_layout(model, heads, addrs, num_blocks, kv=kv, order=order)  # type: ignore[arg-type]


@st.composite
def configs(draw: st.DrawFn) -> ParallelConfig:
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    dcp = draw(st.sampled_from([x for x in (1, 2, 4) if tp % x == 0]))
    return ParallelConfig(tp=tp, pcp=draw(st.sampled_from([1, 2])), dcp=dcp, dp=1)


@st.composite
def block_ids(draw: st.DrawFn, count: int, capacity: int) -> np.ndarray:
    """`count` distinct ids out of `capacity`: packed, shuffled, or runs in shuffled order."""
    kind = draw(st.sampled_from(["packed", "shuffled", "runs", "wrap"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    if kind == "packed":
        start = draw(st.integers(0, capacity - count))
        return np.arange(start, start + count)
    if kind == "wrap":  # the last block of the pool followed by the first: a run across two regions
        return np.roll(np.arange(capacity), 1)[:count]
    if kind == "shuffled":
        return rng.permutation(capacity)[:count]
    cuts = np.sort(rng.choice(np.arange(1, capacity), size=min(3, capacity - 1), replace=False))
    pieces = np.split(np.arange(capacity), cuts)
    return np.concatenate([pieces[i] for i in rng.permutation(len(pieces))])[:count]


@settings(max_examples=150, deadline=None)
@given(
    configs(),
    configs(),
    st.sampled_from(["gqa1", "gqa2", "gqa8", "mla"]),
    st.integers(1, 120),
    st.sampled_from(STYLES),
    st.integers(0, 3),
    st.data(),
)
def test_factored_rows_equal_the_row_by_row_planner(
    prefill: ParallelConfig, decode: ParallelConfig, kind: str, tokens: int, style: str, spare: int, data: st.DataObject
) -> None:
    if kind == "mla":
        model = ModelSpec("m", layers=3, kv_heads=1, head_dim=8, dtype="fp16", block_size=4, attention="mla")
        style = style.replace("perhead", "split")
    else:
        model = ModelSpec("g", layers=3, kv_heads=int(kind[3:]), head_dim=4, dtype="fp16", block_size=4)
    p = plan(prefill, decode, model, tokens)
    src_heads = HeadPlacement.of(model, prefill, "prefill").per_rank
    dst_heads = HeadPlacement.of(model, decode, "decode").per_rank
    layouts, blocks = {}, {}
    for side, ranks, heads, base in (
        ("prefill", p.prefill_ranks, src_heads, 1 << 40),
        ("decode", p.decode_ranks, dst_heads, 1 << 20),
    ):
        for rank in ranks:
            count = p.blocks_on(side, rank)
            capacity = count + spare + 1
            layouts[side, rank] = layout(model, heads, capacity, style, base + rank * (1 << 32))
            blocks[side, rank] = data.draw(block_ids(count, capacity)) if count else np.empty(0, np.int64)
    for pull in p.pulls:
        args = (
            pull,
            layouts["decode", pull.decode_rank],
            layouts["prefill", pull.prefill_rank],
            blocks["decode", pull.decode_rank],
            blocks["prefill", pull.prefill_rank],
        )
        new, old = pull_descriptors(*args), reference(*args)
        assert np.array_equal(canonical(new), old)
        assert new.nbytes == int(old[:, 2].sum())
        assert len(new) <= len(old) + len(layouts["decode", pull.decode_rank].regions)
        rows = np.concatenate(list(new.chunks(7)))
        assert np.array_equal(rows, new.expand())


def test_a_transport_sends_factored_rows_in_batches_and_checks_their_bounds() -> None:
    """Factored rows through a real (in-process) transport move the same bytes as the reference rows.

    The rows are materialized batch by batch, and a layout reaching past the peer's registration is refused.
    """
    import kvbridge
    from kvbridge.base.errors import InvalidDescriptor

    model = ModelSpec("g", layers=3, kv_heads=4, head_dim=4, dtype="fp16", block_size=4)
    p = plan(ParallelConfig(tp=1), ParallelConfig(tp=2), model, 4 * 24)  # decode rank 0: heads 0-1 of 4
    pull = p.pulls_for(0)[0]
    heads = {"prefill": 4, "decode": 2}
    bufs = {s: np.zeros(model.layers * 2 * 32 * heads[s] * 4 * 4 * 2, dtype=np.uint8) for s in heads}
    bufs["prefill"][:] = np.random.default_rng(0).integers(0, 256, len(bufs["prefill"]), dtype=np.uint8)
    layouts = {s: layout(model, heads[s], 32, "split-NHD", bufs[s].ctypes.data) for s in heads}
    rng = np.random.default_rng(1)
    dst_ids, src_ids = rng.permutation(32)[:24], rng.permutation(32)[:24]
    desc = pull_descriptors(pull, layouts["decode"], layouts["prefill"], dst_ids, src_ids)
    expected = np.zeros_like(bufs["decode"])
    base_l, base_r = bufs["decode"].ctypes.data, bufs["prefill"].ctypes.data
    for local, remote, n in reference(pull, layouts["decode"], layouts["prefill"], dst_ids, src_ids).tolist():
        expected[local - base_l : local - base_l + n] = bufs["prefill"][remote - base_r : remote - base_r + n]
    server = kvbridge.create_backend("loopback")
    client = kvbridge.create_backend("loopback", max_batch=100, fault_injection={})  # counts the submissions
    try:
        server.register_memory(bufs["prefill"])
        client.register_memory(bufs["decode"])
        peer = client.connect(server.endpoint_info())
        handle = client.transfer(peer, desc, "read")
        handle.wait(30)
        assert np.array_equal(bufs["decode"], expected)
        assert handle.descriptors == len(desc) and handle.nbytes == desc.nbytes
        assert client.submissions == -(-len(desc) // 100)  # one per batch of 100 rows
        past = layout(model, 4, 64, "split-NHD", base_r)  # twice the blocks the peer registered
        with pytest.raises(InvalidDescriptor, match="remote memory"):
            client.transfer(peer, pull_descriptors(pull, layouts["decode"], past, dst_ids, src_ids + 32))
    finally:
        client.close()
        server.close()
