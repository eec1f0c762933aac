"""kvbridge's own plugins run the conformance suite that third-party plugins run (kvbridge.testing)."""

from __future__ import annotations

from typing import Any

from kvbridge.testing import DeviceConformance, TransportConformance


class TestCpuConformance(DeviceConformance):
    device_name = "cpu"
    transports = (("tcp", None), ("loopback", None), ("mooncake", "tcp"), ("nixl", None))


class TestTcpConformance(TransportConformance):
    transport_name = "tcp"


class TestLoopbackConformance(TransportConformance):
    transport_name = "loopback"

    def kill(self, backend: Any) -> None:
        backend.die()


class TestMooncakeConformance(TransportConformance):
    transport_name = "mooncake"
    protocol = "tcp"
    # fail fast on the dead-peer test: one quick retry
    options = {"retries": 1, "retry_backoff": 0.01}
