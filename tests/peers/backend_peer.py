"""A process holding one buffer behind a kvbridge transport; driven by tests through kvbridge_tools.harness.proc."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

import kvbridge
from kvbridge_tools.harness.proc import serve

state: dict[str, Any] = {}


def pattern(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8)


def init(backend: str, size: int, seed: int, options: dict[str, Any] | None = None) -> dict[str, Any]:
    buf = pattern(size, seed) if seed >= 0 else np.zeros(size, dtype=np.uint8)
    be = kvbridge.create_backend(backend, **(options or {}))
    be.register_memory(buf)
    state.update(buf=buf, backend=be)
    return {"endpoint": be.endpoint_info().hex(), "base": buf.ctypes.data}


def connect(endpoint: str) -> None:
    state["peer"] = state["backend"].connect(bytes.fromhex(endpoint))


def transfer(
    descriptors: list[list[int]], op: str, relative: bool = True, remote_base: int = 0, timeout: float = 60
) -> dict[str, int]:
    """Run descriptors given as offsets (relative=True) into the local buffer and the remote base."""
    desc = np.asarray(descriptors, dtype=np.int64).reshape(-1, 3)
    if relative:
        desc = desc + np.array([state["buf"].ctypes.data, remote_base, 0], dtype=np.int64)
    handle = state["backend"].transfer(state["peer"], desc, op=op)
    handle.wait(timeout)
    return {"descriptors": handle.descriptors, "nbytes": handle.nbytes}


def digest() -> str:
    return hashlib.sha256(state["buf"].tobytes()).hexdigest()


def unregister() -> None:
    state["backend"].unregister_memory(state["buf"])


def close() -> None:
    state.pop("backend").close()


if __name__ == "__main__":
    serve(
        {
            "init": init,
            "connect": connect,
            "transfer": transfer,
            "digest": digest,
            "unregister": unregister,
            "close": close,
        }
    )
