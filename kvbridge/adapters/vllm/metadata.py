"""What the scheduler side tells its workers each step, and the kv_transfer_params it hands out."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import attrs
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvbridge.control.params import KVTransferParams
from kvbridge.errors import ConfigError


@attrs.frozen
class PullTask:
    """Read a request's blocks from a prefill engine (or, with no local blocks, only release them there)."""

    request_id: str
    remote_request_id: str
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_tp: int
    local_block_ids: tuple[int, ...] = attrs.field(converter=tuple)
    remote_block_ids: tuple[int, ...] = attrs.field(converter=tuple)
    report: bool  # the scheduler waits for this request in finished_recving

    @classmethod
    def from_params(cls, request_id: str, params: Mapping[str, Any], local_block_ids: list[int],
                    report: bool) -> PullTask:
        """Raises ConfigError naming what the params lack."""
        p = KVTransferParams.from_dict(params)
        p.require_remote()
        remote = list(p.block_ids)
        if len(local_block_ids) > len(remote):
            raise ConfigError(f"request {request_id}: {len(local_block_ids)} blocks to fill, prefill holds {len(remote)}")
        # Decode's own prefix cache covers the leading blocks; read only the ones it lacks.
        remote = remote[len(remote) - len(local_block_ids):] if local_block_ids else []
        return cls(
            request_id=request_id,
            remote_request_id=str(p.remote_request_id),
            remote_engine_id=str(p.remote_engine_id),
            remote_host=str(p.remote_host),
            remote_port=int(p.remote_port),  # type: ignore[arg-type]
            remote_tp=p.tp_size,
            local_block_ids=local_block_ids,
            remote_block_ids=remote,
            report=report,
        )


@dataclass
class KVBridgeMetadata(KVConnectorMetadata):
    """One step's work for the workers: pulls to start, finished prefill requests to hold."""

    pulls: list[PullTask] = field(default_factory=list)
    offers: list[str] = field(default_factory=list)
