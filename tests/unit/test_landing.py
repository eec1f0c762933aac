"""Paged cache geometry from vLLM-style per-layer views, its refusals, and the landing path's descriptors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from kvbridge.adapters.vllm.cache import ORDERS, byte_views, describe_kv_caches  # noqa: E402
from kvbridge.agent.landing import LandingBuffers, direct, landing_descriptors  # noqa: E402
from kvbridge.base.errors import ConfigError, LayoutMismatch  # noqa: E402
from kvbridge.plan.layout import check_compatible  # noqa: E402

L, B, H, N, C = 2, 6, 4, 16, 8  # C: K+V elements of fp16


def views(layout: str) -> dict[str, torch.Tensor]:
    """Per-layer [B, H, N, C] views of one buffer laid out in `layout`'s physical order, as vLLM does."""
    order = ORDERS[layout]
    sizes = (L, B, H, N, C)
    buf = torch.zeros(L * B * H * N * C, dtype=torch.float16)
    strides, cur = [0] * 5, 1
    for d in reversed(order):
        strides[d], cur = cur, cur * sizes[d]
    full = torch.as_strided(buf, sizes, strides)
    return {f"layer{i}": full[i] for i in range(L)}


@pytest.mark.parametrize("layout", [n for n in ORDERS if n != "ascend-kv-tuple"])
def test_each_layout_is_read_and_landed_in_few_runs(layout: str) -> None:
    kv, _ = describe_kv_caches(views(layout), layout=layout, block_size=N, tp_size=1)
    assert kv.paged is not None and kv.paged.name == layout and kv.heads == H
    desc, _planes, nbytes = landing_descriptors(kv.paged, np.arange(2, 5))  # three consecutive blocks
    assert nbytes == L * 3 * H * N * C * 2 and int(desc[:, 2].sum()) == nbytes
    expected = {"LBHNC": L, "LBNHC": L, "LHBNC": L * H, "BLHNC": 1, "BLNHC": 1, "BHLNC": 1}[layout]
    assert len(desc) == expected


def test_a_view_that_is_not_the_named_layout_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError, match="FLASH_ATTN says the KV cache layout is LBHNC"):
        describe_kv_caches(views("LBNHC"), layout="LBHNC", block_size=N, tp_size=1, backend="FLASH_ATTN")
    with pytest.raises(ConfigError, match="'XYZ' of FLASHINFER is not one kvbridge can move"):
        describe_kv_caches(views("LBNHC"), layout="XYZ", block_size=N, tp_size=1, backend="FLASHINFER")


def test_only_like_arrangements_go_direct() -> None:
    a, _ = describe_kv_caches(views("LBNHC"), layout="LBNHC", block_size=N, tp_size=1)
    b, _ = describe_kv_caches(views("BLNHC"), layout="BLNHC", block_size=N, tp_size=1)
    assert direct(a, a) and not direct(a, b) and not direct(b, a)


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_caches_are_one_byte_elements_named_by_vllms_cache_dtype(cache_dtype: str) -> None:
    # vLLM allocates fp8 KV caches as uint8 tensors (STR_DTYPE_TO_TORCH_DTYPE): the name says the format
    kv = {k: v.view(torch.uint8) for k, v in views("LBNHC").items()}  # C x 2 one-byte elements per token
    layout, _ = describe_kv_caches(kv, layout="LBNHC", block_size=N, tp_size=1, cache_dtype=cache_dtype)
    assert layout.model.dtype == ("fp8_e4m3" if cache_dtype == "fp8" else cache_dtype)
    assert layout.model.dtype_bytes == 1 and layout.model.head_dim == 2 * C
    assert layout.paged is not None and layout.paged.planes[0].content == 2 * C
    other, _ = describe_kv_caches(
        kv, layout="LBNHC", block_size=N, tp_size=1, cache_dtype="fp8_e5m2" if "e4m3" in layout.model.dtype else "fp8"
    )
    with pytest.raises(LayoutMismatch, match="dtype"):  # e4m3 and e5m2 bytes are not interchangeable
        check_compatible(layout, other)
    with pytest.raises(ConfigError, match="not one byte each"):
        describe_kv_caches(views("LBNHC"), layout="LBNHC", block_size=N, tp_size=1, cache_dtype=cache_dtype)


def test_idle_landing_buffers_are_bounded() -> None:
    import kvbridge

    kv, _ = describe_kv_caches(views("LBNHC"), layout="LBNHC", block_size=N, tp_size=1)
    backend = kvbridge.create_backend("loopback")
    buffers = LandingBuffers(backend, kv, byte_views(views("LBNHC"), layout="LBNHC"), max_idle_bytes=3 << 20)
    try:
        a, b = buffers.acquire(2 << 20), buffers.acquire(1)  # 2 MiB and the 1 MiB minimum
        assert len(backend.registered) == 2
        buffers.release(a)
        buffers.release(b)  # 3 MiB idle: at the bound, both kept for reuse
        assert buffers.idle_bytes == 3 << 20 and buffers.acquire(1 << 20) is b
        c = buffers.acquire(1 << 20)  # none idle fits: a new one
        buffers.release(b)
        buffers.release(c)  # beyond the bound: unregistered and dropped
        assert buffers.idle_bytes == 3 << 20 and len(backend.registered) == 2
    finally:
        buffers.close()
        backend.close()


def test_a_buffer_a_failed_transfer_wrote_into_is_never_lent_again() -> None:
    # A transport call that gave up may still write later (Mooncake TCP re-sends slices queued behind a
    # dropped lane once the peer answers): that buffer must not hold the next pull's bytes.
    import kvbridge
    from kvbridge.agent.landing import Landed

    kv, _ = describe_kv_caches(views("LBNHC"), layout="LBNHC", block_size=N, tp_size=1)
    backend = kvbridge.create_backend("loopback")
    buffers = LandingBuffers(backend, kv, byte_views(views("LBNHC"), layout="LBNHC"))
    rearranged: list[object] = []
    try:
        failed = buffers.acquire(1 << 20)
        Landed(buffers, failed, np.zeros((0, 3), np.int64), rearranged.append).finish(False)
        assert buffers.idle_bytes == 0 and buffers.retired_bytes == failed.numel() and not rearranged
        assert buffers.acquire(1 << 20) is not failed  # still registered, never lent again
        assert len(backend.registered) == 2
        unsent = buffers.acquire(1 << 20)  # a pull refused before any byte moved: its buffer is clean
        Landed(buffers, unsent, np.zeros((0, 3), np.int64), rearranged.append).finish(False, moved=False)
        assert buffers.idle_bytes == unsent.numel() and buffers.acquire(1 << 20) is unsent
        done = buffers.acquire(1 << 20)
        Landed(buffers, done, np.zeros((0, 3), np.int64), rearranged.append).finish(True)
        assert rearranged == [done] and buffers.acquire(1 << 20) is done
    finally:
        buffers.close()
        backend.close()


@pytest.mark.parametrize("src,dst", [("LBHNC", "LBHNC"), ("BLHNC", "LBHNC"), ("LBNHC", "BHLNC")])
def test_equal_block_sizes_land_whole_blocks_past_the_prompt(src: str, dst: str) -> None:
    # vLLM's CPU attention packs a block's interior by ISA (K tiled across token slots), so a landed
    # block must arrive whole, as a direct read would: cutting at the prompt's last token and padding
    # changed the KV of real tokens (greedy output diverged from colocated on a 3-token prompt).
    import ctypes

    import kvbridge
    from kvbridge.plan.topology import Pull

    prefill, decode = views(src), views(dst)
    for t in prefill.values():
        t.copy_(torch.randn(t.shape, dtype=torch.float16))
    remote, _ = describe_kv_caches(prefill, layout=src, block_size=N, tp_size=1)
    local, _ = describe_kv_caches(decode, layout=dst, block_size=N, tp_size=1)
    backend = kvbridge.create_backend("loopback")
    buffers = LandingBuffers(backend, local, byte_views(decode, layout=dst))
    pull = Pull(0, 0, (0, H), (0, H), 0, 1, 2, 0, 1, 0, 1)
    try:
        landed = buffers.prepare("r", pull, remote, [4, 1], [0, 5], tokens=N + 3)
        for dst_addr, src_addr, length in landed.descriptors.tolist():  # what the transport reads
            ctypes.memmove(dst_addr, src_addr, length)
        landed.finish(True)
    finally:
        buffers.close()
        backend.close()
    for name in prefill:  # every slot of both blocks, including the 13 past the prompt in the last one
        assert torch.equal(decode[name][[0, 5]], prefill[name][[4, 1]])


@pytest.mark.parametrize("cp", [2, 3])
def test_context_parallel_pulls_land_each_ranks_blocks_at_their_positions(cp: int) -> None:
    # Prefill with PCP: rank c holds logical blocks c, c + cp, ... in its own block list. Over a transport
    # that may write late those pulls land too (whole blocks, like layouts), each block at its position.
    pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine-non-cuda (scripts/setup --test)")
    import ctypes

    import kvbridge
    from kvbridge.plan.topology import ParallelConfig, plan

    tokens = 5 * N - 3
    ranks = [views("LBHNC") for _ in range(cp)]
    for r in ranks:
        for t in r.values():
            t.copy_(torch.randn(t.shape, dtype=torch.float16))
    decode = views("LBHNC")
    local, _ = describe_kv_caches(decode, layout="LBHNC", block_size=N, tp_size=1)
    remote = [describe_kv_caches(r, layout="LBHNC", block_size=N, tp_size=1)[0] for r in ranks]
    prefill_ids = [[B - 1 - i for i in range(B)] for _ in range(cp)]  # each rank's block list, reversed
    local_ids = [3, 0, 5, 1, 4]
    p = plan(ParallelConfig(pcp=cp), ParallelConfig(), local.model, tokens)
    backend = kvbridge.create_backend("mooncake", protocol="tcp", hostname="127.0.0.1")
    buffers = LandingBuffers(backend, local, byte_views(decode, layout="LBHNC"))
    try:
        assert all(buffers.lands(remote[q.prefill_rank], q) for q in p.pulls)
        for pull in p.pulls:
            assert pull.first_block or pull.dst_step != 1, "a context-parallel pull"
            landed = buffers.prepare(
                "r", pull, remote[pull.prefill_rank], prefill_ids[pull.prefill_rank], local_ids, tokens
            )
            for dst_addr, src_addr, length in landed.descriptors.tolist():
                ctypes.memmove(dst_addr, src_addr, length)
            landed.finish(True)
    finally:
        buffers.close()
        backend.close()
    for logical, block in enumerate(local_ids):
        owner, position = logical % cp, logical // cp
        for name in decode:
            assert torch.equal(decode[name][block], ranks[owner][name][prefill_ids[owner][position]]), (logical, name)
    assert not any(decode[name][2].any() for name in decode), "a block of no pull stays untouched"


def test_a_layerwise_read_lands_the_range_and_layers_its_pull_names_from_the_whole_block_lists() -> None:
    # A layer-wise read covers blocks [2, 4) of one layer; the caller passes the request's whole block
    # lists and the pull names the range, as it does for context-parallel pulls.
    pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine-non-cuda (scripts/setup --test)")
    import ctypes

    import attrs

    import kvbridge
    from kvbridge.plan.topology import ParallelConfig, plan

    tokens = 5 * N - 3
    prefill = views("LBHNC")
    for t in prefill.values():
        t.copy_(torch.randn(t.shape, dtype=torch.float16))
    decode = views("LBHNC")
    local, _ = describe_kv_caches(decode, layout="LBHNC", block_size=N, tp_size=1)
    remote, _ = describe_kv_caches(prefill, layout="LBHNC", block_size=N, tp_size=1)
    prefill_ids, local_ids = [5, 4, 3, 2, 1], [3, 0, 5, 1, 4]
    (whole,) = plan(ParallelConfig(), ParallelConfig(), local.model, tokens).pulls
    sub = attrs.evolve(whole, num_blocks=2, src_first=2, dst_first=2)
    backend = kvbridge.create_backend("mooncake", protocol="tcp", hostname="127.0.0.1")
    buffers = LandingBuffers(backend, local, byte_views(decode, layout="LBHNC"))
    try:
        assert buffers.lands(remote, sub)
        landed = buffers.prepare("r", sub, remote, prefill_ids, local_ids, tokens, layers=[1])
        for dst_addr, src_addr, length in landed.descriptors.tolist():
            ctypes.memmove(dst_addr, src_addr, length)
        landed.finish(True)
        too_far = attrs.evolve(sub, src_first=4)
        with pytest.raises(ConfigError, match="block positions up to 5 of prefill"):
            buffers.prepare("r", too_far, remote, prefill_ids, local_ids, tokens, layers=[1])
    finally:
        buffers.close()
        backend.close()
    for position in range(5):
        got, want = decode["layer1"][local_ids[position]], prefill["layer1"][prefill_ids[position]]
        assert torch.equal(got, want) == (position in (2, 3)), position
    assert not decode["layer0"].any(), "a layer the read does not name stays untouched"


@pytest.mark.parametrize("layout", ["LBHNC", "LHBNC"])
def test_host_scatter_writes_exactly_the_blocks_and_heads_named(layout: str) -> None:
    """write_planes on host memory (numpy's row copy) against torch's own index_put.

    For a head range of scattered blocks in strided views, where a wrong stride or head offset shows.
    """
    from kvbridge.agent.landing import write_planes

    rng = np.random.default_rng(7)
    ours = byte_views(views(layout), layout=layout)
    ref = [[v.clone() for v in ours[0]]]
    blocks = torch.from_numpy(rng.permutation(B)[:3].astype(np.int64))
    data = torch.from_numpy(rng.integers(0, 256, (L, 3, 2, N, ours[0][0].shape[-1]), dtype=np.uint8))
    write_planes(ours, blocks, (1, 3), [data])
    for layer, view in enumerate(ref[0]):
        view[:, 1:3].index_put_((blocks,), data[layer])
    for got, want in zip(ours[0], ref[0]):
        assert torch.equal(got, want)
        assert got[blocks][:, 1:3].any() and not got[:, :1].any() and not got[:, 3:].any()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 5 << 20), min_size=1, max_size=40))
def test_repeated_failed_pulls_keep_the_retired_buffers_under_their_bound(sizes: list[int]) -> None:
    # Each failed pull retires its buffer (never freed: a late write may still come); past the bound the
    # next pull that must land is refused (recomputed), so memory does not grow with every failure.
    import kvbridge
    from kvbridge.agent.landing import Landed
    from kvbridge.base.errors import LoadError

    kv, _ = describe_kv_caches(views("LBNHC"), layout="LBNHC", block_size=N, tp_size=1)
    backend = kvbridge.create_backend("loopback")
    bound = 8 << 20
    buffers = LandingBuffers(backend, kv, byte_views(views("LBNHC"), layout="LBNHC"))
    buffers.max_retired_bytes = bound
    refused = 0
    try:
        for nbytes in sizes:
            try:
                buf = buffers.acquire(nbytes, "r")
            except LoadError as exc:
                assert "retired" in str(exc) and "recomputed" in str(exc)
                refused += 1
                continue
            Landed(buffers, buf, np.zeros((0, 3), np.int64), lambda _b: None).finish(False)
            assert buffers.retired_bytes <= bound
        assert sum(r.length for r in backend.registered) <= bound
        assert refused or buffers.retired_bytes == sum(max(1 << 20, 1 << (n - 1).bit_length()) for n in sizes)
    finally:
        buffers.close()
        backend.close()
