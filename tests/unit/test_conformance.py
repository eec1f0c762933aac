"""kvbridge's own plugins run the conformance suite that third-party plugins run (kvbridge.testing)."""

from __future__ import annotations

from typing import Any

from kvbridge.testing import BackendConformance, DeviceConformance


class TestCpuConformance(DeviceConformance):
    device_name = "cpu"
    transports = (("tcp", None), ("loopback", None), ("mooncake", "tcp"), ("nixl", None))


class TestTcpConformance(BackendConformance):
    backend_name = "tcp"


class TestLoopbackConformance(BackendConformance):
    backend_name = "loopback"

    def kill(self, backend: Any) -> None:
        backend.die()


class TestMooncakeConformance(BackendConformance):
    backend_name = "mooncake"
    protocol = "tcp"
    # fail fast on the dead-peer test: one quick retry
    options = {"retries": 1, "retry_backoff": 0.01}
