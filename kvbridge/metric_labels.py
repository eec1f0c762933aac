"""The vocabulary every adapter's transfer metrics share, so vLLM's and LMDeploy's series read alike."""

from __future__ import annotations

from kvbridge.errors import ConfigError, LoadError, PeerGone, TransferError, TransferTimeout

SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
FAILURE_REASONS = ("lease", "timeout", "peer_gone", "transfer", "config", "internal")

# Most specific first: PeerGone and TransferTimeout are TransferErrors.
_REASONS = (
    (LoadError, "lease"),
    (TransferTimeout, "timeout"),
    (PeerGone, "peer_gone"),
    (ConfigError, "config"),
    (TransferError, "transfer"),
)


def failure_reason(error: BaseException) -> str:
    """The `reason` label of a failed transfer: one of FAILURE_REASONS (a bounded set, never a message)."""
    for kind, reason in _REASONS:
        if isinstance(error, kind):
            return reason
    return "internal"
