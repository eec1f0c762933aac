"""vLLM's paged KV cache as a kvbridge `KVLayout`, so `KVAgent` plans and moves it. See docs/internals.md."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvbridge.base.errors import ConfigError
from kvbridge.plan.layout import KVLayout, PagedGeometry, PagedPlane, paged_layout
from kvbridge.plan.presets import ModelSpec

_DTYPES = {
    "float32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "uint8": "uint8",
    "int8": "int8",
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
}
# vLLM's kv_cache_dtype names of fp8 caches, which it allocates as uint8 tensors (STR_DTYPE_TO_TORCH_DTYPE):
# the name, not the tensor, says the format, so prefill e4m3 and decode e5m2 are told apart
FP8_CACHE_DTYPES = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
ASCEND_KV_TUPLE = "ascend-kv-tuple"
# physical order of the logical [L, B, H, N, C] axes, as vllm.v1.kv_cache_layout.KVCacheLayout defines them
ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
    ASCEND_KV_TUPLE: (0, 1, 3, 2, 4),
}
LAYOUT_NAMES = tuple(ORDERS)
# What KVBridgeConnector asks vLLM for on CUDA in pull mode unless told otherwise (connector.default_kv_cache_layout):
# block-outermost, so one block of every layer is one contiguous run (one descriptor per block).
CUDA_DEFAULT_LAYOUT = "BLHNC"


def resolved_layout(vllm_config: Any) -> str:
    """The KV cache layout name vLLM resolved for this engine (the CPU backend's LBHNC on vLLMs before 0.32)."""
    get = getattr(vllm_config.cache_config, "get_resolved_kv_cache_layout", None)
    return "LBHNC" if get is None else get().name


def describe_kv_caches(
    kv_caches: Mapping[str, Any],
    *,
    layout: str,
    block_size: int,
    tp_size: int,
    mla: bool = False,
    backend: str = "vLLM",
    cache_dtype: str = "auto",
) -> tuple[KVLayout, list[tuple[int, int]]]:
    """The layout of vLLM's per-layer KV views and the (address, bytes) storages to register. See docs/internals.md."""
    if layout not in ORDERS:
        raise ConfigError(
            f"KV cache layout {layout!r} of {backend} is not one kvbridge can move; "
            f"supported: {', '.join(LAYOUT_NAMES)}. Set VLLM_KV_CACHE_LAYOUT to one of them"
        )
    if not kv_caches:
        raise ConfigError("vLLM registered no KV cache tensors with KVBridgeConnector")
    names = list(kv_caches)
    if layout == ASCEND_KV_TUPLE:
        entries = [kv_caches[n] for n in names]
        if not all(isinstance(e, (tuple, list)) and len(e) == 2 for e in entries):
            raise ConfigError(f"{backend} layout {layout}: every layer must be a (K, V) pair of tensors")
        # vllm-ascend: (num_blocks, block_size, num_kv_heads, head_size) -> logical [B, H, N, D]
        planes_t = [[e[i].permute(0, 2, 1, 3) for e in entries] for i in (0, 1)]
        kinds = ("k", "v")
    else:
        if any(isinstance(kv_caches[n], (tuple, list)) for n in names):
            raise ConfigError(
                f"{backend} hands (K, V) tuples per layer, but the resolved layout is {layout}; "
                f"pass layout={ASCEND_KV_TUPLE!r} for vllm-ascend caches"
            )
        planes_t = [[kv_caches[n] for n in names]]
        kinds = ("latent",) if mla else ("kv",)
    first = planes_t[0][0]
    dtype = str(first.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ConfigError(f"KV cache dtype {dtype} is not one kvbridge knows ({sorted(_DTYPES)})")
    elem = first.element_size()
    kv_dtype = _DTYPES[dtype]
    if cache_dtype in FP8_CACHE_DTYPES:
        if elem != 1:
            raise ConfigError(f"kv_cache_dtype {cache_dtype} but the KV cache tensors are {dtype}, not one byte each")
        kv_dtype = FP8_CACHE_DTYPES[cache_dtype]
    storages: dict[int, int] = {}
    planes = []
    for kind, tensors in zip(kinds, planes_t):
        ref = tensors[0]
        for name, t in zip(names, tensors):
            if t.ndim != 4 or t.shape != ref.shape or t.stride() != ref.stride() or t.dtype != first.dtype:
                raise ConfigError(
                    f"{backend} layout {layout}: KV cache view {name} has shape {tuple(t.shape)}, stride {t.stride()}, "
                    f"dtype {t.dtype}, unlike the first layer's {tuple(ref.shape)}, {ref.stride()}; kvbridge "
                    "needs every layer laid out alike. Report this layout to kvbridge"
                )
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        _check_order(ref, layout, backend)
        num_blocks, heads, tokens, content = (int(v) for v in ref.shape)
        if tokens != block_size:
            raise ConfigError(
                f"{backend} layout {layout}: KV cache blocks hold {tokens} tokens but the block size is {block_size}"
            )
        sb, sh, sn, _ = (int(v) * elem for v in ref.stride())
        planes.append(PagedPlane(kind, content * elem, tuple(t.data_ptr() for t in tensors), sb, sh, sn))
    num_blocks, heads, _, content = (int(v) for v in first.shape)
    total = sum(p.content for p in planes) // elem
    geometry = PagedGeometry(layout, ORDERS[layout], num_blocks, heads, block_size, planes)
    model = ModelSpec(
        "vllm",
        layers=len(names),
        kv_heads=1 if mla else heads * tp_size,
        head_dim=total,
        dtype=kv_dtype,
        block_size=block_size,
        attention="mla" if mla else "gqa",
    )
    return paged_layout(model, geometry), sorted(storages.items())


def _check_order(view: Any, layout: str, backend: str) -> None:
    """The view's strides must order [B, H, N, C] as `layout` does, content innermost and dense."""
    order = [d - 1 for d in ORDERS[layout] if d != 0]  # physical order of the per-layer view's axes
    strides = view.stride()
    if strides[3] != 1:
        raise ConfigError(
            f"{backend} layout {layout}: a token's content is not contiguous (stride {strides}); "
            "kvbridge cannot address it"
        )
    seen = [strides[d] for d in order if view.shape[d] > 1]
    if seen != sorted(seen, reverse=True):
        raise ConfigError(
            f"{backend} says the KV cache layout is {layout}, but its views have strides {strides} for shape "
            f"{tuple(view.shape)} (block, head, token, content), which is not {layout}; report this to kvbridge"
        )


def byte_views(kv_caches: Mapping[str, Any], *, layout: str) -> list[list[Any]]:
    """Per plane, per layer, a uint8 view `[B, H, N, content bytes]` of the cache.

    What `kvbridge.agent.landing` writes pulled blocks into, and the bench fills and checks."""
    entries = list(kv_caches.values())
    if layout == ASCEND_KV_TUPLE:
        return [[e[i].permute(0, 2, 1, 3).view(torch_uint8()) for e in entries] for i in (0, 1)]
    return [[t.view(torch_uint8()) for t in entries]]


def torch_uint8() -> Any:
    import torch

    return torch.uint8
