"""Where a bench's servers write their logs, and what of them outlives the run."""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)


@contextlib.contextmanager
def bench_logs(keep: str | None, root: Path) -> Iterator[Path]:
    """The folder the servers log into: `keep` (`--keep-logs`), else `root/logs` (the run's temporary folder).

    A run whose servers left stall dumps (kvbridge.base.watchdog: every thread's stack, once per stall) keeps its logs
    either way: copied out of `root` before it goes, and where is said. So a stall comes with its evidence."""
    logs = Path(keep) if keep else root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    try:
        yield logs
    finally:
        dumps = sorted(logs.rglob("stall-*.txt"))
        if dumps and not keep:
            kept = Path(tempfile.mkdtemp(prefix="kvbridge-stalled-run-"))
            shutil.copytree(logs, kept, dirs_exist_ok=True)
            logs = kept
        if dumps:
            log.warning("%d stall dump(s) (every thread's stack): the run's logs are kept in %s", len(dumps), logs)
