"""`kvbridge proxy` under abuse: slow clients, requests that fan out into gigabytes, every stage's lease released.

The proxy is its app served by uvicorn as `kvbridge proxy` serves it (`limits.server`) on 127.0.0.1, in front of the
small real upstreams of kvbridge_tools.harness.pd_servers; clients are real sockets.
"""

from __future__ import annotations

import argparse
import collections
import math
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request, Response

from kvbridge.base.errors import ConfigError
from kvbridge.control import ControlServer, LeaseState, Ledger
from kvbridge_proxy import app as proxy
from kvbridge_proxy.limits import Limits, server
from kvbridge_proxy.settings import ProxySettings
from kvbridge_tools.harness.fixtures import wait_for
from kvbridge_tools.harness.pd_servers import Serving, Upstream
from kvbridge_tools.harness.ports import free_port

SLOW_CLIENTS = 300


class Front(Serving):
    """The proxy for `upstreams` with `limits`, served as `kvbridge proxy` serves it."""

    def __init__(self, prefill: list[str], decode: list[str], limits: Limits) -> None:
        app = proxy.create_app(prefill, decode, warm_up=False, health_interval=3600, limits=limits)
        super().__init__(app)
        self.server = server(app, "127.0.0.1", self.port, limits)
        self.thread = threading.Thread(target=self.server.run, daemon=True)


@pytest.fixture
def upstreams() -> Iterator[tuple[Upstream, Upstream]]:
    with Upstream("prefill") as prefill, Upstream("decode") as decode:
        yield prefill, decode


def _answer(sock: socket.socket) -> tuple[int | None, bytes]:
    """The status and body of the answer the proxy sends on `sock` before it closes it (None: closed without one)."""
    data = b""
    while chunk := sock.recv(65536):  # the socket's timeout bounds each wait
        data += chunk
    if not data:
        return None, b""
    return int(data.split(b" ", 2)[1]), data.partition(b"\r\n\r\n")[2]


def test_slow_clients_are_cut_off_and_health_and_a_normal_request_still_answer(
    upstreams: tuple[Upstream, Upstream],
) -> None:
    # 300 clients that send a request head and one body byte used to hold their connections for good; with the
    # body deadline (408), the caps (503) and /health served past them, the proxy stays usable.
    prefill, decode = upstreams
    limits = Limits(header_timeout_s=2, body_timeout_s=5, max_connections=64, max_connections_per_client=32)
    head = b"POST /v1/completions HTTP/1.1\r\nhost: proxy\r\ncontent-type: application/json\r\n"
    head += b"content-length: 1000\r\n\r\n{"
    socks: list[socket.socket] = []
    try:
        with Front([prefill.url], [decode.url], limits) as front:
            for _ in range(SLOW_CLIENTS):
                socks.append(socket.create_connection(("127.0.0.1", front.port), timeout=60))
                socks[-1].sendall(head)
            heads = []  # and a few that never finish their head
            for _ in range(4):
                heads.append(socket.create_connection(("127.0.0.1", front.port), timeout=60))
                heads[-1].sendall(b"POST /v1/completions HTTP/1.1\r\nhost: pro")
            socks += heads
            trickles = []  # and a few that send /health a body it never reads, byte by byte
            for _ in range(4):
                trickles.append(socket.create_connection(("127.0.0.1", front.port), timeout=60))
                trickles[-1].sendall(b"GET /health HTTP/1.1\r\nhost: proxy\r\ncontent-length: 1000\r\n\r\n{")
            socks += trickles

            health = httpx.get(f"{front.url}/health", timeout=1.0, trust_env=False)
            assert health.status_code == 200, health.text
            # A client at another address is not held back by the slow one's cap.
            other = httpx.HTTPTransport(local_address="127.0.0.2")
            with httpx.Client(transport=other, timeout=30, trust_env=False) as client:
                ok = client.post(f"{front.url}/v1/completions", json={"model": "m", "prompt": "p", "max_tokens": 2})
            assert ok.status_code == 200, ok.text
            assert ok.json()["choices"][0]["text"] == "decode"

            answers = [_answer(s) for s in socks[:SLOW_CLIENTS]]
            statuses = collections.Counter(status for status, _ in answers)
            # The 32 admitted (the per-client cap) are cut at the body deadline, the rest refused as they came.
            assert statuses == {408: 32, 503: SLOW_CLIENTS - 32}, statuses
            # Each refusal says which limit, and which setting raises it.
            bodies = {status: body for status, body in answers}
            assert b"--body-timeout" in bodies[408] and b"--max-connections-per-client" in bodies[503], bodies
            assert all(_answer(s)[0] in (None, 503) for s in heads)  # closed at the head deadline
            assert [_answer(s)[0] for s in trickles] == [200] * 4  # answered, then closed: nobody reads the rest
    finally:
        for s in socks:
            s.close()
    assert len(prefill.bodies) == 1 and len(decode.bodies) == 1  # only the normal request reached them


def test_one_request_sends_no_more_than_the_upstream_byte_cap(upstreams: tuple[Upstream, Upstream]) -> None:
    # A batch used to send every part's keys to a prefill and a decode: a 1 MiB request made 512 MiB upstream.
    prefill, decode = upstreams
    cap = 64 * 1024
    limits = Limits(max_upstream_bytes=cap, max_parts=32)
    stop = ["s" * 1000]  # a key the decode needs and the prefill does not
    body: dict[str, Any] = {"model": "m", "prompt": "p", "temperature": 1.0, "max_tokens": 2, "stop": stop}
    with Front([prefill.url], [decode.url], limits) as front, httpx.Client(timeout=30, trust_env=False) as client:
        over = client.post(f"{front.url}/v1/completions", json={**body, "n": 32, "stop": stop * 3})
        assert over.status_code == 413 and "--max-upstream-bytes" in over.json()["error"]["message"], over.text
        too_many = client.post(f"{front.url}/v1/completions", json={**body, "n": 33})
        assert too_many.status_code == 400 and "--max-parts" in too_many.json()["error"]["message"], too_many.text
        assert prefill.sizes == [] and decode.sizes == []  # refused before anything was sent

        ok = client.post(f"{front.url}/v1/completions", json={**body, "n": 32})
        assert ok.status_code == 200, ok.text
        assert len(ok.json()["choices"]) == 32
    assert len(prefill.sizes) == len(decode.sizes) == 32
    assert sum(prefill.sizes) + sum(decode.sizes) <= cap
    assert all("stop" not in b for b in prefill.bodies) and all(b["stop"] == stop for b in decode.bodies)


def test_retries_count_against_the_upstream_byte_cap(upstreams: tuple[Upstream, Upstream]) -> None:
    # A prefill answering 500 is skipped for the next one, which is sent the body again: that counts too.
    prefill, decode = upstreams
    failing = FastAPI()
    sizes: list[int] = []

    @failing.post("/v1/completions")
    async def fail(request: Request) -> Response:
        sizes.append(len(await request.body()))
        return Response("shutting down", status_code=500)

    @failing.get("/health")
    async def health() -> dict:
        return {}  # in rotation: only its completions fail

    body = {"model": "m", "prompt": "p" * 4000, "max_tokens": 2}
    cap = 10_000  # the first tries (4 kB to a prefill, 4 kB to a decode) fit; a second prefill try leaves too little
    with (
        Serving(failing) as shutting_down,
        Front([shutting_down.url, prefill.url], [decode.url], Limits(max_upstream_bytes=cap)) as front,
    ):
        r = httpx.post(f"{front.url}/v1/completions", json=body, timeout=30, trust_env=False)
    assert r.status_code == 503 and "--max-upstream-bytes" in r.json()["error"]["message"], r.text
    assert len(sizes) == 1 and len(prefill.sizes) == 1 and decode.sizes == []
    assert sum(sizes) + sum(prefill.sizes) <= cap


def test_a_release_reaches_every_pipeline_stage(upstreams: tuple[Upstream, Upstream]) -> None:
    # With pp_size 2 the proxy aborted the lease on stage 0's ranks only: stage 1 held its blocks for lease_s.
    prefill, _ = upstreams
    tp, pp = 2, 2
    base = free_port(span=tp * pp)
    released: list[tuple[int, str, LeaseState]] = []
    servers = []
    try:
        for port in range(base, base + tp * pp):
            ledger = Ledger(lambda lease, why, port=port: released.append((port, lease.request_id, why)), timeout_s=600)
            servers.append(ControlServer("e", port - base, ledger=ledger, port=port, poll_interval_s=0.01))
            ledger.offer("r", [1, 2], expected_pulls=1)
        prefill.side_channel_port = base
        prefill.parallel = {"tp_size": tp, "pp_size": pp}
        decode = Upstream("decode")
        with decode, Front([prefill.url], [decode.url], Limits()) as front:
            wait_for(lambda: decode.health_calls > 0, timeout=10, what="the proxy's first health round")
            decode.__exit__(None, None, None)  # gone before the request: no decode takes it, the lease is released
            url = f"{front.url}/v1/completions"
            r = httpx.post(url, json={"model": "m", "prompt": "p"}, timeout=30, trust_env=False)
        assert r.status_code == 503, r.text
        wait_for(lambda: len(released) == tp * pp, timeout=10, what="every rank's lease to be released")
        assert sorted(released) == [(p, "r", LeaseState.ABORTED) for p in range(base, base + tp * pp)]
    finally:
        for s in servers:
            s.close()


def test_the_limits_options_refuse_what_bounds_nothing() -> None:
    from kvbridge_proxy import cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["proxy", "--body-timeout", "2.5", "--max-parts", "8", "--max-connections-per-client", "9"]
    )
    assert (args.body_timeout, args.max_parts, args.max_connections_per_client) == (2.5, 8, 9)
    assert args.header_timeout == Limits().header_timeout_s and args.max_upstream_bytes == Limits().max_upstream_bytes
    for bad in (
        ["--body-timeout", "nan"],
        ["--header-timeout", "0"],
        ["--keep-alive", "inf"],
        ["--max-connections", "-1"],
        ["--max-upstream-bytes", "1e9"],
        ["--max-parts", str(2**40)],
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(["proxy", *bad])


def test_settings_refuse_a_server_that_is_no_url_and_a_wait_that_is_no_time() -> None:
    for url in ("notaurl", "localhost:8000", "http://127.0.0.1:99999", "ftp://10.0.0.1:21", "http://:8000"):
        with pytest.raises(ConfigError, match="write it as http://HOST:PORT"):
            ProxySettings([url], ["http://127.0.0.1:8200"])
    # an OpenAI client's base URL: every request went to /v1/v1/completions, and every health check failed
    for url in ("http://127.0.0.1:8100/v1", "http://127.0.0.1:8100/v1/", "http://127.0.0.1:8100/?a=1"):
        with pytest.raises(ConfigError, match=r"write it as http://127.0.0.1:8100, without /v1, a query"):
            ProxySettings(["http://127.0.0.1:8100"], [url])
    with pytest.raises(ConfigError, match=r"write it as http://gw:80/decode-3, without /v1"):
        ProxySettings(["http://127.0.0.1:8100"], ["http://gw:80/decode-3/v1"])
    # a server behind a gateway that routes by path, and a trailing slash, are taken
    taken = ProxySettings(["http://127.0.0.1:8100/"], ["http://gw:80/decode-3"])
    assert (taken.prefill, taken.decode) == (("http://127.0.0.1:8100/",), ("http://gw:80/decode-3",))
    for name in ("health_interval", "timeout", "connect_timeout"):
        for seconds in (0.0, -1.0, math.nan, math.inf):
            with pytest.raises(ConfigError, match="takes a number of seconds > 0"):
                ProxySettings(["http://127.0.0.1:8100"], ["http://[::1]:8200"], **{name: seconds})
    assert ProxySettings(["https://p.example:443"], ["http://[::1]:8200"]).decode == ("http://[::1]:8200",)
