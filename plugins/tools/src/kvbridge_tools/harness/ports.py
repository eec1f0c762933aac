"""Free 127.0.0.1 ports for servers that tests and benches start and that bind later.

A port found free now is only a promise: the server that is told to use it may bind it a minute
later (vLLM binds its side channel after loading the model). Ports from the kernel's ephemeral
range are unsafe for that, because every outgoing connection on the machine (health polls, gloo,
Mooncake, ZMQ) takes a local port from that range in the meantime. So ports are drawn from below
it, above the range Mooncake's Transfer Engine picks its own listeners from, and each is handed
out once per process together with the ports after it that a multi-rank server derives from it.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

_MOONCAKE_MAX = 17000  # Mooncake TE picks its RPC and TCP listeners in [15000, 17000)
_FLOOR = 20000
_DEFAULT_EPHEMERAL_START = 32768

_given: list[range] = []
_lock = threading.Lock()
_rng = random.SystemRandom()


def ephemeral_start(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    """First port of the kernel's ephemeral range (where bind(0) and connect() take ports)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_START


def free_port(span: int = 8) -> int:
    """A port p such that p .. p+span-1 bind on 127.0.0.1 now and none was handed out before.

    `span` covers servers that listen on p + rank (a side channel per TP rank).
    """
    if span < 1:
        raise ValueError(f"span must be at least 1, got {span}")
    top = ephemeral_start() - span
    if top - _FLOOR < 1000:
        raise RuntimeError(
            f"the ephemeral port range starts at {ephemeral_start()}, leaving no room below it above "
            f"{_FLOOR}; widen it with `sysctl net.ipv4.ip_local_port_range`"
        )
    with _lock:
        for _ in range(500):
            base = _rng.randrange(max(_FLOOR, _MOONCAKE_MAX), top)
            ports = range(base, base + span)
            if any(p.start < ports.stop and ports.start < p.stop for p in _given):
                continue
            if all(_bindable(port) for port in ports):
                _given.append(ports)
                return base
    raise RuntimeError(f"no run of {span} free 127.0.0.1 ports in [{_FLOOR}, {top})")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
