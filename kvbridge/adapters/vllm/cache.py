"""vLLM's paged KV cache as a kvbridge `KVLayout`, so `KVAgent` plans and moves it.

vLLM's CPU attention backend keeps one tensor per layer, shaped (num_blocks, kv_heads, block_size,
content) with blocks outermost and heads contiguous inside a block (layout LBHNC), where a token's
content is its K followed by its V. A head of a block (all its tokens' K and V) is therefore one
contiguous run: each layer is one HND region whose head payload is K and V together, described with
kind "k" and a model `head_dim` of the K+V content. Decode can then read exactly the heads each
prefill rank owns when their tensor-parallel sizes differ.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.layout import KVLayout, KVRegion
from kvbridge.presets import ModelSpec

_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "uint8": "uint8", "int8": "int8",
           "float8_e4m3fn": "fp8", "float8_e5m2": "fp8"}


def describe_kv_caches(
    kv_caches: Mapping[str, Any], *, block_size: int, tp_size: int
) -> tuple[KVLayout, list[tuple[int, int]]]:
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
    dtype = str(first.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ConfigError(f"KV cache dtype {dtype} is not one kvbridge knows ({sorted(_DTYPES)})")
    elem = first.element_size()
    model = ModelSpec("vllm", layers=len(tensors), kv_heads=heads * tp_size, head_dim=content,
                      dtype=_DTYPES[dtype], block_size=block_size)
    head_bytes = tokens * content * elem
    regions = [
        KVRegion(layer, "k", t.data_ptr(), num_blocks, stride[0] * elem, heads * head_bytes,
                 heads=heads, head_bytes=head_bytes)
        for layer, t in enumerate(tensors)
    ]
    return KVLayout(model, heads, regions), sorted(storages.items())
