"""Every thread's native stack, for a stall dump: where a transport's C++ thread, or Python inside a C call, sits.

Python's own view (`sys._current_frames`) ends at the C call a thread is in, and a thread a native library started
has no Python stack at all. `eu-stack` (elfutils) reads each thread's stack from outside through ptrace. It stops the
process for the read: 10 ms for a process that imported torch, 0.11 s for a vLLM engine core on a loaded box, where
gdb's `thread apply all bt` took 13 s (it loads every library's symbols first). So eu-stack, and nothing when it is
not installed.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable

log = logging.getLogger(__name__)

TOOL = "eu-stack"
TIMEOUT_S = 30.0  # a read that takes longer is given up: the process is stopped while it runs
# prctl(PR_SET_PTRACER): where Linux's Yama allows ptrace of descendants only (Ubuntu's default), a child may trace
# its parent only once the parent names it. Kernels without Yama refuse the call, and need none.
PR_SET_PTRACER = 0x59616D61


def _let_trace(pid: int) -> None:
    """Let process `pid` trace this one (0: nobody again), where Yama asks for it; nothing elsewhere."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux's libc
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0)


def native_stacks(name_of: Callable[[int], str] = str, pid: int | None = None, timeout_s: float = TIMEOUT_S) -> str:
    """Each thread's native stack (`pid`: this process), each headed with its thread id and `name_of(thread id)`.

    Never raises: without eu-stack, or where ptrace is not allowed, the text says so and what to do."""
    tool = shutil.which(TOOL)
    if tool is None:
        return f"Native stacks: not taken ({TOOL} not found; install elfutils to have them)"
    pid = os.getpid() if pid is None else pid
    # A file, not a pipe: the process reading the pipe is the one stopped while eu-stack writes.
    with tempfile.TemporaryFile() as out:
        try:
            reader = subprocess.Popen(
                [tool, "-p", str(pid)], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        except OSError as exc:
            return f"Native stacks: not taken ({TOOL}: {exc})"
        _let_trace(reader.pid)  # before it attaches: it has only just been started
        try:
            reader.wait(timeout_s)
        except subprocess.TimeoutExpired:
            reader.kill()
            reader.wait()
            return f"Native stacks: not taken ({TOOL} took over {timeout_s:g} s)"
        finally:
            _let_trace(0)
        out.seek(0)
        text = out.read().decode(errors="replace")
    stacks = _below_python([_named(line, name_of) for line in text.splitlines() if line.startswith(("TID ", "#"))])
    if not stacks:
        why = " ".join(text.split())[:300] or f"exit status {reader.returncode}"
        return f"Native stacks: not taken ({TOOL}: {why}; a container needs CAP_SYS_PTRACE for it)"
    return "\n".join([f"Every thread's native stack ({TOOL}):", *stacks])


# The interpreter's frame function: a Python thread's native frames past its first one are its Python stack again,
# which the dump shows as Python (tens of frames a thread, in a process of tens of threads).
INTERPRETER = "_PyEval_EvalFrameDefault"


def _below_python(lines: list[str]) -> list[str]:
    """Each thread's native frames up to its first interpreter frame (all of them for a thread with none)."""
    out, in_python = [], False
    for line in lines:
        if line.startswith("  TID "):
            in_python = False
        elif in_python:
            continue
        out.append(line)
        if INTERPRETER in line:
            in_python = True
            out.append("    ... (its Python stack, above)")
    return out


def _named(line: str, name_of: Callable[[int], str]) -> str:
    """`TID 4242:` as `TID 4242 (kvbridge-mc-io):`; a frame line as it is, indented."""
    if not line.startswith("TID "):
        return f"    {line}"
    tid = line[4:].rstrip(":")
    return f"  TID {tid} ({name_of(int(tid))}):" if tid.isdigit() else f"  {line}"
