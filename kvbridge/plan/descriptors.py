"""Descriptors for one pull, factored: a table per group of regions, times the block runs. See docs/internals.md."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from kvbridge.base.block_ids import block_array
from kvbridge.base.errors import ConfigError, LayoutMismatch
from kvbridge.base.memory import L_BASE, L_BLOCK, LENGTH, PIECES, R_BASE, R_BLOCK, DescriptorGroup, FactoredDescriptors
from kvbridge.plan.layout import KVLayout, check_compatible
from kvbridge.plan.topology import Pull


def pull_descriptors(
    pull: Pull,
    local: KVLayout,
    remote: KVLayout,
    local_blocks: Sequence[int] | np.ndarray,
    remote_blocks: Sequence[int] | np.ndarray,
) -> FactoredDescriptors:
    """The (local_addr, remote_addr, length) rows that read `pull` from the remote rank. See docs/internals.md."""
    tables = _tables(local, remote, pull.src_heads, pull.dst_heads)
    dst = _pick(local_blocks, pull.dst_positions(), local.num_blocks, "local", pull)
    src = _pick(remote_blocks, pull.src_positions(), remote.num_blocks, "remote", pull)
    if not len(dst):
        return FactoredDescriptors()
    singles = (dst, src, np.ones(len(dst), dtype=np.int64))
    runs = _runs(dst, src, local.num_blocks) if any(tiles for _, tiles in tables) else singles
    return FactoredDescriptors(tuple(DescriptorGroup(t, *(runs if tiles else singles)) for t, tiles in tables))


def _runs(dst: np.ndarray, src: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first local block, first remote block, length) of runs consecutive on both sides. See docs/internals.md."""
    if len(dst) > 1 and (np.diff(dst) < 0).any():
        at = np.full(capacity + 1, -1, dtype=np.int64)
        at[dst] = np.arange(len(dst))
        after = at[dst + 1]  # the position holding the next local block, -1 if none
        if not ((after >= 0) & (src[after] == src + 1)).any():
            return dst, src, np.ones(len(dst), dtype=np.int64)
        order = np.argsort(dst)
        dst, src = dst[order], src[order]
    starts = np.flatnonzero(np.concatenate(([True], (np.diff(dst) != 1) | (np.diff(src) != 1))))
    return dst[starts], src[starts], np.diff(np.append(starts, len(dst)))


@functools.lru_cache(maxsize=256)
def _tables(
    local: KVLayout, remote: KVLayout, src_heads: tuple[int, int], dst_heads: tuple[int, int]
) -> tuple[tuple[np.ndarray, bool], ...]:
    """Factored tables of one (layout pair, head ranges), one per number of pieces a block is cut into.

    Each says whether its pieces tile their blocks on both sides (then a run of blocks is one row)."""
    check_compatible(local, remote)
    n_heads = src_heads[1] - src_heads[0]
    if n_heads != dst_heads[1] - dst_heads[0]:
        raise ConfigError(f"a pull reads {n_heads} heads {src_heads} into heads {dst_heads}: the counts differ")
    lt, rt = region_table(local), region_table(remote)
    zero = np.zeros(len(lt), dtype=np.int64)
    if src_heads == (0, remote.heads) and dst_heads == (0, local.heads):  # whole blocks: one piece each
        table = np.stack([lt[:, 0], lt[:, 1], zero, rt[:, 0], rt[:, 1], zero, lt[:, 4], zero + 1], axis=1)
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
                lt[:, 0] + dst_heads[0] * lt[:, 3],
                lt[:, 1],
                lt[:, 2],
                rt[:, 0] + src_heads[0] * rt[:, 3],
                rt[:, 1],
                rt[:, 2],
                n_heads * lt[:, 3],
                lt[:, 5],
            ],
            axis=1,
        )
    out = []
    for pieces in np.unique(table[:, PIECES]).tolist():
        t = _chain(table[table[:, PIECES] == pieces])
        tiles = (t[:, PIECES] == 1) & (t[:, LENGTH] == t[:, L_BLOCK]) & (t[:, LENGTH] == t[:, R_BLOCK])
        out.extend((_frozen(t[m]), flag) for m, flag in ((tiles, True), (~tiles, False)) if m.any())
    return tuple(out)


def _chain(t: np.ndarray) -> np.ndarray:
    """Join regions of one piece per block whose piece starts where the previous one's ends, on both sides.

    They must have the same block strides: every layer of a block in block-outermost layouts is one piece."""
    if len(t) < 2 or t[0, PIECES] != 1:
        return t
    t = t[np.argsort(t[:, L_BASE], kind="stable")]
    follows = (
        (t[1:, L_BASE] == t[:-1, L_BASE] + t[:-1, LENGTH])
        & (t[1:, R_BASE] == t[:-1, R_BASE] + t[:-1, LENGTH])
        & (t[1:, L_BLOCK] == t[:-1, L_BLOCK])
        & (t[1:, R_BLOCK] == t[:-1, R_BLOCK])
    )
    starts = np.flatnonzero(np.concatenate(([True], ~follows)))
    out = t[starts]
    out[:, LENGTH] = np.add.reduceat(t[:, LENGTH], starts)
    return out


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    a.flags.writeable = False
    return a


@functools.lru_cache(maxsize=64)
def region_table(layout: KVLayout) -> np.ndarray:
    """(regions, 7) int64: addr, block_stride, chunk_stride, head_bytes, block_bytes, chunks, heads."""
    cols = ("addr", "block_stride", "chunk_stride", "head_bytes", "block_bytes", "chunks", "heads")
    return _frozen(np.array([[getattr(r, c) for c in cols] for r in layout.regions], dtype=np.int64))


def _pick(
    blocks: Sequence[int] | np.ndarray, positions: np.ndarray, capacity: int, side: str, pull: Pull
) -> np.ndarray:
    ids = block_array(blocks)
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
