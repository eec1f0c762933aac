"""`kvbridge proxy --live-moves`: a draining decode's streams continue on another decode, against small real upstreams.

The decode upstreams stream one token per event from a function of the whole context (prompt and tokens so far), as
a greedy model does, so a stream continued elsewhere from prompt + forwarded tokens must give the same tokens: any
token lost or repeated at the cut shows. Servers announce themselves in a real redis with signed records, and the
draining decode's side channel is a real kvbridge ControlServer with a ledger, which sees the proxy's Aborts. The
end-to-end test on real vLLM servers is tests/e2e/test_vllm_elastic.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvbridge.base.errors import ConfigError
from kvbridge.base.secret import admin_token
from kvbridge.control import ControlServer, LeaseState, Ledger, open_registry
from kvbridge.control.discovery import ServerRecord
from kvbridge.control.params import KVTransferParams
from kvbridge.session.lending import precopied, precopy_id
from kvbridge_proxy import membership
from kvbridge_proxy.app import Proxy, create_app
from kvbridge_proxy.moves import next_decode
from kvbridge_proxy.moving_stream import MoveSettings, MovingStream, refusal
from kvbridge_proxy.rebalance import Policy, kv_usage
from kvbridge_proxy.settings import ProxySettings
from kvbridge_proxy.takeover import Upstream
from kvbridge_proxy.upstreams import Instance, NoInstance, Pool
from kvbridge_tools.harness.fixtures import redis_server, wait_for
from kvbridge_tools.harness.pd_servers import Serving, Unaccepting

SECRET = "proxy-live-moves-test-secret-0123456789"
MAX_TOKENS = 40


def next_token(context: list[int]) -> int:
    """What the upstream 'model' says next: a function of the whole context, like greedy decoding."""
    return (sum(context) * 7 + len(context) * 13) % 50_000


def reference(prompt: list[int], n: int) -> list[int]:
    context = list(prompt)
    for _ in range(n):
        context.append(next_token(context))
    return context[len(prompt) :]


def prompt_ids(path: str, body: dict[str, Any]) -> list[int]:
    if path.endswith("chat/completions"):
        return [ord(c) for m in body["messages"] for c in m["content"]]
    prompt = body["prompt"]
    return list(prompt) if isinstance(prompt, list) else [ord(c) for c in prompt]


class TokenDecode(Serving):
    """A decode server streaming `next_token`s, one event every `delay_s`; records what it was sent.

    Asked with `do_remote_decode`, it answers as a prefill server does.

    A request that asks to pull KV and is not streamed (a moved stream's pull) gets one token and the pull's report in
    its params, as KVBridgeConnector reports it (`kvbridge_timing`). `fail_pulls`: such a request gets an error (vLLM's
    `kv_load_failure_policy="fail"`); `recompute_pulls`: its report says the pull failed (policy "recompute": the server
    computed the KV itself); `held_stages`: a pre-copy stage's report names no pull (the server held what it would
    read); `uncached`: its answers say it keeps nothing it pulls (no prefix caching). `die_after`: the connection drops
    after that many token events (a killed server). `hold_done`: [DONE] waits for this event after the last token.
    `precopy_wait`: a pre-copy stage's pull waits for this event (at most 30 s), from the `precopy_wait_from`th on
    (counted from 0); `precopy_dies`: the server drops a pre-copy stage's connection unanswered, and its /health fails
    from then on (it died). `arrived`: when each of `bodies` came (monotonic seconds). `first_delay_s`: a stream's first
    event waits this much more (an engine's first step); `first_sent`: (when, prompt) of each stream's first event."""

    def __init__(
        self,
        *,
        delay_s: float = 0.02,
        fail_pulls: bool = False,
        recompute_pulls: bool = False,
        held_stages: bool = False,
        uncached: bool = False,
        die_after: int | None = None,
        hold_done: threading.Event | None = None,
        precopy_wait: threading.Event | None = None,
        precopy_wait_from: int = 0,
        precopy_dies: bool = False,
        first_delay_s: float = 0.0,
    ) -> None:
        self.bodies: list[dict] = []
        self.arrived: list[float] = []
        self.first_sent: list[tuple[float, list[int]]] = []
        stages = itertools.count()
        self.dead = False
        app = FastAPI()

        async def stream(path: str, request: Request) -> Any:
            body = await request.json()
            self.bodies.append(body)
            self.arrived.append(time.monotonic())
            chat = path.endswith("chat/completions")
            prompt = prompt_ids(path, body)
            params = body.get("kv_transfer_params") or {}
            if params.get("do_remote_decode"):  # a prefill's answer: where the KV is
                where = {"remote_engine_id": "p", "remote_request_id": "r", "remote_host": "127.0.0.1"}
                where |= {"remote_port": 9, "remote_block_ids": [1], "remote_num_tokens": len(prompt)}
                return {"id": "p", "choices": [{"index": 0, "text": "<0>"}], "kv_transfer_params": where}
            cid = f"{'chatcmpl' if chat else 'cmpl'}-{len(self.bodies)}"
            if params.get("do_remote_prefill") and body.get("stream") is False:  # a moved stream's pull
                if precopied(str(params.get("kvbridge_move_id"))) is not None:
                    if precopy_dies:
                        self.dead = True  # and so it stays: its /health fails from now on

                        async def dropped() -> Any:
                            raise RuntimeError("killed")  # before the first byte: the connection drops
                            yield b""

                        return StreamingResponse(dropped())
                    if precopy_wait is not None and next(stages) >= precopy_wait_from:
                        await asyncio.to_thread(precopy_wait.wait, 30)
                if fail_pulls:
                    return JSONResponse({"error": {"message": "KV load failed", "code": 500}}, status_code=500)
                report = {"transfer_ms": 1.0, "at_failed_ms" if recompute_pulls else "at_done_ms": 2.0}
                if held_stages and precopied(str(params.get("kvbridge_move_id"))) is not None:
                    report = {}
                choice = {"index": 0, "text": f"<{next_token(prompt)}>", "finish_reason": "length"}
                said = {"kvbridge_timing": report, "kvbridge_prefix_cache": not uncached}
                return {"id": cid, "choices": [choice], "kv_transfer_params": said}
            ids = bool(body.get("return_token_ids"))
            head = {"id": cid, "created": len(self.bodies), "model": body["model"]}
            head["object"] = "chat.completion.chunk" if chat else "text_completion"

            async def events() -> Any:
                if fail_pulls and params.get("do_remote_prefill"):
                    yield f"data: {json.dumps({'error': {'message': 'KV load failed', 'code': 500}})}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                if chat:
                    role = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
                    if ids:
                        role["prompt_token_ids"] = prompt
                    yield f"data: {json.dumps(role)}\n\n"
                context = list(prompt)
                limit = body.get("max_tokens") or body.get("max_completion_tokens") or MAX_TOKENS
                for n in range(limit):
                    if die_after is not None and n == die_after:
                        raise RuntimeError("killed")  # the server drops the connection mid-stream
                    await asyncio.sleep(delay_s + (first_delay_s if n == 0 else 0.0))
                    if n == 0:
                        self.first_sent.append((time.monotonic(), prompt))
                    token = next_token(context)
                    context.append(token)
                    done = "length" if n == limit - 1 else None
                    choice: dict[str, Any] = {"index": 0, "finish_reason": done}
                    if chat:
                        choice["delta"] = {"content": f"<{token}>"}
                    else:
                        choice["text"] = f"<{token}>"
                        if ids and n == 0:
                            choice["prompt_token_ids"] = prompt
                    if ids:
                        choice["token_ids"] = [token]
                    yield f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"
                if hold_done is not None:
                    await asyncio.to_thread(hold_done.wait, 30)
                if (body.get("stream_options") or {}).get("include_usage"):
                    usage = {"prompt_tokens": len(prompt), "completion_tokens": limit}
                    usage["total_tokens"] = len(prompt) + limit
                    yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            return await stream("/v1/completions", request)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            return await stream("/v1/chat/completions", request)

        @app.get("/health")
        async def health() -> Any:
            return JSONResponse({}, status_code=503 if self.dead else 200)

        super().__init__(app)


@attrs.define
class Cluster:
    """A proxy with --live-moves over a prefill, decodes A and B announced in redis, A's side channel live."""

    proxy: Serving
    a: TokenDecode
    b: TokenDecode
    records: Any
    a_record: ServerRecord
    b_record: ServerRecord
    aborted: list  # (lease id, state) of every lease A's ledger ended
    ledger: Ledger
    side: ControlServer  # A's side channel

    def serve_b(self) -> None:
        self.records.announce(attrs.evolve(self.b_record, state="serving", expires=time.time() + 60), 60)

    def drain_a(self) -> None:
        """B takes requests from now on, A drains."""
        self.serve_b()
        self.records.announce(attrs.evolve(self.a_record, state="draining", expires=time.time() + 60), 60)

    def move_ids(self) -> list[str]:
        return [b["kv_transfer_params"]["kvbridge_move_id"] for b in self.a.bodies if "prompt" in b or "messages" in b]


# A move's plumbing (the cut, the pull, the continuation) is tested as a stop-and-copy; pre-copy's tests ask for it.
STOP_AND_COPY = MoveSettings(mode="stop-and-copy")


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    monkeypatch.setenv("KVBRIDGE_SECRET", SECRET)
    options = getattr(request, "param", {})
    ended: list = []
    ledger = Ledger(lambda lease, why: ended.append((lease.request_id, why)), timeout_s=600)
    side = ControlServer("decode-a", 0, ledger=ledger, secret=SECRET, poll_interval_s=0.01)
    with (
        redis_server(tmp_path) as url,
        TokenDecode() as prefill,
        TokenDecode(**options.get("a", {})) as a,
        TokenDecode(**options.get("b", {})) as b,
    ):
        records = open_registry(url, secret=SECRET)
        a_record = ServerRecord(
            "decode-a", "decode", a.url, expires=time.time() + 60, side_host="127.0.0.1", side_port=side.address[1]
        )
        records.announce(a_record, 60)
        b_record = ServerRecord("decode-b", "decode", b.url, expires=time.time() + 60, side_host="127.0.0.1")
        b_record = attrs.evolve(b_record, side_port=side.address[1] + 1, state="draining")  # every stream starts on A
        records.announce(b_record, 60)
        app = create_app(
            [prefill.url],
            [],
            registry=url,
            live_moves=True,
            health_interval=0.05,
            warm_up=False,
            expose_internals=options.get("expose", True),
            moves=options.get("moves", STOP_AND_COPY),
        )
        try:
            with Serving(app) as proxy:
                client = httpx.Client(base_url=proxy.url, trust_env=False, timeout=30)
                wait_for(lambda: len(client.get("/instances").json()["decode"]) == 2, what="both decodes joined")
                client.close()
                yield Cluster(proxy, a, b, records, a_record, b_record, ended, ledger, side)
        finally:
            records.close()
            side.close()


def _stream(url: str, path: str, body: dict, events: list, started: Any = None) -> None:
    """POST a streamed request; collect its events; call `started()` after the third."""
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=60, trust_env=False) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
                if started is not None and len(events) == 3:
                    started()
            elif line == "data: [DONE]":
                events.append("[DONE]")


def _tokens(events: list) -> list[int]:
    """The tokens a client saw, read from the text it got (`<id>` per token)."""
    text = ""
    for e in events:
        if e == "[DONE]" or not e.get("choices"):
            continue
        c = e["choices"][0]
        text += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return [int(t) for t in text.replace("<", " ").replace(">", " ").split()]


BODIES = [
    ("/v1/completions", {"model": "m", "prompt": "moved while it runs", "max_tokens": MAX_TOKENS, "stream": True}),
    (
        "/v1/completions",
        {
            "model": "m",
            "prompt": "asks for its ids",
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
        },
    ),
    (
        "/v1/chat/completions",
        {
            "model": "m",
            "messages": [{"role": "user", "content": "a chat moved"}],
            "max_completion_tokens": MAX_TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
]


def test_a_draining_decodes_streams_go_on_elsewhere_with_no_token_lost_or_repeated(cluster: Cluster) -> None:
    import threading

    results: list[list] = [[] for _ in BODIES]
    started = threading.Barrier(len(BODIES) + 1, timeout=30)
    threads = [
        threading.Thread(target=_stream, args=(cluster.proxy.url, path, body, out, started.wait))
        for (path, body), out in zip(BODIES, results)
    ]
    for t in threads:
        t.start()
    started.wait()  # every stream has its first events (round robin put some on A, some on B)
    cluster.drain_a()
    for t in threads:
        t.join(timeout=60)
    resumed = [b for b in cluster.b.bodies if isinstance(b.get("prompt"), list)]  # a moved stream's: token ids
    pulls = [b for b in resumed if b["stream"] is False]  # B pulls with a one-token request answered whole
    moved_to_b = [b for b in resumed if b["stream"] is True]  # then streams on from its cache
    for (path, body), events in zip(BODIES, results):
        assert events[-1] == "[DONE]"
        prompt = prompt_ids(path, body)
        assert _tokens(events) == reference(prompt, MAX_TOKENS), "a token lost or repeated at the move"
        data = [e for e in events if e != "[DONE]"]
        assert len({e["id"] for e in data}) == 1, "one stream, one id"
        if path.endswith("chat/completions"):
            assert {e["object"] for e in data} == {"chat.completion.chunk"}
            assert all("text" not in c for e in data for c in e["choices"])
        ids = [i for e in data for c in e["choices"] for i in c.get("token_ids") or ()]
        assert ids == (reference(prompt, MAX_TOKENS) if body.get("return_token_ids") else [])
        asked = [e.get("prompt_token_ids") or e["choices"][0].get("prompt_token_ids") for e in data if e["choices"]]
        assert asked[0] == (prompt if body.get("return_token_ids") else None), "the first event's, if asked for"
        assert not any(asked[1:]), "no other event's: the next decode's are the prompt and the tokens so far"
        usage = [e["usage"] for e in data if e.get("usage")]
        if (body.get("stream_options") or {}).get("include_usage"):
            assert usage == [
                {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": MAX_TOKENS,
                    "total_tokens": len(prompt) + MAX_TOKENS,
                }
            ]
    # Streams that were on A went on on B, pulling from A's side channel what the client had been sent.
    on_a = [b for b in cluster.a.bodies if "kvbridge_move_id" in (b.get("kv_transfer_params") or {})]
    assert on_a and len(moved_to_b) == len(pulls) == len(on_a)
    # the streams move at once: each pull and continuation pair by move id, in whatever order B got them
    by_move = {p["kv_transfer_params"]["kvbridge_move_id"]: p for p in pulls}
    assert len(by_move) == len(pulls)
    for stream in moved_to_b:
        pull = by_move[stream["kv_transfer_params"]["kvbridge_move_id"]]
        params = pull["kv_transfer_params"]
        assert (params["remote_engine_id"], params["remote_port"]) == ("decode-a", cluster.a_record.side_port)
        assert params["remote_num_tokens"] == len(pull["prompt"]) - 1 and not params.get("remote_block_ids")
        assert params["kvbridge_move_id"] in {b["kv_transfer_params"]["kvbridge_move_id"] for b in on_a}
        assert pull["max_tokens"] == 1 and "stream_options" not in pull
        assert stream["prompt"] == pull["prompt"] and "do_remote_prefill" not in stream["kv_transfer_params"]
        assert stream["max_tokens"] < MAX_TOKENS and stream["return_token_ids"] is True
    metrics = httpx.get(f"{cluster.proxy.url}/metrics", trust_env=False).text
    assert f'kvbridge_proxy_live_moves_total{{outcome="pulled"}} {float(len(on_a))}' in metrics
    assert not cluster.aborted, "a lease that was pulled is not aborted"


def _one(cluster: Cluster, *, leave_after: int | None = None, drain: bool = True) -> list:
    """One streamed completion through the proxy; after its third event A drains, or only B joins A."""
    events: list = []
    body = {"model": "m", "prompt": "one stream", "max_tokens": MAX_TOKENS, "stream": True}
    with httpx.stream("POST", f"{cluster.proxy.url}/v1/completions", json=body, timeout=60, trust_env=False) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[len("data: ") :]))
                if len(events) == 3:
                    [move] = cluster.move_ids()
                    cluster.ledger.offer(move, [1, 2], expected_pulls=1)  # what A's connector offers at the cut
                    cluster.drain_a() if drain else cluster.serve_b()
                if leave_after is not None and len(events) == leave_after:
                    break
    return events


def _metric(cluster: Cluster, outcome: str) -> float:
    for line in httpx.get(f"{cluster.proxy.url}/metrics", trust_env=False).text.splitlines():
        if line.startswith(f'kvbridge_proxy_live_moves_total{{outcome="{outcome}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"no live_moves_total series for {outcome}")


def _decode(admin: httpx.Client, url: str) -> dict:
    [entry] = [d for d in admin.get("/instances").json()["decode"] if d["url"] == url]
    return entry


def test_an_operator_cordons_and_drains_a_decode_at_the_proxy(cluster: Cluster) -> None:
    admin = httpx.Client(base_url=cluster.proxy.url, trust_env=False, timeout=30)
    assert admin.post("/admin/drain", json={"server": cluster.a.url}).status_code == 401
    auth = {"Authorization": f"Bearer {admin_token(SECRET)}"}
    assert admin.post("/admin/drain", json={"server": "http://nowhere"}, headers=auth).status_code == 404
    events: list = []
    body = {"model": "m", "prompt": "drained by hand", "max_tokens": MAX_TOKENS, "stream": True}

    def drain() -> None:
        cluster.serve_b()
        wait_for(lambda: not _decode(admin, cluster.b.url)["draining"], what="B serving")
        r = admin.post("/admin/drain", json={"server": cluster.a.url}, headers=auth)
        assert r.status_code == 200 and r.json()["streams_moving"] == 1, r.text

    _stream(cluster.proxy.url, "/v1/completions", body, events, drain)
    assert _tokens(events) == reference(prompt_ids("/v1/completions", body), MAX_TOKENS)
    assert _metric(cluster, "pulled") == 1.0
    a, b = _decode(admin, cluster.a.url), _decode(admin, cluster.b.url)
    assert (a["cordoned"], a["draining"], b["cordoned"]) == (True, False, False)
    assert admin.post("/admin/uncordon", json={"server": cluster.a.url}, headers=auth).status_code == 200
    assert not _decode(admin, cluster.a.url)["cordoned"]
    admin.close()


@pytest.mark.parametrize("cluster", [{"a": {"delay_s": 0.05}}], indirect=True)
def test_a_stream_that_no_decode_could_take_moves_once_one_can(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator drains A while B drains too: the stream stays on A for now, and moves once B serves again.

    (A health round that took out every other decode for a second must not keep a drained decode's streams.)"""
    admin = httpx.Client(base_url=cluster.proxy.url, trust_env=False, timeout=30)
    auth = {"Authorization": f"Bearer {admin_token(SECRET)}"}
    events: list = []
    body = {"model": "m", "prompt": "nowhere to go yet", "max_tokens": MAX_TOKENS, "stream": True}

    def drain() -> None:
        assert admin.post("/admin/drain", json={"server": cluster.a.url}, headers=auth).status_code == 200
        wait_for(lambda: any("stays on" in m for m in caplog.messages), what="the stream to stay on A")
        cluster.serve_b()

    with caplog.at_level("WARNING", logger="kvbridge_proxy.app"):
        _stream(cluster.proxy.url, "/v1/completions", body, events, drain)
    admin.close()
    assert _tokens(events) == reference(prompt_ids("/v1/completions", body), MAX_TOKENS)
    assert _metric(cluster, "pulled") == 1.0, caplog.messages
    [moved] = [m for m in caplog.messages if "moved from" in m]
    assert f"from {cluster.a.url} to {cluster.b.url}" in moved


@pytest.mark.parametrize("cluster", [{"a": {"delay_s": 0.05}}], indirect=True)
def test_a_decode_whose_record_lapsed_and_came_back_still_moves_its_streams_when_it_drains(
    cluster: Cluster, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A's and B's records lapse and come back: A keeps its running stream, cordoned B its cordon.

    The records go (their announcers stood still past the TTL) while a stream runs on A and B is cordoned; then A
    drains: the stream stays until B is uncordoned, then moves to B.

    (In a run on a starved box every record lapsed for a second at once: the proxy took A back as a new server that
    served no stream, so A's drain moved none, and took the cordoned decode back uncordoned. A lapsed server that
    answers health probes is kept LAPSE_GRACE_S now; here the records stay away longer.)"""
    monkeypatch.setattr(membership, "LAPSE_GRACE_S", 0.0)
    admin = httpx.Client(base_url=cluster.proxy.url, trust_env=False, timeout=30)
    auth = {"Authorization": f"Bearer {admin_token(SECRET)}"}
    urls = lambda: [d["url"] for d in admin.get("/instances").json()["decode"]]  # noqa: E731
    events: list = []
    body = {"model": "m", "prompt": "away and back", "max_tokens": MAX_TOKENS, "stream": True}

    def lapse_and_drain() -> None:
        [move] = cluster.move_ids()
        cluster.ledger.offer(move, [1, 2], expected_pulls=1)  # what A's connector offers at the cut
        cluster.serve_b()
        assert admin.post("/admin/cordon", json={"server": cluster.b.url}, headers=auth).status_code == 200
        for record in (cluster.a_record, cluster.b_record):
            cluster.records.withdraw(record.server_id)
        wait_for(lambda: not urls(), what="A and B to leave the pool")
        cluster.records.announce(attrs.evolve(cluster.a_record, expires=time.time() + 60), 60)
        cluster.serve_b()
        wait_for(lambda: len(urls()) == 2, what="A and B back in the pool")
        assert _decode(admin, cluster.a.url)["streams"] == 1
        assert _decode(admin, cluster.b.url)["cordoned"]
        cluster.drain_a()
        wait_for(lambda: any("stays on" in m for m in caplog.messages), what="the stream to stay on A")
        assert admin.post("/admin/uncordon", json={"server": cluster.b.url}, headers=auth).status_code == 200

    with caplog.at_level("WARNING", logger="kvbridge_proxy.app"):
        _stream(cluster.proxy.url, "/v1/completions", body, events, lapse_and_drain)
    admin.close()
    assert _tokens(events) == reference(prompt_ids("/v1/completions", body), MAX_TOKENS)
    assert _metric(cluster, "pulled") == 1.0, caplog.messages
    assert any("back with 1 running streams" in m for m in caplog.messages), caplog.messages
    [moved] = [m for m in caplog.messages if "moved from" in m]
    assert f"from {cluster.a.url} to {cluster.b.url}" in moved


@pytest.mark.parametrize("cluster", [{"b": {"fail_pulls": True}}], indirect=True)
def test_a_pull_that_fails_is_computed_instead_and_the_offered_lease_released(cluster: Cluster) -> None:
    events = _one(cluster)
    assert _tokens(events) == reference(prompt_ids("/v1/completions", {"prompt": "one stream"}), MAX_TOKENS)
    pulled, computed = [b for b in cluster.b.bodies if isinstance(b.get("prompt"), list)]
    assert pulled["kv_transfer_params"]["do_remote_prefill"] is True
    assert "do_remote_prefill" not in computed.get("kv_transfer_params", {}), "the retry computes the prompt"
    [move] = cluster.move_ids()
    wait_for(lambda: (move, LeaseState.ABORTED) in cluster.aborted, what="A's lease released")
    assert (_metric(cluster, "recomputed"), _metric(cluster, "pulled")) == (1.0, 0.0)


@pytest.mark.parametrize("cluster", [{"b": {"recompute_pulls": True}}], indirect=True)
def test_a_pull_the_next_decode_computed_instead_is_reported_recomputed(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 43: B's pull failed and B computed the KV itself (vLLM's "recompute" policy): exact, and said so."""
    with caplog.at_level("WARNING", logger="kvbridge_proxy.app"):
        events = _one(cluster)
    assert _tokens(events) == reference(prompt_ids("/v1/completions", {"prompt": "one stream"}), MAX_TOKENS)
    pull, stream = [b for b in cluster.b.bodies if isinstance(b.get("prompt"), list)]
    assert (pull["stream"], stream["stream"]) == (False, True) and stream["prompt"] == pull["prompt"]
    [move] = cluster.move_ids()
    wait_for(lambda: (move, LeaseState.ABORTED) in cluster.aborted, what="A's lease released")
    assert (_metric(cluster, "recomputed"), _metric(cluster, "pulled")) == (1.0, 0.0)
    [moved] = [r.getMessage() for r in caplog.records if "moved from" in r.getMessage()]
    assert "ms after the cut (closing the source " in moved and ", recomputed)" in moved, moved
    assert any("did not pull it" in r.getMessage() and "at_failed_ms" in r.getMessage() for r in caplog.records)


HOLD = threading.Event()


@pytest.mark.parametrize("cluster", [{"a": {"hold_done": HOLD}}], indirect=True)
def test_a_stream_that_sent_its_last_token_is_not_moved(cluster: Cluster) -> None:
    """Issue 43: A sent its last token (its finish reason), then was drained before its [DONE].

    The stream is over: a move would ask B for one token more than the client asked for (seen in chaos: one token
    too many), pulling what A never offers (the request finished on A)."""
    HOLD.clear()
    admin = httpx.Client(base_url=cluster.proxy.url, trust_env=False, timeout=30)
    auth = {"Authorization": f"Bearer {admin_token(SECRET)}"}
    events: list = []
    body = {"model": "m", "prompt": "drained at its end", "max_tokens": 6, "stream": True}
    with httpx.stream("POST", f"{cluster.proxy.url}/v1/completions", json=body, timeout=60, trust_env=False) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[len("data: ") :]))
                if not HOLD.is_set() and events[-1] != "[DONE]" and events[-1]["choices"][0].get("finish_reason"):
                    cluster.serve_b()
                    wait_for(lambda: not _decode(admin, cluster.b.url)["draining"], what="B serving")
                    drained = admin.post("/admin/drain", json={"server": cluster.a.url}, headers=auth)
                    assert drained.status_code == 200 and drained.json()["streams_moving"] == 1, drained.text
                    HOLD.set()  # A's [DONE] comes only now
    admin.close()
    assert events[-1] == "[DONE]"
    assert _tokens(events) == reference(prompt_ids("/v1/completions", body), 6), "no token more than asked for"
    assert not [b for b in cluster.b.bodies if isinstance(b.get("prompt"), list)], "nothing moved"
    assert _metric(cluster, "pulled") == _metric(cluster, "recomputed") == 0.0


def _stages(cluster: Cluster) -> list[dict]:
    """The pre-copy stages B was asked to pull."""
    asked = [b for b in cluster.b.bodies if isinstance(b.get("prompt"), list)]
    return [b for b in asked if precopied(b["kv_transfer_params"].get("kvbridge_move_id", "")) is not None]


def _released(cluster: Cluster, lease: str) -> bool:
    """Whether the proxy released `lease` on A: an offer of it ends at once if the abort came first, or at the abort.

    Offered once: on a loaded box the abort may come after the first look, and a second offer of a lease that is
    still active is refused."""
    if cluster.ledger.state(lease) is LeaseState.UNKNOWN:
        cluster.ledger.offer(lease, [7])
    return (lease, LeaseState.ABORTED) in cluster.aborted


PRECOPY = MoveSettings(tail_tokens=4)


@pytest.mark.parametrize(
    "cluster",
    [{"moves": PRECOPY}, {"moves": attrs.evolve(PRECOPY, tail="pull")}],
    indirect=True,
    ids=["compute", "pull"],
)
def test_a_stream_is_pre_copied_while_it_runs_then_cut_with_its_tail_left(cluster: Cluster, request: Any) -> None:
    """Issue 43: B pulls the context A filled while the stream runs on A; after the cut, B computes or pulls the rest.

    Computed (the default), the cut needs nothing of A, whose offered blocks are released. The pre-copy stages each
    read under a lease of their own; the move is reported pre-copied."""
    events = _one(cluster)
    prompt = prompt_ids("/v1/completions", {"prompt": "one stream"})
    assert _tokens(events) == reference(prompt, MAX_TOKENS)
    [move] = cluster.move_ids()
    stages = _stages(cluster)
    assert [s["kv_transfer_params"]["kvbridge_move_id"] for s in stages] == [
        precopy_id(move, n) for n in range(1, len(stages) + 1)
    ]
    assert 1 <= len(stages) <= PRECOPY.stages
    context = prompt + reference(prompt, MAX_TOKENS)
    for s in stages:  # each the context the client had, pulled whole but for the token vLLM computes anyway
        assert (s["stream"], s["max_tokens"], s["prompt"]) == (False, 1, context[: len(s["prompt"])])
        assert s["kv_transfer_params"]["remote_num_tokens"] == len(s["prompt"]) - 1
    assert len(stages[0]["prompt"]) >= len(prompt) + 3, "the context after the third event"
    after = [b for b in cluster.b.bodies if isinstance(b.get("prompt"), list) and b not in stages]
    resumed = after[-1]
    assert resumed["stream"] is True and "do_remote_prefill" not in resumed["kv_transfer_params"]
    left = len(resumed["prompt"]) - len(stages[-1]["prompt"])
    assert left <= PRECOPY.tail_tokens + 1 or len(stages) == PRECOPY.stages, (left, len(stages))
    if "pull" in request.node.callspec.id:
        [cut] = after[:-1]
        assert cut["kv_transfer_params"]["kvbridge_move_id"] == move and cut["stream"] is False
        assert cut["prompt"] == resumed["prompt"]
    else:
        assert after == [resumed], "the tail is computed: no pull after the cut"
        wait_for(lambda: (move, LeaseState.ABORTED) in cluster.aborted, what="A's offered blocks released")
    assert (_metric(cluster, "precopied"), _metric(cluster, "pulled")) == (1.0, 0.0)


@pytest.mark.parametrize(
    "cluster",
    [{"moves": PRECOPY, "b": {"held_stages": True}}, {"moves": PRECOPY, "b": {"recompute_pulls": True}}],
    indirect=True,
    ids=["held", "failed"],
)
def test_a_stage_that_read_nothing_still_covers_its_context_and_one_whose_pull_failed_does_not(
    cluster: Cluster, request: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 43: B held all of a stage's context but what it computed: the cut computes only the tail after it.

    A stage whose pull failed ends the pre-copy instead (something is wrong with A's side), and the cut pulls."""
    with caplog.at_level("INFO", logger="kvbridge_proxy.app"):
        events = _one(cluster)
    assert _tokens(events) == reference(prompt_ids("/v1/completions", {"prompt": "one stream"}), MAX_TOKENS)
    [move] = cluster.move_ids()
    stages = _stages(cluster)
    assert stages, "pre-copied"
    for s in stages:  # none of them was read: each lent lease is released
        lease = s["kv_transfer_params"]["kvbridge_move_id"]
        wait_for(lambda lease=lease: _released(cluster, lease), what=f"{lease} released")
    after = [b for b in cluster.b.bodies if isinstance(b.get("prompt"), list) and b not in stages]
    logged = [r.getMessage() for r in caplog.records]
    if request.node.callspec.id == "held":
        assert [b["stream"] for b in after] == [True], "the tail is computed: no pull after the cut"
        assert _metric(cluster, "precopied") == 1.0
        assert any("held what pre-copy stage" in m for m in logged)
        assert not any("pre-copy stage" in m and "failed" in m for m in logged)
    else:
        assert len(stages) == 1 and [b["stream"] for b in after] == [False, True], "the cut pulls"
        assert any("pre-copy stage 1" in m and "its pull failed" in m for m in logged)


@pytest.mark.parametrize(
    "cluster",
    [{"b": {"uncached": True}}, {"b": {"uncached": True}, "moves": PRECOPY}],
    indirect=True,
    ids=["stop-and-copy", "precopy"],
)
def test_a_move_to_a_decode_without_prefix_caching_is_reported_recomputed_and_pulls_nothing_once_known(
    cluster: Cluster, request: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A decode without prefix caching keeps nothing it pulls: its continuation computes the whole context.

    Its answer to the first pull (the move's, or a pre-copy stage's) says so: the move is counted recomputed, no
    further pull or stage goes to it, A's offered blocks are released, and /instances shows it."""
    with caplog.at_level("INFO", logger="kvbridge_proxy.app"):
        events = _one(cluster)
    assert _tokens(events) == reference(prompt_ids("/v1/completions", {"prompt": "one stream"}), MAX_TOKENS)
    asked = [b for b in cluster.b.bodies if isinstance(b.get("prompt"), list)]
    [pull, resumed] = asked  # one pull told; nothing more is read for it (a second stage, a pull at the cut)
    assert (pull["stream"], resumed["stream"]) == (False, True)
    assert "do_remote_prefill" not in resumed.get("kv_transfer_params", {})
    [move] = cluster.move_ids()
    if request.node.callspec.id == "precopy":
        assert precopied(pull["kv_transfer_params"]["kvbridge_move_id"]) is not None, "the first stage told"
        wait_for(lambda: (move, LeaseState.ABORTED) in cluster.aborted, what="A's offered blocks released")
    assert (_metric(cluster, "recomputed"), _metric(cluster, "pulled"), _metric(cluster, "precopied")) == (1, 0, 0)
    logged = [r.getMessage() for r in caplog.records]
    assert any(f"decode server {cluster.b.url} runs without prefix caching" in m for m in logged), logged
    [moved] = [m for m in logged if "moved from" in m]
    assert ", recomputed)" in moved, moved
    with httpx.Client(base_url=cluster.proxy.url, trust_env=False) as admin:
        assert _decode(admin, cluster.b.url)["prefix_cache"] is False


WAIT = threading.Event()


def _one_whole(cluster: Cluster, stages_wait: threading.Event | None = None) -> None:
    """`_one`, its tokens checked whole and exact; `stages_wait` (B's `precopy_wait`) holds B's stages meanwhile."""
    if stages_wait is not None:
        stages_wait.clear()
    try:
        events = _one(cluster)
    finally:
        if stages_wait is not None:
            stages_wait.set()
    assert events[-1] == "[DONE]"
    assert _tokens(events) == reference(prompt_ids("/v1/completions", {"prompt": "one stream"}), MAX_TOKENS)


@pytest.mark.parametrize("cluster", [{"moves": PRECOPY, "b": {"precopy_wait": WAIT}}], indirect=True)
def test_a_stream_that_ends_during_its_pre_copy_is_not_moved_and_its_lent_lease_released(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 43: B's pre-copy stage is slow; the stream finishes on A meanwhile.

    Nothing is cut, the stage's lease on A is released (so A's engine frees the request's blocks), B's stage is
    dropped, and the proxy says why nothing moved."""
    with caplog.at_level("WARNING", logger="kvbridge_proxy.app"):
        _one_whole(cluster, WAIT)
        # the stage's task hears of the end as the proxy closes the stream: on a loaded box, after the client's [DONE]
        wait_for(lambda: any("during its pre-copy" in m for m in caplog.messages), what="why nothing moved")
    [move] = cluster.move_ids()
    [stage] = _stages(cluster)
    assert len(cluster.b.bodies) == 1, "nothing asked of B but the stage"
    wait_for(lambda: _released(cluster, precopy_id(move, 1)), what="the stage's lease released on A")
    assert _metric(cluster, "precopied") == _metric(cluster, "pulled") == _metric(cluster, "recomputed") == 0.0
    [ended] = [m for m in caplog.messages if "during its pre-copy" in m]
    assert move in ended and "nothing to move" in ended, ended


@pytest.mark.parametrize("cluster", [{"moves": PRECOPY, "b": {"precopy_dies": True}}], indirect=True)
def test_a_stream_whose_next_decode_dies_during_pre_copy_stays_and_ends_whole(cluster: Cluster) -> None:
    """Issue 43: B drops the pre-copy stage (it died).

    B is taken out, the stream finishes on A (no other decode), and the stage's lease on A is released."""
    _one_whole(cluster)
    [move] = cluster.move_ids()
    asked = [s["kv_transfer_params"]["kvbridge_move_id"] for s in _stages(cluster)]
    assert asked == [precopy_id(move, 1)] * 2, "dropped unanswered: asked once more, then taken out"
    wait_for(lambda: _released(cluster, precopy_id(move, 1)), what="the stage's lease released on A")
    assert _metric(cluster, "precopied") == _metric(cluster, "pulled") == 0.0


@pytest.mark.parametrize(
    "cluster", [{"moves": PRECOPY, "a": {"die_after": 8}, "b": {"precopy_wait": WAIT}}], indirect=True
)
def test_a_stream_whose_decode_dies_during_pre_copy_is_computed_on_the_next(cluster: Cluster) -> None:
    """Issue 43: A dies while B's pre-copy stage runs: the stage is dropped and B computes the stream (recomputed)."""
    _one_whole(cluster, WAIT)
    [move] = cluster.move_ids()
    wait_for(lambda: _released(cluster, precopy_id(move, 1)), what="the stage's lease released on A")
    assert (_metric(cluster, "recomputed"), _metric(cluster, "precopied")) == (1.0, 0.0)


def _continued(cluster: Cluster, prompt: list[int]) -> float | None:
    """When the continuation of the stream of `prompt` reached B (None: it did not)."""
    for body, at in zip(list(cluster.b.bodies), list(cluster.b.arrived), strict=False):
        if body.get("stream") is True and body["prompt"][: len(prompt)] == prompt:
            return at
    return None


HELD = threading.Event()
LONG = 200  # tokens a stream asks for: it runs on A for about 4 s, through the pre-copies


@pytest.mark.parametrize(
    "cluster",
    [
        {"moves": attrs.evolve(PRECOPY, cut_together_s=30.0), "b": {"precopy_wait": HELD, "precopy_wait_from": 1}},
        {"moves": attrs.evolve(PRECOPY, cut_together_s=0.0), "b": {"precopy_wait": HELD, "precopy_wait_from": 1}},
    ],
    indirect=True,
    ids=["together", "apart"],
)
def test_streams_pre_copied_to_one_decode_are_cut_together(cluster: Cluster, request: Any) -> None:
    """Issue 43: two streams drain from A to B; B answers one's pre-copy stage at once and holds the other's.

    With `cut_together_s`, the stream whose stage ended goes on on A until the other's stage ends, and only then do
    both continuations reach B; with 0 the first is cut at once, while B still holds the other's stage."""
    together = request.node.callspec.id == "together"
    quick, released = [], []

    def hold_one_stage(ids: dict[str, list[int]], events: dict[str, list]) -> None:
        try:
            wait_for(lambda: len(_stages(cluster)) == 2, what="both streams' first stages asked of B")
            first_stage = _stages(cluster)[0]  # B answered it at once and holds the other
            quick.extend(p for p, i in ids.items() if first_stage["prompt"][: len(i)] == i)
            if together:  # (apart, it is cut within an event or two of its stage)
                seen = len(events[quick[0]])
                wait_for(lambda: len(events[quick[0]]) >= seen + 10, what="ten more events of the stream staged")
            else:
                wait_for(lambda: _continued(cluster, ids[quick[0]]) is not None, what="its continuation at B")
            released.append(time.monotonic())
        finally:
            HELD.set()

    HELD.clear()
    ids = _two_long_streams(cluster, hold_one_stage)
    continued = {p: _continued(cluster, i) for p, i in ids.items()}
    assert None not in continued.values(), "both streams went on on B"
    if together:
        assert min(continued.values()) >= released[0], "a stream was cut while B still held the other's pre-copy"
    else:
        assert continued[quick[0]] < released[0], "cut at once, while B held the other's pre-copy"
    assert _metric(cluster, "precopied") == 2.0


def _two_long_streams(
    cluster: Cluster, during: Callable[[dict[str, list[int]], dict[str, list]], None] | None = None
) -> dict[str, list[int]]:
    """Two streams of `LONG` tokens through the proxy; once both have three events A drains. Their prompts' ids.

    `during(ids, events)` runs after the drain, while they stream. Each client's tokens are checked whole and exact."""
    ids = {p: prompt_ids("/v1/completions", {"prompt": p}) for p in ("first of two", "second of two")}
    events: dict[str, list] = {p: [] for p in ids}
    started = threading.Barrier(3, timeout=30)
    bodies = {p: {"model": "m", "prompt": p, "max_tokens": LONG, "stream": True} for p in ids}
    threads = [
        threading.Thread(
            target=_stream,
            args=(cluster.proxy.url, "/v1/completions", bodies[p]),
            kwargs={"events": events[p], "started": started.wait},
        )
        for p in ids
    ]
    try:
        for t in threads:
            t.start()
        started.wait()  # both streams have three events from A
        for move in cluster.move_ids():
            cluster.ledger.offer(move, [1, 2], expected_pulls=1)  # what A's connector offers at the cut
        cluster.drain_a()
        if during is not None:
            during(ids, events)
    finally:
        for t in threads:
            t.join(60)
    for p, i in ids.items():
        assert events[p][-1] == "[DONE]" and _tokens(events[p]) == reference(i, LONG), p
    return ids


@pytest.mark.parametrize(
    "cluster",
    [
        {"moves": attrs.evolve(PRECOPY, cuts_at_once=1), "b": {"first_delay_s": 1.0}},
        {"moves": attrs.evolve(PRECOPY, cuts_at_once=2), "b": {"first_delay_s": 1.0}},
    ],
    indirect=True,
    ids=["one", "two"],
)
def test_pre_copied_streams_are_cut_to_a_decode_one_at_a_time(cluster: Cluster, request: Any) -> None:
    """Issue 43: two streams pre-copied from A to B, whose first step takes 1 s; cut together, then one at a time.

    With `cuts_at_once=1` the second continuation reaches B only after the first one's first event left it (the
    second stream runs on A meanwhile); with 2 both are cut at once."""
    ids = _two_long_streams(cluster)
    came = sorted((_continued(cluster, i), p) for p, i in ids.items())
    (first_at, first), (second_at, _) = came
    [first_event] = [at for at, prompt in cluster.b.first_sent if prompt[: len(ids[first])] == ids[first]]
    if request.node.callspec.id == "one":
        assert second_at >= first_event, "the second stream was cut before the first one's first event from B"
    else:
        assert second_at < first_event, "both cut at once"
    assert _metric(cluster, "precopied") == 2.0


def test_the_move_options_reach_the_settings_and_are_refused_when_nothing_would_read_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import argparse

    from kvbridge_proxy import cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())

    def parsed(*argv: str) -> argparse.Namespace:
        return parser.parse_args(["proxy", "--live-moves", *argv])

    assert cli.settings(parsed()).moves.cut_together_s == MoveSettings().cut_together_s == 2.0
    assert cli.settings(parsed("--precopy-cut-together", "0")).moves.cut_together_s == 0.0
    for wait in ("-1", "nan", "inf"):  # NaN compares false with every bound, so it slipped past `< 0`
        with pytest.raises(ConfigError, match="cut_together_s from 0 seconds and finite"):
            MoveSettings(cut_together_s=float(wait))
    # each number is refused by argparse, naming the option (the settings' own checks named their fields)
    for argv in (
        ["--precopy-cut-together", "nan"],
        ["--precopy-stages", "0"],
        ["--precopy-tail", "-1"],
        ["--precopy-cuts-at-once", "0"],
        ["--rebalance-above", "1.5"],
        ["--health-interval", "0"],
        ["--timeout", "inf"],
        ["--connect-timeout", "-1"],
    ):
        with pytest.raises(SystemExit):
            parsed(*argv)
        assert f"argument {argv[0]}: expected" in capsys.readouterr().err
    # how streams move, or when, without moving them at all: refused, not ignored
    for argv, why in [
        (["--move", "recompute"], "add --live-moves"),
        (["--precopy-tail", "4"], "add --live-moves"),
        (["--rebalance-above", "0.9"], "add --rebalance"),
    ]:
        with pytest.raises(ConfigError, match=why):
            cli.settings(parser.parse_args(["proxy", *argv]))
    assert cli.settings(parser.parse_args(["proxy", "--rebalance", "--precopy-tail", "4"])).moves.tail_tokens == 4
    for timeout in (0.0, math.nan, math.inf):
        with pytest.raises(ConfigError, match="finite stage_timeout_s above 0"):
            MoveSettings(stage_timeout_s=timeout)


def test_a_client_that_leaves_releases_the_blocks_its_decode_offers(cluster: Cluster) -> None:
    events = _one(cluster, leave_after=5, drain=False)
    assert len(events) == 5
    [move] = cluster.move_ids()
    wait_for(lambda: (move, LeaseState.ABORTED) in cluster.aborted, what="A's lease released")
    assert not [b for b in cluster.b.bodies if isinstance(b.get("prompt"), list)], "nothing moved"


def test_a_release_that_got_no_answer_is_asked_again_until_the_rank_answers(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A's side channel is down when the client leaves, and comes back: the proxy's release reaches it then.

    (In a run, a draining decode stood still for 15 s as the proxy released three leases it offered: each lease held
    its blocks until it expired, past the server's shutdown timeout, and vLLM killed the engine.)"""
    port = cluster.side.address[1]
    cluster.side.close()
    with caplog.at_level("INFO", logger="kvbridge_proxy.app"):
        events = _one(cluster, leave_after=5, drain=False)
        assert len(events) == 5
        [move] = cluster.move_ids()
        wait_for(lambda: "asking again" in caplog.text, what="a release that got no answer")
        assert (move, LeaseState.ABORTED) not in cluster.aborted
        side = ControlServer("decode-a", port=port, ledger=cluster.ledger, secret=SECRET, poll_interval_s=0.01)
        try:
            wait_for(lambda: (move, LeaseState.ABORTED) in cluster.aborted, what="A's lease released")
            # the ledger aborts as the side channel answers; the proxy logs once that answer reached it
            wait_for(lambda: f"released request {move}" in caplog.text, what="the proxy's release logged")
        finally:
            side.close()


@pytest.mark.parametrize("cluster", [{"a": {"die_after": 8}}], indirect=True)
def test_a_stream_whose_decode_dies_is_computed_on_another(cluster: Cluster) -> None:
    events = _one(cluster, drain=False)
    assert events[-1] == "[DONE]"
    assert _tokens(events) == reference(prompt_ids("/v1/completions", {"prompt": "one stream"}), MAX_TOKENS)
    assert _metric(cluster, "recomputed") == 1.0


@pytest.mark.parametrize("cluster", [{"a": {"die_after": 0}}], indirect=True)
def test_a_movable_stream_whose_decode_dies_before_its_first_event_goes_to_the_next(cluster: Cluster) -> None:
    # The client got nothing from A: the same decode request goes to B (prefill's KV is there for whichever asks).
    admin = httpx.Client(base_url=cluster.proxy.url, trust_env=False, timeout=30)
    cluster.serve_b()
    wait_for(lambda: not _decode(admin, cluster.b.url)["draining"], what="B serving")
    bodies = [{"model": "m", "prompt": f"stream {i}", "max_tokens": MAX_TOKENS, "stream": True} for i in range(2)]
    streams = [[], []]
    for body, events in zip(bodies, streams):  # A answers /health: it is picked again, and dies again
        _stream(cluster.proxy.url, "/v1/completions", body, events)
    admin.close()
    for body, events in zip(bodies, streams):
        assert _tokens(events) == reference(prompt_ids("/v1/completions", body), MAX_TOKENS)
    assert cluster.a.bodies and len(cluster.b.bodies) == 2, "whatever A took and died on, B took"
    for died_on in cluster.a.bodies:
        [again] = [b for b in cluster.b.bodies if b["prompt"] == died_on["prompt"]]
        assert again["kv_transfer_params"]["remote_request_id"] == "r", "the same decode request: prefill's KV"
    # the time on A is a phase of its own in each such request's timeline, not B's time to the first token
    metrics = httpx.get(f"{cluster.proxy.url}/metrics", trust_env=False).text.splitlines()
    [count] = [line for line in metrics if line.startswith('kvbridge_proxy_phase_seconds_count{phase="decode_failed"}')]
    assert float(count.split()[-1]) == len(cluster.a.bodies)


@pytest.mark.parametrize("cluster", [{"a": {"die_after": 0}, "expose": False}], indirect=True)
def test_a_movable_streams_error_answer_names_what_failed_but_no_address(cluster: Cluster) -> None:
    # B drains: no other decode takes it. Without expose_internals the client reads the server's label and the kind
    # of error, as for a stream that cannot move, never the error's text (it can carry an address).
    body = {"model": "m", "prompt": "no other decode", "max_tokens": MAX_TOKENS, "stream": True}
    r = httpx.post(f"{cluster.proxy.url}/v1/completions", json=body, timeout=30, trust_env=False)
    assert r.status_code == 503, r.text
    error = r.json()["error"]["message"]
    expected = r"decode server decode-\d failed: RemoteProtocolError; no other decode server took it \(.*\)"
    assert re.fullmatch(expected, error), error
    assert cluster.a.bodies and not cluster.b.bodies
    assert "127.0.0.1" not in r.text and "peer closed" not in r.text, r.text


TEXT = {"type": "text", "text": "what is in it?"}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


@pytest.mark.parametrize(
    ("path", "extra", "why"),
    [
        ("/v1/completions", {"stream": False}, "not streamed"),
        ("/v1/completions", {"seed": 3}, "seeded"),
        ("/v1/completions", {"stop": ["x"]}, "stop strings"),
        ("/v1/completions", {"n": 2}, "several sequences"),
        ("/v1/completions", {"presence_penalty": 0.5}, "penalties"),
        ("/v1/completions", {"response_format": {"type": "json_object"}}, "structured output"),
        ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tool calls"),
        ("/v1/chat/completions", {"logprobs": True}, "chat logprobs"),
        ("/v1/chat/completions", {"logprob_token_ids": [5]}, "chat logprobs"),
        # vLLM checks these against the request's own output tokens only (its sampler's `apply_bad_words` gets
        # `output_token_ids`), which on the next decode start at the cut
        ("/v1/completions", {"bad_words": ["ab"]}, "bad word"),
        ("/v1/completions", {"repetition_detection": {"max_pattern_size": 4}}, "repetition detection"),
        ("/v1/chat/completions", {"thinking_token_budget": 64}, "thinking budget"),
        ("/v1/completions", {"watermarking": True}, "watermarking"),
        ("/v1/completions", {"vllm_xargs": {"my_processor": 1}}, "vllm_xargs"),
        # a continuation is token ids: an image's placeholders without the image (or its positions)
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [TEXT, IMAGE]}]}, "media"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "media"),
        ("/v1/completions", {"prompt_embeds": "base64 of a tensor"}, "embeddings"),
    ],
)
def test_requests_whose_parameters_cannot_be_carried_are_not_moved(path: str, extra: dict, why: str) -> None:
    body = {"model": "m", "stream": True, "max_tokens": 4}
    assert refusal(path, body) is None
    harmless = {"repetition_penalty": 1.2, "response_format": {"type": "text"}, "thinking_token_budget": -1}
    assert refusal(path, body | harmless | {"bad_words": [], "watermarking": False, "vllm_xargs": {}}) is None
    texts = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [TEXT, TEXT]}]
    assert refusal(path, body | {"messages": texts}) is None
    assert why in (refusal(path, body | extra) or "")


VLLM_METRICS = """# HELP vllm:kv_cache_usage_perc KV-Cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} %s
"""


def test_a_continuation_carries_what_shapes_each_step_and_a_pull_only_what_it_needs() -> None:
    body = {"model": "m", "stream": True, "max_tokens": 8, "temperature": 0, "logprobs": 2, "logprob_token_ids": [5, 6]}
    body |= {"stream_interval": 2, "stop_token_ids": [7], "return_token_ids": False, "echo": True, "prompt": "xyz"}
    stream = MovingStream("/v1/completions", body, prompt=[1, 2, 3], generated=[4, 5])
    resumed = stream.resume_body(None, mark=True)
    assert resumed["prompt"] == [1, 2, 3, 4, 5] and resumed["max_tokens"] == 6
    assert {k: resumed[k] for k in ("logprobs", "logprob_token_ids", "stream_interval", "stop_token_ids")} == {
        "logprobs": 2,
        "logprob_token_ids": [5, 6],
        "stream_interval": 2,
        "stop_token_ids": [7],
    }
    assert "echo" not in resumed and resumed["return_token_ids"] is True
    pull = stream.pull_body(KVTransferParams(remote_engine_id="a"), lease="L")
    assert pull["max_tokens"] == 1 and pull["stream"] is False
    assert not {"logprobs", "logprob_token_ids", "return_token_ids"} & set(pull)
    chat = MovingStream("/v1/chat/completions", body, prompt=[1, 2, 3], generated=[4, 5])
    assert not {"logprobs", "logprob_token_ids"} & set(chat.resume_body(None, mark=False))


def test_the_rebalancing_policy_moves_a_quarter_of_a_full_decodes_longest_streams_to_an_idle_one() -> None:
    assert kv_usage(VLLM_METRICS % "0.85") == 0.85 and kv_usage("# nothing\n") is None
    hot, cold, mid = (Instance(f"http://d{i}", "decode", f"decode-{i}") for i in range(3))
    for n in range(8):
        stream = MovingStream("/v1/completions", {}, prompt=[1] * 10, generated=[2] * n)
        hot.streams.add(stream)
    policy = Policy(above=0.8, below=0.4)
    moved, target = policy.plan({hot: 0.9, cold: 0.1, mid: 0.5})
    assert target is cold and [len(s.generated) for s in moved] == [7, 6]
    assert policy.plan({hot: 0.7, cold: 0.1}) == ([], None)  # nobody over the bar
    assert policy.plan({hot: 0.9, mid: 0.5}) == ([], None)  # nobody idle enough
    with pytest.raises(ConfigError, match="rebalance-below"):
        Policy(above=0.4, below=0.6)


def test_a_stream_moves_to_a_decode_without_prefix_caching_only_where_no_other_takes_it() -> None:
    """A decode without prefix caching computes a moved stream whole: nothing is sent there while another takes it.

    Neither a drain nor the rebalancer sends one there while a decode with prefix caching takes the stream; where
    none does, it is used, and the rebalancer's choice among such decodes stands."""
    pool = Pool("decode", [f"http://d{i}" for i in range(4)])
    source, cached, plain, other = pool.instances
    plain.prefix_cache = other.prefix_cache = False
    for _ in range(4):  # the pool's round robin never lands on a decode without prefix caching
        assert next_decode(pool, source, None) is cached
    assert next_decode(pool, source, plain) is cached  # a preferred one without it is passed over
    cached.cordoned = True
    assert next_decode(pool, source, plain) is plain  # none with it takes the stream: the preferred one
    assert {next_decode(pool, source, None) for _ in range(4)} == {plain, other}
    plain.cordoned = other.cordoned = True
    with pytest.raises(NoInstance):
        next_decode(pool, source, None)

    hot, idle_plain, busy_cached = (Instance(f"http://r{i}", "decode", f"decode-{i}") for i in range(3))
    hot.streams.add(MovingStream("/v1/completions", {}, prompt=[1] * 10))
    idle_plain.prefix_cache = False
    policy = Policy(above=0.8, below=0.4)
    # the only idle decode would compute the stream whole, and the rest of the pool is not idle: nothing moves
    assert policy.plan({hot: 0.9, idle_plain: 0.1, busy_cached: 0.6}) == ([], None)
    assert policy.plan({hot: 0.9, idle_plain: 0.1, busy_cached: 0.3})[1] is busy_cached
    busy_cached.prefix_cache = False  # none keeps what it pulls: the emptiest
    assert policy.plan({hot: 0.9, idle_plain: 0.1, busy_cached: 0.3})[1] is idle_plain


def test_a_cut_goes_before_events_the_client_has_not_got_unless_the_decode_already_finished() -> None:
    """Events a decode sent faster than the proxy forwards them wait in the proxy; a cut must not wait behind them.

    Seen on real vLLM under load: three of eight streams on a draining decode were never moved, the queue never
    emptying. A decode that already sent its last token offers nothing to pull: that stream ends as it is."""

    async def go() -> list:
        stream = MovingStream("/v1/completions", {"stream": True}, prompt=[1, 2, 3])
        up = Upstream(Instance("http://a", "decode", "decode-0"), resp=None, moving=stream, marked=True)  # type: ignore[arg-type]
        for n in range(5):
            up.queue.put_nowait(("event", {"choices": [{"text": f"<{n}>", "token_ids": [n]}]}))
        got = [await up.next()]
        stream.request_cut("its decode drains")
        got.append(await up.next())
        up.ending = True  # the pump read its finish reason
        got.append(await up.next())
        while not up.queue.empty():  # the client got every event: the cut is still asked for, the queue empty
            await up.next()
        waiting = asyncio.ensure_future(up.next())
        await asyncio.sleep(0)
        up.queue.put_nowait(("done", None))
        got.append(await waiting)
        return got

    first, cut, after, done = asyncio.run(go())
    assert first[0] == "event" and cut == ("cut", "its decode drains") and after[0] == "event"
    assert done == ("done", None), "a finished decode's stream waits for its [DONE], not for a cut"


def test_a_pre_copied_stream_is_cut_right_after_its_next_event_or_at_most_a_bound_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pre-copied stream's cut waits for its next event, so that the client's gap starts at the cut.

    A decode that sends no event (stuck) still has its stream cut, `CUT_AT_EVENT_S` after the pre-copy ended."""
    from kvbridge_proxy import moving_stream

    monkeypatch.setattr(moving_stream, "CUT_AT_EVENT_S", 0.05)

    async def go() -> tuple[bool, bool, bool, bool]:
        at_event = MovingStream("/v1/completions", {"stream": True}, prompt=[1, 2, 3])
        at_event.end_precopy("decode-b", 3)
        asked_before = at_event.cut_requested
        at_event.at_event()
        stuck = MovingStream("/v1/completions", {"stream": True}, prompt=[1, 2, 3])
        stuck.end_precopy("decode-b", 3)
        asked_at_once = stuck.cut_requested
        await asyncio.wait_for(stuck.wait_cut(), 5)
        return asked_before, at_event.cut_requested, asked_at_once, stuck.cut_requested

    assert asyncio.run(go()) == (False, True, False, True)


def test_a_move_asks_its_decode_again_when_slow_to_accept_and_takes_it_out_when_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A move's requests go to the one decode that holds the stream's KV (its pull, then its continuation).

    A connect timeout is a busy server that never saw the request (in a loaded CI run one failed a moved stream): it
    is asked once more and stays in. A refused connection is a server gone: it is taken out at once."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    refused_url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    with closed, Unaccepting() as busy, caplog.at_level("WARNING", logger="kvbridge_proxy.app"):
        urls = [busy.url], [busy.url, refused_url]
        settings = ProxySettings(*urls, health_interval=60, timeout=5, connect_timeout=0.3)
        proxy = Proxy(settings)
        slow, gone = proxy.pools["decode"].instances

        async def send(target: Instance) -> httpx.Response | None:
            what = "pulling a moved stream"
            return await proxy.moves.takeover.send_moved(target, {"prompt": [1]}, {}, stream=False, what=what)

        async def both() -> list[httpx.Response | None]:
            try:
                return [await send(slow), await send(gone)]
            finally:
                await proxy.client.aclose()

        assert asyncio.run(both()) == [None, None]
    late = [m for m in caplog.messages if "did not accept the connection for pulling a moved stream" in m]
    assert [m.endswith(": once more") for m in late] == [True, False], caplog.messages
    assert slow.healthy and not gone.healthy
    assert any(f"{refused_url} failed pulling a moved stream (ConnectError" in m for m in caplog.messages)


class Dropping:
    """A server on 127.0.0.1 that reads each request and drops its first `drops` connections unanswered.

    As a server closing a kept-alive connection as it is reused; then it answers 200 `{}`."""

    def __init__(self, drops: int) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.drops, self.seen = drops, 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                with conn:
                    conn.settimeout(5)
                    data = b""
                    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < self._length(data):
                        data += conn.recv(65536)
                    self.seen += 1
                    if self.seen > self.drops:
                        conn.sendall(
                            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
                        )

    @staticmethod
    def _length(data: bytes) -> int:
        head = data.split(b"\r\n\r\n", 1)[0].lower()
        for line in head.split(b"\r\n"):
            if line.startswith(b"content-length:"):
                return int(line.split(b":")[1])
        return 0

    def close(self) -> None:
        self.sock.close()
        self.thread.join(timeout=5)


def test_a_move_asks_again_when_its_decode_dropped_the_connection_unanswered(caplog: pytest.LogCaptureFixture) -> None:
    """A connection dropped before any answer is asked once more; dropped twice, the decode is taken out.

    vLLM's server closes a kept-alive connection after 5 s idle; one closed as the proxy reused it failed a move."""
    once, always = Dropping(1), Dropping(10)
    try:
        with caplog.at_level("WARNING", logger="kvbridge_proxy.app"):
            proxy = Proxy(ProxySettings([once.url], [once.url, always.url], health_interval=60, timeout=5))
            flaky, gone = proxy.pools["decode"].instances
            what = "taking a moved stream"

            async def both() -> list[httpx.Response | None]:
                try:
                    return [
                        await proxy.moves.takeover.send_moved(t, {"prompt": [1]}, {}, stream=False, what=what)
                        for t in (flaky, gone)
                    ]
                finally:
                    await proxy.client.aclose()

            answered, dropped = asyncio.run(both())
        assert answered is not None and answered.status_code == 200 and dropped is None
        assert (once.seen, always.seen) == (2, 2)
        assert flaky.healthy and not gone.healthy
        assert any(f"{once.url} dropped taking a moved stream" in m and "once more" in m for m in caplog.messages)
        assert any(f"{always.url} failed taking a moved stream (" in m for m in caplog.messages), caplog.messages
    finally:
        once.close()
        always.close()
