"""Transfer statistics through vLLM's own connector-stats path. See docs/internals.md."""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvbridge.base.metric_labels import SECONDS_BUCKETS, SERIES
from kvbridge.session.metrics import KEYS, TransferRecord, timed

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
        make = {
            "counter": self._counter_cls,
            "histogram": functools.partial(self._histogram_cls, buckets=SECONDS_BUCKETS),
            "gauge": functools.partial(self._gauge_cls, multiprocess_mode="mostrecent"),
        }
        self.series = {key: make[s.kind](s.name, s.help, [*labelnames, *s.labels]) for key, s in SERIES.items()}
        self._held: dict[int, list[int]] = {}  # engine -> [leases, blocks] held now
        for values in per_engine_labelvalues.values():  # a scrape sees zeros from the start
            self.series["leases_held"].labels(*values).set(0)
            self.series["blocks_held"].labels(*values).set(0)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        base, series = self.per_engine_labelvalues[engine_idx], self.series
        for transport, peer, transfer_s, control_s, nbytes, descriptors in transfer_stats_data.get("pulls", ()):
            labels = [*base, transport, peer]
            series["bytes"].labels(*labels).inc(nbytes)
            series["descriptors"].labels(*labels).inc(descriptors)
            series["transfers"].labels(*labels).inc()
            series["transfer_s"].labels(*labels).observe(transfer_s)
            series["control_s"].labels(*labels).observe(control_s)
        for key, labels, seconds in timed(transfer_stats_data):
            series[key].labels(*base, *labels).observe(seconds)
        for transport, peer, reason in transfer_stats_data.get("failures", ()):
            series["failures"].labels(*base, transport, peer, reason).inc()
        for transport, peer, n in transfer_stats_data.get("retries", ()):
            series["retries"].labels(*base, transport, peer).inc(n)
        for (event,) in transfer_stats_data.get("leases", ()):
            series["lease_events"].labels(*base, event).inc()
        for transport, open_, admitted in transfer_stats_data.get("guard", ()):
            series["transport_open"].labels(*base, transport).set(open_)
            series["admitted_hosts"].labels(*base, transport).set(admitted)
        held = transfer_stats_data.get("held", ())
        if held:  # deltas from every rank: keep the sum here (vLLM's gauges take `set`, not `inc`)
            total = self._held.setdefault(engine_idx, [0, 0])
            total[0] += sum(h[0] for h in held)
            total[1] += sum(h[1] for h in held)
            series["leases_held"].labels(*base).set(total[0])
            series["blocks_held"].labels(*base).set(total[1])


def _unregister_ours() -> None:
    from prometheus_client import REGISTRY

    for collector, names in list(REGISTRY._collector_to_names.items()):
        if any(n.startswith("kvbridge_") for n in names):
            REGISTRY.unregister(collector)
