"""Children's stderr as log records: what kvbridge-tools' child processes (`harness.proc`) print.

A child process's stderr read by `relay_stderr` (the bench's ranks) becomes log records of
`kvbridge.native`: glog lines at their own severity, except the few that every healthy TCP start
prints and that read as failures, which go to debug. Other lines (the child's own Python logs) pass
through unchanged. Seen on 2026-11-26 with mooncake-transfer-engine-non-cuda 0.3.13.post1, starting a
`TransferEngine` over `tcp` with P2P handshake on a machine without RDMA devices (it then served
transfers): `W ... topology.cpp:201] No RDMA devices found, check your device installation` and
`E ... transfer_metadata.cpp:1098] Local segment descriptor not found`, logged before the engine
registers its own segment.
"""

from __future__ import annotations

import logging
import re
import sys
from typing import IO

log = logging.getLogger("kvbridge.native")

# glog: "E1123 05:17:40.758323 15467 transfer_metadata.cpp:1098] message"
_GLOG = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ ([^\]]+)\] ?(.*)$")
_SEVERITY = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}
# Printed by every healthy Mooncake start over TCP; harmless there, alarming to read.
HARMLESS = (
    "WARNING: Logging before InitGoogleLogging() is written to STDERR",
    "Using default malloc/free for protocol",
    "No RDMA devices found",
    "Local segment descriptor not found",
)


def classify(line: str) -> tuple[int, str] | None:
    """(logging level, message) for a native log line, or None for anything else."""
    text = line.rstrip("\n")
    if text.startswith(HARMLESS[0]):
        return logging.DEBUG, text
    m = _GLOG.match(text)
    if m is None:
        return None
    severity, where, message = m.groups()
    level = logging.DEBUG if any(h in message for h in HARMLESS) else _SEVERITY[severity]
    return level, f"{message} ({where.strip()})"


def relay_stderr(name: str, stream: IO[str], passthrough: IO[str] | None = None) -> None:
    """Read a child's stderr to its end: native lines as log records, the rest to `passthrough`."""
    out = passthrough or sys.stderr
    for line in stream:
        native = classify(line)
        if native is None:
            out.write(line)
            out.flush()
        else:
            log.log(native[0], "%s: %s", name, native[1])
