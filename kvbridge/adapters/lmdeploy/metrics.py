"""The LMDeploy backend's transfer series, named `kvbridge_transfer_*` as vLLM's connector's. See docs/internals.md."""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from kvbridge.base.metric_labels import SECONDS_BUCKETS
from kvbridge.session.metrics import KEYS, TransferRecord

FOLD_EVERY = 256  # recorded entries kept as a list before they are summed: a long-lived backend stays bounded


class TransferMetrics(TransferRecord):
    """The session's transfer recorder, summed per (transport, peer) for a long-lived engine. See docs/internals.md."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.data: dict[str, list[Any]] = {k: [] for k in KEYS}
        self._bytes: dict[tuple[str, str], int] = defaultdict(int)
        self._descriptors: dict[tuple[str, str], int] = defaultdict(int)
        self._transfers: dict[tuple[str, str], int] = defaultdict(int)
        self._seconds: dict[tuple[str, str], list[float]] = {}  # bucket counts..., then the sum
        self._failures: dict[tuple[str, str, str], int] = defaultdict(int)
        self._retries: dict[tuple[str, str], int] = defaultdict(int)

    def record(
        self, transport: str, peer: str, transfer_s: float, control_s: float, nbytes: int, descriptors: int
    ) -> None:
        super().record(transport, peer, transfer_s, control_s, nbytes, descriptors)
        self._fold_when_long()

    def record_failure(self, transport: str, peer: str, error: BaseException) -> None:
        super().record_failure(transport, peer, error)
        self._fold_when_long()

    def _fold_when_long(self) -> None:
        with self._lock:
            if sum(map(len, self.data.values())) >= FOLD_EVERY:
                self._fold()

    def _fold(self) -> None:
        """Sum the recorded entries into the counters; the caller holds the lock."""
        data, self.data = self.data, {k: [] for k in KEYS}
        for transport, peer, transfer_s, _control_s, nbytes, descriptors in data["pulls"]:
            key = (transport, peer)
            self._bytes[key] += nbytes
            self._descriptors[key] += descriptors
            self._transfers[key] += 1
            hist = self._seconds.setdefault(key, [0.0] * (len(SECONDS_BUCKETS) + 2))
            hist[bisect.bisect_left(SECONDS_BUCKETS, transfer_s)] += 1  # the last bucket is +Inf
            hist[-1] += transfer_s
        for transport, peer, reason in data["failures"]:
            self._failures[(transport, peer, reason)] += 1
        for transport, peer, n in data["retries"]:
            self._retries[(transport, peer)] += n

    def snapshot(self) -> dict[str, Any]:
        """The counters as a plain dict, without prometheus-client. See docs/internals.md."""
        with self._lock:
            self._fold()
            return {
                "transfers": [
                    {
                        "transport": t,
                        "peer": p,
                        "bytes": self._bytes[(t, p)],
                        "descriptors": self._descriptors[(t, p)],
                        "count": n,
                        "seconds_sum": self._seconds[(t, p)][-1],
                    }
                    for (t, p), n in self._transfers.items()
                ],
                "failures": [
                    {"transport": t, "peer": p, "reason": r, "count": n} for (t, p, r), n in self._failures.items()
                ],
                "retries": [{"transport": t, "peer": p, "count": n} for (t, p), n in self._retries.items()],
            }

    def collector(self) -> Any:
        """A prometheus-client collector of these series (register it in the engine's registry)."""
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        metrics = self

        class Collector:
            def collect(self) -> Iterator[Any]:
                labels = ["transport", "peer"]
                with metrics._lock:
                    metrics._fold()
                    fams = {
                        "bytes": CounterMetricFamily("kvbridge_transfer_bytes", "KV bytes read.", labels=labels),
                        "descriptors": CounterMetricFamily(
                            "kvbridge_transfer_descriptors", "Transfer descriptors submitted.", labels=labels
                        ),
                        "transfers": CounterMetricFamily(
                            "kvbridge_transfers", "Migrations that completed.", labels=labels
                        ),
                    }
                    for key in metrics._transfers:
                        fams["bytes"].add_metric(list(key), metrics._bytes[key])
                        fams["descriptors"].add_metric(list(key), metrics._descriptors[key])
                        fams["transfers"].add_metric(list(key), metrics._transfers[key])
                    seconds = HistogramMetricFamily(
                        "kvbridge_transfer_seconds",
                        "Time from submitting a migration's descriptors until its bytes landed.",
                        labels=labels,
                    )
                    for key, hist in metrics._seconds.items():
                        running, buckets = 0.0, []
                        for bound, n in zip([*map(str, SECONDS_BUCKETS), "+Inf"], hist[:-1]):
                            running += n
                            buckets.append((bound, running))
                        seconds.add_metric(list(key), buckets, hist[-1])
                    failures = CounterMetricFamily(
                        "kvbridge_transfer_failures", "Migrations that failed, by reason.", labels=[*labels, "reason"]
                    )
                    for key, n in metrics._failures.items():
                        failures.add_metric(list(key), n)
                    retries = CounterMetricFamily(
                        "kvbridge_transfer_retries",
                        "Transfer batches resubmitted after they failed or made no progress within the transfer "
                        "deadline.",
                        labels=labels,
                    )
                    for key, n in metrics._retries.items():
                        retries.add_metric(list(key), n)
                yield from (*fams.values(), seconds, failures, retries)

        return Collector()
