"""What the scheduler side tells its workers each step, and what the workers tell it back (timings)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvbridge.control.messages import Offer
from kvbridge.session.lending import StepLending
from kvbridge.session.stream import LayerwiseMeta
from kvbridge.session.tasks import PullTask


@dataclass
class KVBridgeMetadata(KVConnectorMetadata):
    """One step's work for the workers: pulls to start, finished prefill requests to hold."""

    pulls: list[PullTask] = field(default_factory=list)
    offers: list[Offer] = field(default_factory=list)
    layerwise: LayerwiseMeta = field(default_factory=LayerwiseMeta)  # "transfer": "layerwise" only
    lending: StepLending = field(default_factory=StepLending)  # marked running requests (a live move's pre-copy)
    idle: bool = False  # the step computes nothing: the engine is stepped only to hear of transfers
    arrivals: int | None = None  # requests the engine had taken from its input queue (ArrivalRelay), where relayed


@dataclass
class KVBridgeWorkerMeta(KVConnectorWorkerMetadata):
    """Per-request pull phases (ms) the workers measured this step, for the request's answer. See docs/internals.md."""

    timings: dict[str, dict[str, float]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVBridgeWorkerMeta)
        for rid, phases in other.timings.items():
            mine = self.timings.setdefault(rid, {})
            for k, v in phases.items():
                mine[k] = max(mine.get(k, 0.0), v)
        return self
