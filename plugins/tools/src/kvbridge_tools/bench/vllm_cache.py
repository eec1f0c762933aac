"""KV caches allocated the way vLLM 0.32's model runner allocates them, for a `KVCacheLayout` name.

vLLM's own functions do the work (`compute_layout_strides`, `KVCacheConfig`, `allocate_kv_cache`),
exactly as `get_kv_cache_config` and `GPUModelRunner.initialize_kv_cache_tensors` call them, so the
per-layer views are the ones a real engine hands to `register_kv_caches`. "ascend-kv-tuple" is
vllm-ascend's: a `(K, V)` pair of `(num_blocks, block_size, num_kv_heads, head_size)` tensors per layer.

`fill` and `expected` give a request's fingerprinted logical KV `[L, n, H, N, C bytes]`: every byte
encodes (request, layer, global head, token, content byte), whatever the layout.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvbridge.adapters.vllm.cache import ASCEND_KV_TUPLE
from kvbridge.plan.presets import ModelSpec
from kvbridge_tools.bench.fingerprint import fingerprint

TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "fp8": "float8_e4m3fn"}


def layer_names(layers: range) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in layers]


def allocate(
    layout: str,
    model: ModelSpec,
    heads: int,
    num_blocks: int,
    block_size: int,
    device: str = "cpu",
    *,
    layers: range | None = None,
    cache_dtype: str = "auto",
) -> tuple[dict[str, Any], Any]:
    """Per-layer KV cache views of one rank as vLLM 0.32 (or vllm-ascend) allocates them, and the `KVCacheConfig`.

    That `KVCacheConfig` is the one vLLM hands its connector.

    `device` is a torch device string (``cuda:0``; a string, so a stand-in's ``torch.zeros`` serves it);
    `layers`: this pipeline stage's layers (default all); `cache_dtype`: vLLM's kv_cache_dtype (fp8
    ones allocate uint8, as vLLM does).
    """
    import torch
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MLAAttentionSpec,
        compute_layout_strides,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    if cache_dtype == "auto":
        dtype = getattr(torch, TORCH_DTYPES[model.dtype])
    else:
        dtype = STR_DTYPE_TO_TORCH_DTYPE[cache_dtype]
    layers = layers if layers is not None else range(model.layers)
    names = layer_names(layers)
    if model.attention == "mla":
        spec: Any = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=model.head_dim, dtype=dtype)
    else:
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=model.head_dim, dtype=dtype)
    kv_layout = KVCacheLayout["LBNHC" if layout == ASCEND_KV_TUPLE else layout]
    bytes_per_block = len(layers) * spec.page_size_bytes
    interleaved = bytes_per_block if kv_layout.is_block_outermost else None
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, num_blocks, len(layers), kv_layout, fixed_strides=(None, interleaved, None, None, None)
    )
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=bytes_per_block * num_blocks, layers=names, layer_stride=layer_stride, block_stride=block_stride
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )
    if layout == ASCEND_KV_TUPLE:  # vllm-ascend: its own K and V tensors per layer
        return {
            n: tuple(
                torch.zeros(num_blocks, block_size, heads, model.head_dim, dtype=dtype, device=device) for _ in range(2)
            )
            for n in names
        }, config
    return allocate_kv_cache(config, device, kv_layout), config  # type: ignore[arg-type]


def logical(
    model: ModelSpec, request: int, tokens: int, heads: range, block_size: int, layers: range | None = None
) -> np.ndarray:
    """A request's fingerprinted KV `[L, n, len(heads), block_size, C]` (uint8) for the given global heads.

    It covers the given `layers` (default all); tokens past the request's end are zero.
    """
    content = model.kv_tensors * model.head_dim * model.dtype_bytes
    n = -(-tokens // block_size)
    total_heads = 1 if model.attention == "mla" else model.kv_heads
    layers = layers if layers is not None else range(model.layers)
    layer = np.asarray(list(layers), dtype=np.uint64)[:, None, None, None]
    head = np.asarray(list(heads), dtype=np.uint64)[None, :, None, None]
    token = np.arange(n * block_size, dtype=np.uint64)[None, None, :, None]
    byte = np.arange(content, dtype=np.uint64)[None, None, None, :]
    coord = (
        ((np.uint64(request) * np.uint64(model.layers) + layer) * np.uint64(total_heads) + head) * np.uint64(1 << 20)
        + token
    ) * np.uint64(content) + byte
    values = fingerprint(coord, 1)
    values[:, :, tokens:] = 0
    return values.reshape(len(layers), len(heads), n, block_size, content).transpose(0, 2, 1, 3, 4).copy()
