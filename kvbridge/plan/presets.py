"""Model facts that shape a KV cache, and the presets the bench and tests use."""

from __future__ import annotations

import attrs

from kvbridge.base.errors import ConfigError

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1, "uint8": 1}


@attrs.frozen
class ModelSpec:
    """What decides the shape of a model's KV cache (whole model, before any parallelism)."""

    name: str
    layers: int
    kv_heads: int  # for MLA: 1 latent "head"
    head_dim: int  # for MLA: kv_lora_rank + rope dim
    dtype: str = "bf16"
    block_size: int = 16  # tokens per block
    attention: str = "gqa"  # "gqa" (MHA/GQA: separate K and V) or "mla" (one latent cache)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_tensors(self) -> int:
        """Tensors per layer: K and V, or the one MLA latent cache."""
        return 1 if self.attention == "mla" else 2

    def bytes_per_token(self) -> int:
        return self.layers * self.kv_tensors * self.kv_heads * self.head_dim * self.dtype_bytes


PRESETS: dict[str, ModelSpec] = {
    p.name: p
    for p in (
        ModelSpec("llama3-8b", layers=32, kv_heads=8, head_dim=128, dtype="bf16", block_size=16),
        ModelSpec("qwen2.5-32b", layers=64, kv_heads=8, head_dim=128, dtype="bf16", block_size=16),
        ModelSpec("small", layers=4, kv_heads=8, head_dim=128, dtype="bf16", block_size=16),
        ModelSpec("tiny-gqa", layers=2, kv_heads=16, head_dim=8, dtype="fp16", block_size=16),
        ModelSpec("tiny-mla", layers=2, kv_heads=1, head_dim=32, dtype="fp16", block_size=16, attention="mla"),
        ModelSpec("deepseek-v3", layers=61, kv_heads=1, head_dim=576, dtype="bf16", block_size=64, attention="mla"),
    )
}


def get_preset(name: str) -> ModelSpec:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}") from None
