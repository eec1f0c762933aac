"""The device contract: where a KV cache lives and how a transport reaches it."""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import numpy as np

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
        if isinstance(tensor, np.ndarray):
            contiguous, nbytes = tensor.flags.c_contiguous, tensor.nbytes
        else:
            contiguous = not hasattr(tensor, "is_contiguous") or tensor.is_contiguous()
            nbytes = tensor.numel() * tensor.element_size()
        if not contiguous:
            raise ConfigError("register a contiguous tensor (the KV cache itself, not a strided view of it)")
        if nbytes == 0:
            raise ConfigError("cannot register an empty tensor")
        if isinstance(tensor, np.ndarray):
            return [MemoryRegion(tensor.ctypes.data, nbytes, self.memory_kind, -1)]
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

    @abc.abstractmethod
    def allocate(self, nbytes: int, device_id: int = 0) -> Any:
        """A zeroed, contiguous byte buffer in this device's memory (a tensor or array with a data pointer)."""

    @abc.abstractmethod
    def to_host(self, buffer: Any) -> np.ndarray:
        """A host copy of a buffer from `allocate`, as a uint8 numpy array."""

    @abc.abstractmethod
    def from_host(self, buffer: Any, data: np.ndarray) -> None:
        """Copy host bytes into a buffer from `allocate` (same size)."""

    def host_buffer(self, nbytes: int) -> Any:
        """Zeroed host memory this device copies to and from fastest (pinned on accelerators).

        `kvbridge.staging` mirrors device buffers into it when a transport cannot reach device memory.
        """
        return np.zeros(nbytes, dtype=np.uint8)

    def protocols(self) -> tuple[str, ...]:
        """Transport protocols that reach this device's memory directly, best first."""
        return ("tcp",)

    def nics(self, device_id: int = -1) -> list[str]:
        """Network interfaces nearest to a device, best first (empty when unknown).

        `KVBRIDGE_NIC_<DEVICE>_<ID>` (for example `KVBRIDGE_NIC_CUDA_0=mlx5_0,mlx5_1`) overrides it;
        see `kvbridge.nics`.
        """
        from kvbridge.nics import nic_override

        return nic_override(self.name, device_id) or []
