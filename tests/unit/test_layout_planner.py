"""Layouts, compatibility checks and descriptor building, proven on real buffers.

Bytes are moved here with ctypes.memmove from the descriptors the planner builds: what is
under test is the planner's arithmetic (every (layer, K/V, token, head) lands exactly where it
belongs); the transports are tested with the same descriptors in test_agent.py and the bench.
"""

from __future__ import annotations

import ctypes

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.base.errors import LayoutMismatch
from kvbridge.plan.descriptors import pull_descriptors
from kvbridge.plan.layout import BufferDesc, KVLayout, buffer_layout, check_compatible, lmdeploy_layout, vllm_layout
from kvbridge.plan.presets import PRESETS, ModelSpec
from kvbridge.plan.topology import HeadPlacement, ParallelConfig, Plan, plan
from kvbridge_tools.bench.shares import Share, fill, mismatches


def _make(model: ModelSpec, heads: int, num_blocks: int, style: str) -> tuple[np.ndarray, KVLayout]:
    per_block = model.kv_tensors * heads * model.block_size * model.head_dim * model.dtype_bytes
    buf = np.zeros(model.layers * num_blocks * per_block, dtype=np.uint8)
    layer_bytes = num_blocks * per_block
    addrs = [buf.ctypes.data + i * layer_bytes for i in range(model.layers)]
    if style == "lmdeploy":
        return buf, lmdeploy_layout(model, heads, buf.ctypes.data, num_blocks, order="NHD")
    kv, order = style.split("-")
    kv = {"perhead": "per-head"}.get(kv, kv)
    return buf, vllm_layout(model, heads, addrs, num_blocks, kv=kv, order=order)  # type: ignore[arg-type]


def _ids(rng: np.random.Generator, count: int, capacity: int) -> np.ndarray:
    """`count` distinct block ids out of `capacity`, partly in contiguous runs."""
    if rng.random() < 0.5:
        start = int(rng.integers(0, capacity - count + 1))
        return np.arange(start, start + count)
    return rng.permutation(capacity)[:count]


def _run(p: Plan, style: str, seed: int) -> None:
    """Fill every prefill rank, apply every pull's descriptors, check every decode rank's image."""
    rng = np.random.default_rng(seed)
    m = p.model
    src_place = HeadPlacement.of(m, p.prefill, "prefill")
    dst_place = HeadPlacement.of(m, p.decode, "decode")
    ranks: dict[tuple[str, int], tuple[np.ndarray, KVLayout, Share]] = {}
    for side, config, place in (("prefill", p.prefill, src_place), ("decode", p.decode, dst_place)):
        for rank in p.prefill_ranks if side == "prefill" else p.decode_ranks:
            c = config.coords(rank)
            count = p.blocks_on(side, rank)
            capacity = count + int(rng.integers(0, 4)) + 1  # asymmetric capacity on purpose
            buf, layout = _make(m, place.per_rank, capacity, style)
            ids = _ids(rng, count, capacity)
            share = Share(
                ids.tolist(), [c.cp + i * config.cp for i in range(count)], list(place.heads(c.shard)), p.tokens
            )
            ranks[side, rank] = (buf, layout, share)
    for rank in p.prefill_ranks:
        buf, layout, share = ranks["prefill", rank]
        fill(layout, buf, [share])
    for pull in p.pulls:
        dbuf, dlayout, dshare = ranks["decode", pull.decode_rank]
        pbuf, playout, pshare = ranks["prefill", pull.prefill_rank]
        desc = pull_descriptors(pull, dlayout, playout, dshare.block_ids, pshare.block_ids)
        for local, remote, length in desc.expand().tolist():
            ctypes.memmove(local, remote, length)
    for rank in p.decode_ranks:
        buf, layout, share = ranks["decode", rank]
        n, notes = mismatches(layout, buf, [share])
        assert n == 0, f"decode rank {rank}: {n} wrong words, e.g. {notes}"


@pytest.mark.parametrize("style", ["split-NHD", "split-HND", "joint-NHD", "joint-HND", "perhead-HND", "lmdeploy"])
def test_heterogeneous_tp_and_cp_land_every_word(style: str) -> None:
    model = attrs.evolve(PRESETS["tiny-gqa"], layers=3)
    for prefill, decode in (("tp16,dcp2", "tp8,dcp2,dp2"), ("tp2,pcp2", "tp8,dcp4"), ("tp8,pcp2,dcp2", "tp4,dp4")):
        p = plan(ParallelConfig.parse(prefill), ParallelConfig.parse(decode), model, 150, decode_dp=0)
        _run(p, style, seed=1)


@st.composite
def configs(draw: st.DrawFn) -> ParallelConfig:
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    dcp = draw(st.sampled_from([x for x in (1, 2, 4) if tp % x == 0]))
    return ParallelConfig(tp=tp, pcp=draw(st.sampled_from([1, 2])), dcp=dcp, dp=draw(st.sampled_from([1, 2])))


@settings(max_examples=60, deadline=None)
@given(
    configs(),
    configs(),
    st.sampled_from(["gqa1", "gqa2", "gqa8", "mla"]),
    st.integers(1, 200),
    st.sampled_from(["split-NHD", "split-HND", "joint-NHD", "perhead-HND", "lmdeploy"]),
    st.integers(0, 2**16),
    st.data(),
)
def test_every_layer_token_and_head_lands_once(
    prefill: ParallelConfig, decode: ParallelConfig, kind: str, tokens: int, style: str, seed: int, data: st.DataObject
) -> None:
    if kind == "mla":
        model = ModelSpec("m", layers=2, kv_heads=1, head_dim=8, dtype="fp16", block_size=4, attention="mla")
        style = style.replace("perhead", "split")  # a GQA-only layout
    else:
        model = ModelSpec("g", layers=2, kv_heads=int(kind[3:]), head_dim=4, dtype="fp16", block_size=4)
    p = plan(
        prefill,
        decode,
        model,
        tokens,
        prefill_dp=data.draw(st.integers(0, prefill.dp - 1)),
        decode_dp=data.draw(st.integers(0, decode.dp - 1)),
    )
    _run(p, style, seed)


def test_contiguous_blocks_give_one_descriptor_per_region() -> None:
    model = PRESETS["tiny-gqa"]
    p = plan(ParallelConfig(tp=2), ParallelConfig(tp=2), model, 10 * model.block_size)
    _, local = _make(model, 8, 40, "split-NHD")
    _, remote = _make(model, 8, 30, "split-NHD")
    pull = p.pulls_for(0)[0]
    desc = pull_descriptors(pull, local, remote, np.arange(20, 30), np.arange(5, 15)).expand()
    assert len(desc) == len(local.regions) == model.layers * 2
    block = local.regions[0].block_bytes
    assert (desc[:, 2] == 10 * block).all()
    assert desc[0].tolist() == [local.regions[0].addr + 20 * block, remote.regions[0].addr + 5 * block, 10 * block]
    # two runs on the local side (20..24, 30..34) give two descriptors per region
    split = pull_descriptors(pull, local, remote, np.r_[20:25, 30:35], np.arange(5, 15))
    assert len(split) == 2 * len(local.regions)


def test_head_slices_of_hnd_blocks_are_one_descriptor_per_block() -> None:
    model = PRESETS["tiny-gqa"]
    p = plan(ParallelConfig(tp=2), ParallelConfig(tp=4), model, 4 * model.block_size)
    _, local = _make(model, 4, 8, "split-HND")
    _, remote = _make(model, 8, 8, "split-HND")
    pull = p.pulls_for(1)[0]
    assert pull.src_heads == (4, 8) and pull.dst_heads == (0, 4)
    desc = pull_descriptors(pull, local, remote, np.arange(4), np.arange(4)).expand()
    r = local.regions[0]
    assert len(desc) == 4 * len(local.regions)
    assert (desc[:, 2] == 4 * r.head_bytes).all()
    assert desc[0, 1] == remote.regions[0].addr + 4 * remote.regions[0].head_bytes


def test_compatibility_names_the_differing_field() -> None:
    model = PRESETS["tiny-gqa"]
    _, a = _make(model, 8, 10, "split-NHD")
    _, b = _make(model, 8, 50, "split-NHD")
    check_compatible(a, b)  # different block counts are fine
    _, c = _make(model, 4, 10, "split-NHD")
    check_compatible(a, c)  # different heads per rank too (heterogeneous TP)
    with pytest.raises(LayoutMismatch, match="model.dtype"):
        check_compatible(a, attrs.evolve(b, model=attrs.evolve(model, dtype="bf16")))
    with pytest.raises(LayoutMismatch, match="model.block_size"):
        check_compatible(a, attrs.evolve(b, model=attrs.evolve(model, block_size=32)))
    _, hnd = _make(model, 8, 10, "split-HND")
    with pytest.raises(LayoutMismatch, match=r"regions\[0\].order"):
        check_compatible(a, hnd)
    with pytest.raises(LayoutMismatch, match="regions"):
        check_compatible(a, attrs.evolve(b, regions=b.regions[:-1]))
    with pytest.raises(LayoutMismatch, match=r"regions\[1\].kind"):
        check_compatible(a, attrs.evolve(b, regions=(b.regions[0], b.regions[0]) + b.regions[2:]))


def test_buffer_layout_moves_whole_blocks_and_refuses_head_slices() -> None:
    model = PRESETS["tiny-mla"]
    per_block = model.block_size * model.head_dim * model.dtype_bytes
    bufs = [BufferDesc("latent", 0x10000, 16, per_block, model.layers), BufferDesc("index", 0x90000, 16, 64, 2)]
    layout = buffer_layout(model, 1, bufs)
    assert [(r.layer, r.kind) for r in layout.regions] == [(0, "latent"), (0, "index"), (1, "latent"), (1, "index")]
    assert layout.regions[2].addr == 0x10000 + 16 * per_block
    p = plan(ParallelConfig(tp=2), ParallelConfig(tp=1), model, 3 * model.block_size)
    desc = pull_descriptors(p.pulls[0], layout, layout, [0, 1, 2], [3, 4, 5])
    assert len(desc) == 4  # one run per region

    gqa = PRESETS["tiny-gqa"]
    opaque = buffer_layout(gqa, 8, [BufferDesc("k", 0x10000, 8, 4096, 2), BufferDesc("v", 0x90000, 8, 4096, 2)])
    p = plan(ParallelConfig(tp=2), ParallelConfig(tp=4), gqa, 32)
    small = buffer_layout(gqa, 4, [BufferDesc("k", 0x10000, 8, 2048, 2), BufferDesc("v", 0x90000, 8, 2048, 2)])
    with pytest.raises(LayoutMismatch, match="opaque"):
        pull_descriptors(p.pulls[0], small, opaque, [0, 1], [0, 1])


def test_a_misplaced_word_is_caught_and_decoded() -> None:
    model = PRESETS["tiny-gqa"]
    buf, layout = _make(model, 16, 4, "split-NHD")
    share = Share([2, 0], [0, 1], range(16), 20)
    fill(layout, buf, [share])
    assert mismatches(layout, buf, [share]) == (0, [])
    words = buf.view(np.uint64)
    i = int(np.flatnonzero(words)[5])
    words[[i, i + 1]] = words[[i + 1, i]]  # two dims swapped
    n, notes = mismatches(layout, buf, [share])
    assert n == 2  # block id 0 holds logical block 1: tokens 16..31
    assert "expected {'layer': 0, 'kind': 'k', 'token': 16, 'head': 2, 'dim': 4}" in notes[0]
    assert mismatches(layout, buf, [attrs.evolve(share, tokens=33)])[0] > 2  # one token more is expected


def test_builders_match_real_tensor_layouts() -> None:
    """Region arithmetic against torch's own strides for the shapes engines allocate."""
    import torch

    m, heads, nb = PRESETS["tiny-gqa"], 4, 6
    bs, hd, row = m.block_size, m.head_dim, m.head_dim * m.dtype_bytes
    at = [(0, 0, 0), (5, 3, 15), (2, 1, 7)]  # (block, head, token)

    def ptr(r, b, h, tok):  # type: ignore[no-untyped-def]
        piece = tok if r.chunks > 1 else 0
        inner = 0 if r.chunks > 1 else tok * row
        return r.addr + b * r.block_stride + piece * r.chunk_stride + h * r.head_bytes + inner

    # vLLM CPU backend (0.32): [num_blocks, num_kv_heads, block_size, 2 * head_size], read as
    # view(num_blocks, heads, 2 * block_size, head_size).chunk(2, dim=2) -> K, V
    ts = [torch.zeros(nb, heads, bs, 2 * hd, dtype=torch.float16) for _ in range(m.layers)]
    layout = vllm_layout(m, heads, ts, nb, kv="per-head", order="HND")
    for t, r in zip(ts, layout.regions):
        key, value = t.view(nb, heads, 2 * bs, hd).chunk(2, dim=2)
        for b, h, tok in at:
            assert key[b, h, tok].data_ptr() == ptr(r, b, h, tok)
            assert value[b, h, tok].data_ptr() == ptr(r, b, h, tok) + bs * row

    shapes = {  # kv, order -> per-layer shape; index of (kind, block, head, token) into it
        ("split", "NHD"): ((2, nb, bs, heads, hd), lambda k, b, h, tok: (k, b, tok, h)),
        ("split", "HND"): ((2, nb, heads, bs, hd), lambda k, b, h, tok: (k, b, h, tok)),
        ("joint", "NHD"): ((nb, 2, bs, heads, hd), lambda k, b, h, tok: (b, k, tok, h)),
        ("joint", "HND"): ((nb, 2, heads, bs, hd), lambda k, b, h, tok: (b, k, h, tok)),
    }
    for (kv, order), (shape, index) in shapes.items():
        ts = [torch.zeros(shape, dtype=torch.float16) for _ in range(m.layers)]
        layout = vllm_layout(m, heads, ts, nb, kv=kv, order=order)  # type: ignore[arg-type]
        for i, r in enumerate(layout.regions):
            t, k = ts[i // 2], i % 2
            for b, h, tok in at:
                assert t[index(k, b, h, tok)].data_ptr() == ptr(r, b, h, tok), (kv, order, r.kind)

    # LMDeploy-style pool: (layers, blocks, [K | V] of (block_size, heads, head_dim))
    pool = torch.zeros(m.layers, nb, 2, bs, heads, hd, dtype=torch.float16)
    layout = lmdeploy_layout(m, heads, pool, nb)
    for r in layout.regions:
        for b, h, tok in at:
            assert pool[r.layer, b, int(r.kind == "v"), tok, h].data_ptr() == ptr(r, b, h, tok)
