"""Device-bound transports: every device works with every transport, through one contract. See docs/internals.md."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import attrs
import numpy as np

from kvbridge.base.errors import ConfigError
from kvbridge.base.memory import Descriptors, FactoredDescriptors, RegionIndex, as_regions, is_tensor_like, merge_runs
from kvbridge.base.types import MemoryKind, MemoryRegion
from kvbridge.device.contract import Device
from kvbridge.transport.contract import MigrationBackend, Op, Peer, TransferHandle, WrappingBackend

log = logging.getLogger(__name__)

FEW_RUNS = 16  # up to this many merged runs are copied one by one; more go as one gather and one scatter


def reaches(device: Device, backend: MigrationBackend) -> bool:
    """Whether the backend's transport reads and writes the device's memory without staging."""
    if device.memory_kind not in backend.capabilities.memory_kinds:
        return False
    # Host memory is reachable by anything that reaches DRAM; device memory needs the protocol too.
    return device.memory_kind == MemoryKind.DRAM or backend.protocol in device.protocols()


Maker = Callable[[], MigrationBackend]


def attach(
    backend: MigrationBackend, device: Device, *, force: bool = False, probe: Maker | None = None
) -> MigrationBackend:
    """`backend` bound to `device`'s memory: itself, a `DeviceBackend` or a `StagedBackend`. See docs/internals.md."""
    if isinstance(backend, DeviceBackend):  # bound already (by the caller): to this device, or a mistake
        if backend.device is not device:
            raise ConfigError(
                f"backend {backend.name!r} is bound to device {backend.device.name!r}, not "
                f"{device.name!r}; attach the transport itself"
            )
        if force and not isinstance(backend, StagedBackend):
            raise ConfigError("stage=True needs the transport itself, not one bound to reach the device directly")
        return backend
    if probe is not None and not force and device.synchronizes and reaches(device, backend):
        force = probe_paths(probe, device, key=f"{device.name}/{backend.name}/{backend.protocol}").staged
    if not force and reaches(device, backend):
        if not device.synchronizes:
            return backend
        return DeviceBackend(backend, device)
    log.info(
        "%s over %s/%s goes through host staging (one extra copy per side)", device.name, backend.name, backend.protocol
    )
    return StagedBackend(backend, device)


@attrs.frozen
class PathChoice:
    """What `probe_paths` measured: the best seconds of a verified read of `nbytes`, in place and staged."""

    staged: bool
    in_place_s: float
    staged_s: float
    nbytes: int

    def __str__(self) -> str:
        times = f"in place {self.in_place_s * 1e3:.2f} ms, staged {self.staged_s * 1e3:.2f} ms"
        return f"{'staged' if self.staged else 'in place'} ({times} for {self.nbytes} bytes)"


_choices: dict[str, PathChoice] = {}  # per key (device/transport/protocol): each deployment probes once


def probe_paths(make: Maker, device: Device, *, key: str = "", nbytes: int = 1 << 18, rounds: int = 5) -> PathChoice:
    """Time `nbytes` of device memory moved in place and staged by `make` backends; cached. See docs/internals.md."""
    if key in _choices:
        return _choices[key]
    best = [float("inf")] * 2
    pairs: tuple[list[MigrationBackend], list[MigrationBackend]] = ([], [])
    paths: list[Iterator[float] | None] = [_rounds(make, device, bool(s), pairs[s], nbytes) for s in (0, 1)]
    try:
        for i in range(rounds + 1):  # round 0 sets up and warms up (connections, caches)
            for staged, path in enumerate(paths):
                if path is None:
                    continue
                try:
                    took = next(path)
                except Exception as exc:  # noqa: BLE001 - a path that fails is the slower one
                    log.warning("path probe %s: the %s path failed: %s", key, "staged" if staged else "in-place", exc)
                    paths[staged], best[staged] = None, float("inf")
                    continue
                best[staged] = min(best[staged], took) if i else best[staged]
    finally:
        for be in pairs[0] + pairs[1]:
            be.close()
    choice = PathChoice(best[1] * 1.25 < best[0], best[0], best[1], nbytes)  # in place, unless clearly slower
    log.info("path probe %s: %s", key, choice)
    if key:
        _choices[key] = choice
    return choice


def _rounds(make: Maker, device: Device, staged: bool, pair: list[MigrationBackend], nbytes: int) -> Iterator[float]:
    """Seconds of each verified round of one path; its two backends go into `pair` (the caller closes them)."""
    pair += [attach(make(), device, force=staged) for _ in range(2)]
    src, dst, rng = device.allocate(nbytes), device.allocate(nbytes), np.random.default_rng()
    (local,) = pair[1].register_memory(dst)
    pair[0].register_memory(src)
    peer, remote = pair[1].connect(pair[0].endpoint_info()), pair[0].endpoint().regions[0].addr
    while True:
        pattern = rng.integers(0, 256, nbytes, dtype=np.uint8)  # new bytes each time: a stale copy is caught
        device.from_host(src, pattern)
        begun = time.perf_counter()
        pair[0].publish()
        pair[1].transfer(peer, [(local.addr, remote, nbytes)], "read").wait(5.0)
        took = time.perf_counter() - begun
        if not np.array_equal(device.to_host(dst), pattern):
            raise ConfigError("the read returned other bytes")
        yield took


def transport(backend: MigrationBackend) -> MigrationBackend:
    """The transport under a device-bound backend (itself when unbound): the bench's raw ceiling."""
    return backend.backend if isinstance(backend, DeviceBackend) else backend


class DeviceBackend(WrappingBackend):
    """A transport reaching a device's memory directly, with the device's synchronization. See docs/internals.md."""

    def __init__(self, backend: MigrationBackend, device: Device) -> None:
        self.device = device
        # Merging, cutting and batching are the inner transport's: the wrapper hands it one call.
        capabilities = attrs.evolve(
            backend.capabilities,
            memory_kinds=backend.capabilities.memory_kinds | {device.memory_kind},
            max_batch=None,
            max_descriptor_bytes=None,
        )
        super().__init__(backend, capabilities, backend.options)

    # -- what the device adds to the inner transport's hooks -------------------------------------

    def _regions(self, x: Any) -> list[MemoryRegion]:
        if is_tensor_like(x) or isinstance(x, np.ndarray):
            return self.device.regions(x)
        if isinstance(x, MemoryRegion):
            if x.kind != self.device.memory_kind:
                raise ConfigError(
                    f"a {x.kind.value} region was given to a backend bound to {self.device.name} "
                    f"({self.device.memory_kind.value}); build it with device.region(addr, length)"
                )
            return [x]
        if isinstance(x, list):
            return [r for item in x for r in self._regions(item)]
        raise ConfigError(
            f"register {self.device.name} memory as the tensor itself or as device.region(addr, length, device_id) "
            f"(got {type(x).__name__}): an address alone does not say which device it is on"
        )

    def _send(self, peer: Peer, desc: Descriptors | FactoredDescriptors, op: Op) -> TransferHandle:
        # Checked once, by this wrapper's `transfer`; the transport cuts and batches (no second merge or check).
        ids = self._device_ids(_local_addrs(desc))
        if op == "write":
            self._before(ids)
            return self.backend._send(peer.handle, desc, op)
        return _then_handle(self.backend._send(peer.handle, desc, op), peer, lambda: self._after(ids))

    def _submit(self, peer: Peer, desc: Descriptors, op: Op) -> Future:
        """The contract's hook: one checked batch, through `_send`."""
        return _future(self._send(peer, desc, op))

    # -- device synchronization -----------------------------------------------------------------

    def publish(self, ranges: Any = None, *, waited: bool = False) -> None:
        if not waited:
            self._before(self._device_ids(self._range_columns(ranges)[0]))

    def accept(self, ranges: Any = None) -> None:
        self._after(self._device_ids(self._range_columns(ranges)[0]))

    def _range_columns(self, ranges: Any) -> tuple[np.ndarray, np.ndarray]:
        if ranges is None:
            arr = np.array([(r.addr, r.length) for r in self._local.regions], dtype=np.int64).reshape(-1, 2)
            return arr[:, 0], arr[:, 1]
        arr = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
        if (arr[:, 1] <= 0).any():
            raise ConfigError("every published or accepted range needs a positive length")
        self._local.check(arr[:, 0], arr[:, 1], side="local", peer="")
        return arr[:, 0], arr[:, 1]

    def _device_ids(self, addrs: np.ndarray) -> list[int]:
        """The device ids of the registered regions these addresses are in (one wait per device, not per range)."""
        regions = sorted(self._local.regions, key=lambda r: r.addr)
        if not regions or len(addrs) == 0:
            return []
        ids = {r.device_id for r in regions}
        if len(ids) == 1:
            return list(ids)
        starts = np.array([r.addr for r in regions], dtype=np.int64)
        slot = np.clip(np.searchsorted(starts, addrs, side="right") - 1, 0, None)
        return sorted({regions[i].device_id for i in np.unique(slot).tolist()})

    def _before(self, ids: list[int]) -> None:
        for i in ids:
            self.device.before_transfer(i)

    def _after(self, ids: list[int]) -> None:
        for i in ids:
            self.device.after_transfer(i)


@attrs.define(eq=False)
class _Mirror:
    """One device buffer and its host mirror, as flat byte views."""

    region: MemoryRegion
    device_bytes: Any
    host: Any
    host_bytes: Any
    host_addr: int


class StagedBackend(DeviceBackend):
    """A transport used through host mirrors of device buffers; the contract unchanged. See docs/internals.md."""

    def __init__(self, backend: MigrationBackend, device: Device) -> None:
        self._mirrors: list[_Mirror] = []
        self._pending: dict[int, Any] = {}  # device address -> the buffer object register_memory was given
        self._starts = self._host_starts = np.empty(0, dtype=np.int64)
        self._index = RegionIndex()
        super().__init__(backend, device)

    def register_memory(self, x: Any) -> list[MemoryRegion]:
        try:
            return super().register_memory(x)
        finally:
            self._pending.clear()  # buffer objects are kept by their mirrors, never here

    def unregister_memory(self, x: Any) -> None:
        try:
            super().unregister_memory(x)
        finally:
            self._pending.clear()

    def _regions(self, x: Any) -> list[MemoryRegion]:
        if is_tensor_like(x) or isinstance(x, np.ndarray):
            (region,) = self.device.regions(x)
            self._pending[region.addr] = x
            return [region]
        if isinstance(x, tuple):
            raise ConfigError(
                "staging copies through the buffer object: register the device tensor itself, "
                "or device.region(addr, length, device_id) where only the address is known"
            )
        return super()._regions(x)

    def _register(self, regions: Sequence[MemoryRegion]) -> None:
        made: list[_Mirror] = []
        try:
            for region in regions:
                buf = self._pending.pop(region.addr, None)
                if buf is None:  # known by address only (LMDeploy): the device wraps it
                    buf = self.device.buffer_at(region)
                host = self.device.host_buffer(region.length)
                (host_region,) = as_regions(host)
                self.backend.register_memory(host)
                made.append(_Mirror(region, _flat_bytes(buf), host, _flat_bytes(host), host_region.addr))
        except BaseException:
            for m in made:
                self.backend.unregister_memory(m.host)
            raise
        self._mirrors.extend(made)
        self._reindex()

    def _unregister(self, regions: Sequence[MemoryRegion]) -> None:
        addrs = {r.addr for r in regions}
        for m in self._mirrors:
            if m.region.addr in addrs:
                self.backend.unregister_memory(m.host)
        self._mirrors = [m for m in self._mirrors if m.region.addr not in addrs]
        self._reindex()

    def _reindex(self) -> None:
        """Mirrors sorted by device address, for vectorized lookups of which buffer a range is in."""
        self._mirrors.sort(key=lambda m: m.region.addr)
        self._index = RegionIndex([m.region for m in self._mirrors])
        self._starts = np.array([m.region.addr for m in self._mirrors], dtype=np.int64)
        self._host_starts = np.array([m.host_addr for m in self._mirrors], dtype=np.int64)

    def peer_addresses(self, addrs: Any) -> np.ndarray:
        """Where peers find these device addresses: the same offsets in the host mirrors."""
        a = np.asarray(addrs, dtype=np.int64).reshape(-1)
        self._index.check(a, np.ones_like(a), side="local", peer="")
        slot = np.searchsorted(self._starts, a, side="right") - 1
        return self._host_starts[slot] + (a - self._starts[slot])

    def _send(self, peer: Peer, desc: Descriptors | FactoredDescriptors, op: Op) -> TransferHandle:
        if isinstance(desc, FactoredDescriptors):
            desc = desc.expand()  # every staged byte is copied anyway; the rows are the copies' ranges
        slot = np.searchsorted(self._starts, desc[:, 0], side="right") - 1
        offsets = desc[:, 0] - self._starts[slot]
        staged = desc.copy()
        staged[:, 0] = self._host_starts[slot] + offsets
        # The transport checks the mirror addresses again: a range that spans two device buffers is not
        # one range of a mirror.
        if op == "write":
            self._stage_out(slot, offsets, desc[:, 2])
            return self.backend.transfer(peer.handle, staged, op)
        inner = self.backend.transfer(peer.handle, staged, op)
        return _then_handle(inner, peer, lambda: self._stage_in(slot, offsets, desc[:, 2]))

    def publish(self, ranges: Any = None, *, waited: bool = False) -> None:
        self._stage_out(*self._slots(ranges), wait=not waited)

    def accept(self, ranges: Any = None) -> None:
        self._stage_in(*self._slots(ranges))

    def _slots(self, ranges: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if ranges is None:
            n = len(self._mirrors)
            lengths = np.array([m.region.length for m in self._mirrors], dtype=np.int64)
            return np.arange(n), np.zeros(n, dtype=np.int64), lengths
        addrs, lengths = self._range_columns(ranges)
        slot = np.searchsorted(self._starts, addrs, side="right") - 1
        return slot, addrs - self._starts[slot], lengths

    # -- copies: one vectorized copy per registered buffer touched, one wait per device ------------

    def _stage_out(self, slot: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, *, wait: bool = True) -> None:
        touched = np.unique(slot).tolist()
        if wait:
            self._before(sorted({self._mirrors[s].region.device_id for s in touched}))
        for s in touched:
            m, pick = self._mirrors[s], slot == s
            copy_ranges(m.host_bytes, m.device_bytes, offsets[pick], offsets[pick], lengths[pick])

    def _stage_in(self, slot: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> None:
        touched = np.unique(slot).tolist()
        for s in touched:
            m, pick = self._mirrors[s], slot == s
            copy_ranges(m.device_bytes, m.host_bytes, offsets[pick], offsets[pick], lengths[pick])
        self._after(sorted({self._mirrors[s].region.device_id for s in touched}))


def _local_addrs(desc: Descriptors | FactoredDescriptors) -> np.ndarray:
    """Local addresses enough to tell which registered buffers descriptors touch (one per region if factored)."""
    if isinstance(desc, FactoredDescriptors):
        return desc.spans(remote=False)[0]
    return desc[:, 0]


def _future(handle: Any) -> Future:
    """The inner transfer's outcome as a Future (what `MigrationBackend._submit` returns)."""
    return _then(handle, lambda: None)


def _then_handle(inner: TransferHandle, peer: Peer, step: Any) -> TransferHandle:
    """`inner`'s transfer, complete once `step()` ran after it, as the handle of `peer` (the wrapper's)."""
    return TransferHandle(_then(inner, step), peer=peer.name, descriptors=inner.descriptors, nbytes=inner.nbytes)


def _then(handle: Any, step: Any) -> Future:
    """A Future that completes after `handle` and then `step()` succeeded, or with the first error."""
    out: Future = Future()

    def done(h: Any) -> None:
        error = h.exception()
        if error is not None:
            out.set_exception(error)
            return
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - handed to the waiter, who sees it from wait()
            out.set_exception(exc)
        else:
            out.set_result(h.retries)

    handle.add_done_callback(done)
    return out


def _flat_bytes(buf: Any) -> Any:
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    import torch  # a tensor was passed, so torch is there

    return buf.detach().reshape(-1).view(torch.uint8)


def _rows(offsets: np.ndarray, lengths: np.ndarray, unit: int) -> np.ndarray:
    """Indices of the `unit`-byte rows that the ranges cover, concatenated in order."""
    starts, counts = offsets // unit, lengths // unit
    total = int(counts.sum())
    return np.arange(total, dtype=np.int64) + np.repeat(starts - (np.cumsum(counts) - counts), counts)


def copy_ranges(
    dst: Any,
    src: Any,
    dst_offsets: Sequence[int] | np.ndarray,
    src_offsets: Sequence[int] | np.ndarray,
    lengths: Sequence[int] | np.ndarray,
) -> None:
    """``dst[d:d+n] = src[s:s+n]`` for every range, without a Python loop per range. See docs/internals.md."""
    runs = merge_runs(
        np.stack(
            [
                np.asarray(dst_offsets, dtype=np.int64),
                np.asarray(src_offsets, dtype=np.int64),
                np.asarray(lengths, dtype=np.int64),
            ],
            axis=1,
        ).reshape(-1, 3)
    )
    if len(runs) == 0:
        return
    both_numpy = isinstance(dst, np.ndarray) and isinstance(src, np.ndarray)
    if not both_numpy:
        import torch

        dst = torch.from_numpy(dst) if isinstance(dst, np.ndarray) else dst
        src = torch.from_numpy(src) if isinstance(src, np.ndarray) else src
    if len(runs) <= FEW_RUNS:
        for d, s, n in runs.tolist():
            if both_numpy:
                dst[d : d + n] = src[s : s + n]
            else:
                dst[d : d + n].copy_(src[s : s + n])
        return
    unit = int(np.gcd.reduce(runs.reshape(-1)))
    d_rows, s_rows = _rows(runs[:, 0], runs[:, 2], unit), _rows(runs[:, 1], runs[:, 2], unit)
    if both_numpy:  # flat byte buffers are contiguous, so these reshapes are views
        rows_in = src[: len(src) // unit * unit].reshape(-1, unit)
        rows_out = dst[: len(dst) // unit * unit].reshape(-1, unit)
        # a gather into (or a scatter from) consecutive rows is one copy, not a gather and a scatter
        if (np.diff(d_rows) == 1).all():  # torch's row gather is about twice numpy's `take` here
            import torch

            packed = torch.from_numpy(rows_out[d_rows[0] : d_rows[0] + len(d_rows)])
            torch.index_select(torch.from_numpy(rows_in), 0, torch.from_numpy(s_rows), out=packed)
        elif (np.diff(s_rows) == 1).all():
            rows_out[d_rows] = rows_in[s_rows[0] : s_rows[0] + len(s_rows)]
        else:
            rows_out[d_rows] = rows_in[s_rows]
        return
    import torch

    dst2 = dst[: dst.numel() // unit * unit].view(-1, unit)  # a view: the scatter must land in dst itself
    src2 = src[: src.numel() // unit * unit].view(-1, unit)

    # new_tensor/new_empty place indices and the bounce rows on each tensor's own device.
    rows = src2.index_select(0, src2.new_tensor(s_rows, dtype=torch.int64))
    landed = dst2.new_empty(rows.shape)
    landed.copy_(rows)
    dst2.index_copy_(0, dst2.new_tensor(d_rows, dtype=torch.int64), landed)
