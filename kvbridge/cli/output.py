"""Shared output helpers: rich tables for people, JSON for machines."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

# Piped output (logs, CI) has no terminal width to respect: keep tables wide enough to stay readable.
console = Console() if Console().is_terminal else Console(width=160)
err_console = Console(stderr=True)


def print_json(obj: Any) -> None:
    """`obj` as JSON on stdout; a figure that is not a number (NaN, infinity: JSON has neither) is null."""
    sys.stdout.write(json.dumps(_finite(obj), indent=2, default=str, allow_nan=False) + "\n")


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    return [_finite(v) for v in obj] if isinstance(obj, (list, tuple)) else obj


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    table = Table(title=title, title_justify="left")
    cells = [["" if v is None else str(v) for v in row] for row in rows]
    for i, col in enumerate(columns):
        # Prose (reasons, fixes) wraps; a column of single words (names, versions) is never cut short for it.
        words = [row[i] for row in cells if row[i]]
        single = all(len(w.split()) == 1 for w in words)
        table.add_column(col, min_width=max((len(w) for w in words), default=0) if single else None)
    for row in cells:
        table.add_row(*(escape(c) for c in row))  # text, not markup: "pip install 'x[extra]'" stays intact
    console.print(table)
