"""Provides the `cuda` device. Imports torch only when the registry asks whether CUDA is here."""

from __future__ import annotations

from pathlib import Path

import kvbridge
from kvbridge.base.types import MemoryKind
from kvbridge.device.probes import device_nodes

KVBRIDGE_PLUGIN_API = 3

INSTALL_HINT = (
    "run on a machine with an NVIDIA GPU and driver, in an environment with a CUDA build of torch "
    "(pip install 'kvbridge-cuda[torch]', or torch from https://download.pytorch.org/whl/cu128)"
)


def hardware(dev: Path = Path("/dev")) -> bool:
    """An NVIDIA GPU device node (/dev/nvidiaN) exists here; needs neither torch nor the driver library."""
    return device_nodes("nvidia[0-9]*", dev)


def probe() -> str | None:
    """Why CUDA cannot run here, or None."""
    try:
        import torch
    except ImportError as exc:
        return f"no CUDA device: torch is not importable ({exc})"
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"no CUDA device: torch {torch.__version__} is built without CUDA"
    return "no CUDA device: torch.cuda.is_available() is False (check the driver and CUDA_VISIBLE_DEVICES)"


def _factory(options: kvbridge.NoOptions) -> kvbridge.Device:
    from kvbridge_cuda.device import CudaDevice

    return CudaDevice()


@kvbridge.hookimpl
def kvbridge_devices() -> list[kvbridge.DeviceSpec]:
    return [
        kvbridge.DeviceSpec(
            "cuda", _factory, MemoryKind.VRAM, probe=probe, install_hint=INSTALL_HINT, hardware=hardware
        )
    ]
