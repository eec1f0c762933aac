"""How long one request's KV handover may take under chaos: the bound `kvbridge chaos` holds it to.

The handover is the decode's control, transfer and DONE phases of the `x-kvbridge-timing` header
(not TTFT, which includes queueing). Each has its own limit in the code: a side-channel message
waits at most CONTROL_TIMEOUT_S for its answer (the BeginPull, then the DONEs); a transfer that
makes no progress within the transport's deadline (plus its grace) is resubmitted `retries` times,
after a doubling backoff, and then fails; where a transport declares no deadline (NIXL), the decode's pull
timeout ends its transfer. A network fault can stall any of them for as long as it lasts, once more. So a
handover that takes longer than the sum waited on something nothing bounds.
"""

from __future__ import annotations

from typing import Any

import attrs

from kvbridge.session.pull_control import CONTROL_TIMEOUT_S


@attrs.frozen
class HandoverBound:
    control_s: float
    transfer_deadline_s: float
    retries: int
    retry_backoff_s: float
    fault_s: float
    pull_timeout_s: float | None = None  # set for a transport with no deadline: the pull's timeout ends its transfer

    @property
    def transfer_s(self) -> float:
        if self.pull_timeout_s is not None:
            return self.pull_timeout_s
        # each attempt: the deadline and the grace the backend's watchdog adds (kvbridge.transport.contract)
        attempt = self.transfer_deadline_s + min(1.0, self.transfer_deadline_s / 2)
        backoff = sum(self.retry_backoff_s * 2**k for k in range(self.retries))
        return attempt * (self.retries + 1) + backoff

    @property
    def seconds(self) -> float:
        return 2 * self.control_s + self.transfer_s + self.fault_s

    def as_dict(self) -> dict[str, Any]:
        return {
            "bound_ms": round(self.seconds * 1e3, 1),
            "from": {
                "control_and_done_s": 2 * self.control_s,
                "transfer_s": round(self.transfer_s, 3),
                "longest_fault_s": round(self.fault_s, 2),
            },
        }


def transport_bound(backend: str, options: dict[str, Any], fault_s: float, pull_timeout_s: float) -> HandoverBound:
    """The bound for KVBridgeConnector over `backend` with these options (its defaults where unset).

    `pull_timeout_s`: the decode's `pull_timeout_s`, which ends a transfer where the transport has no deadline."""
    from kvbridge.base.options import as_dict
    from kvbridge.plugin.registry import registry

    parsed = as_dict(registry().backend_entry(backend).parse_options(options))
    if "transfer_deadline" not in parsed:
        return HandoverBound(CONTROL_TIMEOUT_S, 0.0, 0, 0.0, fault_s, pull_timeout_s=pull_timeout_s)
    return HandoverBound(
        control_s=CONTROL_TIMEOUT_S,
        transfer_deadline_s=float(parsed["transfer_deadline"]),
        retries=int(parsed.get("retries", 0)),
        retry_backoff_s=float(parsed.get("retry_backoff", 0.0)),
        fault_s=fault_s,
    )
