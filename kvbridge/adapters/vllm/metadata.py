"""What the scheduler side tells its workers each step, and what the workers tell it back (timings)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import attrs
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvbridge.adapters.vllm.layerwise import LayerwiseMeta
from kvbridge.control.messages import Offer
from kvbridge.control.params import KVTransferParams
from kvbridge.errors import ConfigError


@attrs.frozen
class PullTask:
    """Read a request's blocks from a prefill engine (or, with no local blocks, only release them there)."""

    request_id: str
    params: KVTransferParams  # the prefill's params, narrowed to the blocks (and tokens) decode lacks
    local_block_ids: tuple[int, ...] = attrs.field(converter=tuple)
    report: bool  # the scheduler waits for this request in finished_recving
    asked_at: float = attrs.field(factory=time.time)  # wall clock: the worker may be another process

    @classmethod
    def from_params(
        cls, request_id: str, p: KVTransferParams, local_block_ids: list[int], block_size: int, report: bool
    ) -> PullTask:
        """Raises ConfigError naming what the params lack."""
        p.require_remote()
        remote = p.block_ids
        tokens = p.remote_num_tokens or len(remote) * block_size
        if (len(local_block_ids) - 1) * block_size >= tokens:
            raise ConfigError(
                f"request {request_id}: {len(local_block_ids)} blocks of {block_size} tokens to fill, prefill holds "
                f"{tokens} tokens"
            )
        if not local_block_ids:
            remote, tokens = [], 0
        elif len(local_block_ids) * block_size < tokens:
            # Decode's own prefix cache covers the leading blocks; read only the ones it lacks (same block
            # size on both sides: a prefix hit with different block sizes is not narrowed, see docs/vllm.md).
            skipped = len(remote) - len(local_block_ids)
            remote, tokens = remote[skipped:], tokens - skipped * block_size
        narrowed = attrs.evolve(p, remote_block_ids=[remote], remote_num_tokens=tokens)
        return cls(request_id=request_id, params=narrowed, local_block_ids=local_block_ids, report=report)


@dataclass
class KVBridgeMetadata(KVConnectorMetadata):
    """One step's work for the workers: pulls to start, finished prefill requests to hold."""

    pulls: list[PullTask] = field(default_factory=list)
    offers: list[Offer] = field(default_factory=list)
    layerwise: LayerwiseMeta = field(default_factory=LayerwiseMeta)  # "transfer": "layerwise" only
    idle: bool = False  # the step computes nothing: the engine is stepped only to hear of transfers


@dataclass
class KVBridgeWorkerMeta(KVConnectorWorkerMetadata):
    """Per-request pull phases (milliseconds) the workers measured this step, for the request's answer.

    Ranks pull in parallel, so aggregated over ranks each phase is the slowest rank's.
    """

    timings: dict[str, dict[str, float]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVBridgeWorkerMeta)
        for rid, phases in other.timings.items():
            mine = self.timings.setdefault(rid, {})
            for k, v in phases.items():
                mine[k] = max(mine.get(k, 0.0), v)
        return self
