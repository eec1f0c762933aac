"""Transfer statistics through vLLM's own connector-stats path.

Workers record into a `KVBridgeStats` (`get_kv_connector_stats`); vLLM ships its `data` to the API
server process each step, logs `reduce()` as "KV Transfer metrics", and hands the same `data` to the
`KVBridgePromMetrics` that `build_prom_metrics` made, so the `kvbridge_*` series land in the server's
own `/metrics` beside vLLM's. `data` holds only lists of plain values: it crosses processes.

What is recorded, and its labels, is `kvbridge.session.metrics`'s.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvbridge.metric_labels import FAILURE_REASONS, SECONDS_BUCKETS
from kvbridge.session.metrics import KEYS, TransferRecord

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass
class KVBridgeStats(TransferRecord, KVConnectorStats):
    """What one or more workers recorded since the last step (decode: pulls; prefill: leases)."""

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        for k in KEYS:
            self.data.setdefault(k, [])

    def __getstate__(self) -> dict[str, Any]:
        return {"data": self.data}  # a lock does not cross processes

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.data = state["data"]
        self._lock = threading.Lock()

    def reset(self) -> None:
        self.data = {k: [] for k in KEYS}

    def clone_and_reset(self) -> KVBridgeStats:
        with self._lock:
            snapshot, self.data = self.data, {k: [] for k in KEYS}
        return KVBridgeStats(data=snapshot)

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in KEYS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k in KEYS:
            self.data.setdefault(k, []).extend(other.data.get(k, ()))
        return self


class KVBridgePromMetrics(KVConnectorPromMetrics):
    """The `kvbridge_*` series of one vLLM server; vLLM's own labels (model_name, engine) come first."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister_ours()  # vLLM builds its stat logger again after a restart in the same process
        peer = [*labelnames, "transport", "peer"]
        self.bytes = self._counter_cls("kvbridge_transfer_bytes_total", "KV bytes this decode server read.", peer)
        self.descriptors = self._counter_cls(
            "kvbridge_transfer_descriptors_total", "Transfer descriptors (contiguous runs) submitted.", peer
        )
        self.transfers = self._counter_cls(
            "kvbridge_transfers_total", "Requests whose KV was read successfully (one per request and rank).", peer
        )
        self.transfer_s = self._histogram_cls(
            "kvbridge_transfer_seconds",
            "Time from submitting a request's descriptors until its bytes landed.",
            peer,
            buckets=SECONDS_BUCKETS,
        )
        self.control_s = self._histogram_cls(
            "kvbridge_control_seconds",
            "Side-channel time before a pull's transfer starts: finding the prefill "
            "rank, waiting for its offer, BeginPull.",
            peer,
            buckets=SECONDS_BUCKETS,
        )
        self.failures = self._counter_cls(
            "kvbridge_transfer_failures_total",
            f"Pulls that failed (the engine recomputes or fails the request), by reason: {', '.join(FAILURE_REASONS)}.",
            [*peer, "reason"],
        )
        self.retries = self._counter_cls(
            "kvbridge_transfer_retries_total",
            "Transfer batches resubmitted after they failed or made no progress within the transfer deadline "
            "(each is retried once; a pull that still fails is in kvbridge_transfer_failures_total).",
            peer,
        )
        self.lease_events = self._counter_cls(
            "kvbridge_lease_events_total",
            "Prefill leases by event: offered, released (every DONE came), expired (no DONE in time), aborted; "
            "extended (blocks added to a layer-wise stream's lease).",
            [*labelnames, "event"],
        )
        self.leases_held = self._gauge_cls(
            "kvbridge_leases_held",
            "Finished prefill requests whose blocks are held for a remote decode.",
            labelnames,
            multiprocess_mode="mostrecent",
        )
        self.blocks_held = self._gauge_cls(
            "kvbridge_blocks_held",
            "KV blocks held on prefill for a remote decode.",
            labelnames,
            multiprocess_mode="mostrecent",
        )
        self.transport_open = self._gauge_cls(
            "kvbridge_transport_open",
            "1 when a transport that authenticates nobody (Mooncake, NIXL) runs with the trust option (insecure): "
            "its listeners accept any host; 0 when only loopback, allow= and hosts that proved the secret get in.",
            [*labelnames, "transport"],
            multiprocess_mode="mostrecent",
        )
        self.admitted_hosts = self._gauge_cls(
            "kvbridge_admitted_hosts",
            "Hosts admitted to a guarded transport's listeners because they proved the shared secret.",
            [*labelnames, "transport"],
            multiprocess_mode="mostrecent",
        )
        self._held: dict[int, list[int]] = {}  # engine -> [leases, blocks] held now
        for values in per_engine_labelvalues.values():  # a scrape sees zeros from the start
            self.leases_held.labels(*values).set(0)
            self.blocks_held.labels(*values).set(0)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        base = self.per_engine_labelvalues[engine_idx]
        for transport, peer, transfer_s, control_s, nbytes, descriptors in transfer_stats_data.get("pulls", ()):
            labels = [*base, transport, peer]
            self.bytes.labels(*labels).inc(nbytes)
            self.descriptors.labels(*labels).inc(descriptors)
            self.transfers.labels(*labels).inc()
            self.transfer_s.labels(*labels).observe(transfer_s)
            self.control_s.labels(*labels).observe(control_s)
        for transport, peer, reason in transfer_stats_data.get("failures", ()):
            self.failures.labels(*base, transport, peer, reason).inc()
        for transport, peer, n in transfer_stats_data.get("retries", ()):
            self.retries.labels(*base, transport, peer).inc(n)
        for (event,) in transfer_stats_data.get("leases", ()):
            self.lease_events.labels(*base, event).inc()
        for transport, open_, admitted in transfer_stats_data.get("guard", ()):
            self.transport_open.labels(*base, transport).set(open_)
            self.admitted_hosts.labels(*base, transport).set(admitted)
        held = transfer_stats_data.get("held", ())
        if held:  # deltas from every rank: keep the sum here (vLLM's gauges take `set`, not `inc`)
            total = self._held.setdefault(engine_idx, [0, 0])
            total[0] += sum(h[0] for h in held)
            total[1] += sum(h[1] for h in held)
            self.leases_held.labels(*base).set(total[0])
            self.blocks_held.labels(*base).set(total[1])


def _unregister_ours() -> None:
    from prometheus_client import REGISTRY

    for collector, names in list(REGISTRY._collector_to_names.items()):
        if any(n.startswith("kvbridge_") for n in names):
            REGISTRY.unregister(collector)
