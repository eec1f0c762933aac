"""A real single-member etcd for tests and `kvbridge bench --scale`: started on free ports, stopped by its PID."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from kvbridge.base.errors import ConfigError
from kvbridge_tools.harness.ports import free_port
from kvbridge_tools.harness.redis import stop

if TYPE_CHECKING:
    from kvbridge_tools.harness.hosts import Host


@contextlib.contextmanager
def etcd_server(tmp: Path, host: Host | None = None, timeout: float = 30.0) -> Iterator[str]:
    """An etcd on free ports of 127.0.0.1, or of `host` (a namespace host); yields etcd://ADDRESS:PORT."""
    binary = shutil.which("etcd")
    if binary is None:
        raise ConfigError("etcd is not installed: install etcd-server (scripts/setup --test does)")
    client, peer = free_port(span=1), free_port(span=1)
    address = host.address if host else "127.0.0.1"
    c_url, p_url = f"http://{address}:{client}", f"http://{address}:{peer}"
    argv = [binary, "--name", "kvb", "--data-dir", str(tmp / "etcd"), "--listen-client-urls", c_url]
    argv += ["--advertise-client-urls", c_url, "--listen-peer-urls", p_url, "--initial-advertise-peer-urls", p_url]
    argv += ["--initial-cluster", f"kvb={p_url}"]
    proc = subprocess.Popen(host.command(argv) if host else argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout
        while True:
            with (
                contextlib.suppress(OSError),
                host.entered() if host else contextlib.nullcontext(),
                urllib.request.urlopen(f"{c_url}/health", timeout=1) as resp,  # noqa: S310  # its own address
            ):
                if b'"true"' in resp.read():
                    break
            if proc.poll() is not None:
                raise ConfigError(f"etcd exited with {proc.returncode} on start (port {client})")
            if time.monotonic() > deadline:
                raise ConfigError(f"etcd on port {client} was not healthy within {timeout}s")
            time.sleep(0.05)
        yield f"etcd://{address}:{client}"
    finally:
        stop(proc)
