"""Conformance suite for device plugins: subclass `DeviceConformance` in a ``Test...`` class (docs/plugins.md).

Every test goes through kvbridge's registry, exactly as a user's process would: the plugin must
be installed (``pip install -e .``) for its entry point to be found.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import pytest

import kvbridge
from kvbridge.base.errors import ConfigError, InvalidDescriptor, PluginNotFound, PluginUnavailable
from kvbridge.base.memory import as_regions
from kvbridge.base.types import MemoryKind, MemoryRegion
from kvbridge.device.contract import Device
from kvbridge.device.nics import nic_env
from kvbridge.transport import staging

BLOCK = 512
BLOCKS = 12
MOVED = 8  # blocks moved per round trip; the rest must stay untouched


class DeviceConformance:
    """What every available device plugin must do.

    Configure with class attributes; override the `library` fixture to install a stand-in for the device's library
    first."""

    device_name: ClassVar[str]
    #: (transport, protocol) pairs to round-trip through; None takes the transport's default protocol.
    transports: ClassVar[tuple[tuple[str, str | None], ...]] = (("tcp", None), ("loopback", None))
    #: device ids to allocate on (every one must exist here).
    device_ids: ClassVar[tuple[int, ...]] = (0,)

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "transport" in metafunc.fixturenames:
            metafunc.parametrize(
                "transport", self.transports, ids=[t if p is None else f"{t}-{p}" for t, p in self.transports]
            )
        if "device_id" in metafunc.fixturenames:
            metafunc.parametrize("device_id", self.device_ids, ids=[f"dev{i}" for i in self.device_ids])

    @pytest.fixture
    def library(self) -> Any:
        """Whatever the device needs installed first (a stand-in); its `calls`, if any, are checked."""
        return None

    @pytest.fixture
    def device(self, library: Any) -> Iterator[Device]:
        kvbridge.reset_plugins()
        yield kvbridge.get_device(self.device_name)
        kvbridge.reset_plugins()

    def observed_syncs(self, library: Any, device: Device) -> list[tuple[str, int]] | None:
        """Every synchronization seen so far as (what, device_id) pairs, or None where they are not observable.

        A fresh list each call; order does not matter."""
        calls = getattr(library, "calls", None)
        return None if calls is None else list(calls)

    # -- registration and availability ---------------------------------------------------

    def test_registered_and_available(self, device: Device) -> None:
        info = {i.name: i for i in kvbridge.list_devices()}.get(self.device_name.lower())  # names are case-free
        assert info is not None, f"{self.device_name} is not registered; is the plugin installed?"
        assert info.available, info.reason
        assert info.reason == ""
        assert device.name.lower() == self.device_name.lower()
        assert isinstance(device.memory_kind, MemoryKind)
        assert info.detail.get("memory") == device.memory_kind.value
        assert kvbridge.get_device(self.device_name.upper()) is device  # names are case-insensitive, one instance

    def test_unknown_device_is_plugin_not_found(self, device: Device) -> None:
        with pytest.raises(PluginNotFound, match=self.device_name):  # the message lists what is installed
            kvbridge.get_device(f"no-such-{self.device_name}")

    # -- memory --------------------------------------------------------------------------

    def test_allocate_is_zeroed_and_round_trips_through_host(self, device: Device, device_id: int) -> None:
        buf = device.allocate(4096 + 3, device_id)
        assert not device.to_host(buf).any()
        data = np.random.default_rng(1).integers(0, 256, 4096 + 3, dtype=np.uint8)
        device.from_host(buf, data)
        got = device.to_host(buf)
        assert got.dtype == np.uint8 and got.shape == (4096 + 3,)
        assert np.array_equal(got, data)

    def test_regions_of_a_buffer(self, device: Device, device_id: int) -> None:
        buf = device.allocate(8192, device_id)
        (region,) = device.regions(buf)
        assert isinstance(region, MemoryRegion)
        assert region.length == 8192
        assert region.kind == device.memory_kind
        if device.memory_kind != MemoryKind.DRAM:  # host memory belongs to no device id
            assert region.device_id == device_id
        # a contiguous slice starts where its first byte is and is as long as it is
        (part,) = device.regions(buf[1024:3072])
        assert (part.addr - region.addr, part.length) == (1024, 2048)
        assert part.kind == region.kind and part.device_id == region.device_id

    def test_regions_follow_the_element_size(self, device: Device, device_id: int) -> None:
        buf = device.allocate(4096, device_id)
        wide = buf.view(np.int32) if isinstance(buf, np.ndarray) else buf.view(_torch().int32)
        (region,) = device.regions(wide)
        assert region.length == 4096
        (tail,) = device.regions(wide[256:])
        assert (tail.addr - region.addr, tail.length) == (1024, 3072)

    def test_strided_and_empty_views_are_refused(self, device: Device, device_id: int) -> None:
        buf = device.allocate(4096, device_id)
        with pytest.raises(ConfigError, match="contiguous"):
            device.regions(buf.reshape(64, 64).T if isinstance(buf, np.ndarray) else buf.view(64, 64).t())
        with pytest.raises(ConfigError, match="empty"):
            device.regions(buf[:0])

    def test_host_buffer_is_zeroed_host_memory(self, device: Device) -> None:
        host = device.host_buffer(1000)
        (region,) = as_regions(host)
        assert region.kind == MemoryKind.DRAM and region.length == 1000
        arr = host if isinstance(host, np.ndarray) else host.numpy()
        assert not arr.any()

    # -- synchronization -------------------------------------------------------------------

    def _syncs_during(self, library: Any, device: Device, call: Any) -> list[int] | None:
        """Device ids of the synchronizations `call()` caused, or None where they are not observable."""
        before = self.observed_syncs(library, device)
        call()
        after = self.observed_syncs(library, device)
        if before is None or after is None:
            return None
        return [d for _, d in (collections.Counter(after) - collections.Counter(before)).elements()]

    def test_synchronization_calls(self, device: Device, library: Any, device_id: int) -> None:
        assert device.before_transfer(device_id) is None and device.after_transfer(device_id) is None
        for hook in (device.before_transfer, device.after_transfer):
            seen = self._syncs_during(library, device, functools.partial(hook, device_id))
            assert seen is None or device_id in seen, f"{hook.__name__}({device_id}) reached no device {device_id}"
            # -1 means every device: each one in use must be reached (or the call passes -1 through)
            seen = self._syncs_during(library, device, functools.partial(hook, -1))
            assert seen is None or set(seen) >= set(self.device_ids) or seen == [-1], f"{hook.__name__}(-1): {seen}"

    def test_a_recorded_mark_is_waited_for_on_another_thread(
        self, device: Device, library: Any, device_id: int
    ) -> None:
        """`record` marks the work queued so far without waiting; `wait_recorded` waits for it on another thread.

        Layer-wise streaming calls `record` in the engine's forward. None: the device cannot mark."""
        before = self.observed_syncs(library, device)
        mark = device.record(device_id)
        if mark is None:
            return
        recorded = self.observed_syncs(library, device)
        if before is not None and recorded is not None:
            new = collections.Counter(recorded) - collections.Counter(before)
            assert not any("synchronize" in kind for kind, _ in new.elements()), f"record() waited: {new}"
        waiter = threading.Thread(target=device.wait_recorded, args=(mark,))
        waiter.start()
        waiter.join(30)
        assert not waiter.is_alive(), "wait_recorded did not return for work that was done"
        after = self.observed_syncs(library, device)
        if recorded is not None and after is not None:
            new = collections.Counter(after) - collections.Counter(recorded)
            assert any(d == device_id for _, d in new.elements()), f"wait_recorded reached no device {device_id}: {new}"

    # -- reachability and topology ---------------------------------------------------------

    def test_protocols_and_nics(self, device: Device, device_id: int, monkeypatch: pytest.MonkeyPatch) -> None:
        protocols = device.protocols()
        assert isinstance(protocols, tuple) and protocols and all(isinstance(p, str) for p in protocols)
        found = device.nics(device_id)
        assert isinstance(found, list) and all(isinstance(n, str) for n in found)
        monkeypatch.setenv(nic_env(self.device_name, device_id), "nic-a, nic-b")
        assert device.nics(device_id) == ["nic-a", "nic-b"]

    # -- transfers ---------------------------------------------------------------------------

    @pytest.mark.parametrize("staged", [False, True], ids=["auto", "staged"])
    @pytest.mark.parametrize("op", ["read", "write"])
    def test_round_trip(self, device: Device, transport: tuple[str, str | None], op: str, staged: bool) -> None:
        """Blocks in shuffled order from one backend's buffer into another's, pulled or pushed.

        Bytes that were not addressed stay zero. `auto` stages only where the transport cannot reach the memory."""
        name, protocol = transport
        rng = np.random.default_rng(7)
        perm = rng.permutation(BLOCKS)[:MOVED]
        data = rng.integers(0, 256, BLOCKS * BLOCK, dtype=np.uint8)
        with _pair(name, protocol, device, staged) as (a, b):
            src = device.allocate(BLOCKS * BLOCK, self.device_ids[0])
            dst = device.allocate(BLOCKS * BLOCK, self.device_ids[-1])
            device.from_host(src, data)
            a.register_memory(src)
            b.register_memory(dst)
            src_addr, dst_addr = device.regions(src)[0].addr, device.regions(dst)[0].addr
            idx = np.arange(MOVED, dtype=np.int64)
            if op == "read":  # b pulls from a: a must publish what b reads
                a.publish()
                remote = a.endpoint().regions[0].addr
                desc = np.stack([dst_addr + idx * BLOCK, remote + perm * BLOCK, np.full(MOVED, BLOCK)], axis=1)
                b.transfer(b.connect(a.endpoint_info()), desc, "read").wait(60)
            else:  # a pushes into b: b accepts what landed
                remote = b.endpoint().regions[0].addr
                desc = np.stack([src_addr + perm * BLOCK, remote + idx * BLOCK, np.full(MOVED, BLOCK)], axis=1)
                a.transfer(a.connect(b.endpoint_info()), desc, "write").wait(60)
                b.accept()
            got = device.to_host(dst).reshape(BLOCKS, BLOCK)
        expected = np.zeros((BLOCKS, BLOCK), dtype=np.uint8)
        expected[:MOVED] = data.reshape(BLOCKS, BLOCK)[perm]
        assert np.array_equal(got, expected)

    @pytest.mark.parametrize("staged", [False, True], ids=["auto", "staged"])
    def test_unregistered_range_is_invalid_descriptor(
        self, device: Device, transport: tuple[str, str | None], staged: bool
    ) -> None:
        name, protocol = transport
        with _pair(name, protocol, device, staged) as (a, b):
            src, dst = device.allocate(4096, self.device_ids[0]), device.allocate(4096, self.device_ids[0])
            a.register_memory(src)
            b.register_memory(dst)
            peer = b.connect(a.endpoint_info())
            local = device.regions(dst)[0].addr
            remote = a.endpoint().regions[0].addr
            with pytest.raises(InvalidDescriptor):
                b.transfer(peer, [(local + 4000, remote, 200)], "read")  # local end past the buffer
            with pytest.raises(InvalidDescriptor):
                b.transfer(peer, [(local, remote + 4096, 1)], "read")  # remote range not registered

    def test_staging_by_address(self, device: Device) -> None:
        """Where only an address is known, staging copies through `Device.buffer_at`.

        LMDeploy's CacheEngine hands out pointers. A device that cannot wrap an address says so when registering, not
        later."""
        src, dst = device.allocate(4096, self.device_ids[0]), device.allocate(4096, self.device_ids[0])
        data = np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8)
        device.from_host(src, data)
        with _pair("loopback", None, device, True) as (a, b):
            regions = [device.region(device.regions(x)[0].addr, 4096, self.device_ids[0]) for x in (src, dst)]
            assert all(r.kind == device.memory_kind for r in regions)
            try:
                a.register_memory(regions[0])
            except ConfigError as exc:
                assert device.name in str(exc) and "raw address" in str(exc)
                return
            b.register_memory(regions[1])
            a.publish()
            b.transfer(
                b.connect(a.endpoint_info()), [(regions[1].addr, a.endpoint().regions[0].addr, 4096)], "read"
            ).wait(60)
        assert np.array_equal(device.to_host(dst), data)

    def test_staging_refuses_raw_addresses(self, device: Device) -> None:
        be = kvbridge.create_backend("loopback")
        try:
            staged = staging.attach(be, device, force=True)
            buf = device.allocate(4096, self.device_ids[0])
            with pytest.raises(ConfigError, match="tensor itself"):
                staged.register_memory((device.regions(buf)[0].addr, 4096))
        finally:
            be.close()


class StandInDeviceConformance(DeviceConformance):
    """`DeviceConformance` on a stand-in for the device's library (`kvbridge.testing.standins`).

    Host memory behind the library's module surface, installed only inside these tests, so CI without the hardware runs
    the whole suite. Test ids carry `stand-in`."""

    #: the vendor package stood in (``torch_npu``, ``torch_mlu``); there is no CUDA stand-in.
    standin_module: ClassVar[str]
    device_ids = (0, 1)

    @pytest.fixture(params=["stand-in"])
    def library(self, monkeypatch: pytest.MonkeyPatch) -> Any:
        from kvbridge.testing.standins import install_standin

        return install_standin(monkeypatch, self.device_name, self.standin_module)


class UnavailableDeviceConformance:
    """What a device plugin must do where its hardware or library is missing.

    Register anyway, say why, and fail only when used, with the reason and the fix."""

    device_name: ClassVar[str]
    #: text the unavailability reason must contain (for example "torch_npu is not importable").
    reason_contains: ClassVar[str]

    @pytest.fixture
    def library(self) -> Any:
        return None

    @pytest.fixture
    def fresh(self, library: Any) -> Iterator[None]:
        kvbridge.reset_plugins()
        yield
        kvbridge.reset_plugins()

    def test_listed_unavailable_with_reason_and_hint(self, fresh: None) -> None:
        info = {i.name: i for i in kvbridge.list_devices()}.get(self.device_name.lower())  # names are case-free
        assert info is not None, f"{self.device_name} is not registered; is the plugin installed?"
        assert not info.available
        assert self.reason_contains in info.reason
        assert info.hint, "an unavailable device must say how to fix it"
        refused = {r.distribution: r.reason for r in kvbridge.refused_plugins()}
        assert info.distribution not in refused, refused.get(info.distribution)  # loaded whole, not in part

    def test_using_it_raises_plugin_unavailable(self, fresh: None) -> None:
        with pytest.raises(PluginUnavailable) as err:
            kvbridge.get_device(self.device_name)
        assert self.reason_contains in err.value.reason
        assert err.value.hint and err.value.hint in str(err.value)


@contextlib.contextmanager
def _pair(name: str, protocol: str | None, device: Device, force: bool) -> Iterator[tuple[Any, Any]]:
    """Two backends of one transport, staged as the device needs (or forced), closed on exit."""
    made: list[Any] = []
    try:
        for _ in range(2):
            made.append(staging.attach(kvbridge.create_backend(name, protocol=protocol), device, force=force))
        yield made[0], made[1]
    finally:
        for be in made:
            be.close()
        # Peers, handles and tracebacks form reference cycles; collect them now, so their sockets and
        # native resources are released inside the test that made them, not during a later one.
        gc.collect()


def _torch() -> Any:
    import torch

    return torch
