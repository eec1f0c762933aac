"""The paired statistics every bench reports: the median of per-pair ratios, its range and its interval."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge_tools.bench.pair import median_interval, paired_ratio
from kvbridge_tools.bench.stats import percentile


def test_the_interval_holds_the_median_and_lies_within_the_range() -> None:
    rng = np.random.default_rng(7)
    slow = list(rng.normal(500, 50, 8))
    fast = list(np.asarray(slow) * rng.normal(0.95, 0.1, 8))
    r = paired_ratio(slow, fast)
    low, high = r["ratio_ci90"]
    assert r["ratio_range"][0] <= low <= r["ratio"] <= high <= r["ratio_range"][1]
    assert paired_ratio(slow, fast)["ratio_ci90"] == [low, high]  # a fixed seed: the same run, the same interval


def test_a_clear_difference_excludes_one_and_noise_does_not() -> None:
    clear = [0.90, 0.91, 0.92, 0.90, 0.93, 0.89, 0.91, 0.92]
    assert median_interval(clear)[1] < 1.0
    noisy = [0.85, 1.12, 0.93, 1.05, 0.88, 1.10, 0.97, 1.02]
    low, high = median_interval(noisy)
    assert low < 1.0 < high


def test_one_percentile_for_every_bench_the_median_of_an_even_count_being_the_middle_twos_mean() -> None:
    """The benches took three: nearest rank (the lower middle), the upper middle, and numpy's."""
    import statistics

    eight = [8.0, 1.0, 7.0, 2.0, 6.0, 3.0, 5.0, 4.0]
    assert percentile(eight, 0.5) == statistics.median(eight) == 4.5
    assert percentile(eight[:7], 0.5) == statistics.median(eight[:7]) == 5.0
    assert 7.0 < percentile(eight, 0.99) < 8.0 and percentile(eight, 1.0) == 8.0 and percentile(eight, 0.0) == 1.0
    assert percentile(eight, 0.99, 1) == 7.9 and percentile([], 0.5) is None


def test_degenerate_samples() -> None:
    assert median_interval([1.5]) == [1.5, 1.5]
    assert median_interval([2.0, 2.0, 2.0]) == [2.0, 2.0]
    assert all(np.isnan(median_interval([])))


def test_the_heap_is_frozen_for_the_timed_block_only_and_unfrozen_when_it_fails() -> None:
    # Objects left frozen at exit are never freed (triton's bindings then print "nanobind: leaked" lines).
    import gc

    from kvbridge_tools.bench.pair import frozen_heap

    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError), frozen_heap():
        assert gc.get_freeze_count() > 0
        raise RuntimeError("a request failed")
    assert gc.get_freeze_count() == 0
