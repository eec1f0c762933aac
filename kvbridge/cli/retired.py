"""Retired option spellings: each still works for one release, hidden from --help, and warns with its new name."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)


class _Retired(argparse.Action):
    """A retired flag: sets its new flag's destination and warns with the new name."""

    def __init__(self, option_strings: Sequence[str], dest: str, new: str, **kwargs: Any) -> None:
        # no default of its own: the new flag's stands when the old spelling is not given
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        log.warning("%s is retired and goes in the next release: use %s", option_string, self.new)
        setattr(namespace, self.dest, True)


def add_retired_flags(parser: argparse.ArgumentParser, table: Mapping[str, str]) -> None:
    """Accept each retired flag of `table` (old spelling -> its new on/off flag) as the new one, with a warning."""
    for old, new in table.items():
        parser.add_argument(old, action=_Retired, dest=new.lstrip("-").replace("-", "_"), new=new)
