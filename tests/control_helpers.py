"""Helpers for the control-plane tests: bounded polling, free ports, real redis and etcd servers."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kvbridge.control import KVTransferParams

if TYPE_CHECKING:
    from kvbridge_tools.harness.hosts import Host


def wait_for(cond: Callable[[], bool], timeout: float = 30.0, what: str | Callable[[], str] = "condition") -> None:
    """Poll `cond` until it holds; fail the test after `timeout` seconds, saying `what` (called then, if callable)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what() if callable(what) else what}"
        time.sleep(0.02)


def _require(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.fail(f"{binary} is not installed; run scripts/setup --test")
    return path


@contextmanager
def redis_server(tmp: Path, host: Host | None = None) -> Iterator[str]:
    """A real redis-server on a free port of 127.0.0.1, or of `host` (a namespace host), stopped by its PID.

    On a namespace host it takes a password, as redis does off loopback. Yields redis://[:PASSWORD@]ADDRESS:PORT.
    """
    from kvbridge_tools.harness.redis import redis_server as start

    _require("redis-server")
    with start(tmp, host) as url:
        yield url


@contextmanager
def etcd_server(tmp: Path, host: Host | None = None) -> Iterator[str]:
    """A real single-member etcd on free ports of 127.0.0.1, or of `host` (a namespace host), stopped by its PID.

    Yields etcd://ADDRESS:PORT.
    """
    from kvbridge_tools.harness.etcd import etcd_server as start

    _require("etcd")
    with start(tmp, host) as url:
        yield url


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
