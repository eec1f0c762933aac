"""Where a vLLM rank's paged KV cache lives, and the read descriptors between two ranks.

vLLM's CPU attention backend keeps one tensor per layer, shaped (num_blocks, kv_heads, block_size,
K+V content), blocks outermost and heads contiguous inside a block (layout LBHNC). So a block of one
layer is one contiguous run, and a head of it is a contiguous slice: decode can read exactly the
heads each prefill rank owns when their tensor-parallel sizes differ.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from kvbridge.errors import ConfigError, LayoutMismatch
from kvbridge.memory import Descriptors, merge_runs


@attrs.frozen
class CacheLayout:
    """One rank's KV cache: every layer's block 0 address and the shape of a block."""

    layer_addrs: tuple[int, ...] = attrs.field(converter=tuple)
    num_blocks: int
    block_stride: int  # bytes from one block to the next within a layer
    block_bytes: int  # bytes of one block of one layer (all heads on this rank)
    num_heads: int  # KV heads on this rank
    block_size: int  # tokens per block
    dtype: str
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def head_bytes(self) -> int:
        return self.block_bytes // self.num_heads

    @property
    def total_heads(self) -> int:
        return self.num_heads * self.tp_size

    def head_range(self) -> tuple[int, int]:
        """The model's KV heads this rank holds, [first, end)."""
        return self.tp_rank * self.num_heads, (self.tp_rank + 1) * self.num_heads


def describe_kv_caches(
    kv_caches: Mapping[str, Any], *, block_size: int, tp_rank: int, tp_size: int
) -> tuple[CacheLayout, list[tuple[int, int]]]:
    """The layout of vLLM's per-layer KV tensors and the (address, bytes) storages to register.

    Refuses a layout it cannot address block by block (e.g. K and V in separate leading planes),
    naming what it found, rather than moving wrong bytes.
    """
    if not kv_caches:
        raise ConfigError("vLLM registered no KV cache tensors with KVBridgeConnector")
    tensors = list(kv_caches.values())
    first = tensors[0]
    storages: dict[int, int] = {}
    for name, t in kv_caches.items():
        if t.ndim != 4 or t.shape != first.shape or t.dtype != first.dtype or t.stride() != first.stride():
            raise ConfigError(
                f"KV cache tensor {name} has shape {tuple(t.shape)}, stride {t.stride()}, dtype {t.dtype}; "
                f"KVBridgeConnector needs every layer shaped like the first, (blocks, heads, tokens, content) "
                f"= {tuple(first.shape)}. Report this layout to kvbridge"
            )
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    num_blocks, heads, tokens, content = (int(v) for v in first.shape)
    stride = first.stride()
    if stride[1:] != (tokens * content, content, 1):
        raise ConfigError(
            f"KV cache blocks are not head-major and contiguous (stride {stride}); KVBridgeConnector supports "
            "vLLM's LBHNC layout (the CPU backend's). Report this layout to kvbridge"
        )
    if tokens != block_size:
        raise ConfigError(f"KV cache blocks hold {tokens} tokens but the block size is {block_size}")
    elem = first.element_size()
    layout = CacheLayout(
        layer_addrs=[t.data_ptr() for t in tensors],
        num_blocks=num_blocks,
        block_stride=stride[0] * elem,
        block_bytes=heads * tokens * content * elem,
        num_heads=heads,
        block_size=block_size,
        dtype=str(first.dtype).removeprefix("torch."),
        tp_rank=tp_rank,
        tp_size=tp_size,
    )
    return layout, sorted(storages.items())


def check_compatible(local: CacheLayout, remote: CacheLayout) -> None:
    """Raise LayoutMismatch naming the first field that makes a pull between these ranks wrong."""
    for field, a, b in (
        ("layers", len(local.layer_addrs), len(remote.layer_addrs)),
        ("dtype", local.dtype, remote.dtype),
        ("block_size", local.block_size, remote.block_size),
        ("head_bytes", local.head_bytes, remote.head_bytes),
        ("total KV heads", local.total_heads, remote.total_heads),
    ):
        if a != b:
            raise LayoutMismatch(field, a, b, "Start prefill and decode with the same model, dtype and --block-size")


def overlap(local: CacheLayout, remote: CacheLayout) -> tuple[int, int]:
    """The KV heads both ranks hold, [first, end); empty when first >= end."""
    (a0, a1), (b0, b1) = local.head_range(), remote.head_range()
    return max(a0, b0), min(a1, b1)


def source_ranks(local: CacheLayout, remote_tp: int) -> list[int]:
    """The remote TP ranks a local rank reads from (their heads overlap this rank's)."""
    per = local.total_heads // remote_tp
    a0, a1 = local.head_range()
    return [r for r in range(remote_tp) if max(a0, r * per) < min(a1, (r + 1) * per)]


def pullers(remote_rank: int, remote_tp: int, local_tp: int, total_heads: int) -> int:
    """How many local TP ranks read from one remote rank: the DONEs that rank waits for."""
    per_r, per_l = total_heads // remote_tp, total_heads // local_tp
    r0, r1 = remote_rank * per_r, (remote_rank + 1) * per_r
    return sum(1 for d in range(local_tp) if max(r0, d * per_l) < min(r1, (d + 1) * per_l))


def pull_descriptors(
    local: CacheLayout, remote: CacheLayout, local_blocks: Sequence[int], remote_blocks: Sequence[int]
) -> Descriptors:
    """(local, remote, length) rows that read the remote's blocks into ours, every layer, our heads only."""
    check_compatible(local, remote)
    if len(local_blocks) != len(remote_blocks):
        raise ConfigError(f"{len(local_blocks)} local blocks for {len(remote_blocks)} remote blocks")
    h0, h1 = overlap(local, remote)
    if h0 >= h1 or not len(local_blocks):
        return np.empty((0, 3), dtype=np.int64)
    lb = np.asarray(local_blocks, dtype=np.int64)
    rb = np.asarray(remote_blocks, dtype=np.int64)
    for side, blocks, layout in (("decode", lb, local), ("prefill", rb, remote)):
        if blocks.min() < 0 or blocks.max() >= layout.num_blocks:
            raise ConfigError(f"{side} block id out of range [0, {layout.num_blocks})")
    head = local.head_bytes
    l_off = (h0 - local.head_range()[0]) * head
    r_off = (h0 - remote.head_range()[0]) * head
    la = np.asarray(local.layer_addrs, dtype=np.int64)[:, None] + lb[None, :] * local.block_stride + l_off
    ra = np.asarray(remote.layer_addrs, dtype=np.int64)[:, None] + rb[None, :] * remote.block_stride + r_off
    desc = np.stack([la.ravel(), ra.ravel(), np.full(la.size, (h1 - h0) * head, dtype=np.int64)], axis=1)
    return merge_runs(desc)
