"""The `example` device: KV caches in page-aligned anonymous memory mappings.

It is host memory, so every transport that reaches DRAM reaches it directly and nothing needs
staging. A real accelerator plugin fills the same methods with its library's calls (see
kvbridge_cuda for one).
"""

from __future__ import annotations

import collections
import mmap
from typing import Any

import numpy as np

from kvbridge import Device, MemoryKind


class ExampleDevice(Device):
    """Buffers are numpy views of anonymous mappings (zeroed by the kernel, aligned to a page)."""

    name = "example"
    memory_kind = MemoryKind.DRAM

    def __init__(self) -> None:
        # What a real device would do here is wait for its queues; this one has none, so it counts the
        # calls, which lets its conformance run check that they reach the device.
        self.synchronizations: collections.Counter[tuple[str, int]] = collections.Counter()

    def allocate(self, nbytes: int, device_id: int = 0) -> np.ndarray:
        mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return np.frombuffer(mapping, dtype=np.uint8, count=nbytes)  # the array keeps the mapping alive

    def to_host(self, buffer: Any) -> np.ndarray:
        return np.array(buffer, dtype=np.uint8, copy=True).reshape(-1)

    def from_host(self, buffer: Any, data: np.ndarray) -> None:
        buffer.reshape(-1)[:] = np.ascontiguousarray(data).reshape(-1).view(np.uint8)

    def before_transfer(self, device_id: int = -1) -> None:
        self.synchronizations["before_transfer", device_id] += 1

    def after_transfer(self, device_id: int = -1) -> None:
        self.synchronizations["after_transfer", device_id] += 1

    def protocols(self) -> tuple[str, ...]:
        return ("tcp", "rdma")
