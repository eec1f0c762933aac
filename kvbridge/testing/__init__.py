"""Test kit that ships with kvbridge.

- Conformance suites for plugin authors: `DeviceConformance`, `StandInDeviceConformance`,
  `UnavailableDeviceConformance`,
  `TransportConformance` (subclass them in a ``Test...`` class), and stand-ins for accelerator
  libraries (`kvbridge.testing.standins`). Also a pytest plugin (entry point ``pytest11``:
  ``kvbridge``) that marks every suite test ``conformance``. See docs/plugins.md.
- Test and bench helpers: a tiny offline model, real vLLM servers on loopback.
- The GPU kit behind scripts/gpu-pack and scripts/gpu-check (`gpu_kit`, standard library only, and the
  checks in `gpu_check`): docs/gpu.md.

The suites import pytest, so they load on first use: the helpers work without pytest installed.
"""

from __future__ import annotations

from typing import Any

_SUITES = {
    "DeviceConformance": "kvbridge.testing.devices",
    "UnavailableDeviceConformance": "kvbridge.testing.devices",
    "StandInDeviceConformance": "kvbridge.testing.devices",
    "TransportConformance": "kvbridge.testing.transports",
}

__all__ = sorted(_SUITES)


def __getattr__(name: str) -> Any:
    if name in _SUITES:
        import importlib

        return getattr(importlib.import_module(_SUITES[name]), name)
    raise AttributeError(f"module 'kvbridge.testing' has no attribute {name!r}")
