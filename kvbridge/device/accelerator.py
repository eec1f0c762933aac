"""What every torch accelerator device (`cuda`, `npu`, `mlu`) does the same way. See docs/internals.md."""

from __future__ import annotations

import abc
from typing import Any

import numpy as np

from kvbridge.base.types import MemoryRegion
from kvbridge.device.contract import Device
from kvbridge.device.nics import device_nics


class TorchAcceleratorDevice(Device):
    """A device behind a torch accelerator module."""

    @abc.abstractmethod
    def accel(self) -> Any:
        """The library's accelerator module (``torch.cuda``, ``torch_npu.npu``, ``torch_mlu.mlu``)."""

    def pci_address(self, device_id: int) -> str | None:
        """The device's PCI function (``0000:3b:00.0``) where the platform exposes it."""
        return None

    def _ids(self, device_id: int) -> list[int]:
        return list(range(self.accel().device_count())) if device_id < 0 else [device_id]

    def before_transfer(self, device_id: int = -1) -> None:
        # A NIC or a copy engine reads device memory outside stream order: wait for the work queued
        # on the compute stream (an event recorded after it) to finish. device_id -1: every device.
        for i in self._ids(device_id):
            self.record(i).synchronize()

    def record(self, device_id: int) -> Any:
        # An event on the computing thread's current stream: torch streams are per thread, so it must be
        # recorded here; another thread may then synchronize on it (event waits release the GIL).
        acc = self.accel()
        event = acc.Event()
        event.record(acc.current_stream(device_id))
        return event

    def wait_recorded(self, mark: Any) -> None:
        mark.synchronize()

    def after_transfer(self, device_id: int = -1) -> None:
        # Bytes that arrived by DMA (GPUDirect RDMA, a staged host->device copy on any stream) must be
        # complete and flushed before a kernel reads them: a device-wide synchronize does both.
        acc = self.accel()
        for i in self._ids(device_id):
            acc.synchronize(i)

    def current_id(self) -> int:
        return int(self.accel().current_device())

    def set_current(self, device_id: int) -> None:
        self.accel().set_device(device_id)

    def buffer_at(self, region: MemoryRegion) -> Any:
        import torch

        # torch offers no public "tensor over this device pointer" for every device type; its storage
        # constructor from a data pointer is the one call that works for cuda, npu and mlu alike. The
        # storage does not own the memory: the engine that allocated it keeps it alive.
        probe = torch.zeros(0, dtype=torch.uint8, device=f"{self.name}:{max(region.device_id, 0)}")
        storage = torch._C._construct_storage_from_data_pointer(
            region.addr, probe.untyped_storage().device, region.length
        )
        return probe.set_(storage)

    def allocate(self, nbytes: int, device_id: int = 0) -> Any:
        import torch

        self.accel()  # import the vendor library first: it is what teaches torch the device type
        return torch.zeros(nbytes, dtype=torch.uint8, device=f"{self.name}:{device_id}")

    def host_buffer(self, nbytes: int) -> Any:
        import torch

        self.accel()
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)

    def to_host(self, buffer: Any) -> np.ndarray:
        import torch

        flat = buffer.detach().reshape(-1).view(torch.uint8)
        return flat.to("cpu", copy=True).numpy()

    def from_host(self, buffer: Any, data: np.ndarray) -> None:
        import torch

        src = torch.from_numpy(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        buffer.detach().reshape(-1).view(torch.uint8).copy_(src)
        self.after_transfer(self.device_id(buffer))

    def nics(self, device_id: int = -1) -> list[str]:
        return device_nics(self.name, device_id, self.pci_address(device_id) if device_id >= 0 else None)
