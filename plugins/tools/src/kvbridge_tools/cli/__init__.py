"""The `kvbridge` subcommands kvbridge-tools adds (named by the `kvbridge_commands` hook of `kvbridge_tools.plugin`)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any


def set_options(args: argparse.Namespace, defaults: Mapping[str, Any]) -> list[str]:
    """The options among `defaults` (dest -> default) that `args` holds another value of, as flags (`--gap-range`).

    A list parsed equals the tuple of the same values given as its default."""

    def same(value: Any, default: Any) -> bool:
        if isinstance(value, (list, tuple)) and isinstance(default, (list, tuple)):
            return tuple(value) == tuple(default)
        return bool(value == default)

    return ["--" + d.replace("_", "-") for d, default in defaults.items() if not same(getattr(args, d, None), default)]
