<<<<<<< HEAD
"""Test kit for kvbridge plugins: conformance suites to subclass, and stand-ins for accelerator libraries.

Installed as a pytest plugin (entry point ``pytest11``: ``kvbridge``), which adds the ``conformance``
marker to every test of these suites (``pytest -m conformance``). See docs/plugins.md.
"""

from kvbridge.testing.devices import DeviceConformance, UnavailableDeviceConformance
from kvbridge.testing.transports import TransportConformance

__all__ = ["DeviceConformance", "TransportConformance", "UnavailableDeviceConformance"]
=======
"""Test and bench helpers that ship with kvbridge: a tiny offline model, real vLLM servers on loopback."""
>>>>>>> main
