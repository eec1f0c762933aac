"""NVIDIA GPU memory through torch.cuda."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvbridge.base.types import MemoryKind
from kvbridge.device.accelerator import TorchAcceleratorDevice

NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")
SYS_MODULES = Path("/sys/module")
PEERMEM = ("nvidia_peermem", "nv_peer_mem")  # the kernel modules that let a NIC register GPU memory


def gpudirect_rdma(modules: Path = SYS_MODULES) -> bool:
    """Whether a NIC can read and write GPU memory here (GPUDirect RDMA): a peer-memory module is loaded."""
    return any((modules / name).is_dir() for name in PEERMEM)


class CudaDevice(TorchAcceleratorDevice):
    """KV caches in CUDA device memory.

    Mooncake reaches it with `rdma` where GPUDirect RDMA works (the NIC reads and writes GPU memory,
    which needs the nvidia-peermem module loaded; without it `rdma` is staged) and `nvlink` (GPU to
    GPU inside one node). NIXL reaches it with `ucx` where its UCX was built with CUDA (the NIXL plugin
    declares GPU memory only then), and UCX picks cuda_copy, cuda_ipc or the NIC itself. Any other
    protocol, `tcp` included, goes through pinned host staging (`kvbridge.transport.staging`).
    """

    name = "cuda"
    memory_kind = MemoryKind.VRAM
    sys_modules = SYS_MODULES  # where loaded kernel modules are listed

    def accel(self) -> Any:
        import torch

        return torch.cuda

    def protocols(self) -> tuple[str, ...]:
        return ("rdma", "nvlink", "ucx") if gpudirect_rdma(self.sys_modules) else ("nvlink", "ucx")

    def pci_address(self, device_id: int) -> str | None:
        # CUDA's numbering (CUDA_VISIBLE_DEVICES, FASTEST_FIRST order) maps to a PCI function only through
        # the driver: torch builds that expose pci_bus_id give it directly; otherwise the GPU's UUID is
        # looked up in the driver's /proc listing.
        props = self.accel().get_device_properties(device_id)
        bus = getattr(props, "pci_bus_id", None)
        if bus is not None:
            return f"{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
        uuid = str(getattr(props, "uuid", "") or "")
        return _pci_by_uuid(uuid) if uuid else None


def _pci_by_uuid(uuid: str, root: Path = NVIDIA_PROC) -> str | None:
    """The PCI address whose `information` file names this GPU UUID (``GPU UUID: GPU-...``)."""
    if not root.is_dir():
        return None
    want = uuid.lower().removeprefix("gpu-")
    for info in root.glob("*/information"):
        try:
            text = info.read_text().lower()
        except OSError:
            continue
        if want in text:
            return info.parent.name.lower()
    return None
