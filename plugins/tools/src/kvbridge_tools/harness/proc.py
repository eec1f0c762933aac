"""Child processes driven by JSON lines over stdin/stdout (the bench's ranks, multi-process tests).

The parent calls `Child.call(cmd, **kwargs)`; the child runs `serve(handlers)`. JSON only, never
pickle. Every child is stopped by its PID: politely, then SIGKILL, when the parent closes it.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvbridge.base.errors import KVBridgeError, TransferTimeout
from kvbridge_tools.harness.nativelog import relay_stderr

log = logging.getLogger(__name__)


class ChildError(KVBridgeError):
    """A handler in a child process raised; carries the child's error type and message."""

    def __init__(self, kind: str, message: str, trace: str = "") -> None:
        self.kind = kind
        self.trace = trace
        super().__init__(f"{kind}: {message}")


class Child:
    """A Python child process running `python -m MODULE ARGS...` that serves JSON-line calls."""

    def __init__(
        self,
        module: str,
        *args: str,
        env: Mapping[str, str] | None = None,
        name: str = "",
        prefix: Sequence[str] = (),
    ) -> None:
        """`prefix` goes before the command and must exec it, so that the PID is the child's.

        E.g. `ip netns exec NS`, which runs it on another host: `kvbridge_tools.harness.hosts.Host.command([])`."""
        self.name = name or module
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", module, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,  # native libraries' lines become log records, the rest passes through
            env=full_env,
            text=True,
            bufsize=1,
        )
        self.pid = self.proc.pid
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name=f"child-{self.pid}", daemon=True).start()
        threading.Thread(
            target=relay_stderr, args=(self.name, self.proc.stderr), name=f"child-{self.pid}-stderr", daemon=True
        ).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.strip()
            if not line.startswith("{"):
                continue  # a library that prints to stdout must not break the protocol
            try:
                self._replies.put(json.loads(line))
            except json.JSONDecodeError:
                log.warning("%s: unparsable line from child: %.200s", self.name, line)
        self._replies.put(None)

    def call(self, cmd: str, timeout: float = 120.0, **kwargs: Any) -> Any:
        """Run handler `cmd` in the child and return its result; raise ChildError on its failure."""
        with self._lock:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write(json.dumps({"cmd": cmd, "args": kwargs}) + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                raise ChildError("ChildGone", f"{self.name} (pid {self.pid}) exited with {self.proc.poll()}") from None
            try:
                reply = self._replies.get(timeout=timeout)
            except queue.Empty:
                raise TransferTimeout(
                    f"{self.name} (pid {self.pid}) did not answer {cmd!r} within {timeout}s", peer=self.name
                ) from None
        if reply is None:
            raise ChildError("ChildGone", f"{self.name} (pid {self.pid}) exited with {self.proc.wait()} during {cmd!r}")
        if not reply.get("ok"):
            raise ChildError(reply.get("kind", "Error"), reply.get("error", ""), reply.get("trace", ""))
        return reply.get("result")

    def kill(self) -> None:
        """SIGKILL now, as a crash would."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self, timeout: float = 10.0) -> None:
        """Ask the child to exit, then stop it by PID if it does not."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()  # EOF ends serve()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def stop_all_threads(pid: int, timeout_s: float = 30.0) -> None:
    """SIGSTOP `pid` and return once every thread of it is stopped (state T in /proc), not merely signalled.

    `kill` returns before a thread that is running, or runnable on a loaded box, has stopped; until it does, it may
    still read what the caller sends next."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
            try:
                states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
            except (OSError, IndexError):
                continue  # a thread that just ended
        if states and all(state in "tT" for state in states):
            return
        if time.monotonic() > deadline:
            raise TransferTimeout(f"process {pid} was sent SIGSTOP but its threads are still {states}")
        time.sleep(0.005)  # polling /proc, bounded by the deadline above


def serve(handlers: Mapping[str, Callable[..., Any]]) -> None:
    """Child side: answer JSON-line calls until stdin closes. Logs go to stderr, replies to stdout."""
    out = sys.stdout
    sys.stdout = sys.stderr  # stray prints from libraries must not corrupt replies
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        try:
            result = handlers[msg["cmd"]](**msg.get("args", {}))
            reply = {"ok": True, "result": result}
        except Exception as exc:  # reported to the parent with its type; the child keeps serving
            reply = {"ok": False, "kind": type(exc).__name__, "error": str(exc), "trace": traceback.format_exc()}
        out.write(json.dumps(reply, default=_jsonable) + "\n")
        out.flush()


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, bytes):
        return obj.hex()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"not JSON-serializable: {type(obj).__name__}")
