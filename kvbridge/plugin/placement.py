"""Where a registered buffer lives: the one place a tensor's device picks its device plugin. See docs/internals.md."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvbridge.base.errors import ConfigError
from kvbridge.base.memory import as_regions, is_tensor_like
from kvbridge.base.types import MemoryKind, MemoryRegion
from kvbridge.device.contract import Device
from kvbridge.plugin.registry import get_device, registry


def device_type(tensor: Any) -> str:
    """A tensor's device type as torch spells it (``cuda``), whatever its ``device`` object is."""
    return str(getattr(tensor.device, "type", str(tensor.device).split(":")[0]))


def _tensors(x: Any) -> list[Any]:
    if is_tensor_like(x):
        return [x]
    if isinstance(x, tuple) and all(isinstance(v, int) for v in x):
        return []  # an (address, bytes) pair
    if isinstance(x, Iterable) and not isinstance(x, (str, bytes)) and not hasattr(x, "ctypes"):
        return [t for item in x for t in _tensors(item)]  # lists, dict values, vllm-ascend's (K, V) tuples
    return []


def tensor_device(x: Any) -> Device | None:
    """The device plugin owning a tensor or tensors (one device type); None for arrays and addresses."""
    types = {device_type(t) for t in _tensors(x)}
    if len(types) > 1:
        raise ConfigError(
            f"tensors on several device types ({sorted(types)}); register each device's KV cache "
            "with its own agent or backend"
        )
    return get_device(types.pop()) if types else None


def device_of(x: Any) -> Device:
    """The device plugin owning a tensor or a list of tensors; `cpu` for host arrays and addresses."""
    return tensor_device(x) or get_device("cpu")


def for_device(x: Any, device: Device) -> list[Any]:
    """What to register for `device`. See docs/internals.md."""
    items = x if isinstance(x, list) else [x]
    out: list[Any] = []
    for item in items:
        keep = is_tensor_like(item) or hasattr(item, "ctypes") or device.memory_kind == MemoryKind.DRAM
        if keep or (isinstance(item, MemoryRegion) and item.kind != MemoryKind.DRAM):
            out.append(item)
        else:
            out.extend(device.region(r.addr, r.length) for r in as_regions(item))
    return out


def regions_of(x: Any, device: Device | None = None) -> list[MemoryRegion]:
    """Regions of tensors (via their device plugin), arrays, (addr, length) pairs or regions. See docs/internals.md."""
    if isinstance(x, MemoryRegion):
        return [x]
    if is_tensor_like(x):
        owner = get_device(device_type(x))
        if device is not None and owner is not device:
            raise ConfigError(
                f"a {owner.name} tensor was given where {device.name} memory was expected; pass device={owner.name!r}"
            )
        return owner.regions(x)
    if isinstance(x, list):
        return [r for item in x for r in regions_of(item, device)]
    return as_regions(x)


def local_device() -> Device:
    """The accelerator this process computes on, for engines that hand out addresses, not tensors.

    The first registered device plugin of device memory that is available here; `cpu` where none is."""
    reg = registry()
    for entry in reg.devices.values():
        if entry.memory_kind != MemoryKind.DRAM and entry.unavailable_reason() is None:
            return reg.device(entry.name)
    return get_device("cpu")
