"""`MigrationBackend` on `mooncake.engine.TransferEngine`.

Mooncake's TCP transport admits about 2048 descriptors per peer at a time (1024 queued +
1024 pending); a larger batch is partly rejected ("TCP lane queue-full") and the call right
after it fails while the accepted part drains. So submissions are cut to `max_batch`
(default 1024), serialized per peer, and a failed part is retried a bounded number of times
after a short backoff, which keeps the engine usable after any failure.
"""

from __future__ import annotations

import functools
import logging
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
from kvbridge.options import parse
from kvbridge.types import BackendConfig, EndpointInfo, MemoryRegion

from kvbridge_mooncake.options import TCP_DESCRIPTOR_BYTES, MooncakeOptions
from kvbridge_mooncake.plugin import CAPABILITIES, INSTALL_HINT, probe

log = logging.getLogger(__name__)

P2P = "P2PHANDSHAKE"

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


def explain(rc: int) -> str:
    return f"return code {rc}: {_ERRORS.get(rc, 'unknown error')}"


class MooncakeBackend(MigrationBackend):
    """Mooncake Transfer Engine; options in `MooncakeOptions`."""

    name = "mooncake"
    capabilities = CAPABILITIES

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        reason = probe()
        if reason:
            raise PluginUnavailable("backend", "mooncake", reason, INSTALL_HINT)
        from mooncake.engine import TransferEngine

        opts: MooncakeOptions = parse(MooncakeOptions, config.options, what="backend 'mooncake'")
        piece = opts.max_descriptor_bytes
        if piece is None and self.protocol == "tcp":
            piece = TCP_DESCRIPTOR_BYTES
        self.capabilities = attrs.evolve(  # type: ignore[misc]
            CAPABILITIES, max_batch=opts.max_batch, max_descriptor_bytes=piece or None
        )
        self._retries = opts.retries
        self._backoff = opts.retry_backoff
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
            with lock:  # one batch in flight per peer stays inside the transport's admission limit
                for attempt in range(self._retries + 1):
                    rc = call(peer.handle, local, remote, length)
                    if rc == 0:
                        return
                    if attempt < self._retries:
                        log.info("mooncake %s of %d descriptors with %s failed (%s), retrying",
                                 op, len(local), peer.handle, explain(rc))
                        time.sleep(self._backoff * (2**attempt))
            raise TransferFailed(
                f"Mooncake {op} of {len(local)} descriptors ({sum(length)} bytes) with peer {peer.handle} "
                f"failed after {self._retries + 1} attempts: {explain(rc)}. Check the peer is alive and "
                "its memory is registered",
                peer=peer.handle,
                cause=explain(rc),
            )

        return self._spawn(run)

    def _shutdown(self) -> None:
        # TransferEngine has no explicit shutdown; dropping the last reference stops it.
        self._engine = None
