"""The one percentile every bench and chaos report takes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def percentile(values: Sequence[float], q: float, digits: int | None = None) -> float | None:
    """The `q`-quantile (0 to 1) of `values`, rounded to `digits` if given; None when there are none.

    Interpolated between the two nearest values, as numpy's default and vLLM's serving bench take it: p50 is the
    median (of an even count, the mean of the middle two), and p99 of a few values lies between the two largest."""
    if not len(values):
        return None
    value = float(np.percentile(np.asarray(values, dtype=np.float64), q * 100))
    return value if digits is None else round(value, digits)
