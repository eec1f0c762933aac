"""Staging through host memory, so every device works with every transport.

A transport reaches a device's memory directly only when the device lists the transport's
protocol in `Device.protocols()` and the transport lists the memory kind in its capabilities
(Mooncake `rdma` reaches GPU memory with GPUDirect; `tcp` never does). Otherwise `attach`
wraps the backend in a `StagedBackend`: each registered device buffer gets a host mirror from
`Device.host_buffer` (pinned on accelerators), the mirror is what the transport registers and
what peers address, and bytes are copied between the two around each transfer:

- local ``write`` (push): device -> mirror for the local ranges, then the transport sends;
- local ``read`` (pull): the transport lands bytes in the mirror, then mirror -> device and
  `Device.after_transfer`, before the handle completes;
- a peer that reads this side's memory reads the mirror: call `publish()` first;
- a peer that writes this side's memory writes the mirror: call `accept()` once it has finished.

Cost: every staged byte crosses the device-host link once more on each staging side (one
extra copy at PCIe speed, typically 20-50 GB/s against 12-50 GB/s for the network), the
copies are not overlapped with the network transfer, and each registered buffer takes its size
again in host memory. Peers address the mirror: take remote addresses from the peer's
endpoint regions (same order and lengths as the device buffers), never from a device pointer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import attrs
import numpy as np

from kvbridge.backend import MigrationBackend, Op, Peer, TransferHandle
from kvbridge.device import Device
from kvbridge.errors import ConfigError
from kvbridge.memory import RegionIndex, as_descriptors, as_regions, merge_runs
from kvbridge.types import EndpointInfo, MemoryKind, MemoryRegion

log = logging.getLogger(__name__)

FEW_RUNS = 16  # up to this many merged runs are copied one by one; more go as one gather and one scatter


def reaches(device: Device, backend: MigrationBackend) -> bool:
    """Whether the backend's transport reads and writes the device's memory without staging."""
    if device.memory_kind not in backend.capabilities.memory_kinds:
        return False
    # Host memory is reachable by anything that reaches DRAM; device memory needs the protocol too.
    return device.memory_kind == MemoryKind.DRAM or backend.protocol in device.protocols()


def attach(backend: MigrationBackend, device: Device, *, force: bool = False) -> MigrationBackend | StagedBackend:
    """The backend itself when it reaches the device's memory, else a `StagedBackend` around it.

    `force` stages even when the transport could reach the memory (to measure or test staging).
    """
    if not force and reaches(device, backend):
        return backend
    log.info("%s over %s/%s goes through host staging (one extra copy per side)",
             device.name, backend.name, backend.protocol)
    return StagedBackend(backend, device)


@attrs.define(eq=False)
class _Mirror:
    """One device buffer and its host mirror, as flat byte views."""

    region: MemoryRegion
    device_bytes: Any
    host: Any
    host_bytes: Any
    host_addr: int


class StagedBackend:
    """A transport used through host mirrors of device buffers. Same calls as `MigrationBackend`,
    plus `publish` and `accept` for transfers the peer drives."""

    def __init__(self, backend: MigrationBackend, device: Device) -> None:
        self.backend = backend
        self.device = device
        self._mirrors: list[_Mirror] = []
        self._index = RegionIndex()
        self._starts = self._host_starts = np.empty(0, dtype=np.int64)

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def protocol(self) -> str:
        return self.backend.protocol

    @property
    def capabilities(self) -> Any:
        return self.backend.capabilities

    @property
    def registered(self) -> tuple[MemoryRegion, ...]:
        """The device regions this backend stages (peers see the mirrors: `endpoint().regions`)."""
        return tuple(m.region for m in self._mirrors)

    def register_memory(self, x: Any) -> list[MemoryRegion]:
        """Register device buffers (tensors or arrays from this device, one or a list): each gets a mirror."""
        buffers = _buffers(x)
        if not buffers:
            raise ConfigError("register_memory() got nothing to register")
        out: list[MemoryRegion] = []
        for buf in buffers:
            if isinstance(buf, (MemoryRegion, tuple)) or not hasattr(buf, "__len__"):
                raise ConfigError(
                    "staging copies through the buffer object: register the device tensor itself, "
                    "not an address or a MemoryRegion"
                )
            (region,) = self.device.regions(buf)
            out.append(region)
            if any(m.region.addr == region.addr for m in self._mirrors):
                continue
            host = self.device.host_buffer(region.length)
            (host_region,) = as_regions(host)
            self.backend.register_memory(host)
            self._mirrors.append(_Mirror(region, _flat_bytes(buf), host, _flat_bytes(host), host_region.addr))
        self._reindex()
        return out

    def unregister_memory(self, x: Any) -> None:
        addrs = {r.addr for b in _buffers(x) for r in self.device.regions(b)}
        gone = [m for m in self._mirrors if m.region.addr in addrs]
        for m in gone:
            self.backend.unregister_memory(m.host)
        self._mirrors = [m for m in self._mirrors if m.region.addr not in addrs]
        self._reindex()

    def host_addresses(self, addrs: Any) -> np.ndarray:
        """Where peers find these device addresses: the same offsets in the host mirrors."""
        a = np.asarray(addrs, dtype=np.int64).reshape(-1)
        self._index.check(a, np.ones_like(a), side="local", peer="")
        slot = np.searchsorted(self._starts, a, side="right") - 1
        return self._host_starts[slot] + (a - self._starts[slot])

    def _reindex(self) -> None:
        """Mirrors sorted by device address, for vectorized lookups of which buffer a range is in."""
        self._mirrors.sort(key=lambda m: m.region.addr)
        self._index = RegionIndex([m.region for m in self._mirrors])
        self._starts = np.array([m.region.addr for m in self._mirrors], dtype=np.int64)
        self._host_starts = np.array([m.host_addr for m in self._mirrors], dtype=np.int64)

    def endpoint(self) -> EndpointInfo:
        return self.backend.endpoint()

    def endpoint_info(self) -> bytes:
        return self.backend.endpoint_info()

    def connect(self, info: bytes | EndpointInfo) -> Peer:
        return self.backend.connect(info)

    def disconnect(self, peer: Peer) -> None:
        self.backend.disconnect(peer)

    def transfer(self, peer: Peer, descriptors: Any, op: Op = "read") -> TransferHandle:
        """Like `MigrationBackend.transfer`; local addresses are device addresses, remote ones the peer's."""
        desc = as_descriptors(descriptors)
        if len(desc) == 0:
            return self.backend.transfer(peer, desc, op)
        if op not in ("read", "write"):
            raise ConfigError(f"op must be 'read' or 'write', got {op!r}")
        self._index.check(desc[:, 0], desc[:, 2], side="local", peer="")
        slot = np.searchsorted(self._starts, desc[:, 0], side="right") - 1
        offsets = desc[:, 0] - self._starts[slot]
        staged = desc.copy()
        staged[:, 0] = self._host_starts[slot] + offsets
        if op == "write":
            self._copy(slot, offsets, desc[:, 2], to_host=True)
            return self.backend.transfer(peer, staged, op)
        inner = self.backend.transfer(peer, staged, op)
        out: Future = Future()

        def land(h: TransferHandle) -> None:
            error = h.exception()
            if error is not None:
                out.set_exception(error)
                return
            try:
                self._copy(slot, offsets, desc[:, 2], to_host=False)
            except Exception as exc:  # handed to the waiter, who sees it from wait()
                out.set_exception(exc)
            else:
                out.set_result(None)

        inner.add_done_callback(land)
        return TransferHandle(out, peer=inner.peer, descriptors=inner.descriptors, nbytes=inner.nbytes)

    def publish(self, ranges: Any = None) -> None:
        """Copy device -> mirror so a peer's read sees current bytes. `ranges`: (device_addr, length)
        pairs (an N x 2 array); None copies every registered buffer."""
        self._copy(*self._ranges(ranges), to_host=True)

    def accept(self, ranges: Any = None) -> None:
        """Copy mirror -> device after a peer wrote this side's memory (same `ranges` as `publish`)."""
        self._copy(*self._ranges(ranges), to_host=False)

    def close(self) -> None:
        self.backend.close()
        self._mirrors = []

    def __enter__(self) -> StagedBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- copies --------------------------------------------------------------------------

    def _ranges(self, ranges: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if ranges is None:
            n = len(self._mirrors)
            return np.arange(n), np.zeros(n, dtype=np.int64), np.array(
                [m.region.length for m in self._mirrors], dtype=np.int64)
        arr = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
        if (arr[:, 1] <= 0).any():
            raise ConfigError("every staged range needs a positive length")
        self._index.check(arr[:, 0], arr[:, 1], side="local", peer="")
        slot = np.searchsorted(self._starts, arr[:, 0], side="right") - 1
        return slot, arr[:, 0] - self._starts[slot], arr[:, 1]

    def _copy(self, slot: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, *, to_host: bool) -> None:
        # One vectorized copy per registered buffer touched, never one per block.
        for s in np.unique(slot).tolist():
            m = self._mirrors[s]
            pick = slot == s
            off, n = offsets[pick], lengths[pick]
            if to_host:
                self.device.before_transfer(m.region.device_id)
                copy_ranges(m.host_bytes, m.device_bytes, off, off, n)
            else:
                copy_ranges(m.device_bytes, m.host_bytes, off, off, n)
                self.device.after_transfer(m.region.device_id)


def _buffers(x: Any) -> list[Any]:
    return list(x) if isinstance(x, list) else [x]


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


def copy_ranges(dst: Any, src: Any, dst_offsets: Sequence[int] | np.ndarray, src_offsets: Sequence[int] | np.ndarray,
                lengths: Sequence[int] | np.ndarray) -> None:
    """``dst[d:d+n] = src[s:s+n]`` for every range, without a Python loop per range.

    `dst` and `src` are flat byte buffers: numpy arrays or tensors on any device. Ranges that continue
    each other on both sides are merged first; a few runs are copied straight, many as one gather and
    one scatter in rows of the largest size that divides every offset and length (block-sized for a
    block-aligned KV cache).
    """
    runs = merge_runs(np.stack([np.asarray(dst_offsets, dtype=np.int64), np.asarray(src_offsets, dtype=np.int64),
                                np.asarray(lengths, dtype=np.int64)], axis=1).reshape(-1, 3))
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
        dst[: len(dst) // unit * unit].reshape(-1, unit)[d_rows] = src[: len(src) // unit * unit].reshape(-1, unit)[s_rows]
        return
    import torch

    dst2 = dst[: dst.numel() // unit * unit].view(-1, unit)  # a view: the scatter must land in dst itself
    src2 = src[: src.numel() // unit * unit].view(-1, unit)

    # new_tensor/new_empty place indices and the bounce rows on each tensor's own device.
    rows = src2.index_select(0, src2.new_tensor(s_rows, dtype=torch.int64))
    landed = dst2.new_empty(rows.shape)
    landed.copy_(rows)
    dst2.index_copy_(0, dst2.new_tensor(d_rows, dtype=torch.int64), landed)
