"""A two-process migration through kvbridge's Python API alone, over the built-in tcp transport.

`python api_migration.py` is the decode side: it starts `python api_migration.py prefill` (the prefill
side, a process of its own), pulls four of its blocks into other slots with `KVAgent.pull` and checks
every byte. It prints one JSON line. Standard library, numpy and kvbridge only: it runs in a virtualenv
that holds the library and nothing else (tests/integration/test_library_alone.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np

import kvbridge
from kvbridge.agent.kv_agent import KVAgent, RankInfo
from kvbridge.plan.layout import KVLayout, vllm_layout
from kvbridge.plan.presets import PRESETS
from kvbridge.plan.topology import ParallelConfig

MODEL = PRESETS["tiny-gqa"]
BLOCKS = 8


def cache(seed: int) -> tuple[np.ndarray, KVLayout]:
    """A host KV cache in vLLM's layout, filled from `seed` (the two sides differ everywhere)."""
    layer = 2 * BLOCKS * MODEL.kv_heads * MODEL.block_size * MODEL.head_dim * MODEL.dtype_bytes
    buf = np.random.default_rng(seed).integers(0, 256, MODEL.layers * layer, dtype=np.uint8)
    return buf, vllm_layout(MODEL, MODEL.kv_heads, [buf.ctypes.data + i * layer for i in range(MODEL.layers)], BLOCKS)


def block_bytes(buf: np.ndarray, layout: KVLayout, ids: list[int]) -> bytes:
    base = buf.ctypes.data
    return b"".join(
        buf[r.addr - base + b * r.block_stride :][: r.block_bytes].tobytes() for r in layout.regions for b in ids
    )


def agent(engine: str, buf: np.ndarray, layout: KVLayout) -> KVAgent:
    return KVAgent(engine, 0, ParallelConfig(), layout, buf, backend="tcp")


def prefill() -> None:
    buf, layout = cache(1)
    with agent("prefill", buf, layout) as a:
        print(a.info().encode().hex(), flush=True)
        sys.stdin.readline()  # held until the decode side has pulled


def decode() -> dict[str, Any]:
    child = subprocess.Popen([sys.executable, __file__, "prefill"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdin is not None
        info = RankInfo.decode(bytes.fromhex(child.stdout.readline().decode()))
        buf, layout = cache(2)
        src, dst = [6, 1, 4, 3], [0, 2, 5, 7]
        with agent("decode", buf, layout) as a:
            result = a.pull("req-0", [info], src, dst, len(src) * MODEL.block_size).wait(30)
        expected = block_bytes(*cache(1), src)
        return {
            "prefill_pid": child.pid,
            "pulled": [list(p) for p in result.pulled],
            "error": None if result.error is None else str(result.error),
            "bytes": len(expected),
            "same": block_bytes(buf, layout, dst) == expected,
            "torch_loaded": "torch" in sys.modules,
            "kvbridge": kvbridge.__file__,
        }
    finally:
        if child.stdin is not None:
            child.stdin.close()
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()  # by its PID: it is this process's own child
            child.wait()


if __name__ == "__main__":
    if sys.argv[1:] == ["prefill"]:
        prefill()
    else:
        print(json.dumps({**decode(), "decode_pid": os.getpid()}))
