"""Fingerprinted KV values: every element is a hash of its coordinates.

A byte that lands in the wrong place (wrong request, layer, K/V, token, head or dim) is thus caught on verification.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_ELEMENT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def element_dtype(nbytes: int) -> np.dtype:
    return np.dtype(_ELEMENT[nbytes])


def fingerprint(coords: np.ndarray, nbytes: int) -> np.ndarray:
    """Hash unique uint64 coordinate ids into elements of `nbytes` bytes (multiply-xorshift)."""
    with np.errstate(over="ignore"):
        x = coords.astype(np.uint64) * _GOLDEN
        x ^= x >> np.uint64(29)
        x *= _GOLDEN
        x ^= x >> np.uint64(32)
    return x.astype(element_dtype(nbytes))


def block_values(
    *, request: int, tensor: int, n_tensors: int, blocks: int, block_elems: int, nbytes: int
) -> np.ndarray:
    """Values of one request's blocks in one KV tensor, shape (blocks, block_elems).

    The coordinate id is (request, tensor, token-major element index) packed in 64 bits; the
    element index covers token, head and dim, so each element of a request is unique.
    """
    base = (np.uint64(request) * np.uint64(n_tensors) + np.uint64(tensor)) << np.uint64(40)
    idx = np.arange(blocks * block_elems, dtype=np.uint64).reshape(blocks, block_elems)
    return fingerprint(idx + base, nbytes)
