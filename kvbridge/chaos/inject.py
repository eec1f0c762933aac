"""Transport fault injection for `kvbridge chaos`: off unless a server's connector config asks for it.

`kv_connector_extra_config: {"fault_injection": {"transfer_error": 0.1, "slow_peer": 0.05,
"slow_s": 3.0, "seed": 1}}` makes that fraction of the decode's transfer submissions fail inside
the transport (a `TransferFailed` from the backend, as a broken lane gives) or be held `slow_s`
seconds before they run. Never set it in production.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

from kvbridge.backend import MigrationBackend
from kvbridge.errors import ConfigError, TransferFailed

log = logging.getLogger(__name__)
KNOWN = {"transfer_error", "slow_peer", "slow_s", "seed"}


def install(backend: MigrationBackend, config: Mapping[str, Any]) -> None:
    """Wrap `backend`'s submissions so a fraction fail or are held (see the module doc)."""
    unknown = set(config) - KNOWN
    if unknown:
        raise ConfigError(f"unknown fault_injection keys {sorted(unknown)}; known: {sorted(KNOWN)}")
    error_rate = float(config.get("transfer_error", 0.0))
    slow_rate = float(config.get("slow_peer", 0.0))
    slow_s = float(config.get("slow_s", 3.0))
    if not (0 <= error_rate <= 1 and 0 <= slow_rate <= 1 and error_rate + slow_rate <= 1):
        raise ConfigError(f"fault_injection rates must be in [0, 1] and sum to at most 1, got {dict(config)}")
    rng = random.Random(config.get("seed"))
    lock = threading.Lock()
    submit = backend._submit
    log.warning(
        "FAULT INJECTION on %s: %.0f%% of transfers fail, %.0f%% are held %.1fs (kvbridge chaos)",
        backend.name,
        error_rate * 100,
        slow_rate * 100,
        slow_s,
    )

    def chaotic(peer: Any, desc: Any, op: Any) -> Future:
        with lock:
            roll = rng.random()
        if roll < error_rate:
            log.warning("fault injection: failing a %s of %d descriptors with %s", op, len(desc), peer.name)
            failed: Future = Future()
            failed.set_exception(
                TransferFailed(
                    f"injected transfer error ({op} with {peer.name}, kvbridge chaos)", peer=peer.name, cause="injected"
                )
            )
            return failed
        if roll < error_rate + slow_rate:
            log.warning("fault injection: holding a %s with %s for %.1fs", op, peer.name, slow_s)

            out: Future = Future()

            def release() -> None:  # on a timer thread, so held submissions occupy no transport worker
                if not out.set_running_or_notify_cancel():
                    return  # cancelled by the transfer deadline while held: it never writes
                try:
                    inner = submit(peer, desc, op)
                except Exception as exc:  # noqa: BLE001 - handed to the waiting pull, which reports it
                    out.set_exception(exc)
                    return
                inner.add_done_callback(
                    lambda f: out.set_exception(f.exception()) if f.exception() else out.set_result(f.result())
                )

            timer = threading.Timer(slow_s, release)
            timer.daemon = True
            timer.start()
            return out
        return submit(peer, desc, op)

    backend._submit = chaotic  # type: ignore[method-assign]
