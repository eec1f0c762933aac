"""Registers the `mooncake` transport. Imports nothing from Mooncake until the backend is created."""

from __future__ import annotations

from collections.abc import Callable

import kvbridge
from kvbridge.types import BackendCapabilities, MemoryKind
from kvbridge_mooncake.options import MooncakeOptions

KVBRIDGE_PLUGIN_API = 1

CAPABILITIES = BackendCapabilities(
    protocols=("tcp", "rdma", "nvlink", "ascend"),
    memory_kinds={MemoryKind.DRAM, MemoryKind.VRAM, MemoryKind.NPU, MemoryKind.MLU},
    read=True,
    write=True,
    notifications=False,
    max_batch=1024,
)

INSTALL_HINT = (
    "pip install 'kvbridge-mooncake[non-cuda]' (or [cuda], [npu] to match the machine); "
    "on Debian/Ubuntu also `apt-get install libibverbs1`"
)


def probe() -> str | None:
    """Why Mooncake cannot run here, or None."""
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        text = str(exc)
        if "libibverbs" in text:
            return f"{text} (Mooncake links against libibverbs even for TCP)"
        return f"mooncake.engine is not importable: {text}"
    return None


def _factory(config: kvbridge.BackendConfig) -> kvbridge.MigrationBackend:
    from kvbridge_mooncake.backend import MooncakeBackend

    return MooncakeBackend(config)


@kvbridge.hookimpl
def kvbridge_register_backends(register: Callable[..., None]) -> None:
    register("mooncake", _factory, capabilities=CAPABILITIES, probe=probe, install_hint=INSTALL_HINT,
             options=MooncakeOptions)
