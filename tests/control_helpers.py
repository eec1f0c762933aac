"""Helpers for the control-plane tests: bounded polling, free ports, real redis and etcd servers."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from kvbridge.control import KVTransferParams
from kvbridge_tools.harness.ports import free_port
from kvbridge_tools.harness.redis import stop

if TYPE_CHECKING:
    from kvbridge_tools.harness.hosts import Host


def wait_for(cond: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    """Poll `cond` until it holds; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _require(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.fail(f"{binary} is not installed; run scripts/setup --test")
    return path


def _popen(host: Host | None, argv: list[str], **kwargs: Any) -> subprocess.Popen:
    return subprocess.Popen(host.command(argv) if host else argv, **kwargs)


def _inside(host: Host | None) -> AbstractContextManager[None]:
    """Where the test reaches a server: from the server's own host when it is on one."""
    return host.entered() if host else nullcontext()


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
    client, peer = free_port(span=1), free_port(span=1)
    address = host.address if host else "127.0.0.1"
    c_url, p_url = f"http://{address}:{client}", f"http://{address}:{peer}"
    proc = _popen(
        host,
        [
            _require("etcd"),
            "--name",
            "kvb",
            "--data-dir",
            str(tmp / "etcd"),
            "--listen-client-urls",
            c_url,
            "--advertise-client-urls",
            c_url,
            "--listen-peer-urls",
            p_url,
            "--initial-advertise-peer-urls",
            p_url,
            "--initial-cluster",
            f"kvb={p_url}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def up() -> bool:
            try:
                with _inside(host), urllib.request.urlopen(f"{c_url}/health", timeout=1) as resp:  # noqa: S310
                    return b'"true"' in resp.read()
            except OSError:
                assert proc.poll() is None, f"etcd exited with {proc.returncode}"
                return False

        wait_for(up, what="etcd")
        yield f"etcd://{address}:{client}"
    finally:
        stop(proc)


def rank_info(engine_id: str = "prefill", rank: int = 0, endpoint: bytes = b"endpoint-bytes"):  # noqa: ANN201
    """A RankInfo value (as `KVAgent.info()` makes) for a side channel to serve; addresses are made up."""
    from kvbridge.agent import RankInfo
    from kvbridge.layout import vllm_layout
    from kvbridge.presets import PRESETS
    from kvbridge.topology import ParallelConfig

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
