"""The availability checks every torch accelerator plugin (`cuda`, `npu`, `mlu`) shares. See docs/internals.md."""

from __future__ import annotations

import importlib
from pathlib import Path

from kvbridge.base.errors import described


def device_nodes(pattern: str, dev: Path = Path("/dev")) -> bool:
    """A device node matching `pattern` (``nvidia[0-9]*``) exists under `dev`."""
    return any(dev.glob(pattern))


def library_probe(module: str, accel: str, device: str, check: str) -> str | None:
    """Why `module` cannot drive a device here, or None. See docs/internals.md."""
    try:
        lib = importlib.import_module(module)
    except Exception as exc:  # any import failure (missing, or built for another torch) is the reason
        return f"{module} is not importable ({described(exc)})"
    if not getattr(lib, accel).is_available():
        return f"no {device} device: {module}.{accel}.is_available() is False (check {check})"
    return None
