"""NIC affinity: which network interfaces sit nearest to a device. See docs/internals.md."""

from __future__ import annotations

import os
from pathlib import Path

SYSFS = Path("/sys")


def nic_env(device: str, device_id: int) -> str:
    """The override variable for one device, e.g. ``KVBRIDGE_NIC_CUDA_0``."""
    return f"KVBRIDGE_NIC_{device.upper()}_{device_id}"


def nic_override(device: str, device_id: int) -> list[str] | None:
    """The operator's NIC list for a device, or None when the variable is unset."""
    value = os.environ.get(nic_env(device, device_id))
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def pci_path(address: str, sysfs: Path = SYSFS) -> tuple[str, ...]:
    """The chain of PCI bridges down to a function (``0000:3b:00.0``), or () when not exposed."""
    node = sysfs / "bus" / "pci" / "devices" / address.lower()
    if not node.exists():
        return ()
    return _pci_chain(node.resolve())


def _pci_chain(resolved: Path) -> tuple[str, ...]:
    # /sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0 -> ("pci0000:00", "0000:00:01.0", "0000:01:00.0")
    parts = resolved.parts
    for i, part in enumerate(parts):
        if part.startswith("pci"):
            return tuple(parts[i:])
    return ()


def _shared(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _ranked(cls_dir: Path, target: tuple[str, ...]) -> list[str]:
    if not cls_dir.is_dir():
        return []
    scored = []
    for entry in cls_dir.iterdir():
        dev = entry / "device"
        if not dev.exists():
            continue  # virtual interfaces (lo, bridges, veth) have no PCI function
        chain = _pci_chain(dev.resolve())
        if chain:
            scored.append((-_shared(chain, target), entry.name))
    return [name for _, name in sorted(scored)]


def nics_near(address: str, sysfs: Path = SYSFS) -> list[str]:
    """RDMA devices (else network interfaces) ranked nearest-first to a PCI function; [] when unknown."""
    target = pci_path(address, sysfs)
    if not target:
        return []
    return _ranked(sysfs / "class" / "infiniband", target) or _ranked(sysfs / "class" / "net", target)


def pci_functions(vendor: str, *, device_class: str = "", sysfs: Path = SYSFS) -> list[str]:
    """PCI addresses of a vendor's (``0xcabc``) functions in bus order, optionally of a class prefix (``0x1200``)."""
    root = sysfs / "bus" / "pci" / "devices"
    if not root.is_dir():
        return []
    out = []
    for node in root.iterdir():
        try:
            if (node / "vendor").read_text().strip().lower() != vendor.lower():
                continue
            if device_class and not (node / "class").read_text().strip().lower().startswith(device_class.lower()):
                continue
        except OSError:
            continue
        out.append(node.name)
    return sorted(out)


def device_nics(device: str, device_id: int, pci_address: str | None, sysfs: Path = SYSFS) -> list[str]:
    """The override for a device if set, else the NICs nearest its PCI address, else []."""
    override = nic_override(device, device_id)
    if override is not None:
        return override
    return nics_near(pci_address, sysfs) if pci_address else []
