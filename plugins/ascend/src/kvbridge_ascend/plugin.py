"""Registers the `npu` device. Imports torch_npu only when the registry asks whether an NPU is here."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

import kvbridge
from kvbridge.types import MemoryKind

KVBRIDGE_PLUGIN_API = 1

INSTALL_HINT = (
    "on a machine with an Ascend NPU and CANN, in an environment built for torch-npu (it pins its own torch): "
    "pip install 'kvbridge-ascend[torch-npu]'"
)


def hardware(dev: Path = Path("/dev")) -> bool:
    """An Ascend NPU device node (/dev/davinciN) exists here; needs neither torch_npu nor CANN."""
    return any(dev.glob("davinci[0-9]*"))


def probe() -> str | None:
    """Why an Ascend NPU cannot be used here, or None."""
    try:
        torch_npu = importlib.import_module("torch_npu")
    except Exception as exc:  # any import failure (missing, or built for another torch/CANN) is the reason
        return f"torch_npu is not importable ({type(exc).__name__}: {exc})"
    if not torch_npu.npu.is_available():
        return "no Ascend NPU device: torch_npu.npu.is_available() is False (check CANN and ASCEND_RT_VISIBLE_DEVICES)"
    return None


def _factory() -> kvbridge.Device:
    from kvbridge_ascend.device import NpuDevice

    return NpuDevice()


@kvbridge.hookimpl
def kvbridge_register_devices(register: Callable[..., None]) -> None:
    register("npu", _factory, memory_kind=MemoryKind.NPU, probe=probe, install_hint=INSTALL_HINT,
             hardware=hardware)
