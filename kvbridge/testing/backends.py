"""Conformance suite for transport plugins: subclass `BackendConformance` in a ``Test...`` class (docs/plugins.md).

Both backends live in the test's process and move host memory (numpy buffers); every byte moved
is checked, and so is every byte that must not have moved.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import attrs
import numpy as np
import pytest

import kvbridge
from kvbridge.base import wire
from kvbridge.base.errors import ConfigError, InvalidDescriptor, KVBridgeError, PluginNotFound, TransferError
from kvbridge.base.types import EndpointInfo, MemoryKind
from kvbridge.transport.contract import MigrationBackend, Peer

SIZE = 1 << 16


@attrs.frozen
class Wired:
    """Both backends of a pair with a buffer each registered: `a` holds `src`, `b` holds `dst`."""

    a: MigrationBackend
    b: MigrationBackend
    src: np.ndarray
    dst: np.ndarray

    def b_to_a(self) -> Peer:
        """b's handle on a: b reads a's `src` into `dst` through it."""
        return self.b.connect(self.a.endpoint_info())

    def a_to_b(self) -> Peer:
        """a's handle on b: a writes its `src` into b's `dst` through it."""
        return self.a.connect(self.b.endpoint_info())


class BackendConformance:
    """What every available transport plugin must do."""

    backend_name: ClassVar[str]
    protocol: ClassVar[str | None] = None
    options: ClassVar[dict[str, Any]] = {}
    #: seconds a transfer may take before the suite calls it hung
    timeout: ClassVar[float] = 60.0
    #: seconds a backend may take to learn that a peer is gone (a disconnect message, a failed socket)
    departure_window: ClassVar[float] = 5.0

    def make(self) -> MigrationBackend:
        return kvbridge.create_backend(self.backend_name, protocol=self.protocol, **self.options)

    def kill(self, backend: MigrationBackend) -> None:
        """Make a backend's peers see it gone (a crashed process); closing it is the default."""
        backend.close()

    @pytest.fixture
    def pair(self) -> Iterator[tuple[MigrationBackend, MigrationBackend]]:
        kvbridge.reset_plugins()
        a = self.make()
        try:
            b = self.make()
        except BaseException:
            a.close()
            raise
        yield a, b
        a.close()
        b.close()
        gc.collect()  # release what reference cycles (peers, handles, tracebacks) still hold, in this test
        kvbridge.reset_plugins()

    @pytest.fixture
    def buffers(self) -> tuple[np.ndarray, np.ndarray]:
        src = np.random.default_rng(3).integers(0, 256, SIZE, dtype=np.uint8)
        return src, np.zeros(SIZE, dtype=np.uint8)

    @pytest.fixture
    def wired(self, pair: tuple[MigrationBackend, MigrationBackend], buffers: tuple[np.ndarray, np.ndarray]) -> Wired:
        a, b = pair
        src, dst = buffers
        a.register_memory(src)
        b.register_memory(dst)
        return Wired(a, b, src, dst)

    # -- registration ------------------------------------------------------------------------

    def test_registered_with_capabilities(self, pair: tuple[MigrationBackend, MigrationBackend]) -> None:
        a, _ = pair
        info = {i.name: i for i in kvbridge.list_backends()}[self.backend_name]
        assert info.available, info.reason
        caps = a.capabilities
        assert caps.protocols and a.protocol in caps.protocols
        assert MemoryKind.DRAM in caps.memory_kinds
        assert caps.read or caps.write
        assert caps.max_batch is None or caps.max_batch > 0
        assert info.detail["protocols"] == list(caps.protocols)

    def test_unknown_transport_is_plugin_not_found(self) -> None:
        with pytest.raises(PluginNotFound, match=self.backend_name):
            kvbridge.create_backend(f"no-such-{self.backend_name}")

    def test_endpoint_info_is_self_describing(
        self, pair: tuple[MigrationBackend, MigrationBackend], buffers: tuple[np.ndarray, np.ndarray]
    ) -> None:
        a, _ = pair
        regions = a.register_memory(buffers[0])
        assert a.register_memory(buffers[0]) == regions  # registering twice is harmless
        info = wire.decode(a.endpoint_info(), EndpointInfo)
        assert info.backend == a.name and info.protocol == a.protocol and info.address
        assert info.regions == tuple(regions)

    # -- moving bytes --------------------------------------------------------------------------

    @pytest.mark.parametrize("op", ["read", "write"])
    def test_round_trip(self, wired: Wired, op: str) -> None:
        """Ranges of mixed sizes (1 byte up to 16 KiB), scattered and shuffled, both directions."""
        a, b, src, dst = wired.a, wired.b, wired.src, wired.dst
        rng = np.random.default_rng(11)
        lengths = np.array([1, 7, 64, 512, 4096, 16384, 3, 1000], dtype=np.int64)
        slots = np.cumsum(np.concatenate(([0], lengths[:-1] + 16)))  # gaps of 16 bytes stay untouched
        src_off = slots[rng.permutation(len(slots))]
        src_off = np.minimum(src_off, SIZE - lengths)
        expected = np.zeros(SIZE, dtype=np.uint8)
        for s, d, n in zip(src_off.tolist(), slots.tolist(), lengths.tolist()):  # the oracle, not the transport
            expected[d : d + n] = src[s : s + n]
        if op == "read":  # b pulls a's bytes into its buffer
            desc = np.stack([dst.ctypes.data + slots, src.ctypes.data + src_off, lengths], axis=1)
            b.transfer(wired.b_to_a(), desc, "read").wait(self.timeout)
        else:  # a pushes its bytes into b's buffer
            desc = np.stack([src.ctypes.data + src_off, dst.ctypes.data + slots, lengths], axis=1)
            a.transfer(wired.a_to_b(), desc, "write").wait(self.timeout)
        assert np.array_equal(dst, expected)

    def test_batch_larger_than_max_batch(self, wired: Wired) -> None:
        a, b, src, dst = wired.a, wired.b, wired.src, wired.dst
        n = min(2 * (a.capabilities.max_batch or 256) + 3, SIZE // 16)
        order = np.arange(n, dtype=np.int64)[::-1]  # reversed: no two descriptors merge, so n are submitted
        desc = np.stack([dst.ctypes.data + np.arange(n) * 16, src.ctypes.data + order * 16, np.full(n, 16)], axis=1)
        handle = b.transfer(wired.b_to_a(), desc, "read")
        handle.wait(self.timeout)
        assert handle.done() and handle.descriptors == n and handle.nbytes == 16 * n
        assert np.array_equal(dst[: 16 * n].reshape(n, 16), src[: 16 * n].reshape(n, 16)[order])

    def test_empty_transfer_completes(
        self, pair: tuple[MigrationBackend, MigrationBackend], buffers: tuple[np.ndarray, np.ndarray]
    ) -> None:
        a, b = pair
        a.register_memory(buffers[0])
        handle = b.transfer(b.connect(a.endpoint_info()), np.empty((0, 3), dtype=np.int64))
        handle.wait(1)
        assert handle.done()

    # -- error kinds -------------------------------------------------------------------------------

    def test_unregistered_ranges_are_invalid_descriptors(self, wired: Wired) -> None:
        b, src, dst = wired.b, wired.src, wired.dst
        peer = wired.b_to_a()
        with pytest.raises(InvalidDescriptor):
            b.transfer(peer, [(dst.ctypes.data + SIZE - 8, src.ctypes.data, 16)], "read")
        with pytest.raises(InvalidDescriptor):
            b.transfer(peer, [(dst.ctypes.data, src.ctypes.data + SIZE, 1)], "read")
        with pytest.raises(ConfigError):
            b.transfer(peer, [(dst.ctypes.data, src.ctypes.data, 0)], "read")
        with pytest.raises(ConfigError):
            b.transfer(peer, [(dst.ctypes.data, src.ctypes.data, 8)], "move")

    def test_endpoint_of_another_transport_is_refused(self, pair: tuple[MigrationBackend, MigrationBackend]) -> None:
        a, b = pair
        other = EndpointInfo(backend=f"not-{a.name}", protocol=a.protocol, address="nowhere")
        with pytest.raises(ConfigError, match="same migration backend"):
            b.connect(wire.encode(other))

    def test_closed_backend_refuses_work_and_closes_twice(
        self, pair: tuple[MigrationBackend, MigrationBackend], buffers: tuple[np.ndarray, np.ndarray]
    ) -> None:
        a, _ = pair
        a.register_memory(buffers[0])
        a.close()
        a.close()
        with pytest.raises(ConfigError, match="closed"):
            a.register_memory(buffers[1])
        with pytest.raises(ConfigError, match="closed"):
            a.endpoint_info()

    def test_dead_peer_is_a_transfer_error(self, wired: Wired) -> None:
        b, src, dst = wired.b, wired.src, wired.dst
        peer = wired.b_to_a()
        b.transfer(peer, [(dst.ctypes.data, src.ctypes.data, 64)], "read").wait(self.timeout)
        self.kill(wired.a)
        # Learning of a departure is asynchronous in every transport (NIXL's own progress thread takes in the
        # disconnect message while this thread posts), so the contract is a bounded window, then errors.
        deadline = time.monotonic() + self.departure_window
        attempts = 0
        while True:
            attempts += 1
            try:
                b.transfer(peer, [(dst.ctypes.data, src.ctypes.data, 64)], "read").wait(self.timeout)
            except TransferError as exc:
                error = exc
                break
            assert time.monotonic() < deadline, (
                f"{attempts} transfers to a closed peer succeeded over {self.departure_window}s; "
                "a dead peer must become a TransferError"
            )
        assert isinstance(error, KVBridgeError)
        assert error.peer, "a transfer error names its peer"
