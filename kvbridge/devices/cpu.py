"""Host memory: always available; compute and transfers see the same bytes."""

from __future__ import annotations

from kvbridge.device import Device
from kvbridge.types import MemoryKind


class CpuDevice(Device):
    """KV caches in host DRAM. Nothing to synchronize: CPU writes are visible once made."""

    name = "cpu"
    memory_kind = MemoryKind.DRAM

    def before_transfer(self, device_id: int = -1) -> None:
        return None

    def after_transfer(self, device_id: int = -1) -> None:
        return None

    def protocols(self) -> tuple[str, ...]:
        return ("tcp", "rdma")
