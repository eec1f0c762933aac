"""argparse types for numbers, refused before a command starts anything.

Each refuses text that is no number of its kind, or one outside its bounds, saying which. Every bound is finite: a NaN
or infinite wait or rate is none."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

# Far above any use, and finite.
MAX_COUNT = 1 << 20
MAX_SECONDS = 86400.0


def whole(low: int = 1, high: int = MAX_COUNT) -> Callable[[str], int]:
    """A whole number from `low` to `high`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {low} to {high}, got {value}")
        return value

    return parse


def real(
    what: str = "seconds", low: float = 0.0, high: float = MAX_SECONDS, *, zero: bool = False
) -> Callable[[str], float]:
    """A finite number above `low` (from it, with `zero`) and at most `high`; `what` names it in the error."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        above = low <= value if zero else low < value
        if not (math.isfinite(value) and above and value <= high):
            bound = "from" if zero else "above"
            raise argparse.ArgumentTypeError(f"expected {what} {bound} {low:g} and at most {high:g}, got {text}")
        return value

    return parse


def seconds(text: str) -> float:
    """A wait: seconds above 0, at most a day."""
    return real()(text)
