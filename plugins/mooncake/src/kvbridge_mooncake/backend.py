"""`MigrationBackend` on `mooncake.engine.TransferEngine`.

Mooncake's TCP transport admits about 2048 descriptors per peer at a time (1024 queued +
1024 pending); a larger batch is partly rejected ("TCP lane queue-full") and the call right
after it fails while the accepted part drains. So submissions are cut to `max_batch`
(default 1024), serialized per peer, and a failed part is retried a bounded number of times
after a short backoff, which keeps the engine usable after any failure.

A stuck transfer is bounded by `transfer_deadline` (seconds without progress, default 2), on two
levels. Mooncake TCP's own watchdog drops a session only after 30 s without progress ("ClientSession:
no transfer progress within 30s", and on the serving side "ServerSession::writeBody failed: Broken
pipe"); it reads its period from the environment on every transfer, so the plugin sets it to the
deadline. And kvbridge's base class resubmits a part that has not finished within the deadline once,
at once, on a fresh lane (it does not wait behind the stuck call: see `_Gate`), then fails it. The stuck
call itself cannot be stopped and may still write into the destination until it returns, which it
does only after `MC_TRANSFER_TIMEOUT` (at least 5 s, the floor hard-coded in the binding; the plugin's
polling wait below keeps the binding's bound); the transfer completes only then, so the engine never
reuses memory a late write could land in. A failed pull then
takes at most about deadline + 5 s + 1 s per GiB; a stale lane that rejects the batch fast is retried
here after a short backoff (`retries`), unless the peer's handshake port refuses a connection: its engine is gone,
and the part fails at once with `PeerGone`, which the base class does not resubmit either.

Completion is polled, not spun on. The binding's sync calls (and `get_batch_transfer_status`) wait in
a loop without a pause, so a thread waiting for a transfer takes a whole core for as long as the
transfer runs, and a stalled peer keeps it spinning until the watchdog fires (measured: 7.0 s of CPU in
a 7.0 s stalled pull). On a host whose cores are shared with the engines, that core is taken from the
peer's own transport thread and from the compute it serves: on a 2-vCPU box, decode's spinning wait
starved the prefill's Mooncake thread until the read timed out. So each descriptor is submitted as
a batch of its own (`batch_transfer_async_*`) and its status checked (`transfer_check_status`,
which is exact for a batch of one): yielding between checks for the first 200 µs, then with
sleeps that grow from 20 µs to 500 µs.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import socket
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from kvbridge.base.errors import ConfigError, PeerGone, PluginUnavailable, TransferFailed
from kvbridge.base.memory import Descriptors
from kvbridge.base.options import as_dict
from kvbridge.base.threadname import os_thread_name
from kvbridge.base.types import BackendConfig, EndpointInfo, MemoryKind, MemoryRegion
from kvbridge.control.discovery import redacted
from kvbridge.plugin.registry import device_for_memory
from kvbridge.transport.contract import MigrationBackend, Op, Peer
from kvbridge.transport.netguard import Guard
from kvbridge_mooncake import spec

log = logging.getLogger(__name__)

P2P = "P2PHANDSHAKE"
DEFAULT_DEADLINE_S = 2.0
# Mooncake TCP (0.3.13) reads these per transfer: seconds without progress before it drops a session,
# and seconds it waits for a READ's status frame. Both default to 30 s.
_WATCHDOG_ENV = ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC")
# The Python binding's sync call gives up after MC_TRANSFER_TIMEOUT seconds plus one second per GiB
# (read once per engine, at least 5, default 30); the plugin's polling wait (`_transfer`) keeps that
# bound. It is needed too: slices still queued behind lanes
# the watchdog dropped are not failed by it, and the call would wait the full 30 s (measured).
_CALL_TIMEOUT_ENV = "MC_TRANSFER_TIMEOUT"
CALL_TIMEOUT_FLOOR_S = 5
# Polling a transfer's status: for the first POLL_SPIN_S only yielding between checks (a small transfer
# ends within it: 256 KiB took 0.15 ms polled this way, 0.12 ms with the spinning call, 0.21 ms with
# sleeps from the start), then sleeps growing to the cap (the cap bounds how late a finished transfer
# is seen; the sleeps keep the waiting thread off the cores).
POLL_SPIN_S, POLL_FIRST_S, POLL_CAP_S = 200e-6, 20e-6, 500e-6
# Descriptors run roughly in the order submitted (over a few lanes per peer): a status round stops at
# this many still running, so a round over a long batch costs a few checks, not one per descriptor.
POLL_WINDOW = 8
START_TRIES = 3  # engine starts that lost a port Mooncake picked to another process (`_initialize`)
# After a failed transfer, a connect to the peer's handshake port: refused at once where its engine is gone. A
# retry towards a killed peer spent Mooncake's 1 s lane reconnects, twice over (2.1 s measured), to fail anyway.
GONE_PROBE_S = 0.2
# Mooncake's handshake listener (0.3.13) blocks in accept() under a 1 s SO_RCVTIMEO between checks of its stop
# flag, and the engine's destructor joins it holding the GIL: every close stalled the whole process for up to
# 1 s (1.0 s in 89 of 117 closes in kvbridge's unit and integration tests). `_stop_listener` first shortens
# that wait to this (the kernel rounds it up to a clock tick), then wakes the accept under way with a handshake
# probe to the engine itself.
LISTENER_STOP_WAIT_S = 0.001
# Class names only a wheel built with that transport carries. A wheel without it silently serves an
# unknown protocol with TCP, so the plugin checks first.
ASCEND_TRANSPORTS = (b"HcclTransport", b"AscendDirectTransport", b"HeterogeneousRdmaTransport")

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
def _binaries_mention(*words: bytes) -> bool:
    """Whether the installed Mooncake binaries carry any of these symbols."""
    import mooncake

    root = Path(mooncake.__file__).parent
    libs = [*root.glob("*.so*"), *root.parent.glob("mooncake*.libs/*.so*")]
    return any(w in data for data in (lib.read_bytes() for lib in libs) for w in words)


def _supports_redis_metadata() -> bool:
    """Whether the installed Mooncake binaries carry a redis client (its redis metadata plugin)."""
    return _binaries_mention(b"redisConnect")


def built_with() -> frozenset[str]:
    """What the installed wheel was built with: its `SUPPORT_*` flags, plus `ascend` found in its binaries."""
    import mooncake.engine

    extra = {"ascend"} if _binaries_mention(*ASCEND_TRANSPORTS) else set()
    return spec.wheel_supports(mooncake.engine) | extra


def ascend_identity(ip: str, opts: Mapping[str, object]) -> str:
    """Make the NPU current and name the engine after it: ``ip:port:npu_<physical NPU id>``.

    Mooncake's ascend transport binds to the NPU in `initialize`. Options `npu` (default: the current NPU) and
    `ascend_port` (default 0: the transport picks one)."""
    if ":" in ip:
        raise ConfigError(
            f"the ascend protocol needs a bare IP as hostname, got {ip!r} (the port goes in option ascend_port)"
        )
    npu = device_for_memory(MemoryKind.NPU)
    device_id = int(opts.get("npu", npu.current_id()))  # type: ignore[call-overload]
    physical = npu.physical_id(device_id)
    npu.set_current(device_id)
    return f"{ip}:{int(opts.get('ascend_port', 0))}:npu_{physical}"  # type: ignore[call-overload]


def registrations(regions: Sequence[MemoryRegion], protocol: str) -> list[tuple[str, list[int], list[int]]]:
    """Regions grouped by the location their device plugin names, one `batch_register_memory` call each.

    Locations: ``cuda:0``, ``npu:3``, ``*`` for host memory. Ascend registrations must start on 2 MiB."""
    groups: dict[str, tuple[list[int], list[int]]] = {}
    for r in regions:
        location = "*" if r.kind == MemoryKind.DRAM else device_for_memory(r.kind).location(r.device_id)
        if protocol == "ascend" and r.addr % spec.ASCEND_ALIGNMENT:
            raise ConfigError(
                f"the ascend protocol registers memory on 2 MiB boundaries; the region at {r.addr:#x} starts "
                f"{r.addr % spec.ASCEND_ALIGNMENT} bytes past one. Allocate the KV cache 2 MiB-aligned "
                "(the npu device plugin's allocate does; vllm-ascend aligns its caches the same way)"
            )
        addrs, lengths = groups.setdefault(location, ([], []))
        addrs.append(r.addr)
        lengths.append(r.length)
    return [(loc, addrs, lengths) for loc, (addrs, lengths) in groups.items()]


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


def _env_seconds(var: str, default: float) -> float:
    try:
        return float(os.environ.get(var, default))
    except ValueError:
        log.warning("mooncake: %s=%r is not a number of seconds; using %s", var, os.environ[var], default)
        return default


def _gone(address: str) -> bool:
    """Whether nothing listens at a peer's handshake `address` ("host:port") now: its transfer engine is gone.

    Only a refusal says so; a timeout (a partition, a guard that drops the connection) or another error does not."""
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return False
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=GONE_PROBE_S).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


def explain(rc: int) -> str:
    return f"return code {rc}: {_ERRORS.get(rc, 'unknown error')}"


class _Gate:
    """One batch in flight per peer, except behind a batch that has been running longer than the deadline.

    That one is stuck (its resubmission must not wait for it) and no longer uses the admission budget."""

    def __init__(self, deadline_s: float) -> None:
        self._lock = threading.Lock()
        self._deadline = deadline_s
        self._since = 0.0
        self._held = threading.local()

    def __enter__(self) -> None:
        wait = max(0.0, self._since + self._deadline - time.monotonic())
        self._held.value = self._lock.acquire(timeout=wait) if wait > 0 else self._lock.acquire(blocking=False)
        if self._held.value:
            self._since = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        if self._held.value:
            self._lock.release()


class MooncakeBackend(MigrationBackend):
    """Mooncake Transfer Engine.

    Options (`spec.MooncakeOptions`) and what each protocol reaches are declared in `kvbridge_mooncake.spec`."""

    name = "mooncake"
    capabilities = spec.CAPABILITIES
    options_class = spec.MooncakeOptions

    def __init__(self, config: BackendConfig, options: spec.MooncakeOptions | None = None) -> None:
        super().__init__(config, options)
        # Mooncake's threads start in what follows (its modules' import, the engine) and keep this thread's OS name
        with os_thread_name(spec.NATIVE_THREAD_NAME):
            self._start(config)

    def _start(self, config: BackendConfig) -> None:
        reason = spec.probe()
        if reason:
            raise PluginUnavailable("backend", "mooncake", reason, spec.INSTALL_HINT)
        from mooncake.engine import TransferEngine

        parsed: spec.MooncakeOptions = self.options  # type: ignore[assignment]
        opts = {k: v for k, v in as_dict(parsed).items() if v is not None}  # None: spec's default applies
        # Mooncake authenticates no peer and listens on every interface: refuse or guard before it starts
        self.guard = Guard(f"mooncake {self.protocol} transport", config.hostname, parsed)
        wheel = built_with()
        self.capabilities = spec.capabilities(self.protocol, opts, wheel)  # type: ignore[misc]
        needs = {"nvlink": "intra_nvlink", "ascend": "ascend"}.get(self.protocol)
        if needs and needs not in wheel:
            raise ConfigError(
                f"this Mooncake wheel was built without its {spec.MOONCAKE_PROTOCOL[self.protocol]!r} transport "
                f"(it has: {sorted(wheel) or 'none of the optional ones'}), and would silently fall back to TCP; "
                f"install a Mooncake built for {self.protocol} (USE_INTRA_NVLINK for nvlink, USE_ASCEND for ascend)"
            )
        self._retries = parsed.retries
        self._backoff = parsed.retry_backoff
        self._deadline = float(parsed.transfer_deadline)
        if self._deadline <= 0:
            raise ConfigError(f"mooncake transfer_deadline must be positive seconds, got {self._deadline}")
        if self.protocol == "tcp":
            _arm_watchdog(self._deadline)
        self._call_timeout_s = max(CALL_TIMEOUT_FLOOR_S, _env_seconds(_CALL_TIMEOUT_ENV, 30.0))
        self._metadata = config.metadata_server or P2P
        if self._metadata.startswith("redis://") and not _supports_redis_metadata():
            # Mooncake aborts the whole process when asked for a metadata plugin it was built without.
            raise ConfigError(
                "this Mooncake wheel was built without redis metadata support (no hiredis in it); use "
                "etcd://HOST:PORT, an http:// metadata server, or P2PHANDSHAKE, or install a Mooncake built "
                "with USE_REDIS"
            )
        local = config.hostname
        if self.protocol == "ascend":
            local = ascend_identity(config.hostname, opts)
        protocol = spec.MOONCAKE_PROTOCOL[self.protocol]
        rc = self._initialize(TransferEngine, local, protocol)
        if rc != 0:
            self.guard.close()
            raise ConfigError(
                f"Mooncake TransferEngine.initialize({local!r}, {redacted(self._metadata)!r}, {protocol!r}, "
                f"{config.device_name!r}) failed with {explain(rc)}. Check that the protocol is built into the "
                "installed wheel, the NIC names exist (`kvbridge doctor`), and the metadata server is reachable"
            )
        if self._metadata == P2P:
            self._session = f"{config.hostname}:{self._engine.get_rpc_port()}"
        else:
            self._session = config.hostname
        self._gates: dict[str, _Gate] = {}
        self.transfer_deadline_s = self._deadline
        log.info("mooncake %s engine up as %s (metadata %s)", self.protocol, self._session, redacted(self._metadata))

    def _initialize(self, engine_class: Any, local: str, protocol: str) -> int:
        """Start a TransferEngine (`self._engine`); its return code.

        Mooncake picks its ports at random in 15000-17000, probing each with a bind it then closes: ranks that start
        together on one host (a node's TP workers) can pick the same one, and the later bind raises "Address already
        in use" (seen in CI with the connector bench's ranks). That engine is dropped and a fresh one tries again."""
        attempt = 1
        while True:
            self._engine = engine_class()
            try:
                with self.guard.capture():
                    return int(self._engine.initialize(local, self._metadata, protocol, self.config.device_name))
            except RuntimeError as exc:
                if "Address already in use" not in str(exc) or attempt == START_TRIES:
                    self._engine = None
                    self.guard.close()
                    raise ConfigError(
                        f"Mooncake TransferEngine.initialize({local!r}, ...) failed {attempt} times: {exc}. Mooncake "
                        "binds ports in 15000-17000 on this host: free some there, or start fewer engines at once"
                    ) from exc
                log.warning("mooncake: a port it picked was taken before it bound it (%s): starting again", exc)
                attempt += 1

    def _register(self, regions: Sequence[MemoryRegion]) -> None:
        done: list[int] = []
        for location, addrs, lengths in registrations(regions, self.protocol):
            rc = self._engine.batch_register_memory(addrs, lengths, location)
            if rc != 0:
                if done:
                    self._engine.batch_unregister_memory(done)
                raise ConfigError(
                    f"Mooncake could not register {len(addrs)} regions at location {location!r}: {explain(rc)}"
                )
            done.extend(addrs)

    def _unregister(self, regions: Sequence[MemoryRegion]) -> None:
        rc = self._engine.batch_unregister_memory([r.addr for r in regions])
        if rc != 0:
            log.warning("mooncake: unregistering %d regions failed: %s", len(regions), explain(rc))

    def _address(self) -> str:
        return self._session

    def _connect(self, endpoint: EndpointInfo) -> Any:
        if self.protocol == "nvlink" and self._metadata == P2P:
            host = endpoint.address.rsplit(":", 1)[0]
            if host != self.config.hostname:
                raise ConfigError(
                    f"nvlink reaches GPUs of this host only ({self.config.hostname}); peer "
                    f"{endpoint.address} is on another: use rdma between hosts"
                )
        with self._lock:
            self._gates.setdefault(endpoint.address, _Gate(self._deadline))
        return endpoint.address

    def _submit(self, peer: Peer, desc: Descriptors, op: Op) -> Future:
        local, remote, length = desc[:, 0].tolist(), desc[:, 1].tolist(), desc[:, 2].tolist()
        gate = self._gates[peer.handle]

        def run() -> int:
            begun = time.monotonic()
            with gate:  # one batch in flight per peer stays inside the transport's admission limit
                for attempt in range(self._retries + 1):
                    t0 = time.monotonic()
                    rc = self._transfer(peer.handle, local, remote, length, op)
                    if rc == 0:
                        return attempt
                    took = time.monotonic() - t0
                    if took >= self._deadline:
                        break  # stuck, not rejected: the base class has resubmitted it already
                    if _gone(peer.handle):  # no retry can succeed, here or in the base class
                        raise PeerGone(
                            f"Mooncake {op} of {len(local)} descriptors with peer {peer.handle} failed ({explain(rc)}) "
                            "and its handshake port refused a connection: its transfer engine is gone (the process "
                            "ended or restarted)",
                            peer=peer.handle,
                            cause="peer gone",
                            retries=attempt,
                        )
                    if attempt < self._retries:
                        log.warning(
                            "mooncake %s of %d descriptors with %s failed after %.1fs (%s), retrying on a fresh lane",
                            op,
                            len(local),
                            peer.handle,
                            took,
                            explain(rc),
                        )
                        time.sleep(self._backoff * (2**attempt))
            stuck = " (no progress within the transfer deadline)" if took >= self._deadline else ""
            raise TransferFailed(
                f"Mooncake {op} of {len(local)} descriptors ({sum(length)} bytes) with peer {peer.handle} "
                f"failed after {attempt + 1} attempts in {time.monotonic() - begun:.1f}s{stuck}: "
                f"{explain(rc)}. Check the peer is alive, not stalled, and its memory is registered",
                peer=peer.handle,
                cause=explain(rc),
                retries=attempt,
            )

        return self._spawn(peer, run)

    def _transfer(self, target: str, local: list[int], remote: list[int], length: list[int], op: Op) -> int:
        """Move the descriptors; 0 or Mooncake's error code.

        Returns once every submitted descriptor ended, or after the binding's own call timeout (`MC_TRANSFER_TIMEOUT`
        plus 1 s per GiB), as its sync call does."""
        submit = self._engine.batch_transfer_async_read if op == "read" else self._engine.batch_transfer_async_write
        pending, rc = [], 0
        # One batch per descriptor: `transfer_check_status` reads a batch's first task only, and the only
        # whole-batch status call (`get_batch_transfer_status`) spins like the sync calls.
        for a, b, n in zip(local, remote, length, strict=True):
            batch = submit(target, [a], [b], [n])
            if not batch:  # 0: the segment could not be opened or the submission was refused
                rc = -1
                break
            pending.append(batch)
        submitted = time.monotonic()
        give_up = submitted + self._call_timeout_s + sum(length) / 2**30
        delay = 0.0
        while pending:
            left: list[int] = []
            for i, batch in enumerate(pending):
                if len(left) == POLL_WINDOW:  # the rest were submitted later: checked once these ended
                    left.extend(pending[i:])
                    break
                status = self._engine.transfer_check_status(batch)  # frees the batch once it ended
                if status == 0:
                    left.append(batch)
                elif status < 0:  # -1 failed, -2 timed out
                    rc = rc or -1
            pending = left
            if not pending:
                break
            if time.monotonic() > give_up:
                log.warning(
                    "mooncake: %d descriptors with %s still running after %.0fs",
                    len(pending),
                    target,
                    self._call_timeout_s,
                )
                return rc or -1
            if time.monotonic() - submitted < POLL_SPIN_S:
                time.sleep(0)  # releases the GIL and yields the core
                continue
            time.sleep(delay)
            delay = min(max(delay * 2, POLL_FIRST_S), POLL_CAP_S)
        return rc

    def _shutdown(self) -> None:
        # TransferEngine has no explicit shutdown; dropping the last reference stops it.
        self._stop_listener()
        self._engine = None
        self.guard.close()

    def _stop_listener(self) -> bool:
        """Make the destructor's join of the handshake listener take milliseconds; whether it did.

        Best effort: where the listener is not found or the probe fails, the close takes up to 1 s, as before."""
        if self._engine is None:
            return False
        listener = self.guard.listener(self._engine.get_rpc_port())
        if listener is None:
            log.debug("mooncake: no handshake listener of %s found; its close may take up to 1 s", self._session)
            return False
        with listener:
            seconds, micros = divmod(round(LISTENER_STOP_WAIT_S * 1e6), 1_000_000)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", seconds, micros))
        rc = self._engine.send_probe(self._session)  # the accept under way returns; the next waits the short time
        if rc != 0:
            log.debug("mooncake: probing its own listener %s failed (%s)", self._session, explain(rc))
        return rc == 0
