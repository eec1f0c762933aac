"""Registers the `mlu` device. Imports torch_mlu only when the registry asks whether an MLU is here."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

import kvbridge
from kvbridge.types import MemoryKind

KVBRIDGE_PLUGIN_API = 1

INSTALL_HINT = (
    "on a machine with a Cambricon MLU and CNToolkit, install Cambricon's torch_mlu wheel built for your torch "
    "(it is not on PyPI; Cambricon's PyTorch containers ship it)"
)


def hardware(dev: Path = Path("/dev")) -> bool:
    """A Cambricon MLU device node (/dev/cambricon_devN) exists here; needs neither torch_mlu nor CNToolkit."""
    return any(dev.glob("cambricon_dev[0-9]*"))


def probe() -> str | None:
    """Why a Cambricon MLU cannot be used here, or None."""
    try:
        torch_mlu = importlib.import_module("torch_mlu")
    except Exception as exc:  # any import failure (missing, or built for another torch) is the reason
        return f"torch_mlu is not importable ({type(exc).__name__}: {exc})"
    if not torch_mlu.mlu.is_available():
        return "no MLU device: torch_mlu.mlu.is_available() is False (check the driver and MLU_VISIBLE_DEVICES)"
    return None


def _factory() -> kvbridge.Device:
    from kvbridge_mlu.device import MluDevice

    return MluDevice()


@kvbridge.hookimpl
def kvbridge_register_devices(register: Callable[..., None]) -> None:
    register("mlu", _factory, memory_kind=MemoryKind.MLU, probe=probe, install_hint=INSTALL_HINT,
             hardware=hardware)
