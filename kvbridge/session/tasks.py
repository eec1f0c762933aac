"""What a decode engine asks its ranks to pull: a whole request (`PullTask`) or a layer-wise stream (`StreamTask`)."""

from __future__ import annotations

import time

import attrs

from kvbridge.base.errors import ConfigError
from kvbridge.control.params import KVTransferParams


@attrs.frozen
class PullTask:
    """Read a request's blocks from a prefill engine (or, with no local blocks, only release them there)."""

    request_id: str
    params: KVTransferParams  # the prefill's params, narrowed to the blocks (and tokens) decode lacks
    local_block_ids: tuple[int, ...] = attrs.field(converter=tuple)
    report: bool  # the engine waits for this request among the finished ones
    # params naming no blocks (`lease_blocks`): leading blocks of the lease decode's own prefix cache holds
    skip: int = 0
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
        skipped = 0
        if not local_block_ids:
            remote, tokens = [], 0
        elif len(local_block_ids) * block_size < tokens:
            # Decode's own prefix cache covers the leading blocks; read only the ones it lacks (same block
            # size on both sides: a prefix hit with different block sizes is not narrowed, see docs/vllm.md).
            held = -(-tokens // block_size) if p.lease_blocks else len(remote)
            skipped = held - len(local_block_ids)
            remote, tokens = remote[skipped:], tokens - skipped * block_size
        # blocks named by the lease's answer stay unnamed here (the decode session picks them, `skip` on)
        groups = () if p.lease_blocks else [remote]
        narrowed = attrs.evolve(p, remote_block_ids=groups, remote_num_tokens=tokens)
        return cls(request_id=request_id, params=narrowed, local_block_ids=local_block_ids, report=report, skip=skipped)


@attrs.frozen
class StreamTask:
    """Decode: read `request_id`'s prompt KV layer by layer as prefill computes it.

    No local blocks: only abort it on prefill. `skip`: leading prompt blocks decode's own prefix cache holds."""

    request_id: str
    params: KVTransferParams
    local_block_ids: tuple[int, ...] = attrs.field(converter=tuple)
    tokens: int
    skip: int = 0
    asked_at: float = attrs.field(factory=time.time)
