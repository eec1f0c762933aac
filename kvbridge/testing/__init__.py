"""The conformance kit that ships with kvbridge, for plugin authors.

Suites: `DeviceConformance`, `StandInDeviceConformance`, `UnavailableDeviceConformance` and
`TransportConformance` (subclass them in a ``Test...`` class), and stand-ins for accelerator libraries
(`kvbridge.testing.standins`). Its pytest plugin (entry point ``pytest11``: ``kvbridge``) marks every
suite test ``conformance`` and does nothing else. See docs/plugins.md. The harness kvbridge's own
benches and tests use (hosts, vLLM servers, a tiny model, the GPU kit) is in kvbridge-tools.

The suites import pytest, so they load on first use: `import kvbridge.testing` works without pytest.
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
