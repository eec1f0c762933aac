"""`MigrationBackend` on `mooncake.engine.TransferEngine`.

Mooncake's TCP transport admits about 2048 descriptors per peer at a time (1024 queued +
1024 pending); a larger batch is partly rejected ("TCP lane queue-full") and the call right
after it fails while the accepted part drains. So submissions are cut to `max_batch`
(default 1024), serialized per peer, and a failed part is retried a bounded number of times
after a short backoff, which keeps the engine usable after any failure.

A stuck transfer is bounded by `transfer_deadline` (seconds without progress, default 2). Mooncake
TCP's own watchdog drops a session only after 30 s without progress ("ClientSession: no transfer
progress within 30s", and on the serving side "ServerSession::writeBody failed: Broken pipe"): that
is the 30 s stall seen in the vLLM e2e runs, reproduced by stopping the serving process mid-pull.
The watchdog's period is read from the environment on every transfer, so the plugin sets it to the
deadline; the dropped lane reconnects on the next attempt, the failed part is retried once on it,
and then the transfer fails with the reason.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import attrs
from kvbridge.backend import MigrationBackend, Op, Peer
from kvbridge.errors import ConfigError, PluginUnavailable, TransferFailed
from kvbridge.memory import Descriptors
from kvbridge.types import BackendConfig, EndpointInfo, MemoryRegion

from kvbridge_mooncake.plugin import CAPABILITIES, INSTALL_HINT, probe

log = logging.getLogger(__name__)

P2P = "P2PHANDSHAKE"
TCP_DESCRIPTOR_BYTES = 1 << 20
DEFAULT_DEADLINE_S = 2.0
# Mooncake TCP (0.3.13) reads these per transfer: seconds without progress before it drops a session,
# and seconds it waits for a READ's status frame. Both default to 30 s.
_WATCHDOG_ENV = ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC")
# The Python binding's sync call gives up after MC_TRANSFER_TIMEOUT seconds plus one second per GiB
# (read once per engine, at least 5, default 30). It is needed too: slices still queued behind lanes
# the watchdog dropped are not failed by it, and the call would wait the full 30 s (measured).
_CALL_TIMEOUT_ENV = "MC_TRANSFER_TIMEOUT"
CALL_TIMEOUT_FLOOR_S = 5

# mooncake-transfer-engine include/error.h
_ERRORS = {
    -1: "invalid argument or transfer failure (an unregistered or unreachable address, a dead peer, "
    "or a full TCP lane queue; the engine log says which)",
    -2: "too many requests in flight",
    -3: "address not registered",
    -4: "batch busy",
    -6: "device not found (check device_name / the NIC list)",
    -7: "address range overlaps a registered one",
    -101: "DNS lookup failed for the peer",
    -102: "socket failure talking to the peer",
    -103: "malformed JSON in the handshake",
    -104: "peer rejected the handshake",
    -105: "malformed handshake response",
    -200: "metadata server error",
    -201: "endpoint error",
    -202: "context error",
    -300: "NUMA error",
    -301: "clock error",
    -302: "out of memory",
}


@functools.cache
def _supports_redis_metadata() -> bool:
    """Whether the installed Mooncake binaries carry a redis client (its redis metadata plugin)."""
    import mooncake

    root = Path(mooncake.__file__).parent
    libs = [*root.glob("*.so*"), *root.parent.glob("mooncake*.libs/*.so*")]
    return any(b"redisConnect" in lib.read_bytes() for lib in libs)


def _arm_watchdog(deadline_s: float) -> None:
    """Make Mooncake TCP drop a session after `deadline_s` without progress (it takes whole seconds).

    The variables are process-wide: one an operator set is kept (and logged), so a deployment can tune it.
    """
    want = str(max(1, math.ceil(deadline_s)))
    call = str(max(CALL_TIMEOUT_FLOOR_S, math.ceil(deadline_s)))
    for var, want in [*((v, want) for v in _WATCHDOG_ENV), (_CALL_TIMEOUT_ENV, call)]:
        have = os.environ.setdefault(var, want)
        if have != want:
            log.info("mooncake: %s=%s from the environment kept (transfer deadline %ss)", var, have, deadline_s)


def explain(rc: int) -> str:
    return f"return code {rc}: {_ERRORS.get(rc, 'unknown error')}"


class MooncakeBackend(MigrationBackend):
    """Mooncake Transfer Engine.

    Options: `max_batch` (descriptors per call, default 1024), `max_descriptor_bytes` (default 1 MiB
    on tcp), `transfer_deadline` (seconds without progress before a lane is dropped, default 2),
    `retries` (default 1), `retry_backoff` (seconds, default 0.05).
    """

    name = "mooncake"
    capabilities = CAPABILITIES

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        reason = probe()
        if reason:
            raise PluginUnavailable("backend", "mooncake", reason, INSTALL_HINT)
        from mooncake.engine import TransferEngine

        opts = config.options
        # Mooncake's TCP transport moves one descriptor per lane: ~1 MiB pieces keep its lanes busy in
        # parallel (measured: 64 x 1 MiB about twice as fast as 1 x 64 MiB on loopback).
        piece = opts.get("max_descriptor_bytes", TCP_DESCRIPTOR_BYTES if self.protocol == "tcp" else None)
        self.capabilities = attrs.evolve(  # type: ignore[misc]
            CAPABILITIES,
            max_batch=int(opts.get("max_batch", CAPABILITIES.max_batch)),
            max_descriptor_bytes=int(piece) if piece else None,
        )
        self._deadline = float(opts.get("transfer_deadline", DEFAULT_DEADLINE_S))
        if self._deadline <= 0:
            raise ConfigError(f"mooncake transfer_deadline must be positive seconds, got {self._deadline}")
        # One retry on a fresh lane: a second stall means the peer is stuck, and the caller recomputes.
        self._retries = int(opts.get("retries", 1))
        self._backoff = float(opts.get("retry_backoff", 0.05))
        if self.protocol == "tcp":
            _arm_watchdog(self._deadline)
        self._metadata = config.metadata_server or P2P
        if self._metadata.startswith("redis://") and not _supports_redis_metadata():
            # Mooncake aborts the whole process when asked for a metadata plugin it was built without.
            raise ConfigError(
                "this Mooncake wheel was built without redis metadata support (no hiredis in it); use "
                "etcd://HOST:PORT, an http:// metadata server, or P2PHANDSHAKE, or install a Mooncake built "
                "with USE_REDIS"
            )
        self._engine = TransferEngine()
        rc = self._engine.initialize(config.hostname, self._metadata, self.protocol, config.device_name)
        if rc != 0:
            raise ConfigError(
                f"Mooncake TransferEngine.initialize({config.hostname!r}, {self._metadata!r}, {self.protocol!r}, "
                f"{config.device_name!r}) failed with {explain(rc)}. Check that the protocol is built into the "
                "installed wheel, the NIC names exist (`kvbridge doctor`), and the metadata server is reachable"
            )
        if self._metadata == P2P:
            self._session = f"{config.hostname}:{self._engine.get_rpc_port()}"
        else:
            self._session = config.hostname
        self._peer_locks: dict[str, threading.Lock] = {}
        log.info("mooncake %s engine up as %s (metadata %s)", self.protocol, self._session, self._metadata)

    def _register(self, regions: Sequence[MemoryRegion]) -> None:
        rc = self._engine.batch_register_memory([r.addr for r in regions], [r.length for r in regions])
        if rc != 0:
            raise ConfigError(f"Mooncake could not register {len(regions)} regions: {explain(rc)}")

    def _unregister(self, regions: Sequence[MemoryRegion]) -> None:
        rc = self._engine.batch_unregister_memory([r.addr for r in regions])
        if rc != 0:
            log.warning("mooncake: unregistering %d regions failed: %s", len(regions), explain(rc))

    def _address(self) -> str:
        return self._session

    def _connect(self, endpoint: EndpointInfo) -> Any:
        with self._lock:
            self._peer_locks.setdefault(endpoint.address, threading.Lock())
        return endpoint.address

    def _submit(self, peer: Peer, desc: Descriptors, op: Op) -> Future:
        local, remote, length = desc[:, 0].tolist(), desc[:, 1].tolist(), desc[:, 2].tolist()
        call = self._engine.batch_transfer_sync_read if op == "read" else self._engine.batch_transfer_sync_write
        lock = self._peer_locks[peer.handle]

        def run() -> None:
            begun = time.monotonic()
            with lock:  # one batch in flight per peer stays inside the transport's admission limit
                for attempt in range(self._retries + 1):
                    t0 = time.monotonic()
                    rc = call(peer.handle, local, remote, length)
                    if rc == 0:
                        return
                    took = time.monotonic() - t0
                    if attempt < self._retries:
                        # A failure that took the deadline is Mooncake's watchdog dropping a stuck lane.
                        log.warning("mooncake %s of %d descriptors with %s failed after %.1fs (%s), retrying "
                                    "on a fresh lane", op, len(local), peer.handle, took, explain(rc))
                        time.sleep(self._backoff * (2**attempt))
            stuck = " (no progress within the transfer deadline)" if took >= self._deadline else ""
            raise TransferFailed(
                f"Mooncake {op} of {len(local)} descriptors ({sum(length)} bytes) with peer {peer.handle} "
                f"failed after {self._retries + 1} attempts in {time.monotonic() - begun:.1f}s{stuck}: "
                f"{explain(rc)}. Check the peer is alive, not stalled, and its memory is registered",
                peer=peer.handle,
                cause=explain(rc),
            )

        return self._spawn(run)

    def _shutdown(self) -> None:
        # TransferEngine has no explicit shutdown; dropping the last reference stops it.
        self._engine = None
