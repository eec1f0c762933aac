"""Helpers for the control-plane tests: bounded polling, real redis and etcd servers (from kvbridge_tools.harness)."""

from __future__ import annotations

from kvbridge.control import KVTransferParams
from kvbridge_tools.harness.fixtures import etcd_server, redis_server, wait_for

__all__ = ["etcd_server", "pull_params", "rank_info", "redis_server", "wait_for"]


def rank_info(engine_id: str = "prefill", rank: int = 0, endpoint: bytes = b"endpoint-bytes"):  # noqa: ANN201
    """A RankInfo value (as `KVAgent.info()` makes) for a side channel to serve; addresses are made up."""
    from kvbridge.agent.kv_agent import RankInfo
    from kvbridge.plan.layout import vllm_layout
    from kvbridge.plan.presets import PRESETS
    from kvbridge.plan.topology import ParallelConfig

    model = PRESETS["tiny-gqa"]
    layout = vllm_layout(model, 8, [0x10000 * (i + 1) for i in range(model.layers)], 4)
    return RankInfo(engine_id, rank, ParallelConfig(tp=2), layout, endpoint)


def pull_params(request_id: str, blocks: list[int], port: int, *, tokens: int | None = None, tp_size: int = 1) -> dict:
    """What a prefill engine returns through the proxy for `blocks` of `request_id` (vLLM's keys).

    `tokens` defaults to full blocks of 16.
    """
    return KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id="prefill",
        remote_request_id=request_id,
        remote_block_ids=[blocks],
        remote_host="127.0.0.1",
        remote_port=port,
        tp_size=tp_size,
        remote_num_tokens=len(blocks) * 16 if tokens is None else tokens,
    ).to_dict()
