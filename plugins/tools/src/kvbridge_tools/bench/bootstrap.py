"""Bootstrap intervals for the benches (percentile method; a fixed seed: the same samples give the same interval)."""

from __future__ import annotations

import numpy as np


def resamples(n: int, rounds: int, seed: int = 0) -> np.ndarray:
    """`rounds` resamples of the indices of `n` samples, drawn with replacement: one row each."""
    return np.random.default_rng(seed).integers(0, n, size=(rounds, n))


def central(spread: np.ndarray, level: float) -> tuple[float, float]:
    """The bounds of the central `level` share of a statistic's resampled values (NaNs left out)."""
    low, high = np.nanpercentile(spread, [(1 - level) / 2 * 100, (1 + level) / 2 * 100])
    return float(low), float(high)
