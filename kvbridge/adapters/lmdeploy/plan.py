"""LMDeploy assignment instructs -> merged transfer descriptors, vectorized. See docs/internals.md."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import attrgetter
from typing import Any

import attrs
import numpy as np

from kvbridge.base.errors import InvalidDescriptor
from kvbridge.base.memory import merge_runs
from kvbridge.base.types import MemoryRegion

FIELDS = ("mr_key", "source_offset", "target_offset", "length")
_get = attrgetter(*FIELDS)


def instruct_array(batch: Sequence[Any]) -> np.ndarray:
    """(N, 4) int64 of (mr_key, source_offset, target_offset, length) from AssignmentInstructs."""
    return np.fromiter(map(_get, batch), dtype=np.dtype((np.int64, 4)), count=len(batch)).reshape(-1, 4)


def describe(instructs: np.ndarray, i: int) -> str:
    return f"instruct #{i} (" + ", ".join(f"{k}={int(v)}" for k, v in zip(FIELDS, instructs[i])) + ")"


@attrs.frozen
class InstructPlan:
    """Merged descriptors plus what maps them back to instructs for error messages."""

    instructs: np.ndarray  # (N, 4) as given
    descriptors: np.ndarray  # (M, 3) local_addr, remote_addr, length; sorted and merged
    order: np.ndarray  # (N,) instruct index in local-address order
    first: np.ndarray  # (M,) position in `order` of the instruct holding each descriptor's first byte
    last: np.ndarray  # (M,) ... and its last byte

    def batches(self, size: int) -> list[tuple[np.ndarray, int, int]]:
        """(descriptors, first instruct index, number of instructs touched) per batch of `size` descriptors."""
        out = []
        for a in range(0, len(self.descriptors), size):
            b = min(a + size, len(self.descriptors))
            first, last = int(self.first[a]), int(self.last[b - 1])
            out.append((self.descriptors[a:b], int(self.order[first]), last - first + 1))
        return out

    @property
    def nbytes(self) -> int:
        return int(self.instructs[:, 3].sum())


def _bases(regions: Mapping[int, MemoryRegion]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    keys = np.array(sorted(regions), dtype=np.int64)
    addr = np.array([regions[k].addr for k in keys.tolist()], dtype=np.int64)
    length = np.array([regions[k].length for k in keys.tolist()], dtype=np.int64)
    return keys, addr, length


def _lookup(keys: np.ndarray, mr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index of each mr_key in `keys`, and whether it is there."""
    if len(keys) == 0:
        return np.zeros(len(mr), dtype=np.int64), np.zeros(len(mr), dtype=bool)
    idx = np.clip(np.searchsorted(keys, mr), 0, len(keys) - 1)
    return idx, keys[idx] == mr


def plan(
    instructs: np.ndarray,
    local: Mapping[int, MemoryRegion],
    remote: Mapping[int, MemoryRegion],
    *,
    engine: str,
) -> InstructPlan:
    """Check every instruct against the regions on both sides and build merged descriptors. See docs/internals.md."""
    mr, src, tgt, length = instructs.T

    def refuse(bad: np.ndarray, why: str) -> None:
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InvalidDescriptor(
                f"migration from remote engine {engine}: {describe(instructs, i)} {why} "
                f"({int(bad.sum())} of {len(instructs)} instructs)",
                peer=engine,
                cause=why,
            )

    refuse(length <= 0, "has a non-positive length")
    refuse((src < 0) | (tgt < 0), "has a negative offset")
    lkeys, laddr, llen = _bases(local)
    li, lok = _lookup(lkeys, mr)
    refuse(
        ~lok,
        f"names an mr_key not registered on this side (registered: {lkeys.tolist()}); "
        "call register_memory_region for every cache pool first",
    )
    rkeys, raddr, rlen = _bases(remote)
    ri, rok = _lookup(rkeys, mr)
    refuse(
        ~rok,
        f"names an mr_key the remote engine did not publish (published: {rkeys.tolist()}); "
        "both engines must register the same cache pools",
    )
    refuse(src + length > llen[li], "reaches past the end of the local region")
    refuse(tgt + length > rlen[ri], "reaches past the end of the remote region")

    desc = np.stack([laddr[li] + src, raddr[ri] + tgt, length], axis=1)
    order = np.lexsort((desc[:, 1], desc[:, 0]))
    ordered = desc[order]
    merged = merge_runs(ordered)
    # The instructs (positions in `order`) holding each descriptor's first and last byte.
    local = ordered[:, 0]
    first = np.searchsorted(local, merged[:, 0], side="right") - 1
    last = np.searchsorted(local, merged[:, 0] + merged[:, 2] - 1, side="right") - 1
    return InstructPlan(instructs=instructs, descriptors=merged, order=order, first=first, last=last)
