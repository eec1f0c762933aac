"""What the `mooncake` transport can do, declared once: the plugin registers it, the backend builds on it.

Each kvbridge protocol maps to one of Mooncake's transports, and reaches the memory kinds that
transport reaches in the installed wheel (`mooncake.engine.SUPPORT_*` says what it was built with):

- ``tcp``: host memory; device memory is staged through pinned host mirrors (`kvbridge.transport.staging`).
- ``rdma``: host memory, and GPU memory by GPUDirect RDMA where the wheel is built with CUDA
  (registered with its ``cuda:N`` location); MLU memory where Mooncake is built for it.
- ``nvlink``: GPU memory between GPUs of one host, on Mooncake's intra-node NVLink transport
  (``nvlink_intra``; needs a wheel built with USE_INTRA_NVLINK).
- ``ascend``: Ascend NPU memory (HCCS within a node, the NPUs' RoCE across nodes); the engine's local
  hostname is ``ip:port:npu_<physical id>``, the NPU is made current before `initialize`, and every
  registration starts on a 2 MiB boundary.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kvbridge.base.options import option
from kvbridge.base.threadname import os_thread_name
from kvbridge.base.types import BackendCapabilities, MemoryKind
from kvbridge.transport.netguard import GuardOptions

PROTOCOLS = ("tcp", "rdma", "nvlink", "ascend")
# The OS name of the threads Mooncake starts (native: named after their starter, e.g. the engine's model thread)
NATIVE_THREAD_NAME = "kvbridge-mc-io"
MOONCAKE_PROTOCOL = {"tcp": "tcp", "rdma": "rdma", "nvlink": "nvlink_intra", "ascend": "ascend"}
ASCEND_ALIGNMENT = 2 << 20  # Mooncake's ascend transport (HCCL) registers memory in 2 MiB pages
# Pieces of a long descriptor. Measured with `kvbridge bench --model llama3-8b --tokens 4096` (512 MiB a
# request, contiguous, paired with one 512 MiB descriptor): 1 MiB pieces 77-85 % of raw, 2 MiB 85-86 %,
# 4 MiB 94-102 %, 8 MiB 96-100 %; at 512 tokens (64 MiB) 1 MiB 37-39 ms, 4 MiB 36 ms (docs/transfer-strategies.md).
TCP_DESCRIPTOR_BYTES = 4 << 20
# What a tcp descriptor costs, as measured, is kvbridge-tools' (kvbridge_tools.strategy.TRANSFER_COSTS): only its
# bench chooses between sending descriptors and gathering them.

CAPABILITIES = BackendCapabilities(
    protocols=PROTOCOLS,
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


@attrs.frozen
class MooncakeOptions(GuardOptions):
    """Options of the `mooncake` transport; None means "not set": the default the doc names applies."""

    max_batch: int = option(CAPABILITIES.max_batch, "most descriptors per Mooncake batch call", min=1, max=1 << 24)
    max_descriptor_bytes: int | None = option(
        None,
        f"split descriptors into pieces of at most this many bytes (None: {TCP_DESCRIPTOR_BYTES} on tcp, "
        "unsplit on other protocols)",
        min=1,
        max=1 << 40,
    )
    retries: int = option(
        1, "times a failed batch is resubmitted (on a fresh lane) before the transfer fails", min=0, max=100
    )
    transfer_deadline: float = option(
        2.0,
        "seconds a batch may make no progress before kvbridge resubmits it once (then fails it); on tcp also "
        "when Mooncake drops a stuck lane (its own watchdog waits 30 s)",
        min=0.001,
        max=3600,
    )
    retry_backoff: float = option(0.05, "seconds before the first retry, doubling after each", min=0, max=60)
    npu: int | None = option(
        None, "ascend: the NPU device id the engine binds to (None: the current NPU)", min=0, max=1023
    )
    ascend_port: int = option(
        0, "ascend: the port in the engine's ip:port:npu_N name (0: the transport picks)", min=0, max=65535
    )


def probe() -> str | None:
    """Why Mooncake cannot run here, or None."""
    try:
        with os_thread_name(NATIVE_THREAD_NAME):  # the threads its import starts are named as kvbridge's
            import mooncake.engine  # noqa: F401
    except ImportError as exc:
        text = str(exc)
        if "libibverbs" in text:
            return f"{text} (Mooncake links against libibverbs even for TCP)"
        return f"mooncake.engine is not importable: {text}"
    return None


def wheel_supports(engine: Any) -> frozenset[str]:
    """The optional transports the installed wheel was built with (``cuda``, ``intra_nvlink``, ...)."""
    return frozenset(
        name.removeprefix("SUPPORT_").lower()
        for name in dir(engine)
        if name.startswith("SUPPORT_") and getattr(engine, name) is True
    )


def memory_kinds(protocol: str, built_with: frozenset[str]) -> frozenset[MemoryKind]:
    """The memory one protocol's transport reads and writes in place, for a wheel built with `built_with`."""
    if protocol == "tcp":
        return frozenset({MemoryKind.DRAM})
    if protocol == "rdma":
        gpu = {MemoryKind.VRAM} if "cuda" in built_with else set()
        # Mooncake's MLU support is a build option the wheel does not report; the MLU plugin's protocols
        # say rdma reaches it, as on xLLM's MLU builds.
        return frozenset({MemoryKind.DRAM, MemoryKind.MLU, *gpu})
    if protocol == "nvlink":
        return frozenset({MemoryKind.VRAM})
    if protocol == "ascend":
        return frozenset({MemoryKind.NPU})
    raise ValueError(f"unknown protocol {protocol!r}")


def capabilities(protocol: str, options: Mapping[str, object], built_with: frozenset[str]) -> BackendCapabilities:
    """One engine's capabilities: `CAPABILITIES` narrowed to its protocol, wheel and options."""
    # Mooncake's TCP transport moves one descriptor per lane: pieces keep its lanes busy in parallel
    # (64 x 1 MiB about twice as fast as 1 x 64 MiB on loopback), and each costs a session of its own.
    piece = options.get("max_descriptor_bytes", TCP_DESCRIPTOR_BYTES if protocol == "tcp" else None)
    return attrs.evolve(
        CAPABILITIES,
        memory_kinds=memory_kinds(protocol, built_with),
        max_batch=int(options.get("max_batch", CAPABILITIES.max_batch)),  # type: ignore[arg-type]
        max_descriptor_bytes=int(piece) if piece else None,  # type: ignore[arg-type]
        # measured on tcp (chaos run, docs/chaos.md): the binding returns -1 and frees the batch while its
        # slices stay queued behind dropped lanes, and they land once the peer answers again
        late_writes=protocol == "tcp",
    )
