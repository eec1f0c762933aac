"""In-process transport, for testing the paths that real transports rarely take. See docs/internals.md."""

from __future__ import annotations

import ctypes
import itertools
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import attrs

from kvbridge.base.errors import PeerGone
from kvbridge.base.memory import Descriptors
from kvbridge.base.options import BackendOptions, option
from kvbridge.base.types import BackendCapabilities, BackendConfig, EndpointInfo, MemoryKind, MemoryRegion
from kvbridge.transport.contract import MigrationBackend, Op, Peer

_endpoints: weakref.WeakValueDictionary[str, LoopbackBackend] = weakref.WeakValueDictionary()
_ids = itertools.count(1)


@attrs.frozen
class LoopbackOptions(BackendOptions):
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
        self._addr = f"loopback-{next(_ids)}"
        _endpoints[self._addr] = self

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
        return self._spawn(peer, lambda: self._move(peer, desc, op))

    def _move(self, peer: Peer, desc: Descriptors, op: Op) -> None:
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
