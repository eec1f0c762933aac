"""What the `nixl` transport is, declared once: the plugin registers it, the backend builds on it.

Imports nothing from NIXL until probed or used.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from pathlib import Path
from types import ModuleType

import attrs

from kvbridge.base.options import option
from kvbridge.base.types import BackendCapabilities, MemoryKind
from kvbridge.transport.netguard import GuardOptions

# NIXL backends that move memory between two agents (kvbridge's protocols, lower case). NIXL's other
# plugins (POSIX, GDS, GDS_MT, OBJ, ...) move memory to and from storage, which is not a peer transfer.
PEER_BACKENDS = ("UCX", "LIBFABRIC", "GPUNETIO", "UCCL")
# The OS name of the threads NIXL and its backend library start (UCX's progress and `async` threads): kvbridge's.
NATIVE_THREAD_NAME = "kvbridge-ucx"

# The meta package `nixl` picks the variant matching the CUDA found (what vLLM imports); without it,
# the variant wheels are tried directly.
_API_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")

INSTALL_HINT = (
    "pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1 (--no-deps: the wheel otherwise pulls a CUDA torch; "
    "nixl-cu13 on CUDA 13)"
)


@attrs.frozen
class NixlOptions(GuardOptions):
    """Options of the `nixl` transport (docs/nixl.md says why NIXL's own progress thread is off by default)."""

    progress_thread: bool = option(False, "use NIXL's own progress thread (it busy-polls: about a core per agent)")
    progress_interval: float = option(
        # not 0: the progress loop would spin a core waiting for nothing
        0.005,
        "seconds between progress calls while idle without progress_thread (at least 0.1 once reads are announced)",
        min=0.0001,
        max=86400,
    )
    poll_interval: float = option(
        0.0,
        "seconds between polls of in-flight requests (0: yield between polls for 0.2 ms, then back off to 0.5 ms)",
        min=0,
        max=60,
    )
    num_threads: int = option(
        0, "worker threads of the NIXL backend (UCX, LIBFABRIC); 0: NIXL's default", min=0, max=1024
    )
    transfer_timeout: float = option(
        120.0, "seconds after which an unfinished request is aborted and fails", min=0.001, max=86400
    )
    agent_name: str = option("", "this agent's NIXL name (default: unique per process)")


def nixl_api() -> ModuleType:
    """NIXL's Python API module (`nixl_agent`, `nixl_agent_config`); ImportError when none is installed."""
    errors = []
    for name in _API_MODULES:
        try:
            api = importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        if "NIXL_LOG_LEVEL" not in os.environ:
            # NIXL's Python logger writes INFO lines to stdout (one per agent and backend), which would mix into
            # a program's output; keep it to warnings unless the user asked for more.
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return api
    raise ImportError("; ".join(errors))


def _wheel_libs(folder: str) -> list[Path]:
    """The library folders of the installed NIXL wheels (`nixl_cu12.libs/<folder>`, ...), found without import."""
    found = []
    for pkg in ("nixl_cu12", "nixl_cu13"):
        spec = importlib.util.find_spec(pkg)
        if spec is not None and spec.origin:
            found.append(Path(spec.origin).parent.parent / f"{pkg}.libs" / folder)
    return found


def shipped_backends() -> tuple[str, ...]:
    """The peer backends whose NIXL plugin library is installed, found by file name (no import)."""
    found = {
        p.name[len("libplugin_") : -len(".so")] for libs in _wheel_libs("nixl") for p in libs.glob("libplugin_*.so")
    }
    return tuple(b for b in PEER_BACKENDS if b in found) or ("UCX",)


def ucx_reaches_cuda() -> bool:
    """Whether the UCX shipped with NIXL was built with CUDA (its `uct_cuda` module is installed).

    Only then does UCX read and write GPU memory itself (cuda_copy, cuda_ipc between processes, and
    GPUDirect RDMA through a NIC); without it kvbridge stages GPU memory through pinned host memory.
    """
    return any(any(libs.glob("libuct_cuda.so*")) for libs in _wheel_libs("ucx"))


def capabilities() -> BackendCapabilities:
    return BackendCapabilities(
        protocols=tuple(b.lower() for b in shipped_backends()),
        memory_kinds={MemoryKind.DRAM, MemoryKind.VRAM} if ucx_reaches_cuda() else {MemoryKind.DRAM},
        read=True,
        write=True,
        notifications=False,
        # one NIXL request per submission: NIXL takes the whole list in one C++ call
        max_batch=None,
        # A request released unfinished (`transfer_timeout`, close) still writes: UCX's cancel leaves an RMA get
        # running; over UCX TCP an aborted read landed whole once its peer served it (tests/test_nixl_faults.py).
        late_writes=True,
    )


def probe() -> str | None:
    """Why NIXL cannot run here, or None."""
    try:
        nixl_api()
    except ImportError as exc:
        return f"NIXL's Python API is not importable ({exc})"
    return None
