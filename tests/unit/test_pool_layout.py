"""The pair bench's KV pool in each vLLM layout: where a block's bytes are, and what a request costs in descriptors."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.adapters.vllm.cache import LAYOUT_NAMES
from kvbridge.base.errors import ConfigError
from kvbridge.plan.presets import get_preset
from kvbridge_tools.bench.pair import descriptor_count
from kvbridge_tools.bench.pool_layout import PoolLayout, describe


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_a_blocks_runs_hold_exactly_that_blocks_elements(name: str) -> None:
    layout = PoolLayout(name, get_preset("tiny-gqa"), blocks=5)
    host = np.zeros(layout.nbytes, dtype=np.uint8)
    view = layout.element_view(host)
    view[...] = np.arange(view.size, dtype=np.uint64).reshape(view.shape)  # every element distinct
    assert np.unique(host.view(view.dtype)).size == view.size  # the view covers the pool once
    for block in (0, 3, 4):
        runs = [host[o : o + layout.unit_bytes] for o in layout.unit_offsets([block])]
        moved = np.concatenate(runs).view(view.dtype)
        assert np.array_equal(np.sort(moved), np.sort(view[:, block].reshape(-1)))


def test_descriptors_per_block_of_llama3_8b() -> None:
    spec = get_preset("llama3-8b")  # block 16, 8 KV heads of 128 dims, bf16: 64 KiB per layer's page
    expect = {
        "LBHNC": (32, 64 << 10),
        "LBNHC": (32, 64 << 10),
        "LHBNC": (32 * 8, 8 << 10),
        "BLHNC": (1, 2 << 20),
        "BLNHC": (1, 2 << 20),
        "BHLNC": (1, 2 << 20),
        "ascend-kv-tuple": (64, 32 << 10),
    }
    for name, (units, nbytes) in expect.items():
        layout = PoolLayout(name, spec, blocks=300)
        assert (layout.units_per_block, layout.unit_bytes) == (units, nbytes), name
        assert units * nbytes == spec.bytes_per_token() * spec.block_size
    assert "one descriptor per block" in describe("BLHNC") and "(layer, head, block)" in describe("LHBNC")
    # a fragmented 4096-token request, direct, in 1 MiB pieces: 256 blocks x 2 pieces vs 8192 pages
    rng = np.random.default_rng(0)
    src, dst = rng.permutation(1000)[:256].tolist(), rng.permutation(1000)[:256].tolist()
    assert descriptor_count(src, dst, 1, 2 << 20, 1 << 20) == 512
    assert descriptor_count(src, dst, 32, 64 << 10, 1 << 20) >= 32 * 250  # a few blocks may be adjacent on both


def test_an_unknown_layout_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="unknown KV cache layout 'HND'.*LBHNC.*BLHNC"):
        PoolLayout("HND", get_preset("small"), blocks=4)
