"""Transfer statistics in vLLM's `KVConnectorStats` form: vLLM logs them as "KV Transfer metrics"
with the same keys its own Mooncake connector uses, so the two read side by side."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

_KEYS = ("transfer_duration", "bytes_transferred", "num_descriptors", "num_failed_transfers")


@dataclass
class KVBridgeStats(KVConnectorStats):
    """One row per pull (decode side: this connector reads). Sent from workers to the logger as `data`."""

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        if not self.data:
            self.reset()

    def __getstate__(self) -> dict[str, Any]:
        return {"data": self.data}  # a lock does not cross processes

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.data = state["data"]
        self._lock = threading.Lock()

    def reset(self) -> None:
        self.data = {k: [] for k in _KEYS}

    def record(self, duration_s: float, nbytes: int, descriptors: int) -> None:
        with self._lock:
            self.data["transfer_duration"].append(duration_s)
            self.data["bytes_transferred"].append(nbytes)
            self.data["num_descriptors"].append(descriptors)

    def record_failure(self) -> None:
        with self._lock:
            self.data["num_failed_transfers"].append(1)

    def clone_and_reset(self) -> KVBridgeStats:
        with self._lock:
            snapshot = {k: list(v) for k, v in self.data.items()}
            self.reset()
        return KVBridgeStats(data=snapshot)

    def is_empty(self) -> bool:
        return not self.data["transfer_duration"] and not self.data["num_failed_transfers"]

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k in _KEYS:
            self.data[k].extend(other.data.get(k, ()))
        return self

    def reduce(self) -> dict[str, int | float]:
        t = np.asarray(self.data["transfer_duration"], dtype=np.float64)
        mb = np.asarray(self.data["bytes_transferred"], dtype=np.float64) / 2**20
        n = len(t)
        out: dict[str, int | float] = {"Num successful transfers": n}
        if n:
            out.update({
                "Avg xfer time (ms)": round(float(t.mean()) * 1e3, 3),
                "P90 xfer time (ms)": round(float(np.percentile(t, 90)) * 1e3, 3),
                "Avg MB per transfer": round(float(mb.mean()), 3),
                "Throughput (MB/s)": round(float(mb.sum() / t.sum()), 3) if t.sum() > 0 else 0.0,
                "Avg number of descriptors": round(float(np.mean(self.data["num_descriptors"])), 1),
            })
        out["Num failed transfers"] = len(self.data["num_failed_transfers"])
        return out
