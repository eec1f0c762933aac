"""The vocabulary every adapter's transfer metrics share, so vLLM's and LMDeploy's series read alike."""

from __future__ import annotations

import attrs

from kvbridge.base.errors import ConfigError, LoadError, PeerGone, TransferError, TransferTimeout

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


@attrs.frozen
class Series:
    """One `kvbridge_*` series a server exports: its kind, its help text and its labels after the engine's own."""

    name: str
    kind: str  # "counter", "histogram" (SECONDS_BUCKETS) or "gauge" (the most recent value)
    help: str
    labels: tuple[str, ...] = ()


PEER = ("transport", "peer")
# what a vLLM server exports in its /metrics (kvbridge.adapters.vllm.stats), by the key its recorder fills
SERIES = {
    "bytes": Series("kvbridge_transfer_bytes_total", "counter", "KV bytes this decode server read.", PEER),
    "descriptors": Series(
        "kvbridge_transfer_descriptors_total", "counter", "Transfer descriptors (contiguous runs) submitted.", PEER
    ),
    "transfers": Series(
        "kvbridge_transfers_total",
        "counter",
        "Requests whose KV was read successfully (one per request and rank).",
        PEER,
    ),
    "transfer_s": Series(
        "kvbridge_transfer_seconds",
        "histogram",
        "Time from submitting a request's descriptors until its bytes landed.",
        PEER,
    ),
    "control_s": Series(
        "kvbridge_control_seconds",
        "histogram",
        "Side-channel time before a pull's transfer starts: finding the prefill rank, waiting for its offer, "
        "BeginPull.",
        PEER,
    ),
    "phase_s": Series(
        "kvbridge_handover_phase_seconds",
        "histogram",
        "Each phase of a KV handover: offer (prefill: publishing and leasing a finished request), offer_wait, "
        "contact (first contact: side-channel address, GetInfo), begin_pull, prepare (building the read's "
        "descriptors), read (the transport's own time), land (copying a read that landed in a buffer into the cache), "
        "fence (confirming the read), done "
        "(the DONEs sent after a read held by prefill was reported).",
        ("phase", *PEER),
    ),
    "request_s": Series(
        "kvbridge_side_channel_seconds",
        "histogram",
        "Side-channel requests this rank answered, by kind and part: queued (behind the serving loop's other work, "
        "at most), wait (read to handler start: decoding, authenticating), handler.",
        ("kind", "part"),
    ),
    "failures": Series(
        "kvbridge_transfer_failures_total",
        "counter",
        f"Pulls that failed (the engine recomputes or fails the request), by reason: {', '.join(FAILURE_REASONS)}.",
        (*PEER, "reason"),
    ),
    "retries": Series(
        "kvbridge_transfer_retries_total",
        "counter",
        "Transfer batches resubmitted after they failed or made no progress within the transfer deadline "
        "(each is retried once; a pull that still fails is in kvbridge_transfer_failures_total).",
        PEER,
    ),
    "lease_events": Series(
        "kvbridge_lease_events_total",
        "counter",
        "Prefill leases by event: offered, released (every DONE came), expired (no DONE in time), aborted; "
        "extended (blocks added to a layer-wise stream's lease).",
        ("event",),
    ),
    "leases_held": Series(
        "kvbridge_leases_held", "gauge", "Finished prefill requests whose blocks are held for a remote decode."
    ),
    "blocks_held": Series("kvbridge_blocks_held", "gauge", "KV blocks held on prefill for a remote decode."),
    "transport_open": Series(
        "kvbridge_transport_open",
        "gauge",
        "1 when a transport that authenticates nobody (Mooncake, NIXL) runs with the trust option (insecure): "
        "its listeners accept any host; 0 when only loopback, allow= and hosts that proved the secret get in.",
        ("transport",),
    ),
    "admitted_hosts": Series(
        "kvbridge_admitted_hosts",
        "gauge",
        "Hosts admitted to a guarded transport's listeners because they proved the shared secret.",
        ("transport",),
    ),
}
