"""Host memory: always available; compute and transfers see the same bytes."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from kvbridge.base.types import MemoryKind, MemoryRegion
from kvbridge.device.contract import Device


class CpuDevice(Device):
    """KV caches in host DRAM. Nothing to synchronize: CPU writes are visible once made."""

    name = "cpu"
    memory_kind = MemoryKind.DRAM
    synchronizes = False

    def before_transfer(self, device_id: int = -1) -> None:
        return None

    def after_transfer(self, device_id: int = -1) -> None:
        return None

    def allocate(self, nbytes: int, device_id: int = 0) -> np.ndarray:
        return np.zeros(nbytes, dtype=np.uint8)

    def to_host(self, buffer: Any) -> np.ndarray:
        return np.array(_as_bytes(buffer), copy=True)

    def from_host(self, buffer: Any, data: np.ndarray) -> None:
        _as_bytes(buffer)[:] = data.reshape(-1).view(np.uint8)

    def buffer_at(self, region: MemoryRegion) -> np.ndarray:
        return np.ctypeslib.as_array((ctypes.c_uint8 * region.length).from_address(region.addr))

    def protocols(self) -> tuple[str, ...]:
        return ("tcp", "rdma")


def _as_bytes(buffer: Any) -> np.ndarray:
    """A flat uint8 view of a numpy array or a CPU torch tensor, sharing memory."""
    if isinstance(buffer, np.ndarray):
        return buffer.reshape(-1).view(np.uint8)
    import torch  # only reached for torch tensors; numpy cannot view bf16, so view as bytes first

    return buffer.detach().reshape(-1).view(torch.uint8).numpy()
