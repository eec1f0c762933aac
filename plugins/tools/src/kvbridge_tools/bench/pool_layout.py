"""The pair bench's KV pool laid out as a vLLM `KVCacheLayout`, and the descriptors a request needs in it.

vLLM 0.32 orders the logical `[L, B, H, N, C]` axes (layer, block, head, token, content: a token's K
then its V) physically by one of six stride orders (`kvbridge.adapters.vllm.cache.ORDERS`). What a
request's transfer costs depends on that order: the physical axes after B are one contiguous run per
block (a "unit"), the axes before B repeat it. Layer-outermost layouts (LBHNC, LBNHC) have a 64 KiB
unit per (layer, block) for llama3-8b at block 16; LHBNC one of 8 KiB per (layer, head, block);
block-outermost ones (BLHNC, BLNHC, BHLNC) one unit per block holding every layer (2 MiB).
"ascend-kv-tuple" is vllm-ascend's separate K and V tensor per layer: a unit per (K/V, layer, block).
"""

from __future__ import annotations

import itertools
import math

import attrs
import numpy as np

from kvbridge.adapters.vllm.cache import ASCEND_KV_TUPLE, CUDA_DEFAULT_LAYOUT, LAYOUT_NAMES, ORDERS
from kvbridge.base.errors import ConfigError
from kvbridge.plan.presets import ModelSpec
from kvbridge_tools.bench.fingerprint import element_dtype

DEFAULT_LAYOUT = CUDA_DEFAULT_LAYOUT  # what KVBridgeConnector asks vLLM for on a CUDA deployment by default
B_AXIS = 1  # the block axis in the logical [L, B, H, N, C] order


def describe(name: str) -> str:
    """One line on what a layout means for a request's descriptors (the bench's --help)."""
    order = ORDERS[name]
    if name == ASCEND_KV_TUPLE:
        return f"{name}: separate K and V per layer (vllm-ascend), one descriptor per (K/V, layer, block)"
    outer = "".join("LBHNC"[a] for a in order[: order.index(B_AXIS)])
    per = ", ".join({"L": "layer", "H": "head"}[a] for a in outer)
    return f"{name}: one descriptor per {'(' + per + ', block)' if per else 'block, every layer in it'}"


@attrs.frozen
class PoolLayout:
    """One side's pool of `blocks` blocks of `spec`'s KV, laid out as `name`, in one flat allocation."""

    name: str
    spec: ModelSpec
    blocks: int

    def __attrs_post_init__(self) -> None:
        if self.name not in ORDERS:
            raise ConfigError(f"unknown KV cache layout {self.name!r}; known: {', '.join(LAYOUT_NAMES)}")

    @property
    def logical_shape(self) -> tuple[int, int, int, int, int]:
        """[T, B, H, N, C] in elements: T is the layers (x K/V for separate K and V tensors)."""
        s = self.spec
        if self.name == ASCEND_KV_TUPLE:
            return (s.kv_tensors * s.layers, self.blocks, s.kv_heads, s.block_size, s.head_dim)
        return (s.layers, self.blocks, s.kv_heads, s.block_size, s.kv_tensors * s.head_dim)

    @property
    def order(self) -> tuple[int, ...]:
        return ORDERS[self.name]

    @property
    def strides(self) -> tuple[int, ...]:
        """Byte strides of the logical axes (physical order dense, C-contiguous)."""
        shape = self.logical_shape
        out = [0] * 5
        step = self.spec.dtype_bytes
        for axis in reversed(self.order):
            out[axis] = step
            step *= shape[axis]
        return tuple(out)

    @property
    def nbytes(self) -> int:
        return math.prod(self.logical_shape) * self.spec.dtype_bytes

    @property
    def unit_bytes(self) -> int:
        """Bytes of one contiguous run of a block: the physical axes after the block axis."""
        return self.strides[B_AXIS]

    @property
    def outer_offsets(self) -> np.ndarray:
        """Byte offset of each run of block 0, over the physical axes before the block axis, outermost first."""
        outer = self.order[: self.order.index(B_AXIS)]
        shape, strides = self.logical_shape, self.strides
        combos = itertools.product(*(range(shape[a]) for a in outer))
        return np.array([sum(i * strides[a] for i, a in zip(c, outer)) for c in combos], dtype=np.int64)

    @property
    def units_per_block(self) -> int:
        return len(self.outer_offsets)

    def unit_offsets(self, blocks: list[int]) -> np.ndarray:
        """Byte offsets of a request's runs, every run of its first block's outer index before the next."""
        b = np.asarray(blocks, dtype=np.int64)[None, :] * self.unit_bytes
        return (self.outer_offsets[:, None] + b).reshape(-1)

    def element_view(self, host: np.ndarray) -> np.ndarray:
        """Writable logical [T, B, H, N, C] element view of a host copy of the pool."""
        flat = host.view(element_dtype(self.spec.dtype_bytes))
        return np.lib.stride_tricks.as_strided(flat, shape=self.logical_shape, strides=self.strides)
