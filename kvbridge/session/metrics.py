"""What a rank records of its transfers and leases, for its engine's metrics. See docs/internals.md."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvbridge.base.metric_labels import failure_reason

# pulls: [transport, peer, transfer_s, control_s, bytes, descriptors]; failures: [transport, peer, reason];
# leases: [event] (offered, released, expired, aborted); held: [lease delta, block delta];
# retries: [transport, peer, resubmissions] (of pulls that succeeded or failed);
# guard: [transport, open (1: trust option, any host admitted), hosts admitted] when it changed
# (kvbridge.transport.netguard);
# phases: [phase, transport, peer, seconds] of a handover (HANDOVER_PHASES); requests: [kind, queued_s, wait_s,
# handler_s] of a side-channel request this rank answered
KEYS = ("pulls", "failures", "leases", "held", "retries", "guard", "phases", "requests")
HANDOVER_PHASES = ("offer", "offer_wait", "contact", "begin_pull", "prepare", "read", "land", "fence", "done")
LEASE_EVENTS = ("offered", "released", "expired", "aborted")


def timed(data: dict[str, Any]) -> Iterator[tuple[str, tuple[str, ...], float]]:
    """The phase and side-channel times in `data`: (SERIES key, labels after the engine's own, seconds)."""
    for phase, transport, peer, seconds in data.get("phases", ()):
        yield "phase_s", (phase, transport, peer), seconds
    for kind, *parts in data.get("requests", ()):
        for part, seconds in zip(("queued", "wait", "handler"), parts):
            yield "request_s", (kind, part), seconds


class TransferRecord:
    """The recording half of a rank's statistics; the class that mixes it in holds `data` and `_lock`."""

    data: dict[str, Any]
    _lock: threading.Lock

    def record(
        self, transport: str, peer: str, transfer_s: float, control_s: float, nbytes: int, descriptors: int
    ) -> None:
        with self._lock:
            self.data["pulls"].append([transport, peer, transfer_s, control_s, nbytes, descriptors])

    def record_failure(self, transport: str, peer: str, error: BaseException) -> None:
        with self._lock:
            self.data["failures"].append([transport, peer, failure_reason(error)])

    def record_retries(self, transport: str, peer: str, retries: int) -> None:
        """Resubmissions a pull's transfers needed (after a failed or stuck batch); nothing when 0."""
        if retries:
            with self._lock:
                self.data["retries"].append([transport, peer, int(retries)])

    def record_lease(self, event: str, leases: int, blocks: int) -> None:
        """A lease offered (+1 lease, +blocks held) or ended (released / expired / aborted: -1, -blocks)."""
        with self._lock:
            self.data["leases"].append([event])
            self.data["held"].append([leases, blocks])

    def record_phase(self, phase: str, transport: str, peer: str, seconds: float) -> None:
        """One handover phase (one of HANDOVER_PHASES) of one request on this rank."""
        with self._lock:
            self.data["phases"].append([phase, transport, peer, seconds])

    def record_request(self, kind: str, queued_s: float, wait_s: float, handler_s: float) -> None:
        """A side-channel request this rank answered (`ControlServer`'s `timed`)."""
        with self._lock:
            self.data["requests"].append([kind, queued_s, wait_s, handler_s])

    def record_guard(self, transport: str, open_: bool, admitted: int) -> None:
        """Who a guarded transport's listeners admit now (recorded when it changes)."""
        with self._lock:
            self.data["guard"].append([transport, int(open_), int(admitted)])

    def reduce(self) -> dict[str, int | float]:
        pulls = self.data["pulls"]
        out: dict[str, int | float] = {"Num successful transfers": len(pulls)}
        if pulls:
            t = np.asarray([p[2] for p in pulls], dtype=np.float64)
            mb = np.asarray([p[4] for p in pulls], dtype=np.float64) / 2**20
            out.update(
                {
                    "Avg xfer time (ms)": round(float(t.mean()) * 1e3, 3),
                    "P90 xfer time (ms)": round(float(np.percentile(t, 90)) * 1e3, 3),
                    "Avg control time (ms)": round(float(np.mean([p[3] for p in pulls])) * 1e3, 3),
                    "Avg MB per transfer": round(float(mb.mean()), 3),
                    "Throughput (MB/s)": round(float(mb.sum() / t.sum()), 3) if t.sum() > 0 else 0.0,
                    "Avg number of descriptors": round(float(np.mean([p[5] for p in pulls])), 1),
                }
            )
            # the xfer time holds kvbridge's own work around the transport's read (NixlConnector's is NIXL's alone)
            for phase in ("prepare", "land"):
                spent = [p[3] for p in self.data["phases"] if p[0] == phase]
                if spent:
                    out[f"Avg {phase} time (ms)"] = round(float(np.mean(spent)) * 1e3, 3)
        out["Num failed transfers"] = len(self.data["failures"])
        retries = sum(r[2] for r in self.data.get("retries", ()))
        if retries:
            out["Num retries"] = retries
        for event in LEASE_EVENTS:
            n = sum(1 for (e,) in self.data["leases"] if e == event)
            if n:
                out[f"Leases {event}"] = n
        return out
