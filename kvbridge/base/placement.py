"""`cpu_affinity`: the CPUs an engine's model thread and kvbridge's threads run on. See docs/vllm.md.

On a CPU host the model thread shares cores with the API server, the proxy and kvbridge's own threads. Left to the
kernel it is moved between cores as they wake, and each step finds its caches cold. vLLM's NixlConnector pins it on
CPU platforms (the last core of each NUMA node, from its worker's constructor); `cpu_affinity` lets an operator do
the same with kvbridge, or name the cores.
"""

from __future__ import annotations

import glob
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path

from kvbridge.base.errors import ConfigError

log = logging.getLogger(__name__)

RESERVED = "reserved"
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


def pin_this_thread(value: str | None) -> set[int] | None:
    """Pin the calling thread to the CPUs `value` names; threads it starts from now on inherit them. None: as is."""
    if value is None:
        return None
    allowed = os.sched_getaffinity(0)
    cpus = reserved_cpus(allowed, numa_nodes()) if value == RESERVED else parse_cpus(value)
    if not cpus <= allowed:
        raise ConfigError(
            f"cpu_affinity {value!r} names CPUs {sorted(cpus - allowed)} this process may not run on "
            f"(allowed: {sorted(allowed)}); name CPUs from that list or use {RESERVED!r}"
        )
    os.sched_setaffinity(0, cpus)
    log.info("cpu_affinity %s: the model thread and kvbridge's threads run on CPUs %s", value, sorted(cpus))
    return cpus
