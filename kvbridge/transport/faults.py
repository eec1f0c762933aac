"""Transport fault injection: a wrapping transport that fails, delays or holds transfers. See docs/internals.md."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import attrs

from kvbridge.base.errors import ConfigError, TransferFailed
from kvbridge.base.memory import Descriptors
from kvbridge.transport.contract import MigrationBackend, Op, Peer, WrappingBackend

log = logging.getLogger(__name__)


@attrs.frozen
class FaultRates:
    """Fractions of submissions that fail (`transfer_error`) or are held `slow_s` seconds (`slow_peer`)."""

    transfer_error: float = 0.0
    slow_peer: float = 0.0
    slow_s: float = 3.0
    seed: int | None = None

    @classmethod
    def parse(cls, config: Mapping[str, Any]) -> FaultRates:
        """The connector's `fault_injection` mapping, checked: unknown keys and rates outside [0, 1] are refused."""
        known = {a.name for a in attrs.fields(cls)}
        unknown = set(config) - known
        if unknown:
            raise ConfigError(f"unknown fault_injection keys {sorted(unknown)}; known: {sorted(known)}")
        try:
            seed = config.get("seed")
            rates = cls(
                float(config.get("transfer_error", 0.0)),
                float(config.get("slow_peer", 0.0)),
                float(config.get("slow_s", 3.0)),
                None if seed is None else int(seed),
            )
        except (TypeError, ValueError):
            raise ConfigError(f"fault_injection takes numbers, got {dict(config)}") from None
        error, slow = rates.transfer_error, rates.slow_peer
        if not (0 <= error <= 1 and 0 <= slow <= 1 and error + slow <= 1 and rates.slow_s >= 0):
            raise ConfigError(
                f"fault_injection rates must be in [0, 1] and sum to at most 1, slow_s at least 0; got {dict(config)}"
            )
        return rates


@attrs.define
class _Counted:
    """Faults a test armed: counts are consumed one per submission."""

    fail_submit: int = 0
    fail_completion: int = 0
    delay: float = 0.0


class FaultyBackend(WrappingBackend):
    """A transport with faults injected into its submissions (see the module doc)."""

    def __init__(self, backend: MigrationBackend, rates: FaultRates | None = None) -> None:
        # The wrapper merges, cuts and batches as the transport asks, then submits each batch to it as is.
        super().__init__(backend, backend.capabilities)
        self.transfer_deadline_s = backend.transfer_deadline_s
        self.rates = rates or FaultRates()
        self.submissions = 0
        self._counted = _Counted()
        self._rng = random.Random(self.rates.seed)
        self._faults_lock = threading.Lock()
        if self.rates.transfer_error or self.rates.slow_peer:
            log.warning(
                "FAULT INJECTION on %s: %.0f%% of transfers fail, %.0f%% are held %.1fs (testing only)",
                self.name,
                self.rates.transfer_error * 100,
                self.rates.slow_peer * 100,
                self.rates.slow_s,
            )

    def inject(
        self, *, fail_submit: int = 0, fail_completion: int = 0, delay: float = 0.0, rates: FaultRates | None = None
    ) -> None:
        """Arm counted faults (replacing what was armed before) and, where given, new `rates`. See docs/internals.md."""
        with self._faults_lock:
            self._counted = _Counted(fail_submit, fail_completion, delay)
            if rates is not None:
                self.rates, self._rng = rates, random.Random(rates.seed)

    # -- the faults, before the wrapped transport's submission ----------------------------------

    def _submit(self, peer: Peer, desc: Descriptors, op: Op) -> Future:
        with self._faults_lock:
            self.submissions += 1
            c = self._counted
            fail_submit = c.fail_submit > 0
            fail_completion = not fail_submit and c.fail_completion > 0
            c.fail_submit -= fail_submit
            c.fail_completion -= fail_completion
            delay = c.delay
            rates = self.rates
            roll = self._rng.random()
        if fail_submit:
            raise TransferFailed(f"injected submit failure towards {peer.name}", peer=peer.name, cause="injected")
        if fail_completion or delay:
            return self._spawn(peer, lambda: self._delayed(peer, desc, op, delay, fail_completion))
        if roll < rates.transfer_error:
            log.warning("fault injection: failing a %s of %d descriptors with %s", op, len(desc), peer.name)
            failed: Future = Future()
            failed.set_exception(
                TransferFailed(f"injected transfer error ({op} with {peer.name})", peer=peer.name, cause="injected")
            )
            return failed
        if roll < rates.transfer_error + rates.slow_peer:
            return self._held(peer, desc, op, rates.slow_s)
        return self.backend._submit(peer.handle, desc, op)

    def _delayed(self, peer: Peer, desc: Descriptors, op: Op, delay: float, fail: bool) -> Any:
        """On a worker thread, as a slow transport call runs: the deadline cannot cancel it once started."""
        if delay:
            time.sleep(delay)
        if fail:
            raise TransferFailed(f"injected completion failure towards {peer.name}", peer=peer.name, cause="injected")
        return self.backend._submit(peer.handle, desc, op).result()

    def _held(self, peer: Peer, desc: Descriptors, op: Op, slow_s: float) -> Future:
        """Submitted after `slow_s` on a timer thread, so a held submission occupies no transport worker."""
        log.warning("fault injection: holding a %s with %s for %.1fs", op, peer.name, slow_s)
        out: Future = Future()

        def release() -> None:
            if not out.set_running_or_notify_cancel():
                return  # cancelled by the transfer deadline while held: it never writes
            try:
                inner = self.backend._submit(peer.handle, desc, op)
            except Exception as exc:  # noqa: BLE001 - handed to the waiting transfer, which reports it
                out.set_exception(exc)
                return
            inner.add_done_callback(
                lambda f: out.set_exception(f.exception()) if f.exception() else out.set_result(f.result())
            )

        timer = threading.Timer(slow_s, release)
        timer.daemon = True
        timer.start()
        return out
