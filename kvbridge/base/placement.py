"""`cpu_affinity` and `io_cpus`: the CPUs an engine's model thread and kvbridge's threads run on. See docs/vllm.md.

On a CPU host the model thread shares cores with the API server, the proxy and kvbridge's own threads. Left to the
kernel it is moved between cores as they wake, and each step finds its caches cold. vLLM's NixlConnector pins it on
CPU platforms (the last core of each NUMA node, from its worker's constructor); `cpu_affinity` lets an operator do
the same with kvbridge, or name the cores. kvbridge's threads (side channel, pulls, the transport's I/O threads) run
on the process's other CPUs by default (`io_cpus: others`), as vLLM's CPU backend keeps cores apart from its model
threads for everything else: a transport thread that wakes to serve a read on the model's core preempts the model.
`model` keeps them with it; a CPU list names theirs.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

from kvbridge.base.errors import ConfigError

log = logging.getLogger(__name__)

RESERVED = "reserved"
MODEL, OTHERS = "model", "others"  # io_cpus: with the model thread, or on the CPUs it does not run on
_io: set[int] | None = None  # where kvbridge's threads run once placed (None: where they were started)
_LIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


def parse_cpus(text: str) -> set[int]:
    """A CPU list as Linux writes one (`0-3,8`)."""
    if not _LIST.match(text):
        raise ValueError(f"cpu_affinity must be {RESERVED!r} or a CPU list such as '3' or '0-3,8', got {text!r}")
    cpus: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        if high and int(high) < int(low):
            raise ValueError(f"cpu_affinity: {part!r} counts down; write the lower CPU first")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def check(value: str | None) -> None:
    """Refuse a value that is neither `reserved` nor a CPU list (at parse time: before any engine starts)."""
    if value is not None and value != RESERVED:
        parse_cpus(value)


def numa_nodes() -> dict[int, set[int]]:
    """This host's NUMA nodes and their CPUs (empty where /sys does not list them)."""
    nodes: dict[int, set[int]] = {}
    for path in glob.glob("/sys/devices/system/node/node[0-9]*/cpulist"):
        text = Path(path).read_text().strip()
        if text:
            nodes[int(path.split("/node")[-1].split("/")[0])] = parse_cpus(text)
    return nodes


def reserved_cpus(allowed: set[int], nodes: Mapping[int, set[int]]) -> set[int]:
    """The last allowed CPU of each NUMA node, as NixlConnector picks; the last allowed CPU without a node list."""
    picked = {max(cpus & allowed) for cpus in nodes.values() if cpus & allowed}
    return picked or {max(allowed)}


def check_io(value: str) -> None:
    """Refuse an `io_cpus` that is neither `model`, `others` nor a CPU list."""
    if value not in (MODEL, OTHERS) and not _LIST.match(value):
        raise ValueError(f"io_cpus must be {MODEL!r}, {OTHERS!r} or a CPU list such as '0-2', got {value!r}")


def pin_this_thread(value: str | None, io: str) -> set[int] | None:
    """Pin the calling thread to the CPUs `value` names, and place kvbridge's threads by `io`. None: as is.

    Threads it starts from now on inherit its CPUs; kvbridge's own move to theirs as they start (`place_io_thread`)."""
    global _io
    if value is None:
        return None
    allowed = os.sched_getaffinity(0)
    cpus = reserved_cpus(allowed, numa_nodes()) if value == RESERVED else parse_cpus(value)
    io_cpus = cpus if io == MODEL else (allowed - cpus or cpus) if io == OTHERS else parse_cpus(io)
    for what, named in (("cpu_affinity", cpus), ("io_cpus", io_cpus)):
        if not named <= allowed:
            raise ConfigError(
                f"{what} names CPUs {sorted(named - allowed)} this process may not run on "
                f"(allowed: {sorted(allowed)}); name CPUs from that list"
            )
    os.sched_setaffinity(0, cpus)
    _io = None if io_cpus == cpus else io_cpus
    log.info(
        "cpu_affinity %s: the model thread runs on CPUs %s, kvbridge's threads on %s",
        value,
        sorted(cpus),
        sorted(io_cpus),
    )
    return cpus


def place_io_thread() -> None:
    """Move the calling thread, one of kvbridge's starting, to kvbridge's CPUs (where `io_cpus` put them apart)."""
    if _io is not None:
        os.sched_setaffinity(0, _io)


@contextlib.contextmanager
def on_io_cpus() -> Iterator[None]:
    """The calling thread on kvbridge's CPUs for the block, and the native threads a transport starts in it for good."""
    was = os.sched_getaffinity(0)
    place_io_thread()
    try:
        yield
    finally:
        os.sched_setaffinity(0, was)
