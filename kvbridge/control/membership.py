"""Elastic membership: a server keeps its `ServerRecord` alive in the registry; proxies read. See docs/internals.md."""

from __future__ import annotations

import atexit
import functools
import gc
import logging
import multiprocessing
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

from kvbridge.base import watchdog
from kvbridge.base.errors import ConfigError, KVBridgeError
from kvbridge.base.threadname import NamedThread
from kvbridge.control.discovery import DiscoveryRegistry, ServerRecord

log = logging.getLogger(__name__)

MIN_TTL_S = 1.0
MAX_TTL_S = 3600.0


class Announcer:
    """Keeps one server's record in `registry`, renewed every `ttl_s / 3` on a thread of its own."""

    def __init__(self, registry: DiscoveryRegistry, record: ServerRecord, *, ttl_s: float) -> None:
        if not MIN_TTL_S <= ttl_s <= MAX_TTL_S:  # NaN fails too
            raise ConfigError(f"registry_ttl_s must be {MIN_TTL_S:g} to {MAX_TTL_S:g} seconds, got {ttl_s}")
        self.registry = registry
        self.ttl_s = ttl_s
        self._record = attrs.evolve(record, incarnation=record.incarnation or secrets.token_hex(8))
        self.on_order: Callable[[], None] | None = None  # what a drain order for this server sets off
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._renew()  # a server the registry cannot hear of does not start: say so now
        self._thread = NamedThread(target=self._loop, name=f"kvbridge-announce-{record.server_id}", daemon=True)
        self._thread.start()
        log.info("announced %s server %s at %s in %s", record.role, record.server_id, record.url, registry.url)

    @property
    def record(self) -> ServerRecord:
        return self._record

    def _renew(self) -> None:
        with self._lock:
            if self._stop.is_set():
                return
            self._record = attrs.evolve(self._record, expires=time.time() + self.ttl_s)
            self.registry.announce(self._record, self.ttl_s)

    def _loop(self) -> None:
        # A renewal call that hangs gets every thread's stack dumped; one that runs late (this thread not run, the
        # host starved) is said, with how long the record had left: a record that lapses takes the server out.
        beat = watchdog.watch(f"registry announcer of {self._record.server_id}")
        beat.idle()
        every = self.ttl_s / 3
        due = time.monotonic() + every
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            late = time.monotonic() - due
            if late > every / 2:
                log.warning(
                    "server %s: its record renewed %.1f s late, %.1f s before it would have lapsed (this process "
                    "or its host was not run on time)",
                    self._record.server_id,
                    late,
                    self._record.expires - time.time(),
                )
            beat.busy()
            try:
                self._renew()
                rec = self._record
                if self.on_order is not None and self.registry.take_order(rec.server_id, rec.incarnation):
                    log.warning("server %s: ordered to drain (kvbridge drain)", rec.server_id)
                    on_order, self.on_order = self.on_order, None  # taken once: an order written back is not
                    on_order()
            except KVBridgeError as exc:  # the next round tries again; after a TTL the record is gone
                log.warning("could not renew %s in the registry: %s", self._record.server_id, exc)
            finally:
                beat.idle()
            due = time.monotonic() + every
        watchdog.WATCHDOG.forget(beat)

    def drain(self) -> None:
        """Republish the record as draining: the proxy sends this server no new request."""
        with self._lock:
            self._record = attrs.evolve(self._record, state="draining")
        self._renew()
        log.info("server %s is draining: the proxy sends it no new request", self._record.server_id)

    def close(self) -> None:
        """Stop renewing and withdraw the record (idempotent)."""
        with self._lock:
            if self._stop.is_set():
                return
            self._stop.set()
        self._thread.join(timeout=10)
        try:
            self.registry.withdraw(self._record.server_id)
        except KVBridgeError as exc:
            log.warning(
                "could not withdraw %s from the registry (it expires by itself): %s", self._record.server_id, exc
            )
        self.registry.close()


# Set once this process was told to stop (SIGTERM or a drain order, `SigtermDrain`): its engine's shutdown ends it.
_STOPPING = threading.Event()


@functools.cache  # registered once per process
def _freeze_at_exit() -> None:
    atexit.register(gc.freeze)


def freeze_heap_for_exit() -> None:
    """Freeze the heap at this process's exit, and at once if it was told to stop (an engine's shutdown calls it).

    An exiting process gains nothing from full collections over an engine's heap (torch, the model), and on a loaded
    host each takes seconds (docs/measurements/drain.md): enough for a drained vLLM worker to outlive vLLM's 5 s grace
    and its engine core the shutdown timeout. atexit runs after the engine's own shutdown, right before the
    interpreter's final collections: frozen there, they skip it. In a process told to stop (vLLM's engine core, and
    its worker with the `uni` executor), frozen at once, the heap is skipped by the collection vLLM's model runner runs
    right after the connector's shutdown too; vLLM's engine core unfreezes it before its own last collection, which
    stays. Not at once elsewhere: a process that shuts an engine down and lives on must collect what it leaves.
    """
    if _STOPPING.is_set():
        gc.freeze()
    _freeze_at_exit()


class SigtermDrain:
    """On SIGTERM or a drain order: mark draining, give proxies `grace_s`, then stop. See docs/internals.md."""

    def __init__(self, announcer: Announcer, *, grace_s: float, then: str = "the engine shuts down") -> None:
        self.announcer, self.grace_s, self.then = announcer, grace_s, then
        self.draining = threading.Event()
        self._closed, self._starting = threading.Event(), threading.RLock()  # a signal may come inside it
        if threading.current_thread() is not threading.main_thread():
            log.warning("the connector starts off the main thread: neither SIGTERM nor a drain order drains it")
            return
        previous = signal.getsignal(signal.SIGTERM)
        if not callable(previous):  # no engine handler: nothing to hand the signal to after the grace
            log.warning("SIGTERM has no handler to pass on: neither it nor a drain order drains this server")
            return

        def on_sigterm(signum: int, frame: Any) -> None:
            if self.draining.is_set():  # a second SIGTERM: no more grace
                previous(signum, frame)
                return
            self._start(lambda: previous(signum, None))  # vLLM's handler only records it and wakes its loop

        signal.signal(signal.SIGTERM, on_sigterm)
        parent = multiprocessing.parent_process()
        pid = os.getpid() if parent is None else parent.pid
        announcer.on_order = lambda: self._start(lambda: os.kill(pid, signal.SIGTERM))

    def _start(self, stop: Callable[[], Any]) -> None:
        with self._starting:  # SIGTERM (main thread) and an order (the announcer's) may come at once: one drain
            if self.draining.is_set():
                return
            self.draining.set()
            _STOPPING.set()
        NamedThread(target=self._drain, args=(stop,), name="kvbridge-drain", daemon=True).start()

    def _drain(self, stop: Callable[[], Any]) -> None:
        try:
            self.announcer.drain()
        except KVBridgeError as exc:
            log.warning("could not mark this server draining in the registry: %s", exc)
        self._closed.wait(self.grace_s)
        log.info("draining: %s once no finished request holds blocks", self.then)
        stop()

    def close(self) -> None:
        """End the grace now (the server is shutting down anyway)."""
        self._closed.set()
