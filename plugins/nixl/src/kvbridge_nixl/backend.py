"""`MigrationBackend` on NIXL's Python API (`nixl_agent`).

How the contract maps onto NIXL:
- endpoint: the agent's name is the address; its metadata (`get_agent_metadata()`, which carries the
  registered memory's remote keys) travels in `EndpointInfo.extra`; `connect` is `add_remote_agent`.
- registration: one `register_memory` per region, so each can be deregistered on its own.
- transfer: one NIXL request per submission, built from numpy arrays in one C++ call
  (`initialize_xfer`, READ for pull, WRITE for push); no per-descriptor Python work.
- progress: NIXL's own progress thread polls its workers with no delay (a core per agent while idle),
  so by default it is off and one thread of this backend drives progress instead: it polls in-flight
  requests while there are any, and lets NIXL progress for peers that read from this agent while the owner
  says they do (`expect_reads`; over UCX TCP a read advances only as the passive side progresses), both
  yielding between polls for the first POLL_SPIN_S, then with sleeps that grow to POLL_CAP_S, so a request a
  stopped peer never serves does not keep a core busy. Otherwise it lets NIXL progress every
  `progress_interval` seconds, or every ANNOUNCED_IDLE_S once the owner announces reads.
- every request handle is released on every path: completion, error, timeout and close (abort).
"""

from __future__ import annotations

import base64
import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import attrs
import numpy as np

from kvbridge.base.errors import ConfigError, PluginUnavailable, TransferFailed, TransferTimeout, described
from kvbridge.base.memory import Descriptors
from kvbridge.base.threadname import NamedThread, native_threads_named
from kvbridge.base.types import BackendConfig, EndpointInfo, MemoryKind, MemoryRegion
from kvbridge.transport.contract import MigrationBackend, Op, Peer
from kvbridge.transport.netguard import Guard
from kvbridge_nixl.spec import INSTALL_HINT, NATIVE_THREAD_NAME, NixlOptions, capabilities, nixl_api, probe

log = logging.getLogger(__name__)

_MEM_TYPES = {MemoryKind.DRAM: "DRAM", MemoryKind.VRAM: "VRAM"}
_METADATA_KEY = "nixl_agent_metadata"

# Polling in-flight requests: for the first POLL_SPIN_S only yielding between polls (a small read ends
# within it), then sleeps growing from POLL_FIRST_S to POLL_CAP_S (the cap bounds how late a finished
# request is seen). Yielding without end spun a core for as long as a stopped peer left a read unserved
# (1.0 core measured over UCX TCP), which on a small host is taken from the engines.
POLL_SPIN_S, POLL_FIRST_S, POLL_CAP_S = 200e-6, 20e-6, 500e-6
# Seconds between progress calls while idle once the owner announces every read (`expect_reads`): a passive side
# then needs progress only for what peers send outside a read (a departed agent's disconnect, UCX's keepalive).
ANNOUNCED_IDLE_S = 0.1


@attrs.define(eq=False)
class _InFlight:
    handle: Any
    future: Future
    peer: str
    what: str
    deadline: float


class NixlBackend(MigrationBackend):
    """NIXL agent with one peer backend (the protocol: `ucx` by default, `libfabric`, ...)."""

    name = "nixl"
    capabilities = capabilities()
    options_class = NixlOptions

    def __init__(self, config: BackendConfig, options: NixlOptions | None = None) -> None:
        """`options`: `spec.NixlOptions`, parsed and checked by the registry.

        docs/nixl.md says what each does; its guard options say who may reach UCX's listeners, which authenticate
        nobody: `kvbridge.transport.netguard`."""
        super().__init__(config, options)
        opts: NixlOptions = self.options  # type: ignore[assignment]
        reason = probe()
        if reason:
            raise PluginUnavailable("backend", "nixl", reason, INSTALL_HINT)
        api = nixl_api()
        self._nixl_backend = self.protocol.upper()
        self._name = opts.agent_name or f"kvbridge-{config.hostname}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._own_progress = not opts.progress_thread
        self._progress_interval = opts.progress_interval
        self._poll_interval = opts.poll_interval
        self._timeout = opts.transfer_timeout
        conf = api.nixl_agent_config(enable_prog_thread=opts.progress_thread, backends=[], num_threads=opts.num_threads)
        # UCX authenticates no peer and listens on every interface: refuse or guard before it starts
        self.guard = Guard(f"nixl {self.protocol} transport", config.hostname, opts)
        init = {"num_threads": str(opts.num_threads)} if opts.num_threads else {}
        failed: Exception | None = None
        # UCX's threads start here; its `async` thread names itself, and is named kvbridge's again after
        with self.guard.capture(), native_threads_named(NATIVE_THREAD_NAME):
            self._agent = api.nixl_agent(self._name, conf)
            try:
                self._agent.create_backend(self._nixl_backend, init)
            except Exception as exc:  # NIXL raises its own binding errors; the plugin's library may be missing
                failed = exc
        if failed is not None:
            self.guard.close()
            raise ConfigError(
                f"NIXL could not start its {self._nixl_backend} backend ({described(failed)}). "
                f"NIXL plugins on this machine: {self._agent.get_plugin_list()}; a plugin that is listed but "
                "fails to load lacks its system library (libfabric for LIBFABRIC, DOCA for GPUNETIO). "
                "Choose another protocol or install the library"
            ) from failed
        self._agent_lock = threading.Lock()  # NIXL agents are not thread-safe in their default sync mode
        self._reg: dict[int, Any] = {}
        self._remote: dict[str, int] = {}  # remote agent name -> connected peers using it
        self._inflight: list[_InFlight] = []
        self._reading = 0  # leases on this agent's memory peers are reading now (`expect_reads`)
        self._announced = False  # the owner announces every read: idle progress can be rare
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._progress = NamedThread(target=self._progress_loop, name="kvbridge-nixl-progress", daemon=True)
        self._progress.start()
        log.info(
            "nixl agent %s up with backend %s (own progress thread: %s)",
            self._name,
            self._nixl_backend,
            opts.progress_thread,
        )

    # -- registration and endpoints --------------------------------------------------------

    def _descs(self, regions: Sequence[MemoryRegion]) -> tuple[np.ndarray, str]:
        kinds = {r.kind for r in regions}
        if len(kinds) != 1:
            raise ConfigError("nixl: register host and device memory in separate calls")
        rows = np.array([(r.addr, r.length, max(r.device_id, 0)) for r in regions], dtype=np.uint64)
        return rows, _MEM_TYPES[kinds.pop()]

    def _register(self, regions: Sequence[MemoryRegion]) -> None:
        with self._agent_lock:
            for r in regions:
                rows, mem = self._descs([r])
                try:
                    self._reg[r.addr] = self._agent.register_memory(rows, mem, backends=[self._nixl_backend])
                except Exception as exc:
                    raise ConfigError(
                        f"NIXL could not register {r.length} bytes of {mem} at {r.addr:#x}: {exc}"
                    ) from exc

    def _unregister(self, regions: Sequence[MemoryRegion]) -> None:
        with self._agent_lock:
            for r in regions:
                reg = self._reg.pop(r.addr, None)
                if reg is None:
                    continue
                try:
                    self._agent.deregister_memory(reg, backends=[self._nixl_backend])
                except Exception as exc:  # nothing to do but say so; the memory stays pinned until exit
                    log.warning("nixl: deregistering %d bytes at %#x failed: %s", r.length, r.addr, exc)

    def _address(self) -> str:
        return self._name

    def endpoint(self) -> EndpointInfo:
        base = super().endpoint()
        with self._agent_lock:
            meta = self._agent.get_agent_metadata()
        return attrs.evolve(base, extra={_METADATA_KEY: base64.b64encode(meta).decode("ascii")})

    def _connect(self, endpoint: EndpointInfo) -> Any:
        meta = endpoint.extra.get(_METADATA_KEY)
        if not meta:
            raise ConfigError(
                f"nixl endpoint {endpoint.address!r} carries no agent metadata; "
                "it was not produced by this plugin's endpoint_info()"
            )
        with self._agent_lock:
            # Metadata is taken fresh on every connect: it carries the regions registered since the last one.
            try:
                name = self._agent.add_remote_agent(base64.b64decode(meta))
                name = name.decode() if isinstance(name, bytes) else name
            except Exception as exc:
                raise ConfigError(f"NIXL refused the metadata of agent {endpoint.address!r}: {exc}") from exc
            self._remote[name] = self._remote.get(name, 0) + 1
        return name

    def _disconnect(self, peer: Peer) -> None:
        with self._agent_lock:
            left = self._remote.get(peer.handle, 0) - 1
            if left > 0:
                self._remote[peer.handle] = left
                return
            self._remote.pop(peer.handle, None)
            try:
                self._agent.remove_remote_agent(peer.handle)
            except Exception as exc:
                log.debug("nixl: removing agent %s: %s", peer.handle, exc)

    # -- transfers ---------------------------------------------------------------------------

    def _submit(self, peer: Peer, desc: Descriptors, op: Op) -> Future:
        future: Future = Future()
        # A KV cache lives on one device per side, so the first descriptor's region names memory type and device.
        mine = _region_at(self._local.regions, int(desc[0, 0]))
        theirs = _region_at(peer.regions.regions, int(desc[0, 1]))
        n = len(desc)
        local = np.empty((n, 3), dtype=np.uint64)
        remote = np.empty((n, 3), dtype=np.uint64)
        local[:, 0], local[:, 1], local[:, 2] = desc[:, 0], desc[:, 2], max(mine.device_id, 0)
        remote[:, 0], remote[:, 1], remote[:, 2] = desc[:, 1], desc[:, 2], max(theirs.device_id, 0)
        mem, remote_mem = _MEM_TYPES[mine.kind], _MEM_TYPES[theirs.kind]
        what = f"NIXL {op} of {n} descriptors ({int(desc[:, 2].sum())} bytes) with agent {peer.handle}"
        with self._agent_lock:
            if self._closed:
                future.set_exception(
                    TransferFailed(f"{what} aborted: the backend is closed", peer=peer.handle, cause="closed")
                )
                return future
            handle = None
            try:
                # Let NIXL take in what peers sent (a departed agent's disconnect above all) before posting.
                self._agent.get_new_notifs()
                ldesc = self._agent.get_xfer_descs(local, mem)
                rdesc = self._agent.get_xfer_descs(remote, remote_mem)
                handle = self._agent.initialize_xfer(
                    "READ" if op == "read" else "WRITE", ldesc, rdesc, peer.handle, backends=[self._nixl_backend]
                )
                state = self._agent.transfer(handle)
            except Exception as exc:  # e.g. the peer's agent is gone or its memory was deregistered
                if handle is not None:
                    self._release(handle, what)
                future.set_exception(self._failed(what, peer.handle, described(exc)))
                return future
            if state == "PROC":
                self._inflight.append(_InFlight(handle, future, peer.handle, what, time.monotonic() + self._timeout))
                self._wake.set()
                return future
            self._release(handle, what)
        if state == "DONE":
            future.set_result(None)
        else:
            future.set_exception(self._failed(what, peer.handle, "NIXL reported ERR on post"))
        return future

    @staticmethod
    def _failed(what: str, peer: str, cause: str) -> TransferFailed:
        return TransferFailed(
            f"{what} failed: {cause}. Check that the peer is alive and its memory registered", peer=peer, cause=cause
        )

    def _release(self, handle: Any, what: str) -> None:
        """Release a request handle (NIXL cancels it if still running); called with the agent lock held."""
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:  # NIXL could not cancel it: it keeps the handle and frees it with the agent
            log.warning("nixl: releasing the request of %s failed: %s", what, exc)

    def expect_reads(self, leases: int) -> None:
        """Serve peers' reads promptly while `leases` > 0; the first call says every read will be announced.

        Over UCX TCP a read advances only as the passive side progresses: a 2 MiB read in 64 pieces took 6.7 ms at the
        5 ms idle interval and 2.9 ms served. Once reads are announced, idle progress runs every ANNOUNCED_IDLE_S."""
        self._reading, self._announced = leases, True
        if leases:
            self._wake.set()

    def _progress_loop(self) -> None:
        delay, busy_since = 0.0, 0.0
        while not self._stop.is_set():
            self._wake.clear()  # before polling: whatever is submitted after this poll sets it again
            finished: list[tuple[_InFlight, BaseException | None]] = []
            with self._agent_lock:
                busy = bool(self._inflight)
                serving = self._own_progress and self._reading > 0
                if busy:
                    finished = self._poll()
                elif self._own_progress:
                    try:
                        self._agent.get_new_notifs()  # progresses NIXL's workers for peers reading from us
                    except Exception as exc:
                        log.debug("nixl: idle progress: %s", exc)
            for item, error in finished:
                if error is None:
                    item.future.set_result(None)
                else:
                    item.future.set_exception(error)
            if not busy and not serving:
                delay, busy_since = 0.0, 0.0
                self._wake.wait(self._idle_interval() if self._own_progress else None)
                continue
            now = time.monotonic()
            busy_since = busy_since or now
            if self._poll_interval:
                self._wake.wait(self._poll_interval)
            elif now - busy_since < POLL_SPIN_S:
                os.sched_yield()
            elif self._wake.wait(delay):  # a new request: poll it promptly, backing off again from there
                delay, busy_since = 0.0, 0.0
            else:
                delay = min(max(delay * 2, POLL_FIRST_S), POLL_CAP_S)

    def _idle_interval(self) -> float:
        return max(self._progress_interval, ANNOUNCED_IDLE_S) if self._announced else self._progress_interval

    def _poll(self) -> list[tuple[_InFlight, BaseException | None]]:
        """Check every in-flight request once; release and return the finished ones (agent lock held)."""
        now = time.monotonic()
        finished: list[tuple[_InFlight, BaseException | None]] = []
        keep = []
        for item in self._inflight:
            try:
                state = self._agent.check_xfer_state(item.handle)
            except Exception as exc:
                state, cause = "ERR", described(exc)
            else:
                cause = "NIXL reported ERR"
            if state == "DONE":
                finished.append((item, None))
            elif state == "ERR":
                finished.append((item, self._failed(item.what, item.peer, cause)))
            elif now > item.deadline:
                finished.append(
                    (
                        item,
                        TransferTimeout(
                            f"{item.what} did not finish within {self._timeout}s and was aborted; "
                            "check that the peer is alive and reachable",
                            peer=item.peer,
                            cause="timeout",
                        ),
                    )
                )
            else:
                keep.append(item)
                continue
            self._release(item.handle, item.what)
        self._inflight = keep
        return finished

    def close(self) -> None:
        """Abort what is in flight, then unregister and drop the agent."""
        with self._lock:
            closing = not self._closed
        if closing:
            self._stop.set()
            self._wake.set()
            self._progress.join(timeout=10)
            with self._agent_lock:
                aborted, self._inflight = self._inflight, []
                for item in aborted:
                    self._release(item.handle, item.what)
            for item in aborted:
                item.future.set_exception(
                    TransferFailed(f"{item.what} aborted: the backend was closed", peer=item.peer, cause="closed")
                )
        super().close()

    def _shutdown(self) -> None:
        with self._agent_lock:
            for name in list(self._remote):
                try:
                    self._agent.remove_remote_agent(name)
                except Exception as exc:
                    log.debug("nixl: removing agent %s: %s", name, exc)
            self._remote.clear()
            self._agent = None
        self.guard.close()


def _region_at(regions: Sequence[MemoryRegion], addr: int) -> MemoryRegion:
    """The region holding `addr` (bounds were checked before submission, so there is one)."""
    return next(r for r in regions if r.addr <= addr < r.end)
