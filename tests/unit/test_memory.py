"""Descriptor arithmetic: merging runs and cutting long descriptors are exact inverses."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvbridge.base.memory import RegionIndex, merge_runs, split_large
from kvbridge.base.types import MemoryRegion


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=30), st.integers(1, 700))
def test_split_large_cuts_runs_and_merge_restores_them(lengths: list[int], limit: int) -> None:
    # Rows with a gap between them on both sides, so merging can only rejoin pieces of one row.
    local = np.cumsum([0] + [n + 1 for n in lengths[:-1]])
    desc = np.stack([local + 1000, local + 10**6, np.array(lengths)], axis=1).astype(np.int64)
    cut = split_large(desc, limit)
    assert (cut[:, 2] <= limit).all() and (cut[:, 2] > 0).all()
    assert cut[:, 2].sum() == desc[:, 2].sum()
    assert np.array_equal(merge_runs(cut), desc)


def test_merge_runs_needs_both_sides_to_continue() -> None:
    desc = np.array([[0, 100, 10], [10, 110, 10], [20, 200, 10], [30, 210, 5]])
    assert merge_runs(desc).tolist() == [[0, 100, 20], [20, 200, 15]]


def test_region_index_finds_ranges_outside_and_across_regions() -> None:
    index = RegionIndex([MemoryRegion(1000, 100), MemoryRegion(1100, 50), MemoryRegion(5000, 10)])
    addrs = np.array([1000, 1090, 1149, 999, 5005, 5009])
    lengths = np.array([150, 20, 2, 1, 5, 2])
    # adjacent registrations count as one span; a range may not leave it
    assert index.outside(addrs, lengths).tolist() == [2, 3, 5]


def test_region_index_checks_stay_whole_while_another_thread_registers() -> None:
    # A decode rank's pull threads register landing buffers while others check their descriptors:
    # a range inside a registered region must never be reported outside during an add or a remove.
    import threading

    index = RegionIndex([MemoryRegion(1 << 20, 4096)])
    stop = threading.Event()
    false_misses = []

    def check() -> None:
        while not stop.is_set():
            bad = index.outside(np.array([1 << 20], dtype=np.int64), np.array([4096], dtype=np.int64))
            if len(bad):
                false_misses.append(1)

    reader = threading.Thread(target=check)
    reader.start()
    try:
        for i in range(3000):  # regions below and above the checked one shift every slot
            index.add([MemoryRegion(4096 * (i % 7 + 1), 64), MemoryRegion((2 << 20) + 4096 * i, 64)])
            index.remove([4096 * (i % 7 + 1), (2 << 20) + 4096 * i])
    finally:
        stop.set()
        reader.join()
    assert not false_misses
