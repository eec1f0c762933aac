"""The device contract: where a KV cache lives and how a transport reaches it."""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import numpy as np

from kvbridge.base.errors import ConfigError
from kvbridge.base.memory import buffer_region
from kvbridge.base.types import MemoryKind, MemoryRegion


class Device(abc.ABC):
    """Hooks a transport needs around device memory. See docs/internals.md."""

    name: ClassVar[str]
    memory_kind: ClassVar[MemoryKind]
    #: False where `before_transfer`/`after_transfer` have nothing to wait for (host memory), so a
    #: transport that reaches the memory is used as is, without a device-bound wrapper.
    synchronizes: ClassVar[bool] = True

    def regions(self, tensor: Any) -> list[MemoryRegion]:
        """The memory a tensor occupies: one region, first to last byte, of this device. See docs/internals.md."""
        device_id = -1 if isinstance(tensor, np.ndarray) else self.device_id(tensor)
        return [buffer_region(tensor, self.memory_kind, device_id)]

    def device_id(self, tensor: Any) -> int:
        index = getattr(getattr(tensor, "device", None), "index", None)
        return -1 if index is None else int(index)

    def region(self, addr: int, length: int, device_id: int = -1) -> MemoryRegion:
        """A region of this device's memory known only by address (LMDeploy); `device_id` -1: `current_id()`."""
        return MemoryRegion(addr, length, self.memory_kind, self.current_id() if device_id < 0 else device_id)

    def current_id(self) -> int:
        """The device this process computes on (-1 for host memory, which belongs to no device)."""
        return -1

    def set_current(self, device_id: int) -> None:
        """Make `device_id` the device this process computes on (Mooncake's ascend binds to one at start)."""

    def physical_id(self, device_id: int) -> int:
        """The id the hardware and its fabric know a device by, where a visibility variable renumbers them."""
        return device_id

    def buffer_at(self, region: MemoryRegion) -> Any:
        """A flat byte buffer over existing memory of this device, for staging copies when only the address is known."""
        raise ConfigError(
            f"device {self.name!r} cannot copy from a raw address; register the tensor itself, or use a "
            f"transport protocol that reaches {self.memory_kind.value} memory directly ({', '.join(self.protocols())})"
        )

    def location(self, device_id: int) -> str:
        """How a transport names where this memory lives (Mooncake's `location`): ``cuda:0``; ``*`` for host memory."""
        return "*" if self.memory_kind == MemoryKind.DRAM else f"{self.name}:{max(device_id, 0)}"

    @abc.abstractmethod
    def before_transfer(self, device_id: int = -1) -> None:
        """Make compute writes to device memory visible to a transfer about to read it."""

    @abc.abstractmethod
    def after_transfer(self, device_id: int = -1) -> None:
        """Make bytes a transfer wrote visible to compute that reads them next."""

    def record(self, device_id: int) -> Any:
        """Mark, without waiting, the work this thread has queued on `device_id` so far (an event on its stream).

        None: this device cannot mark work, and `before_transfer` in the computing thread is the only wait."""
        return None

    def wait_recorded(self, mark: Any) -> None:
        """Block until the work before `mark` (from `record`) finished; called on another thread than `record`."""

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
        """Zeroed host memory this device copies to and from fastest (pinned on accelerators): staging mirrors."""
        return np.zeros(nbytes, dtype=np.uint8)

    def protocols(self) -> tuple[str, ...]:
        """Transport protocols that reach this device's memory directly, best first."""
        return ("tcp",)

    def nics(self, device_id: int = -1) -> list[str]:
        """Network interfaces nearest to a device, best first (empty when unknown); `kvbridge.device.nics` overrides."""
        from kvbridge.device.nics import nic_override

        return nic_override(self.name, device_id) or []
