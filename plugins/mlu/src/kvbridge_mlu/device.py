"""Cambricon MLU memory through torch_mlu (``torch_mlu.mlu``, also reachable as ``torch.mlu``)."""

from __future__ import annotations

from typing import Any

from kvbridge.base.types import MemoryKind
from kvbridge.device.accelerator import TorchAcceleratorDevice
from kvbridge.device.nics import pci_functions

CAMBRICON = "0xcabc"


class MluDevice(TorchAcceleratorDevice):
    """KV caches in MLU device memory.

    Mooncake reaches it with `rdma` when Mooncake is built with MLU support (the NIC registers MLU
    memory through the Cambricon peer-memory driver, as xLLM's MLU PD path does). Any other protocol,
    `tcp` included, goes through pinned host staging (`kvbridge.transport.staging`).
    """

    name = "mlu"
    memory_kind = MemoryKind.MLU

    def accel(self) -> Any:
        import torch_mlu

        return torch_mlu.mlu

    def protocols(self) -> tuple[str, ...]:
        return ("rdma",)

    def pci_address(self, device_id: int) -> str | None:
        # MLU N is the Nth Cambricon function in bus order when MLU_VISIBLE_DEVICES does not renumber
        # them (set KVBRIDGE_NIC_MLU_<ID> when it does).
        mlus = pci_functions(CAMBRICON)
        return mlus[device_id] if device_id < len(mlus) else None
