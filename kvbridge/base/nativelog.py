"""Native transport libraries' logs: quiet by default. See docs/internals.md."""

from __future__ import annotations

import logging
import os


def native_env(level: int) -> dict[str, str]:
    """Environment defaults that hold native logs at `level` (a `logging` level) and above."""
    if level <= logging.DEBUG:
        return {}  # -vv: everything the libraries say
    name = "INFO" if level <= logging.INFO else "WARNING"
    # NIXL spells its level WARN (it rejects WARNING and falls back to its default, saying so)
    nixl = "WARN" if name == "WARNING" else name
    wanted = {"MC_LOG_LEVEL": name, "NIXL_LOG_LEVEL": nixl, "UCX_LOG_LEVEL": "info" if name == "INFO" else "warn"}
    return {k: v for k, v in wanted.items() if k not in os.environ}


def quiet_native_logs(level: int) -> None:
    """Set `native_env(level)` in this process (before a native library loads), so children inherit it."""
    os.environ.update(native_env(level))
