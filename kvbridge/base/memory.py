"""Memory regions and transfer descriptors: normalizing what callers pass, checking bounds. See docs/internals.md."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import attrs
import numpy as np

from kvbridge.base.errors import ConfigError, InvalidDescriptor
from kvbridge.base.types import MemoryKind, MemoryRegion

Descriptors = np.ndarray  # shape (N, 3), dtype int64: local_addr, remote_addr, length


def is_tensor_like(x: Any) -> bool:
    return hasattr(x, "data_ptr") and hasattr(x, "element_size") and hasattr(x, "device")


def buffer_region(buf: Any, kind: MemoryKind, device_id: int) -> MemoryRegion:
    """The one region a contiguous tensor or numpy array occupies, first to last byte. See docs/internals.md."""
    if isinstance(buf, np.ndarray):
        contiguous, nbytes, addr = buf.flags.c_contiguous, buf.nbytes, buf.ctypes.data
    else:
        contiguous = not hasattr(buf, "is_contiguous") or buf.is_contiguous()
        nbytes, addr = buf.numel() * buf.element_size(), buf.data_ptr()
    if not contiguous:
        raise ConfigError("register a contiguous tensor (the KV cache itself, not a strided view of it)")
    if nbytes == 0:
        raise ConfigError("cannot register an empty tensor")
    return MemoryRegion(addr, nbytes, kind, device_id)


def as_regions(x: Any) -> list[MemoryRegion]:
    """Regions of host memory: a CPU tensor, a numpy array, a MemoryRegion, an (addr, length) pair, or a list.

    A device tensor is a clear error: its device plugin describes it (`kvbridge.plugin.placement.regions_of`)."""
    if isinstance(x, MemoryRegion):
        return [x]
    if is_tensor_like(x):
        if str(getattr(x.device, "type", x.device)) != "cpu":
            raise ConfigError(
                f"a {x.device} tensor is device memory: describe it with "
                "kvbridge.plugin.placement.regions_of(tensor), or register it through a KVAgent or "
                "kvbridge.transport.staging.attach(backend, device), which know its device"
            )
        return [buffer_region(x, MemoryKind.DRAM, -1)]
    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            raise ConfigError("a numpy array must be C-contiguous to be registered; pass np.ascontiguousarray(x)")
        return [MemoryRegion(x.ctypes.data, x.nbytes)]
    if isinstance(x, tuple) and len(x) == 2 and all(isinstance(v, (int, np.integer)) for v in x):
        return [MemoryRegion(int(x[0]), int(x[1]))]
    if isinstance(x, Iterable) and not isinstance(x, (str, bytes)):
        out: list[MemoryRegion] = []
        for item in x:
            out.extend(as_regions(item))
        return out
    raise ConfigError(
        f"cannot register {type(x).__name__}: pass a tensor, a numpy array, an (address, length) pair, "
        "a MemoryRegion, or a list of those"
    )


def as_descriptors(descriptors: Any) -> Descriptors:
    """An (N, 3) int64 array from triples or an array; refuses non-positive lengths."""
    arr = np.asarray(descriptors, dtype=np.int64)
    if arr.size == 0:
        return arr.reshape(0, 3)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise ConfigError(
            f"descriptors must be (local_addr, remote_addr, length) triples or an N x 3 array, got shape {arr.shape}"
        )
    if (arr[:, 2] <= 0).any():
        bad = int(np.flatnonzero(arr[:, 2] <= 0)[0])
        raise ConfigError(f"descriptor {bad} has length {int(arr[bad, 2])}; every length must be positive")
    return arr


class RegionIndex:
    """Sorted, merged view of registered regions that answers 'is this range inside?' in bulk."""

    def __init__(self, regions: Sequence[MemoryRegion] = ()) -> None:
        self._regions: list[MemoryRegion] = []
        # (starts, ends) replaced as one object: a transfer checking its ranges on another thread while
        # a landing buffer registers must never see new starts with old ends
        self._spans = (np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))
        self.add(regions)

    def add(self, regions: Iterable[MemoryRegion]) -> None:
        self._regions = [*self._regions, *regions]  # a new list: a reader's copy stays whole
        self._rebuild()

    def remove(self, addrs: Iterable[int]) -> list[MemoryRegion]:
        drop = set(addrs)
        removed = [r for r in self._regions if r.addr in drop]
        self._regions = [r for r in self._regions if r.addr not in drop]
        self._rebuild()
        return removed

    def _rebuild(self) -> None:
        spans = sorted((r.addr, r.end) for r in self._regions)
        merged: list[list[int]] = []
        for start, end in spans:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        self._spans = (
            np.array([m[0] for m in merged], dtype=np.int64),
            np.array([m[1] for m in merged], dtype=np.int64),
        )

    @property
    def regions(self) -> tuple[MemoryRegion, ...]:
        return tuple(self._regions)

    def __len__(self) -> int:
        return len(self._regions)

    def outside(self, addrs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Indices of the ranges [addr, addr+length) not wholly inside one registered span. See docs/internals.md."""
        addrs = np.asarray(addrs, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        starts, ends = self._spans
        if len(starts) == 0:
            return np.arange(len(addrs))
        slot = np.searchsorted(starts, addrs, side="right") - 1
        ok = (slot >= 0) & (lengths > 0)
        slot = np.clip(slot, 0, None)
        # Where ok, start <= addr < 2**63 and end > start >= 0, so end - addr cannot overflow; elsewhere the
        # subtraction is skipped (room stays 0).
        room = np.zeros(len(addrs), dtype=np.int64)
        np.subtract(ends[slot], addrs, out=room, where=ok)
        ok &= lengths <= room
        return np.flatnonzero(~ok)

    def check(self, addrs: np.ndarray, lengths: np.ndarray, *, side: str, peer: str) -> None:
        """Raise InvalidDescriptor naming the first range outside the registration."""
        bad = self.outside(addrs, lengths)
        if len(bad):
            i = int(bad[0])
            raise InvalidDescriptor(
                f"descriptor {i} ({len(bad)} in all) reaches {side} memory "
                f"[{int(addrs[i]):#x}, +{int(lengths[i])}) that is not registered"
                f"{' with ' + peer if peer else ''}; register the whole KV tensor before transferring",
                peer=peer,
                cause="unregistered memory",
            )


def merge_runs(desc: Descriptors) -> Descriptors:
    """Merge descriptors whose local and remote ranges both continue the previous one."""
    if len(desc) < 2:
        return desc
    local, remote, length = desc[:, 0], desc[:, 1], desc[:, 2]
    continues = (local[1:] == local[:-1] + length[:-1]) & (remote[1:] == remote[:-1] + length[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    sums = np.add.reduceat(length, starts)
    return np.stack([local[starts], remote[starts], sums], axis=1)


def split_large(desc: Descriptors, max_bytes: int) -> Descriptors:
    """Cut descriptors longer than `max_bytes` into consecutive pieces of at most that size."""
    pieces = -(-desc[:, 2] // max_bytes)
    if len(desc) == 0 or (pieces == 1).all():
        return desc
    row = np.repeat(np.arange(len(desc)), pieces)
    offset = (np.arange(len(row)) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * max_bytes
    out = desc[row].copy()
    out[:, 0] += offset
    out[:, 1] += offset
    out[:, 2] = np.minimum(max_bytes, desc[row, 2] - offset)
    return out


# Columns of a factored descriptor table, one row per region (or per chain of adjacent regions).
L_BASE, L_BLOCK, L_PIECE, R_BASE, R_BLOCK, R_PIECE, LENGTH, PIECES = range(8)


@attrs.frozen(eq=False)
class DescriptorGroup:
    """Regions cut into the same number of pieces per block, and the block runs they move. See docs/internals.md."""

    table: np.ndarray  # (regions, 8) int64, the columns above; every row has the same PIECES
    dst: np.ndarray  # first local block of each run
    src: np.ndarray  # first remote block of each run
    run: np.ndarray  # blocks in each run (all 1 unless the regions' pieces tile their blocks)

    @property
    def rows(self) -> int:
        return len(self.table) * len(self.dst) * int(self.table[0, PIECES])

    def expand(self, start: int, stop: int) -> Descriptors:
        """Rows [start, stop), in (region, run, piece) order."""
        t, pieces = self.table, int(self.table[0, PIECES])
        rest, k = np.divmod(np.arange(start, stop, dtype=np.int64), pieces)
        r, j = np.divmod(rest, len(self.dst))
        local = t[r, L_BASE] + self.dst[j] * t[r, L_BLOCK] + k * t[r, L_PIECE]
        remote = t[r, R_BASE] + self.src[j] * t[r, R_BLOCK] + k * t[r, R_PIECE]
        return np.stack([local, remote, t[r, LENGTH] * self.run[j]], axis=1)

    def spans(self, remote: bool) -> tuple[np.ndarray, np.ndarray]:
        """Per region, (first byte, bytes up to the last) its rows touch on one side: every row lies inside."""
        base, block, piece = (R_BASE, R_BLOCK, R_PIECE) if remote else (L_BASE, L_BLOCK, L_PIECE)
        blocks, t = (self.src if remote else self.dst), self.table
        first = t[:, base] + int(blocks.min()) * t[:, block]
        last = int((blocks + self.run - 1).max())
        size = (last - int(blocks.min())) * t[:, block] + (t[:, PIECES] - 1) * t[:, piece] + t[:, LENGTH]
        return first, size


@attrs.frozen(eq=False)
class FactoredDescriptors:
    """Descriptors kept factored: groups of (regions x block runs x pieces), as planned. See docs/internals.md."""

    groups: tuple[DescriptorGroup, ...] = ()

    def __len__(self) -> int:
        return sum(g.rows for g in self.groups)

    @property
    def nbytes(self) -> int:
        return sum(int(g.table[:, LENGTH].sum()) * int(g.table[0, PIECES]) * int(g.run.sum()) for g in self.groups)

    def chunks(self, rows: int) -> Iterator[Descriptors]:
        """The rows, at most `rows` at a time."""
        for g in self.groups:
            for start in range(0, g.rows, rows):
                yield g.expand(start, min(g.rows, start + rows))

    def expand(self) -> Descriptors:
        """Every row as one (N, 3) int64 array."""
        parts = [g.expand(0, g.rows) for g in self.groups]
        return np.concatenate(parts) if parts else np.empty((0, 3), dtype=np.int64)

    def spans(self, remote: bool) -> tuple[np.ndarray, np.ndarray]:
        """(addresses, lengths) of one range per region that holds all its rows on one side."""
        parts = [g.spans(remote) for g in self.groups]
        if not parts:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def total_bytes(desc: Descriptors | FactoredDescriptors) -> int:
    """Bytes the descriptors move."""
    return desc.nbytes if isinstance(desc, FactoredDescriptors) else int(np.asarray(desc)[:, 2].sum())


def canonical(desc: Descriptors | FactoredDescriptors) -> Descriptors:
    """Rows in local address order, runs merged: descriptors moving the same bytes to the same places match."""
    rows = desc.expand() if isinstance(desc, FactoredDescriptors) else as_descriptors(desc)
    return merge_runs(rows[np.argsort(rows[:, 0], kind="stable")])
