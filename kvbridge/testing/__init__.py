"""The conformance kit that ships with kvbridge, for plugin authors (docs/plugins.md).

The suites in `__all__` (subclass them in a ``Test...`` class) and stand-ins for accelerator libraries
(`kvbridge.testing.standins`); its pytest plugin is `kvbridge.testing.plugin`. The harness kvbridge's own
benches and tests use is in kvbridge-tools. The suites import pytest, so they load on first use.
"""

from __future__ import annotations

from typing import Any

_SUITES = {
    "DeviceConformance": "kvbridge.testing.devices",
    "UnavailableDeviceConformance": "kvbridge.testing.devices",
    "StandInDeviceConformance": "kvbridge.testing.devices",
    "BackendConformance": "kvbridge.testing.backends",
}

__all__ = sorted(_SUITES)


def __getattr__(name: str) -> Any:
    if name in _SUITES:
        import importlib

        return getattr(importlib.import_module(_SUITES[name]), name)
    raise AttributeError(f"module 'kvbridge.testing' has no attribute {name!r}")
