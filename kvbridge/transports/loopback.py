"""In-process transport with fault injection, for testing the paths that real transports rarely take.

Peers are other `LoopbackBackend` instances of the same process, found by address. Bytes move
with `ctypes.memmove`. Faults are armed with `inject()` and `die()`.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import attrs

from kvbridge.backend import MigrationBackend, Op, Peer
from kvbridge.errors import PeerGone, TransferFailed
from kvbridge.memory import Descriptors
from kvbridge.options import TransportOptions, option
from kvbridge.types import BackendCapabilities, BackendConfig, EndpointInfo, MemoryKind, MemoryRegion

_endpoints: weakref.WeakValueDictionary[str, LoopbackBackend] = weakref.WeakValueDictionary()
_ids = itertools.count(1)


@attrs.define
class Faults:
    """Armed faults: counts are consumed one per submission."""

    fail_submit: int = 0
    fail_completion: int = 0
    delay: float = 0.0


@attrs.frozen
class LoopbackOptions(TransportOptions):
    """Options of the `loopback` transport."""

    max_batch: int | None = option(
        None, "most descriptors per submission (None: no limit), to test batching", min=1, max=1 << 24
    )


class LoopbackBackend(MigrationBackend):
    """A transport between backends of one process; options in `LoopbackOptions`."""

    name = "loopback"
    capabilities = BackendCapabilities(
        protocols=("loopback",), memory_kinds={MemoryKind.DRAM}, read=True, write=True, max_batch=None
    )

    options_class = LoopbackOptions

    def __init__(self, config: BackendConfig, options: LoopbackOptions | None = None) -> None:
        super().__init__(config, options)
        max_batch = self.options.max_batch
        if max_batch is not None:
            self.capabilities = attrs.evolve(self.capabilities, max_batch=max_batch)  # type: ignore[misc]
        self.faults = Faults()
        self.submissions = 0
        self._fault_lock = threading.Lock()
        self._addr = f"loopback-{next(_ids)}"
        _endpoints[self._addr] = self

    def inject(self, *, fail_submit: int = 0, fail_completion: int = 0, delay: float = 0.0) -> None:
        """Fail the next `fail_submit` submissions at once, the next `fail_completion` on completion.

        Also delay every completion by `delay` seconds."""
        with self._fault_lock:
            self.faults = Faults(fail_submit, fail_completion, delay)

    def die(self) -> None:
        """Vanish as a crashed process would: peers' transfers fail with PeerGone."""
        _endpoints.pop(self._addr, None)

    def _register(self, regions: Sequence[MemoryRegion]) -> None:
        return None

    def _unregister(self, regions: Sequence[MemoryRegion]) -> None:
        return None

    def _address(self) -> str:
        return self._addr

    def _connect(self, endpoint: EndpointInfo) -> Any:
        if endpoint.address not in _endpoints:
            raise PeerGone(
                f"loopback peer {endpoint.address} is gone; restart it and reconnect",
                peer=endpoint.address,
                cause="peer gone",
            )
        return endpoint.address

    def _submit(self, peer: Peer, desc: Descriptors, op: Op) -> Future:
        with self._fault_lock:
            self.submissions += 1
            fail_submit = self.faults.fail_submit > 0
            fail_completion = not fail_submit and self.faults.fail_completion > 0
            if fail_submit:
                self.faults.fail_submit -= 1
            if fail_completion:
                self.faults.fail_completion -= 1
            delay = self.faults.delay
        if fail_submit:
            raise TransferFailed(f"injected submit failure towards {peer.name}", peer=peer.name, cause="injected")
        return self._spawn(lambda: self._move(peer, desc, op, delay, fail_completion))

    def _move(self, peer: Peer, desc: Descriptors, op: Op, delay: float, fail: bool) -> None:
        if delay:
            time.sleep(delay)
        if fail:
            raise TransferFailed(f"injected completion failure towards {peer.name}", peer=peer.name, cause="injected")
        remote = _endpoints.get(peer.handle)
        if remote is None:
            raise PeerGone(f"loopback peer {peer.name} died during the transfer", peer=peer.name, cause="peer gone")
        # the peer enforces its own registration, as a real remote would
        remote._local.check(desc[:, 1], desc[:, 2], side="remote", peer=peer.name)
        for local, rem, length in desc.tolist():  # test transport: one memmove per descriptor is fine
            dst, src = (local, rem) if op == "read" else (rem, local)
            ctypes.memmove(dst, src, length)

    def _shutdown(self) -> None:
        self.die()
