"""Ascend NPU memory through torch_npu (``torch_npu.npu``, also reachable as ``torch.npu``)."""

from __future__ import annotations

import os
from typing import Any

from kvbridge.base.errors import ConfigError
from kvbridge.base.types import MemoryKind
from kvbridge.device.accelerator import TorchAcceleratorDevice
from kvbridge.device.nics import pci_functions

HUAWEI = "0x19e5"
VISIBLE_ENV = "ASCEND_RT_VISIBLE_DEVICES"
ALIGNMENT = 2 << 20
ACCELERATOR_CLASS = "0x1200"  # PCI class "processing accelerator": the NPUs, not Huawei's NICs


class NpuDevice(TorchAcceleratorDevice):
    """KV caches in Ascend HBM.

    Mooncake reaches it with its `ascend` transport (HCCS inside a node, the NPU's own RoCE ports
    across nodes, chosen by device id). Any other protocol, `tcp` included, goes through pinned host
    staging (`kvbridge.transport.staging`).
    """

    name = "npu"
    memory_kind = MemoryKind.NPU

    def accel(self) -> Any:
        import torch_npu

        return torch_npu.npu

    def protocols(self) -> tuple[str, ...]:
        return ("ascend",)

    def allocate(self, nbytes: int, device_id: int = 0) -> Any:
        # Mooncake's ascend transport registers 2 MiB pages: start every buffer on a 2 MiB boundary, as
        # vllm-ascend does for its KV caches (over-allocate, then slice; the slice keeps the whole alive).
        whole = super().allocate(nbytes + ALIGNMENT, device_id)
        skip = -whole.data_ptr() % ALIGNMENT
        return whole[skip : skip + nbytes]

    def physical_id(self, device_id: int) -> int:
        # ASCEND_RT_VISIBLE_DEVICES renumbers NPUs for torch_npu; HCCL and Mooncake name the physical one.
        visible = [v.strip() for v in os.environ.get(VISIBLE_ENV, "").split(",") if v.strip()]
        if not visible:
            return device_id
        if device_id >= len(visible) or not visible[device_id].isdigit():
            raise ConfigError(
                f"NPU {device_id} is not in {VISIBLE_ENV}={os.environ[VISIBLE_ENV]!r}; set it to "
                "physical NPU ids, one per visible device"
            )
        return int(visible[device_id])

    def pci_address(self, device_id: int) -> str | None:
        # torch_npu exposes no PCI address; NPU N is the Nth Ascend function in bus order when
        # ASCEND_RT_VISIBLE_DEVICES does not renumber them (set KVBRIDGE_NIC_NPU_<ID> when it does).
        npus = pci_functions(HUAWEI, device_class=ACCELERATOR_CLASS)
        return npus[device_id] if device_id < len(npus) else None
