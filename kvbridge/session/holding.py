"""Finished requests whose blocks an engine still holds for a reader, and what a drain waits for among them."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger(__name__)

Params = dict[str, Any] | None  # the kv_transfer_params an engine answers a finished request with

# A draining engine says what it still waits for at most this often (vLLM steps it many times a second meanwhile).
DRAIN_REPORT_S = 5.0


class Holding:
    """The finished requests an engine holds blocks for (a decode's read, a move), by the engine's request id.

    While `draining` is set, `report` logs which hold the drain up, every `DRAIN_REPORT_S`: each second a drain waits
    is then accounted for by a lease id that the readers' logs and the prefill's ledger name too."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._held: dict[str, tuple[str, float]] = {}  # engine request id -> lease id, since
        self._reported = -DRAIN_REPORT_S
        self.draining: threading.Event | None = None  # the engine's drain, where it is in a registry

    def finished(self, request_id: str, held: bool, params: Params) -> tuple[bool, Params]:
        """An engine's answer to a finished request (blocks held, params), noted and passed on unchanged."""
        if held:  # the lease's id where the params name it (a move's lease is named by the move)
            self._held[request_id] = ((params or {}).get("remote_request_id", ""), self._clock())
        return held, params

    def drains(self) -> bool:
        """Whether the engine drains (SIGTERM or a drain order, where it is in a registry)."""
        return self.draining is not None and self.draining.is_set()

    def keeps_refused(self, request_id: str, refused: bool) -> bool:
        """Whether a request the engine's server refused keeps its prefill lease: only while the engine drains.

        vLLM's API server refuses every request once it shuts down (a 500) and has the connector free the prefill's
        blocks (`refused`: vLLM's `abort_immediately`). The proxy then sends the same lease to another decode, which
        would find it aborted and recompute. A lease no decode takes the proxy releases, or it ends at lease_s.
        """
        if not (refused and self.drains()):
            return False
        log.info(
            "request %s refused while this server drains: its prefill lease is kept for the decode the proxy sends it "
            "to next",
            request_id,
        )
        return True

    def __len__(self) -> int:
        return len(self._held)

    def freed(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._held.pop(rid, None)

    def report(self) -> None:
        """While draining: one line naming the oldest hold and how many there are, every `DRAIN_REPORT_S`."""
        if not self.drains() or not self._held:
            return
        now = self._clock()
        if now - self._reported < DRAIN_REPORT_S:
            return
        self._reported = now
        rid, (lease, since) = min(self._held.items(), key=lambda item: item[1][1])
        log.info(
            "draining: %d finished request(s) still hold blocks for a reader; the oldest, %s%s, for %.1f s",
            len(self._held),
            rid,
            f" (lease {lease})" if lease and lease != rid else "",
            now - since,
        )
