"""The device contract: where a KV cache lives and how a transport reaches it."""

from __future__ import annotations

import abc
from typing import Any, ClassVar

from kvbridge.errors import ConfigError
from kvbridge.types import MemoryKind, MemoryRegion


class Device(abc.ABC):
    """Hooks a transport needs around device memory.

    `name` matches `torch.device.type` (`cpu`, `cuda`, `npu`, `mlu`) so tensors find their device.
    """

    name: ClassVar[str]
    memory_kind: ClassVar[MemoryKind]

    def regions(self, tensor: Any) -> list[MemoryRegion]:
        """The memory a tensor occupies: one region from its first to its last byte.

        A non-contiguous view is refused: a transport moves bytes, not strides.
        """
        if hasattr(tensor, "is_contiguous") and not tensor.is_contiguous():
            raise ConfigError("register a contiguous tensor (the KV cache itself, not a strided view of it)")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            raise ConfigError("cannot register an empty tensor")
        return [MemoryRegion(tensor.data_ptr(), nbytes, self.memory_kind, self.device_id(tensor))]

    def device_id(self, tensor: Any) -> int:
        index = getattr(getattr(tensor, "device", None), "index", None)
        return -1 if index is None else int(index)

    @abc.abstractmethod
    def before_transfer(self, device_id: int = -1) -> None:
        """Make compute writes to device memory visible to a transfer about to read it."""

    @abc.abstractmethod
    def after_transfer(self, device_id: int = -1) -> None:
        """Make bytes a transfer wrote visible to compute that reads them next."""

    def protocols(self) -> tuple[str, ...]:
        """Transport protocols that reach this device's memory directly, best first."""
        return ("tcp",)

    def nics(self, device_id: int = -1) -> list[str]:
        """Network interfaces nearest to a device, best first (empty when unknown)."""
        return []
