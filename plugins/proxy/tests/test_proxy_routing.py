"""`kvbridge proxy` routing, against small real HTTP upstreams on 127.0.0.1.

The upstreams answer like vLLM's OpenAI server does in a P/D pair (the end-to-end tests run the proxy
against real vLLM servers).

These pin what is hard to provoke with real servers at the right moment: a decode server that is
dead before the health loop has noticed it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from kvbridge.control.params import KVTransferParams
from kvbridge_proxy import app as proxy
from kvbridge_proxy import membership
from kvbridge_proxy.membership import SLOW_PROBES
from kvbridge_tools.harness.pd_servers import Serving, Unaccepting, Upstream
from kvbridge_tools.harness.ports import free_port

# These tests read which server answered: answers name servers by URL only with expose_internals.
create_app = functools.partial(proxy.create_app, expose_internals=True)


@pytest.fixture
def upstreams() -> Iterator[tuple[Upstream, Upstream]]:
    with Upstream("prefill") as prefill, Upstream("decode") as decode:
        yield prefill, decode


def _session(
    app: FastAPI, requests: list[dict], until: Callable[[], bool] | None = None
) -> tuple[list[httpx.Response], dict]:
    """POST each body to the proxy in one event loop, then read /instances.

    One loop, because the proxy's upstream client lives in it. `until`: kept running after the answers until it holds
    (10 s at most), for what the proxy does in the background.
    """

    async def go() -> tuple[list[httpx.Response], dict]:
        # No lifespan: the health loop never runs, so only the request path can find a dead server.
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
            answers = [await client.post("/v1/completions", json=body) for body in requests]
            deadline = time.monotonic() + 10
            while until is not None and not until() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
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
        {"url": dead, "healthy": False, "in_flight": 0, "streams": 0, "cordoned": False, "prefix_cache": None},
        {"url": decode.url, "healthy": True, "in_flight": 0, "streams": 0, "cordoned": False, "prefix_cache": None},
    ]


def test_no_decode_accepting_is_a_503_that_names_the_cause(upstreams: tuple[Upstream, Upstream]) -> None:
    from kvbridge.session.timeline import HEADER, parse

    prefill, _ = upstreams
    dead = [f"http://127.0.0.1:{free_port(span=1)}" for _ in range(2)]
    (r,), state = _session(create_app([prefill.url], dead), [{"model": "m", "prompt": "p", "max_tokens": 8}])
    assert r.status_code == 503
    assert "no decode server accepted" in r.json()["error"]["message"]
    # The error answer carries the phases known when it was given: prefill, the proxy, and the time of the decodes
    # that failed (both refused connects); nothing of a decode's work.
    t = parse(r.headers[HEADER])
    assert set(t.phases) == {"prefill_connect_ms", "prefill_ms", "proxy_ms", "decode_failed_ms"}
    assert t.phases["prefill_ms"] == 0.5
    assert all(v >= 0 for v in t.phases.values()) and sum(t.phases.values()) <= t.total_ms
    assert not any(d["healthy"] for d in state["decode"])
    assert state["decode"][0]["in_flight"] == 0


@pytest.mark.parametrize("secret", [None, "proxy-test-secret-0123456789abcdef"])
def test_no_decode_accepting_releases_the_prefill_lease_at_once(
    upstreams: tuple[Upstream, Upstream], secret: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The lease used to stay pinned for lease_s (600 s by default) when no decode took the request.
    from kvbridge.control import ControlServer, LeaseState, Ledger

    if secret:
        monkeypatch.setenv("KVBRIDGE_SECRET", secret)
    prefill, _ = upstreams
    released: list = []
    ledger = Ledger(lambda lease, why: released.append((lease.request_id, why)), timeout_s=600)
    server = ControlServer("e", 0, ledger=ledger, secret=secret, poll_interval_s=0.01)
    try:
        ledger.offer("r", [1, 2], expected_pulls=1)
        prefill.side_channel_port = server.address[1]
        dead = [f"http://127.0.0.1:{free_port(span=1)}"]
        body = {"model": "m", "prompt": "p", "max_tokens": 8}
        (r,), _ = _session(create_app([prefill.url], dead), [body], until=lambda: bool(released))
        assert r.status_code == 503
        assert released == [("r", LeaseState.ABORTED)]
    finally:
        server.close()


@pytest.mark.parametrize(
    ("transfer", "stream", "batch", "options"),
    [
        ("pull", True, False, {}),  # the decode's headers came, no event yet
        ("pull", True, False, {"live_moves": True}),
        ("pull", False, False, {}),  # no answer yet
        ("layerwise", True, False, {}),  # the decode request not taken yet
        ("pull", False, True, {}),  # each part's decode request not answered yet
        ("pull", True, True, {}),  # each part's headers came, no event yet
    ],
)
def test_a_client_that_leaves_before_the_decode_answered_releases_the_prefill_lease_at_once(
    transfer: str, stream: bool, batch: bool, options: dict
) -> None:
    # vLLM's server drops a request cancelled before its engine took it, and no connector hears of it: the prefill's
    # lease then held its blocks until it expired (a layer-wise chaos run's one expired lease).
    from kvbridge.control import ControlServer, LeaseState, Ledger
    from kvbridge_tools.harness.fixtures import wait_for

    released: list = []
    ledger = Ledger(lambda lease, why: released.append((lease.request_id, why)), timeout_s=600)
    server = ControlServer("e", 0, ledger=ledger, poll_interval_s=0.01)
    streams = stream and transfer == "pull"  # headers at once, the first event late (else the answer late)
    try:
        with (
            Upstream("prefill") as prefill,
            Upstream("decode", **{"slow_stream_s" if streams else "slow_complete_s": 1.0}) as decode,
            Serving(create_app([prefill.url], [decode.url], transfer=transfer, warm_up=False, **options)) as front,
        ):
            prefill.side_channel_port = server.address[1]
            prompt = ["p", "q"] if batch else "p"  # (a batch: every part's prefill answers lease "r")
            body = {"model": "m", "prompt": prompt, "max_tokens": 4, "stream": stream}
            first = httpx.post(f"{front.url}/v1/completions", json=body, timeout=30, trust_env=False)
            assert first.status_code == 200  # (layer-wise: the pull way, so the proxy learns the side channel)
            ledger.offer("r", [1, 2], expected_pulls=1)
            with pytest.raises(httpx.TimeoutException):
                httpx.post(f"{front.url}/v1/completions", json=body, timeout=0.3, trust_env=False)
            lease = "r" if transfer == "pull" else prefill.bodies[-1]["kv_transfer_params"]["transfer_id"]
            if transfer == "layerwise":  # the prefill offers it under its transfer id (an Abort before it is kept)
                ledger.offer(lease, [3], expected_pulls=1)
            wait_for(lambda: bool(released), timeout=10, what="the lease to be released")
            assert released == [(lease, LeaseState.ABORTED)]
            assert len(decode.bodies) == (4 if batch else 2), "the decode was sent the request the client left"
    finally:
        server.close()


@pytest.mark.parametrize("transfer", ["pull", "layerwise"])
@pytest.mark.parametrize("fails", ["answers 500", "drops the request"])
def test_a_decode_that_refuses_or_drops_the_request_releases_the_prefill_lease_at_once(
    transfer: str, fails: str
) -> None:
    # Nobody else would: the decode read nothing (an error answer), or died with it. Layer-wise both requests go at
    # once, and the prefill's lease under the transfer id was left to expire.
    from kvbridge.control import ControlServer, LeaseState, Ledger
    from kvbridge_tools.harness.fixtures import wait_for

    released: list = []
    ledger = Ledger(lambda lease, why: released.append((lease.request_id, why)), timeout_s=600)
    server = ControlServer("e", 0, ledger=ledger, poll_interval_s=0.01)
    stop = threading.Event()
    try:
        with contextlib.ExitStack() as stack:
            prefill = stack.enter_context(Upstream("prefill"))
            prefill.side_channel_port = server.address[1]
            if fails == "answers 500":
                decode = stack.enter_context(Upstream("decode"))
                decode.fail_status, decode_url = 500, decode.url
            else:
                # it dies once the prefill has the request: a layer-wise prefill request the proxy dropped before it
                # was sent holds no lease, and the lease the test offers would be the first request's
                listener = _holding_decode(
                    "127.0.0.1", threading.Event(), stop, drop=True, dies_after=lambda n: len(prefill.bodies) >= n
                )
                decode_url = f"http://127.0.0.1:{listener.getsockname()[1]}"
            app = create_app([prefill.url], [decode_url], transfer=transfer, warm_up=False, health_interval=60)
            front = stack.enter_context(Serving(app))
            body = {"model": "m", "prompt": "p", "max_tokens": 4}
            if transfer == "layerwise":  # the pull way first: the proxy learns where the prefill's side channel is
                httpx.post(f"{front.url}/v1/completions", json=body, timeout=30, trust_env=False)
                wait_for(lambda: httpx.get(f"{front.url}/instances", trust_env=False).json()["decode"][0]["healthy"],
                         timeout=10, what="the decode back in rotation")  # fmt: skip
            else:
                ledger.offer("r", [1, 2], expected_pulls=1)
            r = httpx.post(f"{front.url}/v1/completions", json=body, timeout=30, trust_env=False)
            assert r.status_code == (500 if fails == "answers 500" else 503), r.text
            lease = "r" if transfer == "pull" else prefill.bodies[-1]["kv_transfer_params"]["transfer_id"]
            if transfer == "layerwise":
                ledger.offer(lease, [3], expected_pulls=1)  # (an Abort before its offer is kept for it)
            wait_for(lambda: bool(released), timeout=10, what="the lease to be released")
            assert released == [(lease, LeaseState.ABORTED)]
    finally:
        stop.set()
        server.close()


def test_a_warm_up_no_decode_took_releases_its_prefill_lease_at_once(upstreams: tuple[Upstream, Upstream]) -> None:
    # A pair warmed as its decode joined, before that decode took connections, left the warm-up's lease on the prefill
    # until lease_s (a chaos run across hosts: three expired at once, one on each prefill).
    from kvbridge.control import ControlServer, LeaseState, Ledger
    from kvbridge_tools.harness.fixtures import wait_for

    prefill, _ = upstreams
    released: list = []
    ledger = Ledger(lambda lease, why: released.append((lease.request_id, why)), timeout_s=600)
    server = ControlServer("e", 0, ledger=ledger, poll_interval_s=0.01)
    try:
        ledger.offer("r", [1, 2], expected_pulls=1)
        prefill.side_channel_port = server.address[1]
        front = proxy.Proxy(proxy.ProxySettings([prefill.url], [f"http://127.0.0.1:{free_port(span=1)}"]))
        pools = front.membership.pools

        async def warm() -> bool:
            try:
                return await front.membership.warm_pair(pools["prefill"].instances[0], pools["decode"].instances[0])
            finally:
                await front.client.aclose()

        assert not asyncio.run(warm()), "a decode that takes no connection is not warmed"
        assert len(prefill.bodies) == 1, "the prefill computed the warm-up"
        wait_for(lambda: bool(released), timeout=10, what="the warm-up's lease to be released")
        assert released == [("r", LeaseState.ABORTED)]
    finally:
        server.close()


@pytest.mark.parametrize("slow", [SLOW_PROBES - 1, 10**6])
def test_a_slow_health_answer_is_busy_not_dead(monkeypatch: pytest.MonkeyPatch, slow: int) -> None:
    monkeypatch.setattr(membership, "PROBE_TIMEOUT_S", 0.05)
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


class DroppingHealth:
    """A decode server's /health that drops the connection of its first `drops` probes unanswered, then answers 200."""

    def __init__(self, drops: int) -> None:
        self.drops, self.probes = drops, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                with contextlib.suppress(OSError):
                    conn.recv(65536)
                    self.probes += 1
                    if self.probes > self.drops:
                        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")

    def __enter__(self) -> DroppingHealth:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.listener.close()


@pytest.mark.parametrize("drops", [1, 10**6])
def test_a_health_probe_whose_connection_dropped_is_asked_again_before_the_server_is_taken_out(
    upstreams: tuple[Upstream, Upstream], caplog: pytest.LogCaptureFixture, drops: int
) -> None:
    """One dropped probe (a kept-alive connection the server closed as it was reused) is asked once more.

    A server that drops every probe is taken out, and the log says why."""
    prefill, _ = upstreams
    with (
        caplog.at_level("INFO", logger="kvbridge_proxy.app"),
        DroppingHealth(drops) as decode,
        Serving(create_app([prefill.url], [decode.url], health_interval=0.05, warm_up=False)) as front,
    ):
        deadline = time.monotonic() + 30
        while decode.probes < 6:
            assert time.monotonic() < deadline, "the proxy stopped probing"
            time.sleep(0.01)
        state = httpx.get(f"{front.url}/instances", trust_env=False).json()
    down = [m for m in caplog.messages if decode.url in m and "down: taken out" in m]
    assert state["decode"][0]["healthy"] is (drops == 1), caplog.messages
    if drops == 1:
        again = f"{decode.url}: health probe failed (RemoteProtocolError): once more"
        assert not down and any(again in m for m in caplog.messages), caplog.messages
    else:
        assert len(down) == 1 and "RemoteProtocolError" in down[0], down


def test_each_pair_is_warmed_once_both_servers_are_up() -> None:
    # First contact (decode fetching prefill's RankInfo, the transport's connection) is paid by one
    # request the proxy sends through each pair, not by a client's first request.
    with Upstream("prefill") as prefill, Upstream("decode") as d1, Upstream("decode") as d2:
        d1.prefix_cache, d2.prefix_cache = True, False  # what each decode's answer says it keeps of what it pulled
        down = f"http://127.0.0.1:{free_port(span=1)}"  # a decode server that is not up: not warmed
        with Serving(create_app([prefill.url], [d1.url, d2.url, down], health_interval=0.01)) as front:
            deadline = time.monotonic() + 30
            while len(d1.bodies) + len(d2.bodies) < 2 or d1.health_calls < 5:
                assert time.monotonic() < deadline, "the proxy did not warm its pairs"
                time.sleep(0.01)
            state = httpx.get(f"{front.url}/instances", trust_env=False).json()
    assert [i["healthy"] for i in state["decode"]] == [True, True, False]
    assert [i["prefix_cache"] for i in state["decode"]] == [True, False, None], "learned from the warm-ups' answers"
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
    assert r.status_code == 503 and url in r.json()["error"]["message"]
    assert (r.headers["x-kvbridge-prefill"], r.headers["x-kvbridge-decode"]) == (prefill.url, url)
    assert state["decode"] == [
        {"url": url, "healthy": False, "in_flight": 0, "streams": 0, "cordoned": False, "prefix_cache": None}
    ]
    assert "prefill_ms=0.500" in r.headers["x-kvbridge-timing"]


class Dying:
    """A decode server that takes one request and dies before answering anything.

    At once, after a stream's headers, or a part of the way into a whole answer's body."""

    HEADS = {
        "at once": b"",
        "after its headers": b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n",
        "mid-body": b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 400\r\n\r\n{"choices": [',
    }

    def __init__(self, when: str) -> None:
        self.listener = socket.create_server(("127.0.0.1", free_port(span=1)))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.took = 0
        self._thread = threading.Thread(target=self._die_once, args=(self.HEADS[when],), daemon=True)
        self._thread.start()

    def _die_once(self, head: bytes) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.recv(65536)
            self.took += 1
            conn.sendall(head)

    def close(self) -> None:
        self._thread.join(timeout=10)
        self.listener.close()


@pytest.mark.parametrize(("when", "stream"), [("at once", False), ("after its headers", True), ("mid-body", False)])
def test_a_decode_that_dies_before_answering_anything_hands_the_request_to_the_next(
    when: str, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # The client saw nothing of the first decode's answer, and prefill's lease still holds the KV for whichever decode
    # asks: the same decode request goes to the next decode, and the client gets its answer, not a 503.
    caplog.set_level("WARNING", logger="kvbridge_proxy")
    with Upstream("prefill") as prefill, Upstream("decode") as good:
        dying = Dying(when)
        try:
            app = create_app([prefill.url], [dying.url, good.url])  # the first pick is the first decode listed
            body = {"model": "m", "prompt": "p", "max_tokens": 8, "stream": stream}
            (r,), state = _session(app, [body])
        finally:
            dying.close()
    assert r.status_code == 200, r.text
    assert dying.took == 1 and len(good.bodies) == 1, "taken by the dying decode, then by the next"
    assert good.bodies[0]["kv_transfer_params"]["remote_request_id"] == "r", "the same decode request, prefill's KV"
    assert r.headers["x-kvbridge-decode"] == good.url
    assert [(d["url"], d["healthy"], d["in_flight"]) for d in state["decode"]] == [
        (dying.url, False, 0),
        (good.url, True, 0),
    ]
    assert len(prefill.bodies) == 1, "one prefill: the KV it holds is what the next decode reads"
    # the log ties the time lost to the decode and the request (`kvbridge chaos` reads it for a slow request)
    from kvbridge.session.timeline import HEADER, parse

    rid = parse(r.headers[HEADER]).request_id
    said = [m for m in caplog.messages if dying.url in m and "failed" in m]
    assert len(said) == 1 and f" {rid}" in said[0], (rid, caplog.messages)


def test_error_answers_carry_the_timeline_known_so_far(caplog: pytest.LogCaptureFixture) -> None:
    """Failed requests name their request and the phases known in their timing header.

    No prefill server (503), a bad body (400), a client that leaves during prefill (499, seen in the
    proxy's log: nobody is there to read its answer).
    """
    from kvbridge.session.timeline import HEADER, parse

    dead = f"http://127.0.0.1:{free_port(span=1)}"
    app = create_app([dead], [dead])

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
            return [
                await client.post("/v1/completions", json={"model": "m", "prompt": "p"}, headers={"x-request-id": "a"}),
                await client.post("/v1/completions", content=b"not json", headers={"x-request-id": "b"}),
            ]

    r503, r400 = asyncio.run(go())
    assert r503.status_code == 503 and r400.status_code == 400 and "not JSON" in r400.json()["error"]["message"]
    for r, rid, phases in ((r503, "a", {"prefill_connect_ms"}), (r400, "b", set())):
        t = parse(r.headers[HEADER])  # the 503 spent its time on a refused connect to the prefill
        assert t.request_id == rid and set(t.phases) == phases and t.total_ms >= 0
    caplog.set_level("INFO", logger="kvbridge_proxy.app")
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

    from kvbridge.session.timeline import CONNECT_PHASES, FAILOVER_PHASE, HEADER, PHASES, parse

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
    failed_over = 0
    for i, r in enumerate(answers):
        assert r.status_code == 200 and r.headers["x-request-id"] == f"r{i}"
        t = parse(r.headers[HEADER])
        # the first request opened the connections (its connect phases); the others went on kept-alive ones
        connects = set(CONNECT_PHASES) if i == 0 else set()
        expected = set(PHASES) - set(CONNECT_PHASES) - {FAILOVER_PHASE} | connects
        assert t.request_id == f"r{i}" and set(t.phases) - {FAILOVER_PHASE} == expected
        failed_over += FAILOVER_PHASE in t.phases
        # What the engines reported is passed on as they said it; the proxy's own parts are measured.
        assert (t.phases["prefill_ms"], t.phases["transfer_ms"]) == (0.5, 0.3)
        assert t.marks == {"at_resolving_ms": 0.0, "at_done_ms": 0.9}, "the pull's states, apart from the phases"
        assert all(v >= 0 for v in t.phases.values()) and sum(t.phases.values()) <= t.total_ms
    assert failed_over == 1, "the request sent to the dead decode first has that attempt's time apart"
    # The engines' timing is not sent on to decode.
    assert [b.get("kv_transfer_params", {}).get("kvbridge_timing") for b in decode.bodies] == [None] * 3
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert samples[("kvbridge_proxy_phase_seconds_count", (("phase", "total"),))] == 3
    assert samples[("kvbridge_proxy_phase_seconds_count", (("phase", "transfer"),))] == 3
    assert samples[("kvbridge_proxy_phase_seconds_count", (("phase", "decode_connect"),))] == 1
    assert ("kvbridge_proxy_phase_seconds_count", (("phase", "at_done"),)) not in samples, "a mark is no phase"
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
        {"url": busy.url, "healthy": True, "in_flight": 0, "streams": 0, "cordoned": False, "prefix_cache": None},
        {"url": decode.url, "healthy": True, "in_flight": 0, "streams": 0, "cordoned": False, "prefix_cache": None},
    ]


def test_only_decode_slow_to_accept_is_tried_again_then_a_503_that_says_so(
    upstreams: tuple[Upstream, Upstream], caplog: pytest.LogCaptureFixture
) -> None:
    prefill, _ = upstreams
    with Unaccepting() as busy, caplog.at_level("WARNING", logger="kvbridge_proxy.app"):
        (r,), state = _session(
            create_app([prefill.url], [busy.url], connect_timeout=0.3), [{"model": "m", "prompt": "p"}]
        )
    assert r.status_code == 503
    assert f"{busy.url}, {busy.url} did not accept the connection in time" in r.json()["error"]["message"]
    assert sum("did not accept the connection in time" in m for m in caplog.messages) == 2
    assert state["decode"] == [
        {"url": busy.url, "healthy": True, "in_flight": 0, "streams": 0, "cordoned": False, "prefix_cache": None}
    ]


def test_health_checks_go_on_when_the_http_stack_raises_what_it_should_not(
    upstreams: tuple[Upstream, Upstream], caplog: pytest.LogCaptureFixture
) -> None:
    # An exception that is no httpx.HTTPError (here InvalidURL for a port with a space; in a chaos run,
    # httpcore's AttributeError on a socket closed mid-connect) once ended the health loop for good, and
    # every server taken out after that stayed out: 544 of 1000 requests failed "no healthy prefill".
    # The proxy's options and its registry refuse such a URL now: the test puts it in the pool itself.
    prefill, decode = upstreams
    front = proxy.Proxy(proxy.ProxySettings([prefill.url], [decode.url], health_interval=0.01, warm_up=False))
    broken = front.membership.pools["decode"].join("http://127.0.0.1:12 34")

    async def rounds(n: int) -> None:
        loop = asyncio.create_task(front.membership.health_loop(lambda: None))
        try:
            deadline = time.monotonic() + 30
            while front.membership.health_rounds < n:
                assert time.monotonic() < deadline, "the proxy stopped probing"
                await asyncio.sleep(0.01)
        finally:
            loop.cancel()
            await front.client.aclose()

    seen = decode.health_calls
    with caplog.at_level("WARNING", logger="kvbridge_proxy.app"):
        asyncio.run(rounds(5))
    assert decode.health_calls >= seen + 5
    assert [d.healthy for d in front.membership.pools["decode"].instances] == [True, False] and not broken.healthy
    assert any("health probe failed (InvalidURL" in m for m in caplog.messages), caplog.messages


def test_a_registry_record_whose_url_names_no_server_is_not_taken_and_said_once(
    upstreams: tuple[Upstream, Upstream], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    prefill, decode = upstreams
    servers = tmp_path / "servers.json"
    # an announcer that left out the scheme, beside a good record
    servers.write_text(json.dumps([{"role": "decode", "url": decode.url}, {"role": "decode", "url": "localhost:8200"}]))
    front = proxy.Proxy(proxy.ProxySettings([prefill.url], [], registry=f"file://{servers}", warm_up=False))

    async def read_twice() -> None:
        try:
            await front.membership.read_members()
            await front.membership.read_members()
        finally:
            await front.client.aclose()

    with caplog.at_level("WARNING", logger="kvbridge_proxy.app"):
        asyncio.run(read_twice())
    assert [i.url for i in front.membership.pools["decode"].instances] == [decode.url]
    said = [m for m in caplog.messages if "record in the registry not taken" in m]
    assert len(said) == 1 and "'localhost:8200': write it as http://HOST:PORT" in said[0], caplog.messages


def test_a_registry_that_cannot_be_read_is_said_once_then_seldom_and_its_return_said(
    upstreams: tuple[Upstream, Upstream], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """A registry the proxy cannot read was one warning a read, every 0.5 s: 7,200 lines an hour of an outage."""
    prefill, decode = upstreams
    servers = tmp_path / "servers.json"
    servers.write_text("[{")  # an operator's edit, half saved
    front = proxy.Proxy(proxy.ProxySettings([prefill.url], [], registry=f"file://{servers}", warm_up=False))

    async def reads(n: int) -> None:
        for _ in range(n):
            await front.membership.read_members()

    with caplog.at_level("WARNING", logger="kvbridge_proxy.app"):
        try:
            asyncio.run(reads(5))
            said = [m for m in caplog.messages if "could not read the servers" in m]
            assert len(said) == 1 and "cannot read the server list" in said[0], caplog.messages
            assert "(first try)" in said[0] and "for 0 s" not in said[0], said  # it had lasted no time yet
            front.membership._unread_said -= membership.REGISTRY_UNREAD_SAID_S  # as if that long had passed
            asyncio.run(reads(2))
            assert len([m for m in caplog.messages if "could not read the servers" in m]) == 2
            servers.write_text(json.dumps([{"role": "decode", "url": decode.url}]))
            asyncio.run(reads(1))
        finally:
            asyncio.run(front.client.aclose())
    assert [m for m in caplog.messages if "read the servers in" in m and "again, after" in m], caplog.messages
    assert [i.url for i in front.membership.pools["decode"].instances] == [decode.url]


def _post_all(app: FastAPI, bodies: list[dict], headers: dict[str, str] | None = None) -> list[httpx.Response]:
    """POST the bodies to the proxy at once (one event loop, as clients do concurrently)."""

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
            return list(
                await asyncio.gather(*(client.post("/v1/completions", json=b, headers=headers) for b in bodies))
            )

    return asyncio.run(go())


def _events(r: httpx.Response) -> list[Any]:
    return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]" for line in r.text.split("\n\n") if line]


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_is_one_pd_request_per_choice_merged_in_order(
    upstreams: tuple[Upstream, Upstream], stream: bool
) -> None:
    # vLLM answers a batch with the first prompt's kv_transfer_params only: each choice is its own P/D request
    # (own prefill, own params, own upstream id), and the answers are merged as vLLM answers a batch.
    prefill, decode = upstreams
    body = {"model": "m", "prompt": ["a", "bb", "ccc"], "n": 2, "seed": 5, "temperature": 1.0, "max_tokens": 4}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    (r,) = _post_all(create_app([prefill.url], [decode.url]), [body], {"x-request-id": "batch"})
    assert r.status_code == 200, r.text
    if stream:
        events = _events(r)
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        *chunks, usage = events[:-1]
        choices = sorted((c for e in chunks for c in e["choices"]), key=lambda c: c["index"])
        ids = {e["id"] for e in events[:-1]}
    else:
        answer = r.json()
        choices, usage, ids = answer["choices"], answer, {answer["id"]}
    assert [(c["index"], c["prompt"], c["seed"]) for c in choices] == [
        (p * 2 + i, prompt, 5 + i) for p, prompt in enumerate(["a", "bb", "ccc"]) for i in range(2)
    ]
    # Each prompt's tokens counted once, every choice's completion tokens.
    assert usage["usage"] == {"prompt_tokens": 6, "completion_tokens": 6, "total_tokens": 12}
    assert ids == {"cmpl-batch"}  # as a colocated server names the answer to request "batch"
    # Six P/D requests, each with an id of the proxy's, the same at prefill and at decode.
    assert len(set(prefill.ids)) == 6 and set(prefill.ids) == set(decode.ids) and "batch" not in prefill.ids
    assert sorted(b["prompt"] for b in prefill.bodies) == ["a", "a", "bb", "bb", "ccc", "ccc"]
    assert all(b["n"] == 1 and b["max_tokens"] == 1 for b in prefill.bodies)
    assert all(b["kv_transfer_params"]["remote_engine_id"] == "e" for b in decode.bodies)


def test_a_client_request_id_shared_by_concurrent_requests_keys_no_lease(upstreams: tuple[Upstream, Upstream]) -> None:
    # Prefill's lease is keyed on the request id the servers get: two clients' "same" must not be one lease.
    prefill, decode = upstreams
    bodies = [{"model": "m", "prompt": f"p{i}", "max_tokens": 4} for i in range(4)]
    answers = _post_all(create_app([prefill.url], [decode.url]), bodies, {"x-request-id": "same"})
    assert all(r.status_code == 200 and r.headers["x-request-id"] == "same" for r in answers)
    assert len(set(prefill.ids)) == 4 and set(prefill.ids) == set(decode.ids) and "same" not in prefill.ids


def test_answers_name_no_internal_url_unless_asked(upstreams: tuple[Upstream, Upstream]) -> None:
    prefill, decode = upstreams
    dead = f"http://127.0.0.1:{free_port(span=1)}"
    app = proxy.create_app([prefill.url], [dead])  # the default: expose_internals off
    answers, state = _session(app, [{"model": "m", "prompt": "p", "max_tokens": 4}] * 2)
    app = proxy.create_app([prefill.url], [decode.url])
    (ok,), _ = _session(app, [{"model": "m", "prompt": "p", "max_tokens": 4}])
    assert [r.status_code for r in answers] == [503, 503] and ok.status_code == 200
    for text in [*(r.text for r in answers), json.dumps(state), *(str(r.headers) for r in [*answers, ok])]:
        assert "127.0.0.1" not in text, text
    assert state["decode"] == [
        {"url": "decode-0", "healthy": False, "in_flight": 0, "streams": 0, "cordoned": False, "prefix_cache": None}
    ]
    assert answers[1].json()["error"]["message"] == "no healthy decode server among ['decode-0']"


def test_no_healthy_decode_sends_nothing_to_prefill(upstreams: tuple[Upstream, Upstream]) -> None:
    # Prefill would hold the prompt's KV for lease_s for a decode that never comes.
    prefill, _ = upstreams
    dead = f"http://127.0.0.1:{free_port(span=1)}"
    with Serving(create_app([prefill.url], [dead], health_interval=0.01, warm_up=False)) as front:
        deadline = time.monotonic() + 30
        while httpx.get(f"{front.url}/instances", trust_env=False).json()["decode"][0]["healthy"]:
            assert time.monotonic() < deadline, "the health loop did not take the dead decode out"
            time.sleep(0.01)
        r = httpx.post(f"{front.url}/v1/completions", json={"model": "m", "prompt": "p"}, trust_env=False)
    assert r.status_code == 503 and "no healthy decode server" in r.json()["error"]["message"]
    assert prefill.bodies == []


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_server_taken_out_that_is_back_serves_before_the_next_health_round(
    role: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where every server of a role is taken out, a request probes them before it answers 503: one may be back.

    No health loop runs here (no lifespan), so without that probe the server that came back stays out for good."""
    monkeypatch.setattr(membership, "REVIVE_INTERVAL_S", 0.0)  # the second request probes again at once
    other = "decode" if role == "prefill" else "prefill"
    with Upstream(other) as up:
        late = Upstream(role)  # its port chosen, nobody listening there yet
        urls = {role: [late.url], other: [up.url]}
        app = create_app(urls["prefill"], urls["decode"])

        async def go() -> tuple[httpx.Response, httpx.Response, dict]:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
                body = {"model": "m", "prompt": "p", "max_tokens": 8}
                down = await client.post("/v1/completions", json=body)  # refused: taken out
                with late:
                    with caplog.at_level("INFO", logger="kvbridge_proxy.app"):
                        back = await client.post("/v1/completions", json=body)
                    return down, back, (await client.get("/instances")).json()

        down, back, state = asyncio.run(go())
    assert down.status_code == 503, down.text
    assert back.status_code == 200, back.text
    assert back.headers[f"x-kvbridge-{role}"] == late.url
    assert state[role][0]["healthy"] is True
    assert any(
        f"no {role} server left to try: 1 taken out probed at once, back: ['{late.url}']" in m for m in caplog.messages
    )


def test_a_decode_request_cancelled_before_it_was_taken_leaves_in_flight_at_zero() -> None:
    # Layer-wise: the client leaves while the decode server is still taking the request; the proxy cancels
    # the send, and the instance's in_flight (what /metrics and /instances show) comes back to 0.
    with (
        Upstream("prefill") as prefill,
        Upstream("decode", slow_complete_s=1.0) as decode,
        Serving(create_app([prefill.url], [decode.url], transfer="layerwise", warm_up=False)) as front,
    ):
        body = {"model": "m", "prompt": "p", "max_tokens": 4}
        first = httpx.post(f"{front.url}/v1/completions", json=body, timeout=30, trust_env=False)
        assert first.status_code == 200  # the pull way: the proxy now knows the prefill's side channel
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{front.url}/v1/completions", json=body, timeout=0.3, trust_env=False)
        deadline = time.monotonic() + 10
        while len(decode.bodies) < 2:  # the decode server got the request the client left
            assert time.monotonic() < deadline
            time.sleep(0.01)
        while (state := httpx.get(f"{front.url}/instances", trust_env=False).json())["decode"][0]["in_flight"]:
            assert time.monotonic() < deadline, state
            time.sleep(0.01)


def test_a_request_unanswered_for_long_is_logged_once_with_where_it_waits(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that waits on the proxy for LONG_WAIT_S gets a log line that says where the proxy waits for it.

    (A chaos run's client waited 180 s on the proxy and no log said where.)"""
    from kvbridge_proxy import relay

    monkeypatch.setattr(relay, "LONG_WAIT_S", 0.3)
    with (
        Upstream("prefill") as prefill,
        Upstream("decode", slow_complete_s=2.0) as decode,
        Serving(create_app([prefill.url], [decode.url], health_interval=0.05, warm_up=False)) as front,
        caplog.at_level("WARNING", logger="kvbridge_proxy.app"),
    ):
        body = {"model": "m", "prompt": "p", "max_tokens": 4}
        headers = {"x-request-id": "waits-long"}
        r = httpx.post(f"{front.url}/v1/completions", json=body, headers=headers, timeout=30, trust_env=False)
        assert r.status_code == 200 and decode.bodies
    said = [m for m in caplog.messages if "no answer after" in m]
    assert len(said) == 1, caplog.messages
    assert said[0].startswith("request waits-long: no answer after") and "send_decode" in said[0], said


def _holding_decode(
    address: str, got: threading.Event, stop: threading.Event, *, drop: bool = False, dies_after: Any = None
) -> socket.socket:
    """A decode server on `address` that answers /health and takes a completion, never to answer it.

    `drop`: it closes the connection instead, as a server that died taking it; `dies_after(n)`: it does so once that
    holds of its n-th completion (at most 10 s on)."""
    listener = socket.create_server((address, 0))
    listener.settimeout(0.2)
    held: list[socket.socket] = []
    taken = itertools.count(1)

    def serve() -> None:
        with listener:
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                conn.settimeout(10)
                try:
                    head = conn.recv(65536)
                except OSError:
                    conn.close()
                    continue
                if head.startswith(b"GET /health"):
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: application/json\r\n\r\n{}")
                    conn.close()
                elif drop:
                    n, until = next(taken), time.monotonic() + 10
                    while dies_after is not None and not dies_after(n) and time.monotonic() < until:
                        time.sleep(0.01)
                    conn.close()
                    got.set()
                else:
                    held.append(conn)  # read, and never answered
                    got.set()
        for conn in held:
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return listener


def test_a_decode_whose_host_went_silent_mid_request_is_found_out_by_keepalive(hosts_factory: Any) -> None:
    """The decode took a request, then its host went silent (a partition: no reset, no FIN ever comes).

    The proxy's connection looks open for as long as nobody sends; the kernel's keepalive probes find it dead, and the
    client gets an answer that names the decode instead of waiting the proxy's whole timeout. (In chaos runs two
    requests sent to a decode as it was killed waited so, its reset lost on a lossy link.)"""
    hosts = hosts_factory(["proxy", "decode"])
    got, stop = threading.Event(), threading.Event()
    with hosts["decode"].entered():
        listener = _holding_decode(hosts["decode"].address, got, stop)
    decode_url = f"http://{hosts['decode'].address}:{listener.getsockname()[1]}"
    try:
        with (
            hosts["proxy"].entered(),
            Upstream("prefill") as prefill,
            Serving(create_app([prefill.url], [decode_url], health_interval=3600, warm_up=False)) as front,
        ):
            answer: list[httpx.Response] = []
            body = {"model": "m", "prompt": "p", "max_tokens": 4}
            client = threading.Thread(
                target=lambda: answer.append(
                    httpx.post(f"{front.url}/v1/completions", json=body, timeout=120, trust_env=False)
                )
            )
            client.start()
            assert got.wait(30), "the decode never got the request"
            hosts.partition("proxy", "decode")
            client.join(timeout=120)
            assert not client.is_alive(), "the proxy still waits on a decode that is gone"
    finally:
        stop.set()
    [r] = answer
    assert r.status_code == 503 and decode_url in r.json()["error"]["message"], r.text


def _heal_once_a_syn_left(hosts: Any, port: int, healed: list[float]) -> None:
    """Heal proxy<->decode once the proxy's SYN to `port` is out (its SYN-ACK dropped, a partition "back").

    The kernels' first retransmission (1 s on Linux) then finds the link up."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        out = hosts["proxy"].run(["ss", "-Htn", "state", "syn-sent", "dport", f"= :{port}"], capture_output=True)
        if out.stdout.strip():
            break
        time.sleep(0.01)
    hosts.heal("proxy", "decode")
    healed.append(time.monotonic())


def test_a_lost_syn_to_the_decode_is_timed_as_its_connect_not_as_the_decode(hosts_factory: Any) -> None:
    """A lost SYN-ACK is the decode's connect in the timeline, apart from the decode's own time.

    On a lossy link a lost SYN or SYN-ACK costs the kernel's initial retransmission timeout, 1 s (chaos runs' longest
    times to first token)."""
    from kvbridge.session.timeline import HEADER, parse

    hosts = hosts_factory(["proxy", "decode"])
    with contextlib.ExitStack() as stack:
        with hosts["decode"].entered():
            decode = stack.enter_context(Upstream("decode", host=hosts["decode"].address))
        port = int(decode.url.rsplit(":", 1)[1])
        healed: list[float] = []
        with hosts["proxy"].entered():
            prefill = stack.enter_context(Upstream("prefill"))
            hosts.partition("proxy", "decode", "back")
            healer = threading.Thread(target=_heal_once_a_syn_left, args=(hosts, port, healed), daemon=True)
            healer.start()
            (r,), _ = _session(
                create_app([prefill.url], [decode.url]), [{"model": "m", "prompt": "p", "max_tokens": 4}]
            )
        healer.join(timeout=60)
    assert healed and r.status_code == 200, r.text
    t = parse(r.headers[HEADER])
    assert t.phases["decode_connect_ms"] >= 900, t.phases  # Linux's first SYN (and SYN-ACK) retransmission: 1 s
    assert t.phases["decode_first_token_ms"] < 500 and t.phases["prefill_connect_ms"] < 500, t.phases
    assert sum(t.phases.values()) <= t.total_ms
    # and the kernels counted it: a SYN sent again by the proxy's host, or a SYN-ACK by the decode's
    assert hosts.tcp_counters("proxy")["syn"] + hosts.tcp_counters("decode")["syn"] >= 1


def test_a_stopping_proxy_waits_for_the_releases_under_way_and_cuts_only_what_outlives_its_bound() -> None:
    # Before, a release spawned as the proxy stopped was cancelled with its event loop: the lease held for lease_s.
    from kvbridge_proxy.upstreams import Background

    ended: list[str] = []

    async def release(name: str, takes_s: float) -> None:
        try:
            await asyncio.sleep(takes_s)
            ended.append(name)
        except asyncio.CancelledError:
            ended.append(f"{name} cut")
            raise

    async def stop() -> tuple[int, float]:
        background = Background()
        background.spawn(release("answered", 0.05))
        background.spawn(release("unanswered", 60))
        began = time.monotonic()
        return await background.drain(1.0), time.monotonic() - began

    cut, took_s = asyncio.run(stop())
    assert (cut, sorted(ended)) == (1, ["answered", "unanswered cut"])
    assert took_s < 30  # bounded by drain's 1 s, not by the unanswered release's 60


# The proxy's release in a process of its own on the proxy's host: the side-channel client's sockets belong to the
# process's shared ZeroMQ context, whose thread (which connects them) was born in the namespace the process started in.
RELEASE = """
import asyncio, json, logging, sys
from kvbridge.base.secret import load_secret
from kvbridge.control.params import KVTransferParams
from kvbridge_proxy.release import LeaseRelease
from kvbridge_proxy.upstreams import Background
said = []
handler = logging.Handler()
handler.emit = lambda record: said.append(record.getMessage())
logging.getLogger("kvbridge_proxy.app").addHandler(handler)
logging.getLogger("kvbridge_proxy.app").setLevel(logging.INFO)
release = LeaseRelease(load_secret(), Background()).release
asyncio.run(release(KVTransferParams.from_dict(json.loads(sys.argv[1])), "no decode took it"))
print(json.dumps(said))
"""


def test_a_release_whose_syn_ack_is_lost_once_is_answered_when_first_asked(hosts_factory: Any) -> None:
    """One SYN-ACK lost on the way to the proxy is no release timeout (the kernel sends it again after 1 s).

    In an elastic chaos run (loss on every link) a release timed out at exactly the 1 s a lost SYN costs, and its
    lease was released only when asked again."""
    from kvbridge.control import ControlServer, LeaseState, Ledger

    secret = "proxy-release-test-secret-0123456789"
    hosts = hosts_factory(["proxy", "decode"])
    ended: list[tuple[str, LeaseState]] = []
    ledger = Ledger(lambda lease, why: ended.append((lease.request_id, why)), timeout_s=600)
    ledger.offer("held-1", [3, 4], expected_pulls=1)
    with hosts["decode"].entered():
        side = ControlServer("prefill-0", host=hosts["decode"].address, ledger=ledger, secret=secret)
    try:
        params = {"do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_request_id": "held-1"}
        params |= {"remote_host": hosts["decode"].address, "remote_port": side.address[1]}
        healed: list[float] = []
        hosts.partition("proxy", "decode", "back")
        healer = threading.Thread(target=_heal_once_a_syn_left, args=(hosts, side.address[1], healed), daemon=True)
        healer.start()
        release = hosts["proxy"].popen(
            [sys.executable, "-c", RELEASE, json.dumps(params)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "KVBRIDGE_SECRET": secret},
        )
        out, _ = release.communicate(timeout=60)
        healer.join(timeout=60)
    finally:
        side.close()
    assert release.returncode == 0 and healed
    said = json.loads(out)
    assert not [m for m in said if "asking again" in m], said
    assert any(m.startswith("released request held-1") for m in said), said
    assert ended == [("held-1", LeaseState.ABORTED)]
    # and a SYN-ACK was lost: the decode's host sent it again (or the proxy's its SYN)
    assert hosts.tcp_counters("proxy")["syn"] + hosts.tcp_counters("decode")["syn"] >= 1


def test_a_prefills_side_channel_serves_its_releases_and_layer_wise_requests_only_with_one_dp_rank() -> None:
    """One map of where each prefill's side channel is: every engine's for releases, one-DP-rank ones' for streaming."""

    def told(dp_size: int, **sizes: int) -> KVTransferParams:
        return KVTransferParams(
            remote_engine_id="e", remote_host="192.0.2.1", remote_port=5800, dp_size=dp_size, **sizes
        )

    layerwise = proxy.Proxy(proxy.ProxySettings(["http://p"], ["http://d"], transfer="layerwise")).membership
    assert layerwise.identity("http://p") is None  # not known before its first answer
    layerwise.learn("http://p", told(1, tp_size=2, pcp_size=2, dcp_size=2, pp_size=2))
    contact = layerwise.identity("http://p")
    assert contact is not None
    assert (contact.tp_size, contact.pcp_size, contact.dcp_size, contact.pp_size) == (2, 2, 2, 2)
    assert contact.remote_request_id is None and contact.block_ids == ()  # where it is, nothing of the request
    layerwise.learn("http://p", told(2))  # restarted with two DP ranks: which one holds a request is not known
    assert layerwise.identity("http://p") is None and layerwise.side_channels["http://p"].dp_size == 2
    pulled = proxy.Proxy(proxy.ProxySettings(["http://p"], ["http://d"])).membership
    pulled.learn("http://p", told(1))
    assert pulled.identity("http://p") is None and pulled.side_channels["http://p"].remote_port == 5800


def test_layerwise_follows_a_restarted_prefill(upstreams: tuple[Upstream, Upstream]) -> None:
    # The proxy learns a prefill's identity (engine id, side channel) from its answers; a prefill that
    # restarted answers with its new one, and the next requests' decode params name it.
    prefill, decode = upstreams
    app = create_app([prefill.url], [decode.url], transfer="layerwise", warm_up=False)

    async def go() -> list[str]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
            body = {"model": "m", "prompt": "p", "max_tokens": 4}
            for _ in range(2):  # the pull way first, then layer-wise
                assert (await client.post("/v1/completions", json=body)).status_code == 200
            prefill.engine_id = "e2"  # restarted
            for _ in range(10):
                assert (await client.post("/v1/completions", json=body)).status_code == 200
                await asyncio.sleep(0.01)  # the prefill's answer comes on its own
                if decode.bodies[-1]["kv_transfer_params"]["remote_engine_id"] == "e2":
                    break
            return [b["kv_transfer_params"]["remote_engine_id"] for b in decode.bodies]

    engines = asyncio.run(go())
    assert engines[:2] == ["e", "e"] and engines[-1] == "e2", engines


def test_prefill_that_answers_a_server_error_is_skipped_for_the_next(upstreams: tuple[Upstream, Upstream]) -> None:
    """A prefill server answering 500 is skipped for the next one; where every prefill fails, the client gets it.

    A vLLM server that began shutting down (SIGTERM) answers 500 until the proxy reads that it is draining.
    """
    prefill, decode = upstreams
    failing = FastAPI()
    calls: list[str] = []

    @failing.post("/v1/completions")
    async def fail() -> Response:
        calls.append("x")
        return Response("cannot schedule new futures after shutdown", status_code=500)

    with Serving(failing) as shutting_down:
        bodies = [{"model": "m", "prompt": f"p{n}", "max_tokens": 8} for n in range(2)]
        answers, _ = _session(create_app([shutting_down.url, prefill.url], [decode.url]), bodies)
        assert [r.status_code for r in answers] == [200, 200] and len(calls) >= 1
        assert {r.headers["x-kvbridge-prefill"] for r in answers} == {prefill.url}
        (alone,), _ = _session(create_app([shutting_down.url], [decode.url]), bodies[:1])
    assert alone.status_code == 500 and "shutdown" in alone.json()["error"]["message"]


def test_a_request_is_never_sent_twice_to_a_prefill_that_answered_it_a_server_error(
    upstreams: tuple[Upstream, Upstream],
) -> None:
    """Requests in flight at once share the round robin: a retry must not land on the server that just failed it.

    A chaos run (a prefill drained while 5 requests were in flight) had one client answered 500: its retries went back
    to the shutting-down server until the attempts ran out, while the other prefill served."""
    prefill, decode = upstreams
    failing = FastAPI()
    asked: list[str] = []
    first_round = asyncio.Event()

    @failing.post("/v1/completions")
    async def fail(request: Request) -> Response:
        asked.append((await request.json())["prompt"])
        if len(asked) >= 3:  # half of the six: the first round's share of this server
            first_round.set()
        with contextlib.suppress(asyncio.TimeoutError):  # so that every retry comes after the whole first round
            await asyncio.wait_for(first_round.wait(), 30)
        return Response("cannot schedule new futures after shutdown", status_code=500)

    async def six_at_once(app: FastAPI) -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
            bodies = [{"model": "m", "prompt": f"p{n}", "max_tokens": 8} for n in range(6)]
            return list(await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies)))

    with Serving(failing) as shutting_down:
        app = create_app([shutting_down.url, prefill.url], [decode.url])
        answers = asyncio.run(six_at_once(app))
    assert len(asked) == len(set(asked)) == 3, f"asked again after its 500: {asked}"
    assert [r.status_code for r in answers] == [200] * 6, [r.text for r in answers if r.status_code != 200]
    assert {r.headers["x-kvbridge-prefill"] for r in answers} == {prefill.url}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_server_error_from_the_only_server_serving_has_the_ones_taken_out_probed_first(
    role: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One server shutting down (500) and the other taken out but back: the request goes to the one that is back.

    A chaos run drained one of two prefills 0.4 s after the other came back from a kill, before the proxy's health
    round saw it back: four clients got the draining server's 500."""
    monkeypatch.setattr(membership, "REVIVE_INTERVAL_S", 0.0)
    other = "decode" if role == "prefill" else "prefill"
    failing = FastAPI()

    @failing.post("/v1/completions")
    async def fail() -> Response:
        return Response("cannot schedule new futures after shutdown", status_code=500)

    with Upstream(other) as up, Serving(failing) as shutting_down:
        late = Upstream(role)  # its port chosen, nobody listening there yet
        urls = {role: [shutting_down.url, late.url], other: [up.url]}
        app = create_app(urls["prefill"], urls["decode"])

        async def go() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
                body = {"model": "m", "prompt": "p", "max_tokens": 8}
                down = await client.post("/v1/completions", json=body)  # `late` refused: taken out
                with late:
                    return down, await client.post("/v1/completions", json=body)

        down, back = asyncio.run(go())
    # before: the prefill's last 500; a decode's is let go once the next decode is tried, so none is left (503)
    assert down.status_code == (500 if role == "prefill" else 503), down.text
    assert back.status_code == 200, back.text
    assert back.headers[f"x-kvbridge-{role}"] == late.url


def test_decode_that_answers_a_server_error_is_skipped_for_the_next(upstreams: tuple[Upstream, Upstream]) -> None:
    """A decode server answering 500 before anything else is skipped for the next one, which reads the same KV.

    A vLLM server that began shutting down (SIGTERM) answers 500 until the proxy reads that it is draining: before
    this, each request routed there in that window failed. Where every decode answers so, the client gets it."""
    prefill, decode = upstreams
    failing = FastAPI()
    calls: list[str] = []

    @failing.post("/v1/completions")
    async def fail() -> Response:
        calls.append("x")
        return Response("cannot schedule new futures after shutdown", status_code=500)

    with Serving(failing) as shutting_down:
        bodies = [{"model": "m", "prompt": f"p{n}", "max_tokens": 8, "stream": n == 1} for n in range(4)]
        answers, state = _session(create_app([prefill.url], [shutting_down.url, decode.url]), bodies)
        assert [r.status_code for r in answers] == [200] * 4 and len(calls) >= 1
        assert {r.headers["x-kvbridge-decode"] for r in answers} == {decode.url}
        assert all(d["in_flight"] == 0 for d in state["decode"])
        (alone,), _ = _session(create_app([prefill.url], [shutting_down.url]), bodies[:1])
    assert alone.status_code == 500 and "shutdown" in alone.text


def test_a_proxy_whose_event_loop_is_held_gets_every_stack_dumped(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, upstreams: tuple[Upstream, Upstream]
) -> None:
    """Issue 42: a proxy whose event loop stood still (a blocking call in a coroutine) leaves its own evidence.

    A route that blocks the loop for longer than the watchdog's stall time: the dump names the loop and the frame
    that held it, once for the stall."""
    from kvbridge.base.watchdog import WATCHDOG

    monkeypatch.setenv("KVBRIDGE_STALL_DIR", str(tmp_path))
    prefill, decode = upstreams
    release = threading.Event()
    app = create_app([prefill.url], [decode.url], health_interval=0.05)

    @app.get("/hold")
    async def held_by_a_blocking_call() -> dict:
        release.wait(30)  # blocks the event loop: what a synchronous call in a coroutine does
        return {}

    def loop_dumps() -> list[str]:
        texts = [p.read_text() for p in tmp_path.glob("stall-*.txt")]
        return [t for t in texts if "proxy event loop" in t.splitlines()[0]]

    with Serving(app) as front:
        holding = threading.Thread(target=httpx.get, args=(f"{front.url}/hold",), kwargs={"timeout": 60})
        holding.start()
        try:
            deadline = time.monotonic() + 30
            while not loop_dumps():
                assert time.monotonic() < deadline and holding.is_alive(), "no dump of the held event loop"
                time.sleep(0.05)
            looked = WATCHDOG.checked  # held through two more of the watchdog's looks: still one dump
            while WATCHDOG.checked <= looked + WATCHDOG.stall_s:
                assert time.monotonic() < deadline, "the watchdog stopped looking"
                time.sleep(0.05)
        finally:
            release.set()
            holding.join(30)
        # the loop runs again: the proxy answers
        assert httpx.get(f"{front.url}/instances", trust_env=False).status_code == 200
    (dump,) = loop_dumps()
    assert "in held_by_a_blocking_call" in dump and "release.wait(30)" in dump, dump
    # the loop's thread was blocked (in the wait), neither on a CPU nor waiting for one
    (loop,) = [line for line in dump.splitlines() if line.startswith("  proxy event loop (thread ")]
    assert "blocked (a lock, I/O, a sleep) or stopped" in loop, dump


@pytest.mark.parametrize("status", [500, 400])
@pytest.mark.parametrize("stream", [False, True])
def test_a_layerwise_prefill_that_fails_has_the_request_sent_again_the_pull_way(stream: bool, status: int) -> None:
    """A layer-wise decode waits for its prefill's stream (up to its pull_timeout_s, 60 s by default, then recomputes).

    When that prefill answers a server error instead (shutting down), the proxy drops the decode request and sends
    the request the pull way to another prefill: the client does not wait the minute out. A 4xx is the request's own
    fault (vLLM refused it): the client gets it, as the pull way gives it, and nothing is sent again."""
    layerwise: list[str] = []

    with Upstream("prefill") as failing, Upstream("prefill") as good:
        decoding = FastAPI()

        @decoding.post("/v1/completions")
        async def complete(request: Request) -> Any:
            body = await request.json()
            params = body.get("kv_transfer_params") or {}
            mode = params.get("transfer_mode")

            async def ready() -> None:  # as a real decode: a layer-wise request ends once its prefill streamed it
                if mode != "layerwise":
                    return
                layerwise.append(params["transfer_id"])
                for _ in range(600):  # at most 60 s, or until the proxy dropped it (vLLM then aborts it)
                    if await request.is_disconnected():
                        return
                    if any((b.get("kv_transfer_params") or {}).get("transfer_id") == params["transfer_id"]
                           for b in good.bodies):  # fmt: skip
                        return
                    await asyncio.sleep(0.1)

            choice = {"text": mode or "pull", "index": 0}
            if not stream:
                await ready()
                return {"id": "c", "choices": [choice], "usage": {}, "kv_transfer_params": {}}

            async def events() -> Any:  # the headers go out at once, the first event once the KV is in
                await ready()
                yield f"data: {json.dumps({'id': 'c', 'choices': [choice]})}\n\ndata: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        with Serving(decoding) as decode:
            app = create_app([failing.url, good.url], [decode.url], transfer="layerwise", warm_up=False)

            async def go() -> list[httpx.Response]:
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://proxy", timeout=30) as client:
                    body = {"model": "m", "prompt": "p", "max_tokens": 8, "stream": stream}
                    for _ in range(2):  # the pull way, once to each prefill: the proxy learns where both stream from
                        assert (await client.post("/v1/completions", json=body)).status_code == 200
                    assert len(failing.bodies) == len(good.bodies) == 1
                    failing.fail_status = status
                    return list(await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(4))))

            answers = asyncio.run(go())

    def modes(server: Upstream) -> list[str]:
        return [KVTransferParams.from_dict(b["kv_transfer_params"]).transfer_mode for b in server.bodies[1:]]

    failed = modes(failing)
    assert failed and set(failed) == {"layerwise"}  # it failed layer-wise requests: the case tested
    if status == 400:
        refused = [r for r in answers if r.status_code == 400]
        assert len(refused) == len(failed) and [r.status_code for r in answers].count(200) == 4 - len(failed)
        assert {r.json()["error"]["message"] for r in refused} == {"refused"}  # vLLM's error object, passed on
        assert modes(good) == ["layerwise"] * (4 - len(failed))  # none sent again
        return
    assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
    assert {r.headers["x-kvbridge-prefill"] for r in answers} == {good.url}
    # each of those went the pull way to the good one; the good one's own were read layer-wise
    assert sorted(modes(good)) == sorted(["pull"] * len(failed) + ["layerwise"] * (4 - len(failed)))
    assert sum('"pull"' in r.text for r in answers) == len(failed)  # the decode answered those the pull way


def test_a_connection_reset_as_it_opens_is_a_refused_connection_not_the_proxys_500() -> None:
    """A connect whose socket was gone before the keepalive options were set fails as a refused connection.

    httpcore sets those options after the connect; a server killed as it accepted has reset the connection by then,
    and httpcore raised AttributeError, which the proxy answered with a 500 of its own (a layer-wise chaos run). That
    race cannot be provoked on demand: the pool's network backend here is httpcore's own, raising what httpcore 1.0.9
    raises then for one port."""
    import httpcore

    from kvbridge_proxy.upstreams import new_client

    class ResetAsItOpens(httpcore.AnyIOBackend):
        def __init__(self, port: int, message: str) -> None:
            self.port, self.message = port, message

        async def connect_tcp(self, host: str, port: int, **kwargs: Any) -> httpcore.AsyncNetworkStream:
            if port == self.port:
                raise AttributeError(self.message)
            return await super().connect_tcp(host, port, **kwargs)

    async def get(client: httpx.AsyncClient, port: int) -> int:
        async with client:
            return (await client.get(f"http://127.0.0.1:{port}/health")).status_code

    app = FastAPI()
    app.get("/health")(lambda: {})
    with Serving(app) as up:
        dead = free_port()
        for message, raised in (("'NoneType' object has no attribute 'setsockopt'", httpx.ConnectError),
                                ("'NoneType' object has no attribute 'other'", AttributeError)):  # fmt: skip
            client = new_client(5.0, 5.0)
            client._transport._pool._network_backend = ResetAsItOpens(dead, message)  # type: ignore[attr-defined]
            with pytest.raises(raised):
                asyncio.run(get(client, dead))
        client = new_client(5.0, 5.0)
        client._transport._pool._network_backend = ResetAsItOpens(dead, "")  # type: ignore[attr-defined]
        assert asyncio.run(get(client, up.port)) == 200, "other servers are reached as ever"


def test_the_models_are_listed_by_a_serving_decode_else_a_prefill_else_a_503(
    upstreams: tuple[Upstream, Upstream],
) -> None:
    """OpenAI clients (the SDK's `models.list()`, many UIs) ask `GET /v1/models` first; the proxy had no such route."""
    prefill, decode = upstreams
    dead = f"http://127.0.0.1:{free_port(span=1)}"

    async def models(app: FastAPI) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
            return await client.get("/v1/models")

    listed = asyncio.run(models(proxy.create_app([prefill.url], [decode.url])))
    assert listed.status_code == 200 and listed.json()["data"][0]["id"] == "tiny"
    fallback = asyncio.run(models(proxy.create_app([prefill.url], [dead])))  # the decode refuses: the prefill lists
    assert fallback.status_code == 200 and fallback.json() == listed.json()
    none = asyncio.run(models(proxy.create_app([dead], [dead])))
    assert none.status_code == 503 and "no server serves now to list the models" in none.json()["error"]["message"]
    assert prefill.bodies == decode.bodies == [], "listing the models sends no completion"


def test_a_server_named_twice_in_one_role_is_refused() -> None:
    """It was two instances of one server: twice its share of requests, and two health checks."""
    from kvbridge.base.errors import ConfigError

    with pytest.raises(ConfigError, match=r"prefill server\(s\) \['http://192.0.2.1:8100'\] given more than once"):
        proxy.create_app(["http://192.0.2.1:8100", "http://192.0.2.1:8100/"], ["http://192.0.2.2:8200"])
    proxy.create_app(["http://192.0.2.1:8100"], ["http://192.0.2.1:8100"])  # one kv_both server in both roles: taken


def test_a_request_the_prefill_refuses_gets_its_answer_as_the_server_gave_it(
    upstreams: tuple[Upstream, Upstream],
) -> None:
    """A 4xx is the request's own fault (a prompt past max_model_len): vLLM's answer, as a server straight gives it.

    It was wrapped as a string, `{"error": "prefill failed: {...}"}`, which loses vLLM's error object."""
    prefill, decode = upstreams
    prefill.fail_status = 400
    (refused,), _ = _session(create_app([prefill.url], [decode.url]), [{"model": "m", "prompt": "p", "max_tokens": 4}])
    assert refused.status_code == 400 and refused.json()["error"]["type"] == "BadRequestError"
    assert "x-kvbridge-timing" in refused.headers and decode.bodies == []
    prefill.fail_status = 500  # a server's own failure is named as the prefill's
    (failed,), _ = _session(create_app([prefill.url], [decode.url]), [{"model": "m", "prompt": "p", "max_tokens": 4}])
    assert failed.status_code == 500 and failed.json()["error"]["message"].startswith("prefill failed: ")
