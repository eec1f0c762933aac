"""Paged cache geometry from vLLM-style per-layer views, its refusals, and the landing path's descriptors."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvbridge.adapters.vllm.cache import ORDERS, describe_kv_caches  # noqa: E402
from kvbridge.errors import ConfigError  # noqa: E402
from kvbridge.landing import direct, landing_descriptors  # noqa: E402

L, B, H, N, C = 2, 6, 4, 16, 8  # C: K+V elements of fp16


def views(layout: str) -> dict[str, torch.Tensor]:
    """Per-layer [B, H, N, C] views of one buffer laid out in `layout`'s physical order, as vLLM does."""
    order = ORDERS[layout]
    sizes = (L, B, H, N, C)
    buf = torch.zeros(L * B * H * N * C, dtype=torch.float16)
    strides, cur = [0] * 5, 1
    for d in reversed(order):
        strides[d], cur = cur, cur * sizes[d]
    full = torch.as_strided(buf, sizes, strides)
    return {f"layer{i}": full[i] for i in range(L)}


@pytest.mark.parametrize("layout", [n for n in ORDERS if n != "ascend-kv-tuple"])
def test_each_layout_is_read_and_landed_in_few_runs(layout: str) -> None:
    kv, _ = describe_kv_caches(views(layout), layout=layout, block_size=N, tp_size=1)
    assert kv.paged is not None and kv.paged.name == layout and kv.heads == H
    desc, _planes, nbytes = landing_descriptors(kv.paged, np.arange(2, 5))  # three consecutive blocks
    assert nbytes == L * 3 * H * N * C * 2 and int(desc[:, 2].sum()) == nbytes
    expected = {"LBHNC": L, "LBNHC": L, "LHBNC": L * H, "BLHNC": 1, "BLNHC": 1, "BHLNC": 1}[layout]
    assert len(desc) == expected


def test_a_view_that_is_not_the_named_layout_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError, match="FLASH_ATTN says the KV cache layout is LBHNC"):
        describe_kv_caches(views("LBNHC"), layout="LBHNC", block_size=N, tp_size=1, backend="FLASH_ATTN")
    with pytest.raises(ConfigError, match="'XYZ' of FLASHINFER is not one kvbridge can move"):
        describe_kv_caches(views("LBNHC"), layout="XYZ", block_size=N, tp_size=1, backend="FLASHINFER")


def test_only_like_arrangements_go_direct() -> None:
    a, _ = describe_kv_caches(views("LBNHC"), layout="LBNHC", block_size=N, tp_size=1)
    b, _ = describe_kv_caches(views("BLNHC"), layout="BLNHC", block_size=N, tp_size=1)
    assert direct(a, a) and not direct(a, b) and not direct(b, a)
