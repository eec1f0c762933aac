"""`kvbridge proxy` routing, against small real HTTP upstreams on 127.0.0.1 that answer like vLLM's
OpenAI server does in a P/D pair (the end-to-end tests run it against real vLLM servers).

These pin what is hard to provoke with real servers at the right moment: a decode server that is
dead before the health loop has noticed it.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request

from kvbridge.adapters.vllm import proxy
from kvbridge.adapters.vllm.proxy import SLOW_PROBES, create_app
from kvbridge.control.params import KVTransferParams
from kvbridge.testing.ports import free_port


class Serving:
    """A uvicorn server for `app` on 127.0.0.1, in a thread, for the life of a `with` block."""

    def __init__(self, app: FastAPI) -> None:
        self.port = free_port(span=1)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Serving:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()


class Upstream(Serving):
    """Answers like a vLLM server of `role` (after `slow_complete_s`), records the bodies it was sent, and
    answers /health slowly (`slow_health_s`) for its first `slow_health` probes."""

    def __init__(
        self, role: str, *, slow_health: int = 0, slow_health_s: float = 0.0, slow_complete_s: float = 0.0
    ) -> None:
        self.role, self.bodies, self.health_calls = role, [], 0
        app = FastAPI()

        @app.post("/v1/completions")
        async def complete(request: Request) -> dict:
            body = await request.json()
            self.bodies.append(body)
            if role == "prefill":  # as KVBridgeConnector reports: where the KV is, how long prefill took
                params = {
                    "remote_engine_id": "e",
                    "remote_request_id": "r",
                    "remote_host": "127.0.0.1",
                    "remote_port": 5800,
                    "remote_block_ids": [1, 2],
                    "kvbridge_timing": {"prefill_ms": 0.5},
                }
            else:  # and the decode's pull phases, in its (non-streamed) answer
                phases = {"dispatch_ms": 0.0, "queue_ms": 0.1, "offer_wait_ms": 0.05, "control_ms": 0.2}
                phases |= {"transfer_ms": 0.3, "done_ms": 0.4}
                params = {"kvbridge_timing": phases}
            # It takes at least as long as it says it took: the proxy's clock then bounds the phases.
            await asyncio.sleep(max(slow_complete_s, sum(params["kvbridge_timing"].values()) / 1e3))
            return {"choices": [{"text": role, "index": 0}], "kv_transfer_params": params}

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": "tiny", "object": "model"}]}

        @app.get("/health")
        async def health() -> dict:
            self.health_calls += 1
            if self.health_calls <= slow_health:
                await asyncio.sleep(slow_health_s)
            return {}

        super().__init__(app)


@pytest.fixture
def upstreams() -> Iterator[tuple[Upstream, Upstream]]:
    with Upstream("prefill") as prefill, Upstream("decode") as decode:
        yield prefill, decode


def _session(app: FastAPI, requests: list[dict]) -> tuple[list[httpx.Response], dict]:
    """POST each body to the proxy in one event loop (the proxy's upstream client lives in it),
    then read /instances."""

    async def go() -> tuple[list[httpx.Response], dict]:
        # No lifespan: the health loop never runs, so only the request path can find a dead server.
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
            answers = [await client.post("/v1/completions", json=body) for body in requests]
            return answers, (await client.get("/instances")).json()

    return asyncio.run(go())


def test_decode_that_refuses_the_connection_is_skipped_and_taken_out(upstreams: tuple[Upstream, Upstream]) -> None:
    prefill, decode = upstreams
    dead = f"http://127.0.0.1:{free_port(span=1)}"  # nothing listens there
    app = create_app([prefill.url], [dead, decode.url])
    answers, state = _session(app, [{"model": "m", "prompt": f"p{i}", "max_tokens": 8} for i in range(3)])
    for r in answers:
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "decode"
        assert (r.headers["x-kvbridge-prefill"], r.headers["x-kvbridge-decode"]) == (prefill.url, decode.url)
    # Every decode request carried prefill's kv_transfer_params; prefill was asked for one token.
    handed = [KVTransferParams.from_dict(b["kv_transfer_params"]) for b in decode.bodies]
    assert [(p.remote_engine_id, p.block_ids) for p in handed] == [("e", (1, 2))] * 3
    assert all(b["max_tokens"] == 1 and b["kv_transfer_params"]["do_remote_decode"] for b in prefill.bodies)
    assert state["decode"] == [
        {"url": dead, "healthy": False, "in_flight": 0},
        {"url": decode.url, "healthy": True, "in_flight": 0},
    ]


def test_no_decode_accepting_is_a_503_that_names_the_cause(upstreams: tuple[Upstream, Upstream]) -> None:
    from kvbridge.adapters.vllm.timeline import HEADER, parse

    prefill, _ = upstreams
    dead = [f"http://127.0.0.1:{free_port(span=1)}" for _ in range(2)]
    (r,), state = _session(create_app([prefill.url], dead), [{"model": "m", "prompt": "p", "max_tokens": 8}])
    assert r.status_code == 503
    assert "no decode server accepted" in r.json()["error"]
    # The error answer carries the phases known when it was given: prefill and the proxy, no decode.
    t = parse(r.headers[HEADER])
    assert set(t.phases) == {"prefill_ms", "proxy_ms"} and t.phases["prefill_ms"] == 0.5
    assert all(v >= 0 for v in t.phases.values()) and sum(t.phases.values()) <= t.total_ms
    assert not any(d["healthy"] for d in state["decode"])
    assert state["decode"][0]["in_flight"] == 0


@pytest.mark.parametrize("slow", [SLOW_PROBES - 1, 10**6])
def test_a_slow_health_answer_is_busy_not_dead(monkeypatch: pytest.MonkeyPatch, slow: int) -> None:
    monkeypatch.setattr(proxy, "PROBE_TIMEOUT_S", 0.05)
    with (
        Upstream("prefill") as prefill,
        Upstream("decode", slow_health=slow, slow_health_s=0.5) as decode,
        Serving(create_app([prefill.url], [decode.url], health_interval=0.01)) as front,
    ):
        deadline = time.monotonic() + 30
        while decode.health_calls < SLOW_PROBES + 2:
            assert time.monotonic() < deadline, "the proxy stopped probing"
            time.sleep(0.01)
        state = httpx.get(f"{front.url}/instances", trust_env=False).json()
    # Fewer slow answers in a row than SLOW_PROBES never take a server out; endless ones do.
    assert state["decode"][0]["healthy"] is (slow < SLOW_PROBES)


def test_each_pair_is_warmed_once_both_servers_are_up() -> None:
    # First contact (decode fetching prefill's RankInfo, the transport's connection) is paid by one
    # request the proxy sends through each pair, not by a client's first request.
    with Upstream("prefill") as prefill, Upstream("decode") as d1, Upstream("decode") as d2:
        down = f"http://127.0.0.1:{free_port(span=1)}"  # a decode server that is not up: not warmed
        with Serving(create_app([prefill.url], [d1.url, d2.url, down], health_interval=0.01)) as front:
            deadline = time.monotonic() + 30
            while len(d1.bodies) + len(d2.bodies) < 2 or d1.health_calls < 5:
                assert time.monotonic() < deadline, "the proxy did not warm its pairs"
                time.sleep(0.01)
            state = httpx.get(f"{front.url}/instances", trust_env=False).json()
    assert [i["healthy"] for i in state["decode"]] == [True, True, False]
    assert len(prefill.bodies) == 2 and all(b["max_tokens"] == 1 and b["model"] == "tiny" for b in prefill.bodies)
    for d in (d1, d2):  # once each, with what prefill answered (less its timing)
        [body] = d.bodies
        assert (
            body["kv_transfer_params"]["remote_engine_id"] == "e"
            and "kvbridge_timing" not in body["kv_transfer_params"]
        )


def test_decode_that_drops_the_request_is_a_503_naming_it(upstreams: tuple[Upstream, Upstream]) -> None:
    prefill, _ = upstreams
    # A decode server that takes the connection and dies before answering.
    listener = socket.create_server(("127.0.0.1", free_port(span=1)))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"

    def drop_one() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.close()

    dropper = threading.Thread(target=drop_one, daemon=True)
    dropper.start()
    try:
        (r,), state = _session(create_app([prefill.url], [url]), [{"model": "m", "prompt": "p", "max_tokens": 8}])
    finally:
        dropper.join(timeout=10)
        listener.close()
    assert r.status_code == 503 and url in r.json()["error"]
    assert (r.headers["x-kvbridge-prefill"], r.headers["x-kvbridge-decode"]) == (prefill.url, url)
    assert state["decode"] == [{"url": url, "healthy": False, "in_flight": 0}]
    assert "prefill_ms=0.500" in r.headers["x-kvbridge-timing"]


def test_error_answers_carry_the_timeline_known_so_far(caplog: pytest.LogCaptureFixture) -> None:
    """No prefill server (503), a bad body (400), a client that leaves during prefill (499, seen in the
    proxy's log: nobody is there to read its answer): each names its request and the phases known."""
    from kvbridge.adapters.vllm.timeline import HEADER, parse

    dead = f"http://127.0.0.1:{free_port(span=1)}"
    app = create_app([dead], [dead])

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
            return [
                await client.post("/v1/completions", json={"model": "m", "prompt": "p"}, headers={"x-request-id": "a"}),
                await client.post("/v1/completions", content=b"not json", headers={"x-request-id": "b"}),
            ]

    r503, r400 = asyncio.run(go())
    assert r503.status_code == 503 and r400.status_code == 400 and "not JSON" in r400.json()["error"]
    for r, rid in ((r503, "a"), (r400, "b")):
        t = parse(r.headers[HEADER])
        assert t.request_id == rid and t.phases == {} and t.total_ms >= 0
    caplog.set_level("INFO", logger="kvbridge.adapters.vllm.proxy")
    with (
        Upstream("prefill", slow_complete_s=2.0) as prefill,
        Upstream("decode") as decode,
        Serving(create_app([prefill.url], [decode.url])) as front,
    ):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(
                f"{front.url}/v1/completions",
                json={"model": "m", "prompt": "p"},
                headers={"x-request-id": "gone"},
                timeout=0.3,
                trust_env=False,
            )
        deadline = time.monotonic() + 10
        while "(answered 499)" not in caplog.text:
            assert time.monotonic() < deadline, "the proxy did not notice the client leave"
            time.sleep(0.02)
    line = next(r.getMessage() for r in caplog.records if "(answered 499)" in r.getMessage())
    assert parse(line.removeprefix("kvbridge-timing ").removesuffix(" (answered 499)")).request_id == "gone"


def test_every_answer_carries_its_timeline_and_metrics_count_it(upstreams: tuple[Upstream, Upstream]) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from kvbridge.adapters.vllm.timeline import HEADER, PHASES, parse

    prefill, decode = upstreams
    dead = f"http://127.0.0.1:{free_port(span=1)}"
    app = create_app([prefill.url], [dead, decode.url])

    async def go() -> tuple[list[httpx.Response], str]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
            answers = [
                await client.post(
                    "/v1/completions",
                    json={"model": "m", "prompt": f"p{i}", "max_tokens": 4},
                    headers={"x-request-id": f"r{i}"},
                )
                for i in range(3)
            ]
            return answers, (await client.get("/metrics")).text

    answers, text = asyncio.run(go())
    for i, r in enumerate(answers):
        assert r.status_code == 200 and r.headers["x-request-id"] == f"r{i}"
        t = parse(r.headers[HEADER])
        assert t.request_id == f"r{i}" and set(t.phases) == set(PHASES)
        # What the engines reported is passed on as they said it; the proxy's own parts are measured.
        assert (t.phases["prefill_ms"], t.phases["transfer_ms"]) == (0.5, 0.3)
        assert all(v >= 0 for v in t.phases.values()) and sum(t.phases.values()) <= t.total_ms
    # The engines' timing is not sent on to decode.
    assert [b.get("kv_transfer_params", {}).get("kvbridge_timing") for b in decode.bodies] == [None] * 3
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert samples[("kvbridge_proxy_phase_seconds_count", (("phase", "total"),))] == 3
    assert samples[("kvbridge_proxy_phase_seconds_count", (("phase", "transfer"),))] == 3
    assert samples[("kvbridge_proxy_phase_seconds_sum", (("phase", "handover"),))] == pytest.approx(3 * 1.05e-3)
    assert samples[("kvbridge_proxy_requests_total", (("code", "200"),))] == 3
    assert samples[("kvbridge_proxy_failovers_total", (("role", "decode"),))] == 1  # the dead one, once
    assert samples[("kvbridge_proxy_upstream_healthy", (("role", "decode"), ("upstream", dead)))] == 0
    assert samples[("kvbridge_proxy_upstream_in_flight", (("role", "decode"), ("upstream", decode.url)))] == 0


def test_layerwise_sends_both_servers_one_transfer_id_once_it_knows_the_prefill(
    upstreams: tuple[Upstream, Upstream],
) -> None:
    prefill, decode = upstreams
    app = create_app([prefill.url], [decode.url], transfer="layerwise")
    answers, _ = _session(app, [{"model": "m", "prompt": f"p{i}", "max_tokens": 8} for i in range(3)])
    assert [r.status_code for r in answers] == [200] * 3
    # The first request is pulled: prefill's answer tells the proxy where its side channel is.
    first = KVTransferParams.from_dict(decode.bodies[0]["kv_transfer_params"])
    assert first.transfer_mode == "pull" and first.block_ids == (1, 2)
    # Then both servers get each request, with one transfer id, and decode the prefill's address.
    to_prefill = [KVTransferParams.from_dict(b["kv_transfer_params"]) for b in prefill.bodies[1:]]
    to_decode = [KVTransferParams.from_dict(b["kv_transfer_params"]) for b in decode.bodies[1:]]
    assert all(p.do_remote_decode and p.transfer_mode == "layerwise" for p in to_prefill)
    assert sorted(p.transfer_id for p in to_prefill) == sorted(d.transfer_id for d in to_decode)
    assert len({p.transfer_id for p in to_prefill}) == 2
    for d in to_decode:
        assert d.do_remote_prefill and d.transfer_mode == "layerwise" and d.remote_request_id == d.transfer_id
        assert (d.remote_engine_id, d.remote_host, d.remote_port, d.block_ids) == ("e", "127.0.0.1", 5800, ())
    assert all(b["max_tokens"] == 1 for b in prefill.bodies) and all(b["max_tokens"] == 8 for b in decode.bodies)


class Unaccepting:
    """A listener on 127.0.0.1 whose accept queue is full: connects to it time out, as to a server too busy
    to accept or on a starved box (the proxy's ConnectTimeout in a loaded e2e run)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.fillers = []
        for _ in range(2):  # backlog 0 holds one; the kernel drops SYNs beyond it
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(self.sock.getsockname())
            self.fillers.append(c)

    def __enter__(self) -> Unaccepting:
        return self

    def __exit__(self, *exc: object) -> None:
        for c in [*self.fillers, self.sock]:
            c.close()


def test_a_decode_slow_to_accept_stays_in_and_the_request_goes_to_the_next(
    upstreams: tuple[Upstream, Upstream],
) -> None:
    prefill, decode = upstreams
    with Unaccepting() as busy:
        app = create_app([prefill.url], [busy.url, decode.url], connect_timeout=0.3)
        answers, state = _session(app, [{"model": "m", "prompt": f"p{i}", "max_tokens": 8} for i in range(3)])
    assert [r.status_code for r in answers] == [200] * 3, [r.text for r in answers]
    assert all(r.headers["x-kvbridge-decode"] == decode.url for r in answers)
    assert len(decode.bodies) == 3
    # Slow to accept is not dead: it stays in the pool for the health probe to judge.
    assert state["decode"] == [
        {"url": busy.url, "healthy": True, "in_flight": 0},
        {"url": decode.url, "healthy": True, "in_flight": 0},
    ]


def test_only_decode_slow_to_accept_is_tried_again_then_a_503_that_says_so(
    upstreams: tuple[Upstream, Upstream], caplog: pytest.LogCaptureFixture
) -> None:
    prefill, _ = upstreams
    with Unaccepting() as busy, caplog.at_level("WARNING", logger="kvbridge.adapters.vllm.proxy"):
        (r,), state = _session(
            create_app([prefill.url], [busy.url], connect_timeout=0.3), [{"model": "m", "prompt": "p"}]
        )
    assert r.status_code == 503
    assert f"{busy.url}, {busy.url} did not accept the connection in time" in r.json()["error"]
    assert sum("did not accept the connection in time" in m for m in caplog.messages) == 2
    assert state["decode"] == [{"url": busy.url, "healthy": True, "in_flight": 0}]


def test_health_checks_go_on_when_the_http_stack_raises_what_it_should_not(
    upstreams: tuple[Upstream, Upstream], caplog: pytest.LogCaptureFixture
) -> None:
    # An exception that is no httpx.HTTPError (here InvalidURL for a port with a space; in a chaos run,
    # httpcore's AttributeError on a socket closed mid-connect) once ended the health loop for good, and
    # every server taken out after that stayed out: 544 of 1000 requests failed "no healthy prefill".
    prefill, decode = upstreams
    broken = "http://127.0.0.1:12 34"
    with (
        caplog.at_level("WARNING", logger="kvbridge.adapters.vllm.proxy"),
        Serving(create_app([prefill.url], [broken, decode.url], health_interval=0.01, warm_up=False)) as front,
    ):
        seen = decode.health_calls
        deadline = time.monotonic() + 30
        while decode.health_calls < seen + 5:
            assert time.monotonic() < deadline, "the proxy stopped probing"
            time.sleep(0.01)
        state = httpx.get(f"{front.url}/instances", trust_env=False).json()
    assert [d["healthy"] for d in state["decode"]] == [False, True]
    assert any("health probe failed (InvalidURL" in m for m in caplog.messages), caplog.messages
