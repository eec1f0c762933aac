"""An XpYd proxy for vLLM prefill/decode servers, speaking the OpenAI API (`kvbridge proxy`).

The flow is the one vLLM's NIXL example proxies use, so servers configured for those work here
and the other way round: the prefill server gets the request with `max_tokens: 1` and
`kv_transfer_params: {"do_remote_decode": true}`; the `kv_transfer_params` its response carries
go into the decode request, whose answer (streamed or not) is passed through to the client.
Instances are picked round-robin among the healthy ones; a health loop takes a dead instance
out (at once when it refuses connections, after a few timed-out probes when it is only slow) and
puts it back when it answers again. A prefill server that answers a server error (5xx: a vLLM server
shutting down does) is skipped for the next one. A decode server that refuses the connection is skipped for
the next one, since prefill holds the KV for whichever decode asks; so is one that took the request
and died before the client saw anything of its answer. Responses name the servers that made them in
`x-kvbridge-prefill` and `x-kvbridge-decode`, a 503 from a decode server that failed after taking the
request (no other decode left) included. A client that disconnects closes the upstream request,
which vLLM turns into an abort.

First contact between a prefill and a decode server (decode fetching the prefill ranks' RankInfo,
the transport's connection) costs far more than a handover, so
the proxy pays it, not a client: once both servers of a pair answer /health, and again after either
was down, it sends one one-token request through the pair (`warm_up`; logged at info, failures at
warning).

A batch (a list `prompt`, `n > 1`) is split into one P/D request per choice and the answers merged
(`fanout`). Each P/D request gets an id the proxy makes, sent to both servers as `X-Request-Id` (vLLM's
request id, which prefill's lease is keyed on): a client's id, which two clients may share, never keys a
lease. The client's `x-request-id` (or a new one) names the request in the answer, its `x-kvbridge-timing`
header (see `timeline`) and the log line that repeats it at info. `/metrics` serves the proxy's Prometheus
series (docs/operations.md).

With a registry (`registry`, `kvbridge proxy --registry URL`) the pools also follow the servers that announce
themselves there (`kvbridge.control.membership`, docs/elastic.md): each health round reads the records, adds the
servers that joined, drops those whose record is gone or expired, and sends no new request to one that is
draining. The `--prefill`/`--decode` servers stay whatever the registry says.

The servers' URLs reach clients (the `x-kvbridge-prefill`/`x-kvbridge-decode` headers, `/instances`, error
answers, `/metrics` labels) only with `expose_internals` (`--expose-internals`); otherwise a server is named
by its role and place in the list (`decode-1`).

The proxy is in rooms, each a class with its own state that `Proxy` wires together: `membership.Membership` (the
pools, the registry, health probes, warm-up, rebalancing), `handover.Handovers` (the P/D handover), `relay.Relay` (a
request's answer relayed, a batch's merged), `moves.Moves` (live moves of running streams) and `admin.Admin`
(`/health`, `/instances`, `/metrics`, `/admin`); their settings are one `settings.ProxySettings`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request

from kvbridge.base import watchdog
from kvbridge.base.secret import load_secret
from kvbridge_proxy.admin import Admin
from kvbridge_proxy.handover import Handovers
from kvbridge_proxy.limits import Admission
from kvbridge_proxy.membership import Membership, pools_of
from kvbridge_proxy.metrics import ProxyMetrics
from kvbridge_proxy.moves import Moves
from kvbridge_proxy.relay import Relay
from kvbridge_proxy.release import RELEASE_TIMEOUT_S, LeaseRelease
from kvbridge_proxy.settings import ProxySettings
from kvbridge_proxy.upstreams import Background, new_client

ROUTES = ("/v1/completions", "/v1/chat/completions")
HEARTBEAT_S = 0.1  # the event loop tells the stall watchdog it runs this often
DRAIN_RELEASES_S = 2 * RELEASE_TIMEOUT_S  # a stopping proxy waits this long for its releases: one try each, with time


async def _heartbeat() -> None:
    """Beat the stall watchdog from the event loop.

    A loop held for `stall_s` (a blocking call in a coroutine, or the process not run at all) gets every thread's stack
    dumped, the loop's own among them, with where its seconds went (kvbridge.base.watchdog)."""
    beat = watchdog.watch("proxy event loop")
    try:
        while True:
            beat.busy()
            await asyncio.sleep(HEARTBEAT_S)
    finally:
        watchdog.WATCHDOG.forget(beat)


class Proxy:
    """The proxy: its rooms (see the module doc), the upstream client and metrics they share, and its lifetime."""

    def __init__(self, settings: ProxySettings) -> None:
        self.settings = settings
        pools = pools_of(settings)
        self.client = new_client(settings.timeout, settings.connect_timeout)
        self.metrics = ProxyMetrics()
        # To release a prefill's lease at once when no decode took the request (else it waits lease_s), to check the
        # registry's records, and for the admin calls.
        secret = load_secret()
        self.background = background = Background()
        release = LeaseRelease(secret, background).release
        self.membership = Membership(settings, pools, self.client, secret, self.metrics, release)
        self.pools = self.membership.pools
        self.handovers = Handovers(settings, self.client, self.membership, self.metrics, background, release)
        self.moves = Moves(settings, self.client, self.membership, self.handovers, self.metrics, background)
        self.relay = Relay(settings, self.handovers, self.moves, self.metrics)
        self.admin = Admin(settings, self.membership, self.metrics, secret)

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: FastAPI) -> AsyncIterator[None]:
        members = self.membership.members
        health = self.membership.health_loop(self.relay.long_waits)
        tasks = [asyncio.create_task(health), asyncio.create_task(_heartbeat())]
        if members is not None:
            tasks.append(asyncio.create_task(self.membership.membership_loop()))
        try:
            yield
        finally:
            for t in [*tasks, *self.membership.warming.values()]:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
            # the releases just sent (a client that left as it stopped): else those leases hold blocks for lease_s
            await self.background.drain(DRAIN_RELEASES_S)
            await self.client.aclose()
            if members is not None:
                members.close()


def create_app(prefill: Sequence[str], decode: Sequence[str], **options: Any) -> FastAPI:
    """The app of a proxy of `prefill` and `decode` servers; `options` are the other fields of `ProxySettings`."""
    return build_app(ProxySettings(prefill, decode, **options))


def build_app(settings: ProxySettings) -> FastAPI:
    """The FastAPI app: the OpenAI routes the proxy serves, and its own (ROUTES, and admin.Admin's).

    Serve it with `limits.server` for the deadlines on request heads (`settings.limits`)."""
    proxy = Proxy(settings)
    app = FastAPI(lifespan=proxy.lifespan)
    app.add_middleware(Admission, limits=settings.limits)
    for path in ROUTES:
        app.add_api_route(path, _bind(proxy.relay.complete, path), methods=["POST"])
    app.add_api_route("/v1/models", proxy.admin.models, methods=["GET"])
    app.add_api_route("/health", proxy.admin.health, methods=["GET"])
    app.add_api_route("/instances", proxy.admin.instances, methods=["GET"])
    app.add_api_route("/metrics", proxy.admin.prometheus, methods=["GET"])
    for action in ("cordon", "uncordon", "drain"):
        app.add_api_route(f"/admin/{action}", _bind(proxy.admin.admin, action), methods=["POST"])
    return app


def _bind(handle: Any, path: str) -> Any:
    async def endpoint(request: Request) -> Any:
        return await handle(path, request)

    return endpoint
