"""`BlockIds`: one request's KV block ids, held as one read-only int64 array. See docs/internals.md."""

from __future__ import annotations

import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np

MAX_BLOCK_ID = (1 << 63) - 1
_WIRE_DTYPE = np.dtype("<i8")


def block_array(ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Block ids as an int64 array, copied only where they must be. See docs/internals.md."""
    if isinstance(ids, BlockIds):
        return ids.array
    if isinstance(ids, np.ndarray):
        return ids.astype(np.int64, copy=False)
    try:
        return np.frombuffer(array.array("q", ids), dtype=np.int64)
    except (TypeError, OverflowError):
        return np.asarray(ids, dtype=np.int64)  # what array.array refuses: numpy converts it or raises its own error


def _as_array(ids: Any) -> np.ndarray:
    if isinstance(ids, BlockIds):
        return ids.array
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise ValueError(f"block ids must be a 1-D integer array, got {ids.dtype} of shape {ids.shape}")
        if ids.dtype.kind == "u" and ids.size and int(ids.max()) > MAX_BLOCK_ID:
            raise ValueError("block ids must be in [0, 2**63)")
        return np.array(ids, dtype=np.int64)  # a copy: the caller's array stays the caller's
    try:
        # array.array checks every item is an int (floats and strings raise) at C speed
        return np.frombuffer(array.array("q", ids), dtype=np.int64)
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"block ids must be integers in [0, 2**63): {exc}") from None


def _checked(a: np.ndarray) -> np.ndarray:
    if a.size and int(a.min()) < 0:
        raise ValueError(f"block ids must be in [0, 2**63), got {int(a.min())}")
    if a.flags.writeable:
        a.flags.writeable = False
    return a


class BlockIds(Sequence[int]):
    """Immutable block ids: a sequence of ints backed by a read-only int64 array.

    Compares equal to a tuple or list of the same ids; the array is `array`, or `np.asarray(ids)`, without a copy."""

    __slots__ = ("_ids",)

    def __init__(self, ids: Iterable[int] | np.ndarray = ()) -> None:
        self._ids = _checked(_as_array(ids))

    @classmethod
    def _owning(cls, a: np.ndarray) -> BlockIds:
        """Wrap an int64 array nobody else holds (no copy)."""
        out = cls.__new__(cls)
        out._ids = _checked(a)
        return out

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> BlockIds:
        """Ids packed by `to_bytes` (8 bytes each, little-endian); ValueError on anything else."""
        if len(data) % _WIRE_DTYPE.itemsize:
            raise ValueError(f"packed block ids take 8 bytes each; got {len(data)} bytes")
        # a view of immutable bytes (a copy only on a big-endian host)
        return cls._owning(np.frombuffer(bytes(data), dtype=_WIRE_DTYPE).astype(np.int64, copy=False))

    def to_bytes(self) -> bytes:
        return self._ids.astype(_WIRE_DTYPE, copy=False).tobytes()

    @property
    def array(self) -> np.ndarray:
        """The ids as a read-only int64 array (no copy)."""
        return self._ids

    def tolist(self) -> list[int]:
        return self._ids.tolist()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if copy:
            return self._ids.astype(dtype or np.int64, copy=True)
        return self._ids if dtype is None else self._ids.astype(dtype, copy=False)

    def __len__(self) -> int:
        return len(self._ids)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> BlockIds: ...
    def __getitem__(self, index: int | slice) -> int | BlockIds:
        if isinstance(index, slice):
            return BlockIds._owning(self._ids[index])  # a view of an immutable array
        return int(self._ids[index])

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids.tolist())

    def __add__(self, other: Iterable[int]) -> BlockIds:
        return BlockIds._owning(np.concatenate([self._ids, _as_array(other)]))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockIds):
            return bool(np.array_equal(self._ids, other._ids))
        if isinstance(other, (tuple, list)):
            return len(other) == len(self._ids) and self.tolist() == list(other)
        return NotImplemented

    def __reduce__(self) -> tuple[Any, tuple[np.ndarray]]:
        return BlockIds, (self._ids,)  # checked again, and read-only again, when unpickled

    def __hash__(self) -> int:
        return hash(tuple(self.tolist()))  # equal to a tuple of the same ids, so hashed like one

    def __repr__(self) -> str:
        ids = self._ids.tolist()
        return f"BlockIds({ids[:16]}{'...' if len(ids) > 16 else ''}, n={len(ids)})"
