"""Ascend NPU memory through torch_npu (``torch_npu.npu``, also reachable as ``torch.npu``)."""

from __future__ import annotations

from typing import Any

from kvbridge.devices.accelerator import TorchAcceleratorDevice
from kvbridge.nics import pci_functions
from kvbridge.types import MemoryKind

HUAWEI = "0x19e5"
ACCELERATOR_CLASS = "0x1200"  # PCI class "processing accelerator": the NPUs, not Huawei's NICs


class NpuDevice(TorchAcceleratorDevice):
    """KV caches in Ascend HBM.

    Mooncake reaches it with its `ascend` transport (HCCS inside a node, the NPU's own RoCE ports
    across nodes, chosen by device id). Any other protocol, `tcp` included, goes through pinned host
    staging (`kvbridge.staging`).
    """

    name = "npu"
    memory_kind = MemoryKind.NPU

    def accel(self) -> Any:
        import torch_npu

        return torch_npu.npu

    def protocols(self) -> tuple[str, ...]:
        return ("ascend",)

    def pci_address(self, device_id: int) -> str | None:
        # torch_npu exposes no PCI address; NPU N is the Nth Ascend function in bus order when
        # ASCEND_RT_VISIBLE_DEVICES does not renumber them (set KVBRIDGE_NIC_NPU_<ID> when it does).
        npus = pci_functions(HUAWEI, device_class=ACCELERATOR_CLASS)
        return npus[device_id] if device_id < len(npus) else None
