"""Descriptors for one pull: numpy arrays over (region, block, chunk), merged into runs.

Nothing here loops in Python per layer or per block: the regions of a layout are grouped by
how many pieces a head slice has (one group in practice), and each group is one broadcast.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from kvbridge.errors import ConfigError, LayoutMismatch
from kvbridge.layout import KVLayout, check_compatible
from kvbridge.memory import Descriptors, merge_runs
from kvbridge.topology import Pull


def pull_descriptors(
    pull: Pull,
    local: KVLayout,
    remote: KVLayout,
    local_blocks: Sequence[int] | np.ndarray,
    remote_blocks: Sequence[int] | np.ndarray,
) -> Descriptors:
    """(local_addr, remote_addr, length) rows that read `pull` from the remote rank into this one.

    `local_blocks` / `remote_blocks` are the request's block ids on each rank, in the rank's
    block order (position i holds the rank's i-th block of the request). Runs of consecutive
    blocks that are contiguous on both sides become one descriptor.
    """
    _check(local, remote)
    dst = _pick(local_blocks, pull.dst_positions(), local.num_blocks, "local", pull)
    src = _pick(remote_blocks, pull.src_positions(), remote.num_blocks, "remote", pull)
    whole = pull.src_heads == (0, remote.heads) and pull.dst_heads == (0, local.heads)
    n_heads = pull.src_heads[1] - pull.src_heads[0]
    if n_heads != pull.dst_heads[1] - pull.dst_heads[0]:
        raise ConfigError(f"pull {pull} reads {n_heads} heads into a different number of heads")

    # one row per region: base, block stride, piece stride, head offset (local, then remote), piece length, pieces
    lt, rt = region_table(local), region_table(remote)
    zero = np.zeros(len(lt), dtype=np.int64)
    if whole:  # one piece of block_bytes per block
        table = np.stack([lt[:, 0], lt[:, 1], zero, zero, rt[:, 0], rt[:, 1], zero, zero, lt[:, 4], zero + 1], axis=1)
    else:
        opaque = np.flatnonzero(lt[:, 6] == 0)
        if len(opaque):
            i = int(opaque[0])
            raise LayoutMismatch(
                f"regions[{i}].heads",
                0,
                int(rt[i, 6]),
                "This cache is opaque (no head slicing) but the two sides hold different heads; "
                "use the same TP on both sides or a layout with heads (NHD/HND)",
            )
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
        col = lambda j, t=t: t[:, j, None, None]  # noqa: E731 - (regions, 1, 1) for broadcasting
        k = np.arange(pieces, dtype=np.int64)[None, None, :]
        local_addr = col(0) + dst[None, :, None] * col(1) + k * col(2) + col(3)
        remote_addr = col(4) + src[None, :, None] * col(5) + k * col(6) + col(7)
        length = np.broadcast_to(col(8), local_addr.shape)
        parts.append(np.stack([local_addr.ravel(), remote_addr.ravel(), length.ravel()], axis=1))
    desc = np.concatenate(parts)
    # in local address order, so a block of every layer (block-outermost layouts) becomes one run
    return merge_runs(desc[np.argsort(desc[:, 0], kind="stable")])


@functools.lru_cache(maxsize=64)
def _check(local: KVLayout, remote: KVLayout) -> None:
    check_compatible(local, remote)


@functools.lru_cache(maxsize=64)
def region_table(layout: KVLayout) -> np.ndarray:
    """(regions, 7) int64: addr, block_stride, chunk_stride, head_bytes, block_bytes, chunks, heads."""
    cols = ("addr", "block_stride", "chunk_stride", "head_bytes", "block_bytes", "chunks", "heads")
    table = np.array([[getattr(r, c) for c in cols] for r in layout.regions], dtype=np.int64)
    table.flags.writeable = False
    return table


def _pick(
    blocks: Sequence[int] | np.ndarray, positions: np.ndarray, capacity: int, side: str, pull: Pull
) -> np.ndarray:
    ids = np.asarray(blocks, dtype=np.int64)
    if len(positions) and positions[-1] >= len(ids):
        raise ConfigError(
            f"the {side} rank holds {len(ids)} blocks of this request but pull from prefill rank "
            f"{pull.prefill_rank} to decode rank {pull.decode_rank} needs position {int(positions[-1])}; "
            "pass the request's block ids of that rank in order"
        )
    picked = ids[positions]
    if len(picked) and (picked.min() < 0 or picked.max() >= capacity):
        raise ConfigError(f"{side} block id out of range [0, {capacity}) in {picked.tolist()[:8]}...")
    return picked
