"""A real redis-server for tests and `kvbridge chaos`: started on a free port, stopped by its PID."""

from __future__ import annotations

import contextlib
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from kvbridge.base.errors import ConfigError
from kvbridge_tools.harness.ports import free_port

if TYPE_CHECKING:
    from kvbridge_tools.harness.hosts import Host


def _pong(address: str, port: int, password: str) -> bool:
    with socket.create_connection((address, port), timeout=1) as s:
        s.sendall((f"AUTH {password}\r\n" if password else "").encode() + b"PING\r\n")
        got = b""
        while b"PONG" not in got and b"-" not in got[:1] and len(got) < 64:
            chunk = s.recv(64)
            if not chunk:
                break
            got += chunk
        return b"+PONG" in got


@contextlib.contextmanager
def redis_server(tmp: Path, host: Host | None = None, timeout: float = 30.0) -> Iterator[str]:
    """A redis-server on a free port of 127.0.0.1, or of `host` (a namespace host); yields its URL.

    On a namespace host it takes a password, as redis does off loopback: the URL is
    redis://[:PASSWORD@]ADDRESS:PORT. Nothing is saved to disk; the server is stopped by its PID.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        raise ConfigError("redis-server is not installed: install redis (scripts/setup --test does)")
    port = free_port(span=1)
    address = host.address if host else "127.0.0.1"
    password = secrets.token_hex(8) if host else ""
    argv = [binary, "--port", str(port), "--bind", address, "--save", "", "--appendonly", "no", "--dir", str(tmp)]
    argv += ["--requirepass", password] if password else []
    proc = subprocess.Popen(host.command(argv) if host else argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError), host.entered() if host else contextlib.nullcontext():
                if _pong(address, port, password):
                    break
            if proc.poll() is not None:
                raise ConfigError(f"redis-server exited with {proc.returncode} on start (port {port})")
            if time.monotonic() > deadline:
                raise ConfigError(f"redis-server on port {port} did not answer PING within {timeout}s")
            time.sleep(0.05)
        yield f"redis://:{password}@{address}:{port}" if password else f"redis://{address}:{port}"
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM `proc`, SIGKILL it after 10 s; wait for it (idempotent)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
