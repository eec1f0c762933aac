"""Recoverable fingerprints for multi-rank runs: every 8-byte word says which (layer, K/V, token, head, dim) it holds.

A decode rank can thus prove it holds exactly its share of heads and tokens. (`kvbridge_tools.bench.fingerprint`
hashes coordinates for the one-pair bench; here they must be readable back, across different parallel configs.)

A word packs layer (12 bits), kind (2 bits: K=1, V=2, latent=3, so a valid word is never 0),
global token (24 bits), global head (12 bits) and the dim of its first element (14 bits). A
rank's expected image is zero everywhere except its share of each request, so comparing a
whole buffer with the image proves the rank holds exactly its share: nothing missing, nothing
misplaced, nothing extra. Tokens past the end of a request (in its partial last block) stay 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from kvbridge.base.errors import ConfigError
from kvbridge.plan.descriptors import region_table
from kvbridge.plan.layout import KVLayout

KIND_CODE = {"k": 1, "v": 2, "latent": 3}
CODE_KIND = {v: k for k, v in KIND_CODE.items()}


@attrs.frozen
class Share:
    """What one rank holds of one request: its block ids, their logical blocks, its global heads."""

    block_ids: tuple[int, ...] = attrs.field(converter=tuple)
    logical_blocks: tuple[int, ...] = attrs.field(converter=tuple)
    heads: tuple[int, ...] = attrs.field(converter=tuple)
    tokens: int


def pack(layer: np.ndarray, kind: np.ndarray, token: np.ndarray, head: np.ndarray, dim: np.ndarray) -> np.ndarray:
    u = np.uint64
    return (
        (layer.astype(u) << u(52))
        | (kind.astype(u) << u(50))
        | (token.astype(u) << u(26))
        | (head.astype(u) << u(14))
        | dim.astype(u)
    )


def unpack(word: int) -> dict[str, object]:
    """The coordinates a word encodes (for error messages)."""
    w = int(word)
    return {
        "layer": w >> 52,
        "kind": CODE_KIND.get((w >> 50) & 3, "?"),
        "token": (w >> 26) & 0xFFFFFF,
        "head": (w >> 14) & 0xFFF,
        "dim": w & 0x3FFF,
    }


def _words(layout: KVLayout, base: int, share: Share) -> tuple[np.ndarray, np.ndarray]:
    """Word indices (into the buffer at `base`) and fingerprints of one share."""
    m = layout.model
    es = m.dtype_bytes
    row = m.head_dim * es
    if row % 8:
        raise ConfigError(f"fingerprints need head_dim * dtype bytes to be a multiple of 8, got {row}")
    t = region_table(layout)
    if (t[:, 6] == 0).any():
        raise ConfigError("fingerprints need a layout with heads (NHD/HND), not opaque buffers")
    # a "kv" region holds, per head, K then V of every token: an extra axis of two halves
    halves = 2 if layout.regions[0].kind == "kv" else 1
    if any((r.kind == "kv") != (halves == 2) for r in layout.regions):
        raise ConfigError("fingerprints need every region to be 'kv', or none")
    kinds = np.array([KIND_CODE.get(r.kind, 0) for r in layout.regions])
    layers = np.array([r.layer for r in layout.regions])
    ids = np.asarray(share.block_ids, dtype=np.int64)
    token = np.asarray(share.logical_blocks, dtype=np.int64)[:, None] * m.block_size + np.arange(m.block_size)
    heads = np.asarray(share.heads, dtype=np.int64)
    words = row // 8
    # axes: region, block, head, half (K/V of a "kv" region), token-in-block, word
    r_ax = (slice(None), None, None, None, None, None)
    b_ax = (None, slice(None), None, None, None, None)
    h = np.arange(len(heads))[None, None, :, None, None, None]
    half = np.arange(halves)[None, None, None, :, None, None]
    tok = np.arange(m.block_size)[None, None, None, None, :, None]
    w = np.arange(words)[None, None, None, None, None, :]
    nhd = t[:, 5] > 1
    head_step = t[:, 3][r_ax]  # head_bytes: a head's row (NHD) or its whole token slab (HND)
    tok_step = np.where(nhd, t[:, 2], row)[r_ax]
    offset = (
        (t[:, 0] - base)[r_ax]
        + ids[b_ax] * t[:, 1][r_ax]
        + h * head_step
        + half * (m.block_size * row)
        + tok * tok_step
        + w * 8
    )
    kind = kinds[r_ax] if halves == 1 else half + 1
    token6 = token[None, :, None, None, :, None]
    values = pack(layers[r_ax], kind, token6, heads[None, None, :, None, None, None], w * (8 // es))
    offset, values = np.broadcast_arrays(offset, values)
    valid = np.broadcast_to(token6 < share.tokens, offset.shape)
    if (offset[valid] % 8).any():
        raise ConfigError("fingerprints need 8-byte aligned rows")
    return offset[valid] // 8, values[valid]


def image(layout: KVLayout, buffer: np.ndarray, shares: Sequence[Share]) -> np.ndarray:
    """The uint64 image a buffer holding `layout` must equal when it holds exactly these shares."""
    base = buffer.ctypes.data
    if buffer.nbytes % 8 or base % 8:
        raise ConfigError("fingerprinted buffers must be 8-byte aligned and sized")
    out = np.zeros(buffer.nbytes // 8, dtype=np.uint64)
    for share in shares:
        idx, values = _words(layout, base, share)
        out[idx] = values
    return out


def fill(layout: KVLayout, buffer: np.ndarray, shares: Sequence[Share]) -> None:
    """Write the fingerprints of `shares` into `buffer` (a C-contiguous numpy array the layout lives in)."""
    buffer.reshape(-1).view(np.uint64)[:] = image(layout, buffer, shares)


def mismatches(layout: KVLayout, buffer: np.ndarray, shares: Sequence[Share], limit: int = 5) -> tuple[int, list[str]]:
    """(number of wrong words, descriptions of the first few) against the expected image."""
    expected = image(layout, buffer, shares)
    got = buffer.reshape(-1).view(np.uint64)
    bad = np.flatnonzero(got != expected)
    notes = [
        f"word {int(i)}: expected {unpack(expected[i]) if expected[i] else 'zero'}, "
        f"got {unpack(got[i]) if got[i] else 'zero'}"
        for i in bad[:limit]
    ]
    return len(bad), notes
