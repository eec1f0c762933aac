"""An XpYd proxy for vLLM prefill/decode servers, speaking the OpenAI API (`kvbridge proxy`).

The flow is the one vLLM's NIXL example proxies use, so servers configured for those work here
and the other way round: the prefill server gets the request with `max_tokens: 1` and
`kv_transfer_params: {"do_remote_decode": true}`; the `kv_transfer_params` its response carries
go into the decode request, whose answer (streamed or not) is passed through to the client.
Instances are picked round-robin among the healthy ones; a health loop takes a dead instance
out (at once when it refuses connections, after a few timed-out probes when it is only slow) and
puts it back when it answers again. A prefill server that answers a server error (5xx: a vLLM server
shutting down does) is skipped for the next one. A decode server that refuses the connection is skipped for
the next one, since prefill holds the KV for whichever decode asks. Responses name the servers
that made them in `x-kvbridge-prefill` and `x-kvbridge-decode`, a 503 from a decode server that
failed after taking the request included. A client that disconnects closes the upstream request,
which vLLM turns into an abort.

First contact between a prefill and a decode server (decode fetching the prefill ranks' RankInfo,
the transport's connection) costs far more than a handover (~180 ms measured on a 2-vCPU VM), so
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
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import logging
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator, Collection, Sequence
from typing import Any

import attrs
import httpx
import prometheus_client as prom
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvbridge.base import watchdog
from kvbridge.base.errors import ConfigError, KVBridgeError, PeerGone, TransferTimeout
from kvbridge.base.secret import admin_token, load_secret
from kvbridge.control.client import ControlClient
from kvbridge.control.discovery import ServerRecord
from kvbridge.control.params import KVTransferParams
from kvbridge.plan.rank_ports import side_channel_port
from kvbridge.session.lending import precopy_id
from kvbridge.session.timeline import HEADER, PULL_REPORT, Timeline
from kvbridge_proxy import fanout
from kvbridge_proxy.limits import BUDGET, Admission, Budget, Limits, encoded
from kvbridge_proxy.members import StaticMembers, open_members
from kvbridge_proxy.migration import MOVES, MoveSettings, MovingStream, pull_outcome, refusal
from kvbridge_proxy.rebalance import Policy, kv_usage

log = logging.getLogger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions")
PROBE_TIMEOUT_S = 5.0
# Seconds to open a connection to an upstream. On loopback a connect takes microseconds unless the server's
# accept queue is full or the box is starved; such a server never saw the request, so the proxy tries again.
CONNECT_TIMEOUT_S = 5.0
KEEP_ALIVE_S = 3.0
# TCP keepalive on every upstream connection: probes after 5 s idle, every 2 s, 3 unanswered end it. A server that went
# away without a word (killed, its reset lost on a lossy link; or its host gone) leaves a connection that looks open for
# as long as nobody sends, and the proxy, waiting for its answer, sent nothing more: in chaos runs two requests waited
# on a killed decode for the whole timeout. A probe is answered by the peer's kernel, however busy its server.
KEEPALIVE = tuple(
    (level, option, value)
    for level, name, value in (
        (socket.SOL_SOCKET, "SO_KEEPALIVE", 1),
        (socket.IPPROTO_TCP, "TCP_KEEPIDLE", 5),
        (socket.IPPROTO_TCP, "TCP_KEEPINTVL", 2),
        (socket.IPPROTO_TCP, "TCP_KEEPCNT", 3),
    )
    if (option := getattr(socket, name, None)) is not None
)
# A request with no answer after this long is logged once, with where it waits (its task's stack): the client sees a
# hang, and the log must say where it is.
LONG_WAIT_S = 60.0
HEARTBEAT_S = 0.1  # the event loop tells the stall watchdog it runs this often
MOVE_CONNECT_TRIES = 2  # a move's requests go to the one decode that holds its KV: a busy one is asked again
# A connection that dropped before any answer: most often a kept-alive one the server closed as it was reused. The
# server may well be up; a request that it never answered is asked once more before it counts.
DROPPED = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)
SLOW_PROBES = 3
# A health round probes at most this many servers at once: a thousand probes started together held the event loop
# (requests and registry reads waited behind them).
PROBES_IN_FLIGHT = 64
# A serving server whose record lapsed stays in rotation this long while it answers health probes. A record lapses when
# its announcer is late by two thirds of the TTL, as on a box starved for seconds: in a run every decode's record lapsed
# at once, and a stream being moved found no decode to go to. A server that withdraws its record drained first.
LAPSE_GRACE_S = 30.0
REGISTRY_INTERVAL_S = 0.5  # the registry is read this often (or each health interval, if shorter): a join is seen
MAX_BODY_BYTES = 32 * 1024 * 1024  # a prompt near any max_model_len fits many times over
# Levels of JSON nesting a request may have: far more than a chat request's tools schemas take, and far below
# what Python's JSON (and so the proxy's own encoding of the upstream request) can recurse into.
MAX_JSON_DEPTH = 128
# A client's x-request-id: printable ASCII, no space or ';' (the timing header's separator), bounded.
REQUEST_ID = re.compile(r"[\x21-\x3a\x3c-\x7e]{1,128}")


@attrs.define(eq=False)
class Instance:
    url: str
    role: str
    label: str  # what clients see: the URL with expose_internals, else role and place ("decode-1")
    healthy: bool = True
    slow_probes: int = 0  # health probes in a row that timed out
    in_flight: int = 0  # requests sent to it and not yet answered in full
    announced: bool = False  # it came from the registry (and leaves when its record does)
    draining: bool = False  # its record says draining: no new request
    cordoned: bool = False  # an operator said so (POST /admin/cordon): no new request
    # where its side channel is (from its registry record): a stream migrated off it is pulled from there
    identity: KVTransferParams | None = None
    streams: set[MovingStream] = attrs.Factory(set)  # the movable streams it serves now (--migrate)
    lapsed: float = 0.0  # when its record was last found gone (time.monotonic()); 0.0 while it has one

    @property
    def serving(self) -> bool:
        """Whether it takes new requests."""
        return self.healthy and not self.draining and not self.cordoned


class Pool:
    """Round-robin over the healthy instances of one role that are not draining."""

    def __init__(self, role: str, urls: Sequence[str], *, expose: bool = False, registry: bool = False) -> None:
        if not urls and not registry:
            raise ConfigError(
                f"the proxy needs at least one {role} server URL (--{role} http://HOST:PORT) or a --registry"
            )
        self.role = role
        self.expose = expose
        self._names = itertools.count()  # a server's place in the list, never reused: its label
        self.instances = [self._new(u) for u in urls]
        self._counter = itertools.count()
        # servers whose record lapsed while requests of theirs still ran or an operator had cordoned them, by URL:
        # one that comes back is the same server, with its running streams (a drain must find them) and its cordon
        self._left: dict[str, Instance] = {}

    def _new(self, url: str, *, announced: bool = False) -> Instance:
        url = url.rstrip("/")
        return Instance(url, self.role, url if self.expose else f"{self.role}-{next(self._names)}", announced=announced)

    def join(self, url: str, identity: KVTransferParams | None = None) -> Instance:
        """A server announced in the registry: in rotation from now on (the health loop probes it).

        One that left with requests still running, or cordoned, and comes back with the same identity is the same
        server: it returns with them (its streams, its count in flight) and its cordon."""
        self._left = {u: i for u, i in self._left.items() if _remembered(i)}
        inst = self._left.pop(url.rstrip("/"), None)
        if inst is None or inst.identity != identity:
            inst = self._new(url, announced=True)
        inst.identity = identity
        self.instances.append(inst)
        return inst

    def leave(self, inst: Instance) -> None:
        """Out of rotation; its requests in flight finish."""
        self.instances.remove(inst)
        if inst.announced and _remembered(inst):
            self._left[inst.url] = inst

    def healthy(self) -> list[Instance]:
        """The healthy instances that take new requests; NoInstance when there are none."""
        healthy = [i for i in self.instances if i.serving]
        if not healthy:
            raise NoInstance(f"no healthy {self.role} server among {[i.label for i in self.instances]}")
        return healthy

    def pick(self, *, exclude: Collection[Instance] = ()) -> Instance:
        healthy = [i for i in self.healthy() if i not in exclude]
        if not healthy:
            raise NoInstance(f"no other healthy {self.role} server than {[i.label for i in exclude]}")
        return healthy[next(self._counter) % len(healthy)]


def _awaits(coro: Any) -> list[str]:
    """Where a suspended coroutine waits: each frame of its chain of awaits, outermost first.

    (A task's own stack shows the outermost frame only.)"""
    lines = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            lines.append(f"  awaiting {coro!r}"[:300])
            break
        lines.append(f'  File "{frame.f_code.co_filename}", line {frame.f_lineno}, in {frame.f_code.co_name}')
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None) or getattr(coro, "gi_yieldfrom", None)
    return lines


def _since(monotonic: float) -> float:
    return time.monotonic() - monotonic


def _remembered(inst: Instance) -> bool:
    """Whether a server that left the registry is kept to come back as itself (`Pool.join`)."""
    return bool(inst.streams or inst.in_flight or inst.cordoned)


class NoInstance(ConfigError):
    """Every instance of a role is down."""


class OverBudget(NoInstance):
    """Sending the next upstream request would pass the client request's `max_upstream_bytes` (retries did)."""


def _charge(content: bytes) -> None:
    """Count an upstream body against the client request's budget (`limits.BUDGET`); OverBudget past it."""
    budget = BUDGET.get()
    over = None if budget is None else budget.charge(len(content))
    if over is not None:
        raise OverBudget(over)


class DecodeFailed(Exception):
    """The decode server took the request and then failed before answering (it died, say)."""

    def __init__(self, inst: Instance, cause: httpx.TransportError) -> None:
        detail = f"{type(cause).__name__}: {cause}" if inst.label == inst.url else type(cause).__name__
        super().__init__(f"decode server {inst.label} failed: {detail}")
        self.inst = inst


@attrs.define(eq=False)
class Handover:
    """One P/D request whose decode answer is coming.

    `resp` (streamed, not read yet), the answer's headers naming the servers (with expose_internals), when the decode
    request was sent, and in layer-wise mode the prefill request (`computing`), cancelled when nobody reads its KV any
    more."""

    decode: Instance
    resp: httpx.Response
    headers: dict[str, str]
    sent: float
    computing: asyncio.Future | None = None

    async def close(self) -> None:
        """Drop it unread: vLLM aborts the decode request (and the prefill one in layer-wise mode)."""
        if self.computing is not None:
            self.computing.cancel()
        try:
            await self.resp.aclose()
        finally:
            self.decode.in_flight -= 1


def _identity(record: ServerRecord) -> KVTransferParams | None:
    """Where a server's KV can be pulled from, from its registry record (None: the record does not say)."""
    if not record.side_host or not record.side_port or record.dp_size != 1:
        return None  # with DP the proxy cannot know which engine holds a request
    return KVTransferParams(
        remote_engine_id=record.server_id,
        remote_host=record.side_host,
        remote_port=record.side_port,
        tp_size=record.tp_size,
        pp_size=record.pp_size,
    )


def _sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


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


@attrs.define(eq=False)
class Upstream:
    """A decode's streamed answer read event by event on a task of its own, for a stream that may move.

    `next()` gives ("event", dict), ("done", None), ("failed", why) or, when the stream was asked to move,
    ("cut", why). `marked`: the request carried the stream's migration id (the decode offers its blocks when cut)."""

    decode: Instance
    resp: httpx.Response
    moving: MovingStream
    marked: bool
    queue: asyncio.Queue = attrs.Factory(asyncio.Queue)
    pump: asyncio.Task | None = None
    ending: bool = False  # it sent its last token (a finish reason, or [DONE]): nothing left to move
    _closed: bool = False

    @classmethod
    def open(cls, decode: Instance, resp: httpx.Response, moving: MovingStream, *, marked: bool) -> Upstream:
        """Start reading; the caller already counted the request in `decode.in_flight`."""
        up = cls(decode, resp, moving, marked)
        up.pump = asyncio.ensure_future(up._read())
        decode.streams.add(moving)
        return up

    async def _read(self) -> None:
        try:
            async for line in self.resp.aiter_lines():
                data = line[len("data:") :].strip() if line.startswith("data:") else ""
                if data == "[DONE]":
                    self.ending = True
                    self.queue.put_nowait(("done", None))
                    return
                if data:
                    event = json.loads(data)
                    if not isinstance(event, dict):
                        raise ValueError("an event that is not a JSON object")
                    choices = event.get("choices")
                    if isinstance(choices, list) and any(
                        isinstance(c, dict) and c.get("finish_reason") for c in choices
                    ):
                        self.ending = True
                    self.queue.put_nowait(("event", event))
            self.queue.put_nowait(("failed", "the stream ended without [DONE]"))
        except (httpx.TransportError, ValueError) as exc:
            self.queue.put_nowait(("failed", f"{type(exc).__name__}: {exc}"))

    def push_back(self, item: tuple[str, Any]) -> None:
        """Put an item read ahead first again (the queue holds nothing else yet: the caller read the only one)."""
        rest = [self.queue.get_nowait() for _ in range(self.queue.qsize())]
        for x in [item, *rest]:
            self.queue.put_nowait(x)

    async def next(self) -> tuple[str, Any]:
        """The next event, or a cut once asked for (between two events, never before the prompt's ids are known)."""
        moving = self.moving
        # A decode that already finished the request (it sent its finish reason) offers nothing to pull, and nothing
        # is left to generate: the stream ends as it is, cut asked for or not (a cut then would ask the next decode
        # for one token more than the client asked for).
        if not (moving.movable and moving.prompt is not None) or self.ending or moving.spent:
            return await self.queue.get()
        # A cut goes before what is queued (a decode faster than its client is cut all the same).
        if moving.cut_requested:
            return ("cut", moving.cut_reason)
        if not self.queue.empty():
            return self.queue.get_nowait()
        get = asyncio.ensure_future(self.queue.get())
        cut = asyncio.ensure_future(moving.wait_cut())
        try:
            await asyncio.wait({get, cut}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cut.cancel()
            if not get.done() and not cut.done():  # cancelled itself (the client left)
                get.cancel()
        if get.done():
            return get.result()
        if self.ending:  # the finish reason came in while the cut was asked for: it wins, as above
            return await get
        get.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await get
        return ("cut", moving.cut_reason)

    async def close(self) -> None:
        """Drop the decode's answer (vLLM aborts the request); idempotent."""
        if self._closed:
            return
        self._closed = True
        self.decode.streams.discard(self.moving)
        if self.pump is not None:
            self.pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.pump
        try:
            await self.resp.aclose()
        finally:
            self.decode.in_flight -= 1


# Keys that shape only what is sampled after the prompt, or how the answer is written: prefill's one token is thrown
# away, so it is sent none of them (less to send; and `min_tokens` above 1 would be refused with `max_tokens` 1).
# Nothing that shapes the prompt (messages, tools, chat template, special tokens, truncation) is left out.
NOT_FOR_PREFILL = (
    "stream_options",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "bad_words",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "echo",
    "min_tokens",
)


def prefill_body(body: dict[str, Any], params: KVTransferParams | None = None) -> dict[str, Any]:
    """The request the prefill server gets: one token, no streaming, asks to hold KV for a decode."""
    out = {k: v for k, v in body.items() if k not in NOT_FOR_PREFILL}
    out["kv_transfer_params"] = (params or KVTransferParams(do_remote_decode=True)).to_dict()
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


async def read_body(request: Request) -> dict[str, Any] | JSONResponse:
    """The request's JSON object, or a 4xx that says what is wrong (logged): bounded in size, never a 500.

    `kv_transfer_params` are the proxy's to set: a client's own (also in `vllm_xargs`, which vLLM merges into the same
    place) could make decode read from a host it names."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            log.warning("refused a request to %s: body over %d bytes", request.url.path, MAX_BODY_BYTES)
            return JSONResponse({"error": f"request body over {MAX_BODY_BYTES} bytes"}, status_code=413)
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
        deep = _deeper_than(body, MAX_JSON_DEPTH)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        log.warning("refused a request to %s: body is not JSON (%s)", request.url.path, exc)
        return JSONResponse({"error": f"the request body is not JSON: {exc}"}, status_code=400)
    except RecursionError:
        deep = True
    if deep:
        log.warning("refused a request to %s: JSON nested deeper than %d levels", request.url.path, MAX_JSON_DEPTH)
        error = f"the request body's JSON is nested too deeply (over {MAX_JSON_DEPTH} levels)"
        return JSONResponse({"error": error}, status_code=400)
    if not isinstance(body, dict):
        log.warning("refused a request to %s: body is a JSON %s, not an object", request.url.path, type(body).__name__)
        return JSONResponse({"error": "the request body must be a JSON object"}, status_code=400)
    xargs = body.get("vllm_xargs")
    if "kv_transfer_params" in body or (isinstance(xargs, dict) and "kv_transfer_params" in xargs):
        where = "kv_transfer_params" if "kv_transfer_params" in body else "vllm_xargs.kv_transfer_params"
        log.warning("refused a request to %s: the client set %s", request.url.path, where)
        return JSONResponse({"error": f"{where}: kv_transfer_params are set by the proxy, not by clients"}, 400)
    return body


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether JSON `value` nests more than `limit` levels (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return False


async def until_disconnect(request: Request | None, work: Any) -> Any:
    """Run `work`; if the client disconnects first, cancel it (closing the upstream request) and return None.

    No `request`: the caller watches the client (a part of a batch)."""
    if request is None:
        return await work
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ProxyMetrics:
    """The proxy's Prometheus series, in a registry of its own (one per app)."""

    def __init__(self, pools: dict[str, Pool]) -> None:
        self.registry = prom.CollectorRegistry()
        self.phase = prom.Histogram(
            "kvbridge_proxy_phase_seconds",
            "Requests' timeline phases, the KV handover (the decode's pull phases "
            "together) and the total (docs/operations.md).",
            ["phase"],
            buckets=PHASE_BUCKETS,
            registry=self.registry,
        )
        self.requests = prom.Counter(
            "kvbridge_proxy_requests_total", "Requests answered, by HTTP status code.", ["code"], registry=self.registry
        )
        self.failovers = prom.Counter(
            "kvbridge_proxy_failovers_total",
            "Upstreams skipped for the next one because they refused or dropped the connection.",
            ["role"],
            registry=self.registry,
        )
        self.healthy = prom.Gauge(
            "kvbridge_proxy_upstream_healthy",
            "1 while the upstream is in rotation.",
            ["role", "upstream"],
            registry=self.registry,
        )
        self.in_flight = prom.Gauge(
            "kvbridge_proxy_upstream_in_flight",
            "Requests sent to the upstream, not yet answered.",
            ["role", "upstream"],
            registry=self.registry,
        )
        self.migrations = prom.Counter(
            "kvbridge_proxy_migrations_total",
            "Streams moved to another decode (--migrate), by outcome: precopied (the next decode read most of the KV "
            "before the cut, the rest after), pulled (it read the KV after the cut), "
            "recomputed (it computed the prompt and the tokens so far), failed (the stream ended with an error).",
            ["outcome"],
            registry=self.registry,
        )
        self.precopy_stages = prom.Counter(
            "kvbridge_proxy_precopy_stages_total",
            "Pre-copy stages of moving streams whose blocks the next decode pulled before the cut.",
            registry=self.registry,
        )
        self.handover_gap = prom.Histogram(
            "kvbridge_proxy_migration_gap_seconds",
            "From the cut of a moved stream to the next decode's first event.",
            buckets=PHASE_BUCKETS,
            registry=self.registry,
        )
        for outcome in ("precopied", "pulled", "recomputed", "failed"):
            self.migrations.labels(outcome)
        for inst in (i for p in pools.values() for i in p.instances):
            self.track(inst)
        for role in pools:
            self.failovers.labels(role)

    def track(self, inst: Instance) -> None:
        """Series of a new upstream, read at scrape time: the instances are the truth."""
        self.healthy.labels(inst.role, inst.label).set_function(lambda: float(inst.serving))
        self.in_flight.labels(inst.role, inst.label).set_function(lambda: float(inst.in_flight))

    def forget(self, inst: Instance) -> None:
        """An upstream that left: its series go."""
        for gauge in (self.healthy, self.in_flight):
            with contextlib.suppress(KeyError):
                gauge.remove(inst.role, inst.label)

    def observe(self, timeline: Timeline) -> None:
        for name, ms in timeline.phases.items():
            self.phase.labels(name.removesuffix("_ms")).observe(ms / 1e3)
        handover = timeline.handover_ms()
        if handover is not None:  # the KV handover: the decode's whole pull
            self.phase.labels("handover").observe(handover / 1e3)
        self.phase.labels("total").observe(timeline.total_ms / 1e3)


RELEASE_TIMEOUT_S = 1.0  # a prefill rank that does not answer the release in this long keeps its lease
# A rank that did not answer is asked again after 1, 2, 4, ... s, for this long: a stalled engine answers later, and
# until then its lease holds blocks (a draining server waits for them: one was killed at its shutdown timeout).
RELEASE_RETRY_S = 64.0


class Proxy:
    """The proxy's state (pools, upstream client, metrics) and its named handlers."""

    def __init__(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        *,
        health_interval: float,
        timeout: float,
        warm_up: bool = True,
        transfer: str = "pull",
        connect_timeout: float = CONNECT_TIMEOUT_S,
        expose_internals: bool = False,
        registry: str | None = None,
        migrate: bool = False,
        rebalance: Policy | None = None,
        limits: Limits | None = None,
        moves: MoveSettings | None = None,
    ) -> None:
        if transfer not in ("pull", "layerwise"):
            raise ConfigError(f"--transfer must be pull or layerwise, got {transfer!r}")
        self.expose = expose_internals
        self.limits = limits or Limits()
        dynamic = registry is not None
        self.pools = {
            "prefill": Pool("prefill", prefill, expose=expose_internals, registry=dynamic),
            "decode": Pool("decode", decode, expose=expose_internals, registry=dynamic),
        }
        self.transfer = transfer
        self.migrate = migrate or rebalance is not None  # move a draining decode's streams elsewhere (migration.py)
        self.rebalance = rebalance
        self.moves = moves or MoveSettings()
        # layerwise: where each prefill server's side channel is (from its last answer; forgotten while it is down)
        self.identities: dict[str, KVTransferParams] = {}
        self.health_interval = health_interval
        self.warm_up = warm_up
        self._warm: set[tuple[str, str]] = set()  # (prefill, decode) pairs warmed since both were last up
        self._warming: dict[tuple[str, str], asyncio.Task] = {}
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            trust_env=False,
            transport=httpx.AsyncHTTPTransport(
                # kept-alive connections are let go before vLLM's server closes them (VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
                # 5 s): one it closed just as it was reused fails the request sent on it
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=KEEP_ALIVE_S),
                socket_options=list(KEEPALIVE),
            ),
        )
        self.metrics = ProxyMetrics(self.pools)
        # To release a prefill's lease at once when no decode took the request (else it waits lease_s), and to
        # check the registry's records.
        self.secret = load_secret()
        self.members = None if registry is None else open_members(registry, secret=self.secret)
        if self.members is not None and not self.secret and not isinstance(self.members, StaticMembers):
            log.warning(
                "the proxy has no KVBRIDGE_SECRET: it takes every record in %s unchecked; anyone who can write "
                "there can add servers (docs/elastic.md)",
                self.members.url,
            )
        self._background: set[asyncio.Task] = set()  # clean-ups that must outlive a cancelled request
        # requests not answered yet (their first byte): the task serving each, its id and when it came; `_long_waits`
        self._waiting: dict[asyncio.Task, tuple[str, float]] = {}
        self._long_waits_said: set[asyncio.Task] = set()
        self.membership_rounds = 0  # registry reads done: a test waits for one after a change
        self.health_rounds = 0  # rounds that probed every server (`kvbridge bench --scale` times them)

    # -- membership ----------------------------------------------------------------------------

    def sync(self, records: Sequence[ServerRecord]) -> None:
        """Make the pools' announced servers the registry's: join the new, drop the gone, mark the draining."""
        wanted = {(r.role, r.url.rstrip("/")): r for r in records}
        for role, pool in self.pools.items():
            for inst in list(pool.instances):
                record = wanted.pop((role, inst.url), None)
                if record is None:
                    if inst.announced and self._lapse_kept(inst):
                        continue
                    if inst.announced:
                        inst.lapsed = 0.0
                        pool.leave(inst)
                        self.metrics.forget(inst)
                        self.identities.pop(inst.url, None)
                        self._warm = {pair for pair in self._warm if inst.url not in pair}
                        log.warning("%s server %s left the registry: taken out", role, inst.url)
                    elif inst.draining:  # a static server whose record went: serving as configured
                        inst.draining = False
                    continue
                if inst.lapsed:
                    log.warning("%s server %s: its record is back after %.1f s", role, inst.url, _since(inst.lapsed))
                    inst.lapsed = 0.0
                if record.draining != inst.draining:
                    log.warning("%s server %s is %s", role, inst.url, "draining" if record.draining else "serving")
                    inst.draining = record.draining
                inst.identity = _identity(record)
        for (role, url), record in sorted(wanted.items()):
            inst = self.pools[role].join(url, _identity(record))
            inst.draining = record.draining
            self.metrics.track(inst)
            back = f", back with {len(inst.streams)} running streams" if inst.streams else ""
            log.warning("%s server %s joined from the registry (capacity %d%s)", role, url, record.capacity, back)

    def _lapse_kept(self, inst: Instance) -> bool:
        """Whether a server whose record is gone stays in rotation for now (LAPSE_GRACE_S)."""
        if inst.draining or not inst.healthy:
            return False
        if not inst.lapsed:
            inst.lapsed = time.monotonic()
            log.warning(
                "%s server %s: its record lapsed; it stays while it answers health probes, for at most %g s",
                inst.role,
                inst.url,
                LAPSE_GRACE_S,
            )
        return _since(inst.lapsed) < LAPSE_GRACE_S

    async def read_members(self) -> None:
        """One read of the registry into the pools; a registry that cannot be read leaves them as they were."""
        assert self.members is not None
        try:
            records = await asyncio.to_thread(self.members.servers)
        except KVBridgeError as exc:
            log.warning("could not read the servers in %s (the pools stay as they are): %s", self.members.url, exc)
            return
        self.sync(records)
        self.membership_rounds += 1

    # -- health --------------------------------------------------------------------------------

    async def probe(self, inst: Instance) -> None:
        # A server that refuses connections or answers an error is down now. One that is only slow
        # to answer /health is busy (a loaded vLLM can take seconds), and taking it out would shift
        # all its traffic onto the others; it is down after SLOW_PROBES slow answers in a row.
        why = ""
        try:
            try:
                resp = await self.client.get(f"{inst.url}/health", timeout=PROBE_TIMEOUT_S)
            except httpx.TimeoutException:
                raise
            except httpx.TransportError as exc:
                # Once more at once: a server that is gone refuses again in microseconds, while a connection that
                # dropped (DROPPED), or a connect the kernel failed, may not say it is. In a run one round took out
                # both idle decodes at once, with no HTTP answer, on a box starved for seconds; the next was fine.
                log.info("%s server %s: health probe failed (%s): once more", inst.role, inst.url, type(exc).__name__)
                resp = await self.client.get(f"{inst.url}/health", timeout=PROBE_TIMEOUT_S)
            ok, inst.slow_probes = resp.status_code == 200, 0
            why = f" ({resp.status_code})"
        except httpx.TimeoutException:
            inst.slow_probes += 1
            ok = inst.healthy and inst.slow_probes < SLOW_PROBES
            why = f" ({inst.slow_probes} slow probes in a row)"
        except httpx.HTTPError as exc:
            ok, why = False, f" ({type(exc).__name__}: {exc})"
        except Exception as exc:  # noqa: BLE001
            # The HTTP stack's own bugs are a failed probe, not the end of health checks (seen in a chaos
            # run: httpcore raised AttributeError on a socket closed while connecting to a killed server).
            log.warning("%s server %s: health probe failed (%s: %s)", inst.role, inst.url, type(exc).__name__, exc)
            ok = False
        if ok != inst.healthy:
            log.warning("%s server %s is %s", inst.role, inst.url, "back" if ok else f"down: taken out{why}")
        inst.healthy = ok

    async def _probe_in(self, slots: asyncio.Semaphore, inst: Instance) -> None:
        async with slots:
            await self.probe(inst)

    async def health_loop(self) -> None:
        """Probe every instance each `health_interval` for the proxy's lifetime.

        A round that fails is logged and the next one runs: a dead loop would keep every server taken out since then out
        for good."""
        while True:
            try:
                slots = asyncio.Semaphore(PROBES_IN_FLIGHT)
                await asyncio.gather(*(self._probe_in(slots, i) for p in self.pools.values() for i in p.instances))
                self.health_rounds += 1
                self._long_waits()
                if self.rebalance is not None:
                    await self.rebalance_round(self.rebalance)
                if self.warm_up:
                    self._warm_pairs()
            except Exception:
                log.exception("health check round failed; the next one runs in %.1fs", self.health_interval)
            await asyncio.sleep(self.health_interval)

    async def membership_loop(self) -> None:
        """Read the registry every `REGISTRY_INTERVAL_S` (or `health_interval`, if shorter), apart from health rounds.

        A health round probes every server and grows with the deployment (seconds at a thousand servers on 2 busy
        cores): a join read in the same loop waited for it (docs/measurements/scale.md)."""
        interval = min(self.health_interval, REGISTRY_INTERVAL_S)
        while True:
            try:
                await self.read_members()
            except Exception:  # as in the health loop: a dead loop would follow the registry no more
                log.exception("registry round failed; the next one runs in %.1fs", interval)
            await asyncio.sleep(interval)

    async def rebalance_round(self, policy: Policy) -> None:
        """Read every serving decode's KV cache usage and move the streams the policy picks (rebalance.py)."""

        async def usage(inst: Instance) -> tuple[Instance, float | None]:
            try:
                resp = await self.client.get(f"{inst.url}/metrics", timeout=PROBE_TIMEOUT_S)
                return inst, kv_usage(resp.text) if resp.status_code == 200 else None
            except (httpx.HTTPError, ValueError) as exc:
                log.info("could not read %s/metrics for rebalancing: %s", inst.url, exc)
                return inst, None

        serving = [i for i in self.pools["decode"].instances if i.serving]
        read = await asyncio.gather(*(usage(i) for i in serving))
        streams, target = policy.plan({inst: value for inst, value in read if value is not None})
        for stream in streams:
            stream.request_cut("rebalancing", prefer=target)

    def _warm_pairs(self) -> None:
        """Start warming every pair of healthy servers not warmed since both were last up."""
        for p in self.pools["prefill"].instances:
            for d in self.pools["decode"].instances:
                pair = (p.url, d.url)
                if not p.healthy:
                    self.identities.pop(p.url, None)  # it may come back restarted, with another side channel
                if not (p.healthy and d.healthy):
                    self._warm.discard(pair)  # a server that was down may have restarted: first contact again
                elif p.draining or d.draining or p.cordoned or d.cordoned:
                    continue
                elif pair not in self._warm and pair not in self._warming:
                    self._warming[pair] = asyncio.create_task(self.warm_pair(p, d))

    async def warm_pair(self, prefill: Instance, decode: Instance) -> bool:
        """One one-token request through the pair, so its first contact is not paid by a client's request."""
        pair = (prefill.url, decode.url)
        headers = {"X-Request-Id": f"kvbridge-warm-up-{uuid.uuid4().hex[:12]}"}
        try:
            models = await self.client.get(f"{prefill.url}/v1/models", timeout=PROBE_TIMEOUT_S)
            models.raise_for_status()
            body: dict[str, Any] = {"model": models.json()["data"][0]["id"], "prompt": "kvbridge", "max_tokens": 1}
            first = await self.client.post(f"{prefill.url}/v1/completions", json=prefill_body(body), headers=headers)
            first.raise_for_status()
            params = first.json().get("kv_transfer_params")
            if params:
                decoded = KVTransferParams.from_dict(params)
                self._learn(prefill.url, decoded)  # layer-wise: where its side channel is
                body["kv_transfer_params"] = attrs.evolve(decoded, kvbridge_timing=None).to_dict()
            begun = time.perf_counter()
            (await self.client.post(f"{decode.url}/v1/completions", json=body, headers=headers)).raise_for_status()
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, ConfigError) as exc:
            log.warning("warming %s -> %s failed (its first request pays first contact): %s", *pair, exc)
            return False
        finally:
            self._warming.pop(pair, None)
        self._warm.add(pair)
        log.info("warmed %s -> %s (decode %.1f ms)", *pair, (time.perf_counter() - begun) * 1e3)
        return True

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(self.health_loop()), asyncio.create_task(_heartbeat())]
        if self.members is not None:
            tasks.append(asyncio.create_task(self.membership_loop()))
        try:
            yield
        finally:
            for t in [*tasks, *self._warming.values()]:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
            await self.client.aclose()
            if self.members is not None:
                self.members.close()

    def _take_out(self, inst: Instance, why: str) -> None:
        log.warning("%s server %s %s: taken out", inst.role, inst.url, why)
        inst.healthy = False
        self.metrics.failovers.labels(inst.role).inc()

    def _names(self, *servers: Instance) -> dict[str, str]:
        """The headers naming the servers of an answer (`x-kvbridge-prefill`, `-decode`), with expose_internals.

        Without expose_internals there are none."""
        return {f"x-kvbridge-{i.role}": i.url for i in servers} if self.expose else {}

    # -- upstream calls ------------------------------------------------------------------------

    async def call_prefill(
        self,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        params: KVTransferParams | None = None,
        instance: Instance | None = None,
    ) -> tuple[Instance, dict[str, Any]]:
        """POST to a prefill server (`instance`, or round robin), trying the next one when one fails.

        On a connection failure the server is taken out and the next one tried; on a server error (5xx) the
        next one is tried. Not with `instance`: a layer-wise decode already reads from that one. A 5xx is
        what a vLLM server answers once it began shutting down (SIGTERM), before the proxy's next registry
        read says it is draining: no KV is held for it.
        """
        pool = self.pools["prefill"]
        failed: httpx.Response | None = None
        for attempt in range(1 if instance is not None else len(pool.instances) + 1):
            if attempt and not any(i.healthy for i in pool.instances):
                break
            inst = instance or pool.pick()
            content = encoded(prefill_body(body, params))
            _charge(content)
            inst.in_flight += 1
            try:
                resp = await self.client.post(
                    f"{inst.url}{path}", content=content, headers={**headers, "content-type": "application/json"}
                )
            except httpx.ConnectTimeout:
                log.warning("prefill server %s did not accept the connection in time (busy?): next", inst.url)
                continue
            except httpx.TransportError as exc:
                self._take_out(inst, f"failed ({exc})")
                continue
            finally:
                inst.in_flight -= 1
            if resp.status_code >= 500 and instance is None:
                log.warning("prefill server %s answered %d (shutting down?): next", inst.url, resp.status_code)
                self.metrics.failovers.labels(inst.role).inc()
                failed = resp
                continue
            resp.raise_for_status()
            return inst, resp.json()
        if failed is not None:
            failed.raise_for_status()
        raise NoInstance(f"no prefill server answered for {path}")

    async def send_decode(
        self, path: str, body: dict[str, Any], headers: dict[str, str], moving: MovingStream | None = None
    ) -> tuple[Instance, httpx.Response]:
        """Start the decode request (streamed); the caller decrements the instance's in_flight.

        A decode server that refuses the connection never saw the request, and prefill still holds the KV for whichever
        decode asks, so try the next one. So does one that answers a server error (5xx) at once: what a vLLM server
        answers once it began shutting down, before the proxy's next registry read says it is draining; the last such
        answer is returned when no other decode is left. A `moving` stream is marked for the decode picked
        (`MovingStream.mark`)."""
        pool = self.pools["decode"]
        late: list[str] = []
        refused: list[Instance] = []  # answered 5xx: not tried again for this request
        # One more try than instances: a busy server that was slow to accept gets a second chance.
        for attempt in range(len(pool.instances) + 1):
            if attempt and not any(i.healthy for i in pool.instances):
                break
            try:
                inst = pool.pick(exclude=refused)
            except NoInstance:
                if refused:
                    break
                raise
            payload = body if moving is None else moving.mark(body, inst.identity)
            content = encoded(payload)
            _charge(content)
            upstream = self.client.build_request(
                "POST", f"{inst.url}{path}", content=content, headers={**headers, "content-type": "application/json"}
            )
            inst.in_flight += 1
            try:
                resp = await self.client.send(upstream, stream=True)
                if resp.status_code < 500 or not any(i.serving and i not in (*refused, inst) for i in pool.instances):
                    return inst, resp
                await resp.aclose()
                inst.in_flight -= 1
                refused.append(inst)
                self.metrics.failovers.labels(inst.role).inc()
                log.warning("decode server %s answered %d (shutting down?): next", inst.url, resp.status_code)
            except httpx.ConnectError as exc:
                inst.in_flight -= 1
                self._take_out(inst, f"refused the connection ({exc})")
            except httpx.ConnectTimeout:
                # Not down: its accept queue is full or this box is starved. It never saw the request;
                # the health probe decides whether it is gone.
                inst.in_flight -= 1
                late.append(inst.label)
                log.warning("decode server %s did not accept the connection in time (busy?): next", inst.url)
            except httpx.TransportError as exc:
                inst.in_flight -= 1
                self._take_out(inst, f"failed after taking the request ({exc})")
                raise DecodeFailed(inst, exc) from exc
            except BaseException:  # cancelled (the client left, or another part of its batch failed)
                inst.in_flight -= 1
                raise
        slow = f" ({', '.join(late)} did not accept the connection in time)" if late else ""
        raise NoInstance(f"no decode server accepted {path}{slow}")

    # -- handlers ------------------------------------------------------------------------------

    def _answer(
        self, code: int, error: str, headers: dict[str, str] | None = None, timeline: Timeline | None = None
    ) -> JSONResponse:
        """An error answer; with the request's timeline, it carries the phases known so far (and logs them)."""
        self.metrics.requests.labels(str(code)).inc()
        headers = dict(headers or {})
        if timeline is not None:
            timeline.total_ms = (time.perf_counter() - timeline.begun) * 1e3
            headers[HEADER] = timeline.header()
            log.info("kvbridge-timing %s (answered %d)", timeline.header(), code)
        return JSONResponse({"error": error}, status_code=code, headers=headers)

    async def complete(self, path: str, request: Request) -> Any:
        """A completion or chat request: prefill, hand its params to a decode, relay the decode's answer.

        Per part of a batch, merged."""
        begun = time.perf_counter()
        client_id = request.headers.get("x-request-id")
        bad_id = client_id is not None and not REQUEST_ID.fullmatch(client_id)
        timeline = Timeline(client_id if client_id and not bad_id else str(uuid.uuid4()), begun=begun)
        task = asyncio.current_task()
        if task is None:  # (only outside an event loop's task)
            return await self._complete(path, request, timeline, begun)
        self._waiting[task] = (timeline.request_id, time.monotonic())
        try:
            return await self._complete(path, request, timeline, begun)
        finally:
            del self._waiting[task]
            self._long_waits_said.discard(task)

    def _long_waits(self) -> None:
        """Log each request unanswered for LONG_WAIT_S, once, with the stack of the task that waits for it."""
        now = time.monotonic()
        for task, (request_id, since) in list(self._waiting.items()):
            if now - since < LONG_WAIT_S or task in self._long_waits_said:
                continue
            self._long_waits_said.add(task)
            where = "\n".join(_awaits(task.get_coro()))
            log.warning("request %s: no answer after %.1f s; it waits in:\n%s", request_id, now - since, where)

    async def _complete(self, path: str, request: Request, timeline: Timeline, begun: float) -> Any:
        ids = {"x-request-id": timeline.request_id}
        client_id = request.headers.get("x-request-id")
        if client_id is not None and client_id != timeline.request_id:
            log.warning("refused a request to %s: x-request-id %r is not 1 to 128 printable ASCII", path, client_id)
            error = "x-request-id must be 1 to 128 printable ASCII characters, without spaces or ';'"
            return self._answer(400, error, ids, timeline)
        body = await read_body(request)
        if isinstance(body, JSONResponse):
            return self._answer(body.status_code, json.loads(bytes(body.body))["error"], ids, timeline)
        try:
            parts = fanout.split(path, body, self.limits.max_parts)
        except fanout.Refused as exc:
            log.warning("refused a request to %s: %s", path, exc)
            return self._answer(400, f"{exc.field}: {exc}", ids, timeline)
        over = self._over_budget(parts)
        if over is not None:
            log.warning("refused a request to %s: %s", path, over[1])
            return self._answer(*over, ids, timeline)
        BUDGET.set(Budget(self.limits.max_upstream_bytes))  # every part's upstream body, retries included, counts
        if len(parts) > 1 or parts[0].body is not body:
            return await self._complete_parts(path, request, parts, timeline, begun)
        moving = None
        if self.migrate:
            why = refusal(path, body)
            if why is None:
                moving = MovingStream(path, body, timeline.request_id)
            else:
                log.info("request %s stays on its decode if that one drains: %s", timeline.request_id, why)
        handover = await self._handover(path, request, body, timeline, moving)
        if isinstance(handover, Response):
            return handover
        out_headers = {**handover.headers, **ids}
        streamed = handover.resp.headers.get("content-type", "").startswith("text/event-stream")
        if moving is not None and streamed and handover.resp.status_code == 200:
            answer = await self._relay_moving(request, handover, moving, timeline, begun, out_headers)
        else:
            relay = self._relay_stream if streamed else self._relay_whole
            answer = await relay(request, handover.resp, handover.decode, timeline, begun, handover.sent, out_headers)
        if getattr(answer, "status_code", 200) == 499 and handover.computing is not None:
            handover.computing.cancel()  # the client left: prefill stops too
        return answer

    def _over_budget(self, parts: list[fanout.Part]) -> tuple[int, str] | None:
        """The 413 (or 400) for a request whose parts' first tries alone would pass `max_upstream_bytes`.

        Refused before anything is sent: each part's prefill body, and its decode body less the params prefill adds."""
        try:
            size = sum(len(encoded(prefill_body(p.body))) + len(encoded(p.body)) for p in parts)
        except ValueError as exc:  # NaN or Infinity, which the JSON the servers read has no spelling for
            return 400, f"the request body cannot be sent on as JSON: {exc}"
        cap = self.limits.max_upstream_bytes
        if size <= cap:
            return None
        return 413, (
            f"the request's {len(parts)} P/D requests would send {size} bytes upstream, over the proxy's {cap} "
            "(--max-upstream-bytes)"
        )

    async def _handover(
        self,
        path: str,
        request: Request | None,
        body: dict[str, Any],
        timeline: Timeline,
        moving: MovingStream | None = None,
    ) -> Handover | JSONResponse:
        """One P/D request, up to the decode's answer coming (a Handover), or the error answer to give."""
        # Leases are keyed on this id (prefill's vLLM request id): never on a client's, which two may share.
        headers = {"X-Request-Id": f"kvbridge-{uuid.uuid4().hex}"}
        log.info("request %s: P/D request %s", timeline.request_id, headers["X-Request-Id"])  # the servers log this
        try:
            self.pools["decode"].healthy()  # else prefill would hold KV that no decode reads until its lease ends
        except NoInstance as exc:
            return self._answer(503, str(exc), None, timeline)
        if self.transfer == "layerwise":
            streamed = await self._handover_layerwise(path, request, body, headers, timeline, moving)
            if streamed is not None:
                return streamed
        try:
            answer = await until_disconnect(request, self.call_prefill(path, body, headers))
            if answer is None:
                log.info("client left during prefill of %s: prefill request cancelled", timeline.request_id)
                return self._answer(499, "client disconnected", None, timeline)
            prefill, first = answer
            params = KVTransferParams.from_dict(first.get("kv_transfer_params"))
        except NoInstance as exc:
            return self._answer(503, str(exc), None, timeline)
        except httpx.HTTPStatusError as exc:
            return self._answer(exc.response.status_code, f"prefill failed: {exc.response.text}", None, timeline)
        except ConfigError as exc:
            return self._answer(502, f"prefill server answered unusable kv_transfer_params: {exc}", None, timeline)
        prefill_done = time.perf_counter()
        self._learn(prefill.url, params)
        timeline.add(params.kvbridge_timing, ("prefill_ms",))
        decode_body = dict(body)
        if first.get("kv_transfer_params"):
            decode_body["kv_transfer_params"] = attrs.evolve(params, kvbridge_timing=None).to_dict()
        else:
            log.warning(
                "prefill answer for %s carries no kv_transfer_params; decode recomputes the prompt", timeline.request_id
            )
        sent = time.perf_counter()
        timeline.phases["proxy_ms"] = (sent - prefill_done) * 1e3
        try:
            decode, resp = await self.send_decode(path, decode_body, headers, moving)
        except NoInstance as exc:
            await self._release_lease(params, f"no decode took it: {exc}")
            return self._answer(503, str(exc), self._names(prefill), timeline)
        except DecodeFailed as exc:
            await self._release_lease(params, f"no decode took it: {exc}")
            return self._answer(503, str(exc), self._names(prefill, exc.inst), timeline)
        return Handover(decode, resp, self._names(prefill, decode), sent)

    async def _release_lease(self, params: KVTransferParams, why: str) -> None:
        """Tell each rank holding a lease on the request's KV that no decode will read it (an Abort, side channel).

        A prefill's lease, or a migrated stream's on the decode it left. So its blocks are free now, not when the lease
        ends. Needs the shared secret where the server has one (KVBRIDGE_SECRET or KVBRIDGE_SECRET_FILE in the proxy's
        environment); without it the lease ends by itself. A rank that does not answer is asked again in the
        background (`RELEASE_RETRY_S`); an Abort that comes before the offer it ends is kept by the rank's ledger."""
        if params.remote_request_id is None or params.remote_host is None or params.remote_port is None:
            return
        request_id = str(params.remote_request_id)
        host = str(params.remote_host)

        def abort(stage: int, rank: int, again: bool = False) -> bool:
            """False where the rank did not answer: it is asked again."""
            # Every stage's ranks hold blocks of the request: with pp_size > 1 the later stages' too (their ports follow
            # the engine's numbering, kvbridge.plan.rank_ports; remote_port is the engine's base, dp_rank its DP rank).
            try:
                port = side_channel_port(
                    int(params.remote_port),  # type: ignore[arg-type]
                    tp_rank=rank,
                    tp_size=params.tp_size,
                    pp_rank=stage,
                    pp_size=params.pp_size,
                    dp_index=params.dp_rank,
                )
                with ControlClient(host, port, secret=self.secret, sender="proxy", timeout_s=RELEASE_TIMEOUT_S) as c:
                    c.abort(request_id, reason=why)
                log.info("released request %s on stage %d rank %d (%s:%d)", request_id, stage, rank, host, port)
                return True
            except (TransferTimeout, PeerGone) as exc:
                (log.info if again else log.warning)(
                    "could not release request %s on stage %d rank %d (%s); asking again", request_id, stage, rank, exc
                )
                return False
            except KVBridgeError as exc:
                log.warning(
                    "could not release request %s on stage %d rank %d (%s); its lease ends by itself%s",
                    request_id,
                    stage,
                    rank,
                    exc,
                    "" if self.secret else " (the proxy has no KVBRIDGE_SECRET)",
                )
                return True

        async def ask(ranks: list[tuple[int, int]], again: bool = False) -> list[tuple[int, int]]:
            done = await asyncio.gather(*(asyncio.to_thread(abort, s, r, again) for s, r in ranks))
            return [rank for rank, ok in zip(ranks, done, strict=True) if not ok]

        async def ask_again(ranks: list[tuple[int, int]]) -> None:
            delay, until = RELEASE_TIMEOUT_S, time.monotonic() + RELEASE_RETRY_S
            while ranks and time.monotonic() + delay < until:
                await asyncio.sleep(delay)
                ranks, delay = await ask(ranks, again=True), delay * 2
            if ranks:
                log.warning(
                    "gave up releasing request %s on (stage, rank) %s: its lease ends by itself", request_id, ranks
                )

        left = await ask([(s, r) for s in range(params.pp_size) for r in range(params.tp_size)])
        if left:
            self._spawn(ask_again(left))

    async def _complete_parts(
        self, path: str, request: Request, parts: list[fanout.Part], timeline: Timeline, begun: float
    ) -> Any:
        """A batch: its parts' P/D requests at once, their answers merged (`fanout`)."""
        subs = [Timeline(timeline.request_id, begun=begun) for _ in parts]
        opened = await until_disconnect(request, self._open_all(path, parts, subs))
        if opened is None:
            log.info("client left before decode took every part of %s: all cancelled", timeline.request_id)
            return self._answer(499, "client disconnected", None, timeline)
        ids = {"x-request-id": timeline.request_id}
        failed = next((h for h in opened if not isinstance(h, Handover)), None)
        if failed is None:
            failed = next((h for h in opened if h.resp.status_code != 200), None)
        if failed is not None:  # the first error answers for the batch, as vLLM fails a batch whole
            await self._close_all([h for h in opened if h is not failed])
            if not isinstance(failed, Handover):
                failed.headers["x-request-id"] = timeline.request_id
                return failed
            return await self._relay_whole(
                request, failed.resp, failed.decode, timeline, begun, failed.sent, {**failed.headers, **ids}
            )
        timeline.phases.update(subs[0].phases)  # the first part's phases stand for the batch's
        headers = {**opened[0].headers, **ids}
        if all(h.resp.headers.get("content-type", "").startswith("text/event-stream") for h in opened):
            return await self._merge_stream(request, parts, opened, timeline, begun, headers)
        return await self._merge_whole(request, parts, opened, timeline, begun, headers)

    async def _open_all(
        self, path: str, parts: list[fanout.Part], subs: list[Timeline]
    ) -> list[Handover | JSONResponse]:
        """Every part's handover at once; cancelled, the ones already open are closed."""
        tasks = [asyncio.ensure_future(self._handover(path, None, p.body, t)) for p, t in zip(parts, subs)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._close_all([t.result() for t in tasks if not t.cancelled() and t.exception() is None])
            raise

    @staticmethod
    async def _close_all(opened: Sequence[Handover | JSONResponse]) -> None:
        for h in opened:
            if isinstance(h, Handover):
                await h.close()

    async def _merge_whole(
        self,
        request: Request,
        parts: list[fanout.Part],
        opened: list[Handover],
        timeline: Timeline,
        begun: float,
        headers: dict[str, str],
    ) -> Response:
        """Non-streamed parts: read each answer whole, answer the batch with them merged."""

        async def read(h: Handover) -> bytes:
            try:
                return await h.resp.aread()
            finally:
                await h.resp.aclose()
                h.decode.in_flight -= 1

        contents = await until_disconnect(request, asyncio.gather(*(read(h) for h in opened)))
        if contents is None:
            for h in opened:
                if h.computing is not None:
                    h.computing.cancel()
            log.info("client left during decode of %s: decode requests cancelled", timeline.request_id)
            return self._answer(499, "client disconnected", headers, timeline)
        try:
            answers = [json.loads(c) for c in contents]
            merged = fanout.merge_whole(parts, answers, timeline.request_id)
        except (ValueError, TypeError, AttributeError, KeyError) as exc:
            return self._answer(502, f"a decode server answered what is not a completion: {exc}", headers, timeline)
        with contextlib.suppress(ValueError, ConfigError, AttributeError):
            timeline.add(KVTransferParams.from_dict(answers[0].get("kv_transfer_params")).kvbridge_timing, PULL_REPORT)
        self._finish(timeline, begun, opened[0].sent, time.perf_counter())
        self.metrics.requests.labels("200").inc()
        return JSONResponse(merged, headers={**headers, HEADER: timeline.header()})

    async def _merge_stream(
        self,
        request: Request,
        parts: list[fanout.Part],
        opened: list[Handover],
        timeline: Timeline,
        begun: float,
        headers: dict[str, str],
    ) -> Any:
        """Streamed parts: one stream of every part's chunks as they come.

        Each choice carries its index, the parts' usage is summed into one chunk, and one `[DONE]` ends it."""
        merge = fanout.StreamMerge(parts, timeline.request_id)
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def pump(k: int, h: Handover) -> None:
            try:
                async for line in h.resp.aiter_lines():
                    data = line.removeprefix("data:").strip() if line.startswith("data:") else None
                    if data == "[DONE]":
                        break
                    if data:
                        queue.put_nowait((k, json.loads(data)))
            except (httpx.TransportError, ValueError) as exc:
                log.warning(
                    "decode server %s failed streaming part %d of %s: %s", h.decode.url, k, timeline.request_id, exc
                )
                queue.put_nowait((k, {"error": {"message": f"decode server {h.decode.label} failed", "code": 503}}))
            finally:
                await h.resp.aclose()
                h.decode.in_flight -= 1
                queue.put_nowait((k, None))

        tasks = [asyncio.ensure_future(pump(k, h)) for k, h in enumerate(opened)]

        async def stop(finished: bool) -> None:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if not finished:  # the client left: prefill stops too
                for h in opened:
                    if h.computing is not None:
                        h.computing.cancel()

        first = await until_disconnect(request, queue.get())
        if first is None:
            await stop(False)
            log.info("client left before the first token of %s: decode requests cancelled", timeline.request_id)
            return self._answer(499, "client disconnected", headers, timeline)
        self._finish(timeline, begun, opened[0].sent, time.perf_counter())
        self.metrics.requests.labels("200").inc()

        async def events() -> AsyncIterator[bytes]:
            finished, item, running = False, first, len(tasks)
            try:
                while True:
                    k, event = item
                    if event is None:
                        running -= 1
                    elif (out := merge.chunk(k, event)) is not None:
                        yield f"data: {json.dumps(out, separators=(',', ':'))}\n\n".encode()
                    if not running:
                        break
                    item = await queue.get()
                usage = merge.usage_chunk()
                if usage is not None:
                    yield f"data: {json.dumps(usage, separators=(',', ':'))}\n\n".encode()
                yield b"data: [DONE]\n\n"
                finished = True
            finally:
                await stop(finished)

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={**headers, HEADER: timeline.header()}
        )

    def _learn(self, prefill_url: str, params: KVTransferParams) -> None:
        """Keep where a prefill server's side channel is, for layer-wise requests to it.

        One DP rank only: with several, the proxy cannot know which one will hold a request before it answers. Each
        answer says it again: a prefill that restarted (another engine id, maybe another port) is followed."""
        if self.transfer != "layerwise":
            return
        if None in (params.remote_engine_id, params.remote_host, params.remote_port):
            return
        if params.dp_size > 1:
            if self.identities.pop(prefill_url, None) is None:
                log.warning("prefill server %s runs DP %d: its requests stay in pull mode", prefill_url, params.dp_size)
            return
        identity = KVTransferParams(
            remote_engine_id=params.remote_engine_id,
            remote_host=params.remote_host,
            remote_port=params.remote_port,
            tp_size=params.tp_size,
            pcp_size=params.pcp_size,
            dcp_size=params.dcp_size,
            pp_size=params.pp_size,
        )
        known = self.identities.get(prefill_url)
        if known == identity:
            return
        self.identities[prefill_url] = identity
        log.info(
            "prefill server %s: engine %s, side channel %s:%s, layer-wise from now on%s",
            prefill_url,
            params.remote_engine_id,
            params.remote_host,
            params.remote_port,
            "" if known is None else f" (it was engine {known.remote_engine_id}: restarted)",
        )

    async def _handover_layerwise(
        self,
        path: str,
        request: Request | None,
        body: dict[str, Any],
        headers: dict[str, str],
        timeline: Timeline,
        moving: MovingStream | None = None,
    ) -> Handover | JSONResponse | None:
        """Send the request to a prefill and a decode server at once, with one transfer id.

        Decode reads each layer while prefill computes the next. None: this prefill's side channel is not known yet (the
        request goes the pull way, which tells the proxy where it is)."""
        pool = self.pools["prefill"]
        try:
            prefill = pool.pick()
        except NoInstance as exc:
            return self._answer(503, str(exc), None, timeline)
        identity = self.identities.get(prefill.url)
        if identity is None:
            return None
        transfer_id = uuid.uuid4().hex  # unique even when clients reuse their x-request-id
        mode = {"transfer_mode": "layerwise", "transfer_id": transfer_id}
        to_prefill = KVTransferParams(do_remote_decode=True, **mode)
        to_decode = attrs.evolve(identity, do_remote_prefill=True, remote_request_id=transfer_id, **mode)
        computing = asyncio.ensure_future(self.call_prefill(path, body, headers, to_prefill, prefill))
        computing.add_done_callback(lambda task: self._prefill_ended(task, prefill, timeline))
        sent = time.perf_counter()
        try:
            started = await until_disconnect(
                request, self.send_decode(path, {**body, "kv_transfer_params": to_decode.to_dict()}, headers, moving)
            )
        except (NoInstance, DecodeFailed) as exc:
            computing.cancel()  # nobody reads it: vLLM aborts the prefill request, its lease is aborted
            names = self._names(prefill, exc.inst) if isinstance(exc, DecodeFailed) else self._names(prefill)
            return self._answer(503, str(exc), names, timeline)
        except BaseException:
            computing.cancel()
            raise
        if started is None:
            computing.cancel()
            log.info("client left before decode took %s: both requests cancelled", timeline.request_id)
            return self._answer(499, "client disconnected", None, timeline)
        decode, resp = started
        return Handover(decode, resp, self._names(prefill, decode), sent, computing)

    def _prefill_ended(self, task: asyncio.Future, prefill: Instance, timeline: Timeline) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:  # the decode's stream then fails or times out, and decode recomputes
            log.warning("layer-wise prefill of %s on %s failed: %s", timeline.request_id, prefill.url, exc)
            return
        _inst, answer = task.result()
        with contextlib.suppress(ConfigError):
            params = KVTransferParams.from_dict(answer.get("kv_transfer_params"))
            timeline.add(params.kvbridge_timing, ("prefill_ms",))
            self._learn(prefill.url, params)  # a restarted prefill answers with its new identity

    def _finish(self, timeline: Timeline, begun: float, sent: float, first_byte: float) -> None:
        """Close the timeline at the first byte of the decode's answer."""
        decode_ms = (first_byte - sent) * 1e3
        timeline.phases["decode_first_token_ms"] = max(0.0, decode_ms - (timeline.handover_ms() or 0.0))
        timeline.total_ms = (first_byte - begun) * 1e3
        self.metrics.observe(timeline)
        log.info("kvbridge-timing %s", timeline.header())

    async def _relay_whole(
        self,
        request: Request,
        resp: httpx.Response,
        decode: Instance,
        timeline: Timeline,
        begun: float,
        sent: float,
        headers: dict[str, str],
    ) -> Response:
        """A non-streamed answer: read it whole, take the decode's reported pull phases from it."""
        try:
            content = await until_disconnect(request, resp.aread())
        finally:
            await resp.aclose()  # also when the client left: vLLM aborts the decode request
            decode.in_flight -= 1
        if content is None:
            log.info("client left during decode of %s: decode request cancelled", timeline.request_id)
            return self._answer(499, "client disconnected", headers, timeline)
        with contextlib.suppress(ValueError, ConfigError, AttributeError):  # an error answer has no params
            reported = KVTransferParams.from_dict(resp.json().get("kv_transfer_params")).kvbridge_timing
            timeline.add(reported, PULL_REPORT)
        self._finish(timeline, begun, sent, time.perf_counter())
        self.metrics.requests.labels(str(resp.status_code)).inc()
        return Response(
            content,
            status_code=resp.status_code,
            headers={**headers, HEADER: timeline.header()},
            media_type=resp.headers.get("content-type", "application/json"),
        )

    async def _relay_stream(
        self,
        request: Request,
        resp: httpx.Response,
        decode: Instance,
        timeline: Timeline,
        begun: float,
        sent: float,
        headers: dict[str, str],
    ) -> Any:
        """A streamed answer: the headers go out with its first chunk, so the timeline ends there."""
        chunks = resp.aiter_raw()
        failed: httpx.TransportError | None = None
        try:
            first = await until_disconnect(request, anext(chunks, b""))
        except httpx.TransportError as exc:  # the decode server died before its first chunk
            first, failed = None, exc
        except BaseException:
            first = None
            raise
        finally:
            if first is None:
                await resp.aclose()
                decode.in_flight -= 1
        if failed is not None:
            decode.healthy = False
            log.warning(
                "decode server %s failed before the first chunk of %s: %s", decode.url, timeline.request_id, failed
            )
            detail = f"{type(failed).__name__}: {failed}" if self.expose else type(failed).__name__
            return self._answer(503, f"decode server {decode.label} failed: {detail}", headers, timeline)
        if first is None:
            log.info("client left before the first token of %s: decode request cancelled", timeline.request_id)
            return self._answer(499, "client disconnected", headers, timeline)
        self._finish(timeline, begun, sent, time.perf_counter())
        self.metrics.requests.labels(str(resp.status_code)).inc()

        async def relay() -> AsyncIterator[bytes]:
            # When the client goes away Starlette stops this generator; closing the upstream
            # response drops the connection, and vLLM aborts the decode request.
            try:
                yield first
                async for chunk in chunks:
                    yield chunk
            finally:
                await resp.aclose()
                decode.in_flight -= 1

        return StreamingResponse(
            relay(),
            status_code=resp.status_code,
            media_type=resp.headers.get("content-type", "text/event-stream"),
            headers={**headers, HEADER: timeline.header()},
        )

    # -- live decode migration (--migrate, migration.py) ------------------------------------------

    async def _relay_moving(
        self,
        request: Request,
        handover: Handover,
        moving: MovingStream,
        timeline: Timeline,
        begun: float,
        headers: dict[str, str],
    ) -> Any:
        """A streamed answer the proxy reads event by event, to move it to another decode when its own drains.

        The move happens between two events: what the client got is what the next decode continues from."""
        up = Upstream.open(handover.decode, handover.resp, moving, marked=handover.decode.identity is not None)
        first = await until_disconnect(request, up.next())
        if first is None or first[0] == "failed":
            await self._leave(up, moving, "its client left before the first token")
            if first is None:
                log.info("client left before the first token of %s: decode request cancelled", timeline.request_id)
                return self._answer(499, "client disconnected", headers, timeline)
            handover.decode.healthy = False
            log.warning(
                "decode server %s failed before the first event of %s", handover.decode.url, timeline.request_id
            )
            return self._answer(503, f"decode server {handover.decode.label} failed: {first[1]}", headers, timeline)
        self._finish(timeline, begun, handover.sent, time.perf_counter())
        self.metrics.requests.labels("200").inc()

        async def events() -> AsyncIterator[bytes]:
            nonlocal up
            item: tuple[str, Any] = first
            finished = False
            try:
                while True:
                    kind, payload = item
                    if kind == "event":
                        yield _sse(moving.take(payload))
                        if up.decode.draining:
                            moving.request_cut("its decode drains")
                        moving.cut_again(wanted=not up.decode.serving)
                    elif kind == "done" or moving.spent:  # (spent: its decode died after the last token: it is whole)
                        yield b"data: [DONE]\n\n"
                        finished = True
                        return
                    elif kind == "cut" and self._precopies(moving, up):
                        pass  # it goes on here while the next decode pulls what it filled; the cut comes after
                    else:  # the decode died or the cut: continue on another decode
                        if moving.precopy is not None:
                            moving.precopy.cancel()  # its decode died: what it lent is gone
                        moved = await self._move(moving, up, payload, pull=kind == "cut")
                        if moved is None:
                            error = {"message": f"decode server {up.decode.label} failed: {payload}", "code": 503}
                            yield _sse({"error": error})
                            yield b"data: [DONE]\n\n"
                            finished = True
                            return
                        up = moved
                    item = await up.next()
            finally:
                if moving.precopy is not None:
                    moving.precopy.cancel()  # it releases what it holds
                self._spawn(up.close() if finished else self._leave(up, moving, "its client left"))

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={**headers, HEADER: timeline.header()}
        )

    def _spawn(self, cleanup: Any) -> None:
        """Run a clean-up on a task of its own.

        When a client left, Starlette's cancel scope cancels every await of the request's own task."""
        task = asyncio.ensure_future(cleanup)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _leave(self, up: Upstream, moving: MovingStream, why: str) -> None:
        """Close the stream's upstream and release the blocks its decode offers for a move that will not come."""
        await up.close()
        if up.marked and up.decode.identity is not None:
            params = attrs.evolve(up.decode.identity, remote_request_id=moving.migration_id)
            await self._release_lease(params, why)

    async def _move(self, moving: MovingStream, up: Upstream, why: str, *, pull: bool) -> Upstream | None:
        """Continue `moving` on another decode: its KV pulled from the one it leaves (`pull`), else computed there.

        None when it cannot continue (nobody can take it, or the decode died before the proxy knew the prompt's ids).
        A cut that finds no other decode leaves the stream where it is (`up`, still open)."""
        source = up.decode
        if moving.prompt is None:
            await up.close()
            return None
        precopied, moving.precopied = moving.precopied, None
        try:
            target = self._next_decode(source, precopied[0] if precopied is not None and pull else moving.prefer)
        except NoInstance as exc:
            if pull:
                log.warning("stream %s stays on %s for now: %s", moving.migration_id, source.url, exc)
                moving.stay(self.health_interval)  # the next health round may bring one back
                return up
            await up.close()
            return None
        cut = time.perf_counter()
        await up.close()  # vLLM aborts the request; a marked one's blocks are offered under its migration id
        closed = time.perf_counter()
        move = moving.move or self.moves.mode
        offered = source.identity if pull and up.marked else None
        # a pre-copied stream's tail is computed where its pre-copy went (MoveSettings.tail), not pulled
        precomputed = precopied is not None and precopied[1] > 0 and precopied[0] is target
        tail = precomputed and self.moves.tail == "compute"
        pulled = offered if move != "recompute" and not tail else None
        if offered is not None and pulled is None:  # nobody will read the blocks it offers
            self._spawn(self._release_lease(attrs.evolve(offered, remote_request_id=moving.migration_id), "unread"))
        for n, identity in enumerate([pulled, None] if pulled is not None or tail else [None]):
            if n:  # the pull failed (or the pre-copied decode): the next decode computes it all
                try:
                    target = self.pools["decode"].pick(exclude=(source,))
                except NoInstance:
                    break
            outcome = "precopied" if tail and not n else "recomputed"
            if identity is not None:
                reported = await self._pull(moving, target, identity)
                if reported is None:
                    continue
                outcome = reported
                if outcome == "pulled" and precomputed:
                    outcome = "precopied"
            # the KV is in the target's cache now (pulled, or computed there): the stream goes on from it
            moved = await self._resume(moving, target)
            if moved is None:
                continue
            if pulled is not None and outcome == "recomputed":  # nobody read the offered blocks: free them now
                await self._release_lease(attrs.evolve(pulled, remote_request_id=moving.migration_id), "recomputed")
            gap = time.perf_counter() - cut
            self.metrics.migrations.labels(outcome).inc()
            self.metrics.handover_gap.observe(gap)
            log.warning(
                "stream %s (request %s) moved from %s to %s after %d tokens (%s, %s): "
                "first event %.1f ms after the cut (closing the source %.1f ms)",
                moving.migration_id,
                moving.request_id,
                source.url,
                target.url,
                len(moving.generated),
                why,
                outcome,
                gap * 1e3,
                (closed - cut) * 1e3,
            )
            moving.moved()
            return moved
        if pulled is not None:
            await self._release_lease(attrs.evolve(pulled, remote_request_id=moving.migration_id), "the move failed")
        self.metrics.migrations.labels("failed").inc()
        log.warning("stream %s could not move off %s (%s): it ends with an error", moving.migration_id, source.url, why)
        return None

    def _next_decode(self, source: Instance, prefer: Instance | None) -> Instance:
        """Where a stream leaving `source` goes: `prefer` while it takes requests, else the pool's pick (NoInstance)."""
        if prefer is not None and prefer is not source and prefer.serving:
            return prefer
        return self.pools["decode"].pick(exclude=(source,))

    def _precopies(self, moving: MovingStream, up: Upstream) -> bool:
        """Start pre-copying a stream whose cut came, where it can be (then the cut waits for it): whether it did."""
        source = up.decode
        if moving.precopied is not None or not up.marked or source.identity is None:
            return False  # (precopied: this cut's pre-copy ran already)
        if (moving.move or self.moves.mode) != "precopy" or moving.prompt is None:
            return False
        if len(moving.prompt) + len(moving.generated) <= self.moves.tail_tokens:
            return False  # as little as the cut would pull anyway
        try:
            target = self._next_decode(source, moving.prefer)
        except NoInstance:
            return False  # the cut finds none either, and the stream stays
        if target.identity is None:
            return False
        moving.begin_precopy(asyncio.ensure_future(self._precopy(moving, source.identity, target)))
        return True

    async def _precopy(self, moving: MovingStream, source: KVTransferParams, target: Instance) -> None:
        """Have `target` pull, in stages, the blocks the stream fills on `source` while it runs on; then cut it.

        A stage pulls what its context adds; the stages end when at most `tail_tokens` are left to the cut."""
        covered, began = 0, time.perf_counter()
        try:
            for stage in range(1, self.moves.stages + 1):
                context = len(moving.prompt or ()) + len(moving.generated)
                if covered and context - covered <= self.moves.tail_tokens:
                    break
                lease = precopy_id(moving.migration_id, stage)
                outcome = None
                try:
                    outcome = await asyncio.wait_for(
                        self._pull(moving, target, source, lease=lease, tokens=context), self.moves.stage_timeout_s
                    )
                finally:  # a lease read whole ended with its reader's DONE; any other is released here
                    if outcome != "pulled":
                        self._spawn(self._release_lease(attrs.evolve(source, remote_request_id=lease), "pre-copy"))
                if outcome != "pulled":
                    log.warning(
                        "stream %s: pre-copy stage %d to %s %s",
                        moving.migration_id,
                        stage,
                        target.url,
                        "failed" if outcome is None else "was computed, not pulled",
                    )
                    break
                covered = context
                self.metrics.precopy_stages.inc()
        except asyncio.TimeoutError:
            log.warning(
                "stream %s: a pre-copy stage to %s took over %.0f s",
                moving.migration_id,
                target.url,
                self.moves.stage_timeout_s,
            )
        except asyncio.CancelledError:  # the stream ended or its client left: nothing is cut
            moving.precopy = None
            raise
        except Exception:
            log.exception("stream %s: pre-copy to %s failed", moving.migration_id, target.url)
        log.info(
            "stream %s: pre-copied %d tokens to %s in %.1f ms; cut with %d tokens",
            moving.migration_id,
            covered,
            target.url,
            (time.perf_counter() - began) * 1e3,
            len(moving.prompt or ()) + len(moving.generated),
        )
        moving.end_precopy(target, covered)

    async def _send_moved(
        self, target: Instance, body: dict[str, Any], headers: dict[str, str], *, stream: bool, what: str
    ) -> httpx.Response | None:
        """POST a move's request to `target`: its response, or None (logged) when it failed.

        Only `target` holds the stream's KV, so a request it may never have seen is asked once more: a connect timeout
        (a busy server, as in `send_decode`: not taken out) and a connection that dropped before any answer (a kept-
        alive connection the server closed as it was reused; a request it had begun was aborted with it). What fails
        again, or fails any other way, takes it out."""
        request = self.client.build_request("POST", f"{target.url}/v1/completions", json=body, headers=headers)
        for attempt in range(MOVE_CONNECT_TRIES):
            again = attempt + 1 < MOVE_CONNECT_TRIES
            try:
                return await self.client.send(request, stream=stream)
            except httpx.ConnectTimeout:
                log.warning(
                    "decode server %s did not accept the connection for %s in time (busy?)%s",
                    target.url,
                    what,
                    ": once more" if again else "",
                )
            except DROPPED as exc:
                if not again:
                    self._take_out(target, f"failed {what} ({type(exc).__name__}: {exc})")
                    return None
                log.warning("decode server %s dropped %s (%s): once more", target.url, what, type(exc).__name__)
            except httpx.TransportError as exc:
                self._take_out(target, f"failed {what} ({type(exc).__name__}: {exc})")
                return None
        return None

    async def _pull(
        self,
        moving: MovingStream,
        target: Instance,
        source: KVTransferParams,
        *,
        lease: str | None = None,
        tokens: int | None = None,
    ) -> str | None:
        """Have `target` pull the stream's KV from `source` (the decode it left): what its connector reports happened.

        vLLM puts no `kv_transfer_params` in a stream, so the pull is a one-token request answered whole, whose params
        carry the target's report of its pull (`kvbridge_timing`, its pull states); the stream then goes on from the
        target's prefix cache. "pulled", "recomputed" (the pull failed and the target computed the KV itself: vLLM's
        `kv_load_failure_policy="recompute"`), or None when the target refused or failed the request (policy "fail").
        `lease` and `tokens`: a pre-copy stage's lease and the context it reads (MovingStream.pull_body)."""
        body = moving.pull_body(source, lease=lease, tokens=tokens)
        headers = {"X-Request-Id": f"kvbridge-{uuid.uuid4().hex}"}
        what = "pulling a moved stream" if lease is None else "pre-copying a stream"
        target.in_flight += 1
        try:
            resp = await self._send_moved(target, body, headers, stream=False, what=what)
            if resp is None:
                return None
        except BaseException:  # the client left: the target offers the aborted request's blocks under the migration id
            if target.identity is not None and lease is None:
                lease_of = attrs.evolve(target.identity, remote_request_id=moving.migration_id)
                self._spawn(self._release_lease(lease_of, "its client left"))
            raise
        finally:
            target.in_flight -= 1
        try:
            answer = resp.json()
            timing = (answer.get("kv_transfer_params") or {}).get("kvbridge_timing") or {}
            ok = resp.status_code == 200 and "error" not in answer and isinstance(timing, dict)
        except (ValueError, AttributeError):
            ok = False
        if not ok:
            log.warning(
                "decode %s failed pulling moved stream %s: %d %s",
                target.url,
                moving.migration_id,
                resp.status_code,
                resp.text[:300],
            )
            return None
        outcome = pull_outcome(timing)
        if outcome != "pulled":
            log.warning(
                "stream %s: %s did not pull it from %s, it computed it (its pull: %s)",
                moving.migration_id,
                target.url,
                source.remote_engine_id,
                {k: v for k, v in timing.items() if k.startswith("at_")} or "not reported",
            )
        return outcome

    async def _resume(self, moving: MovingStream, target: Instance) -> Upstream | None:
        """Send the continuation to `target`; its upstream once its first event came, or None (logged).

        The target computes what its cache lacks: nothing but the last token after a pull (`_pull`)."""
        body = moving.resume_body(None, mark=target.identity is not None)
        headers = {"X-Request-Id": f"kvbridge-{uuid.uuid4().hex}"}
        target.in_flight += 1
        sent = time.perf_counter()
        try:
            resp = await self._send_moved(target, body, headers, stream=True, what="taking a moved stream")
            if resp is None:
                target.in_flight -= 1
                return None
            if resp.status_code != 200:
                text = (await resp.aread())[:300]
                await resp.aclose()
        except httpx.TransportError as exc:  # reading a refusal's body
            target.in_flight -= 1
            self._take_out(target, f"failed taking a moved stream ({type(exc).__name__}: {exc})")
            return None
        except BaseException:
            target.in_flight -= 1
            raise
        if resp.status_code != 200:
            target.in_flight -= 1
            log.warning(
                "decode %s refused moved stream %s: %d %s", target.url, moving.migration_id, resp.status_code, text
            )
            return None
        answered = time.perf_counter()
        moved = Upstream.open(target, resp, moving, marked="kv_transfer_params" in body)
        try:
            first = await moved.queue.get()  # not next(): the cut that brought it here is still set
        except BaseException:  # the client left while the next decode was starting
            self._spawn(self._leave(moved, moving, "its client left"))
            raise
        log.info(
            "stream %s: %s answered %s in %.1f ms, its first event came %.1f ms later",
            moving.migration_id,
            target.url,
            headers["X-Request-Id"],
            (answered - sent) * 1e3,
            (time.perf_counter() - answered) * 1e3,
        )
        if first[0] != "event" or "error" in first[1]:
            await moved.close()
            log.warning("decode server %s failed moved stream %s: %s", target.url, moving.migration_id, first[1])
            return None
        moved.push_back(first)
        return moved

    async def health(self) -> Any:
        ok = all(any(i.healthy for i in p.instances) for p in self.pools.values())
        return JSONResponse({"ok": ok}, status_code=200 if ok else 503)

    async def instances(self) -> Any:
        state: dict[str, Any] = {
            # streams: the movable streams it serves now (what a drain would move)
            role: [
                {"url": i.label, "healthy": i.healthy, "in_flight": i.in_flight, "streams": len(i.streams)}
                for i in p.instances
            ]
            for role, p in self.pools.items()
        }
        if self.members is not None:  # which servers are draining, and how many registry reads were done
            for role, p in self.pools.items():
                for entry, inst in zip(state[role], p.instances):
                    entry["draining"] = inst.draining
        for role, p in self.pools.items():
            for entry, inst in zip(state[role], p.instances):
                entry["cordoned"] = inst.cordoned
            state["registry_rounds"] = self.membership_rounds
        state["health_rounds"] = self.health_rounds
        labels = {i.url: i.label for p in self.pools.values() for i in p.instances}
        # (prefill, decode) pairs whose first contact is made
        state["warmed"] = sorted((labels[p], labels[d]) for p, d in self._warm if p in labels and d in labels)
        return state

    async def admin(self, action: str, request: Request) -> Any:
        """`POST /admin/{cordon,uncordon,drain}` `{"server": URL or label}`, with the admin token as bearer token.

        A drain may say how its streams move (`"move"`: precopy, stop-and-copy or recompute; the proxy's by default).

        The token is derived from the shared secret (`kvbridge proxy --admin-token`), never the secret itself.

        cordon: no new request goes there; uncordon: it takes them again; drain: cordon, and with --migrate move its
        streams to other decodes now. The server itself keeps running: stop it afterwards (docs/elastic.md)."""
        if not self.secret:
            return JSONResponse({"error": "the admin calls need the proxy's KVBRIDGE_SECRET (none is set)"}, 403)
        token = request.headers.get("authorization", "").removeprefix("Bearer ").encode()
        if not hmac.compare_digest(token, str(admin_token(self.secret)).encode()):
            log.warning("refused an admin %s: bad or missing bearer token", action)
            return JSONResponse(
                {"error": "Authorization: Bearer <the admin token: `kvbridge proxy --admin-token`> is required"}, 401
            )
        body = await read_body(request)
        if isinstance(body, JSONResponse):
            return body
        name, move = body.get("server"), body.get("move")
        if move is not None and (action != "drain" or move not in MOVES):
            return JSONResponse({"error": f"'move' is for a drain, one of {list(MOVES)}; got {move!r}"}, 400)
        found = [i for p in self.pools.values() for i in p.instances if name in (i.url, i.label)]
        if not isinstance(name, str) or not found:
            known = [i.label for p in self.pools.values() for i in p.instances]
            return JSONResponse({"error": f"no server {name!r}; the proxy knows {known}"}, 404)
        for inst in found:
            inst.cordoned = action != "uncordon"
            moved = list(inst.streams) if action == "drain" and self.migrate else []
            for stream in moved:
                stream.request_cut("an operator drained its decode", move=move)
            log.warning(
                "%s server %s %sed by an operator (%d streams to move)", inst.role, inst.url, action, len(moved)
            )
        return {
            "server": name,
            "action": action,
            "streams_moving": sum(len(i.streams) for i in found if action == "drain"),
        }

    async def prometheus(self) -> Response:
        return Response(prom.generate_latest(self.metrics.registry), media_type=prom.CONTENT_TYPE_LATEST)


def create_app(
    prefill: Sequence[str],
    decode: Sequence[str],
    *,
    health_interval: float = 2.0,
    timeout: float = 600.0,
    warm_up: bool = True,
    transfer: str = "pull",
    connect_timeout: float = CONNECT_TIMEOUT_S,
    expose_internals: bool = False,
    registry: str | None = None,
    migrate: bool = False,
    rebalance: Policy | None = None,
    limits: Limits | None = None,
    moves: MoveSettings | None = None,
) -> FastAPI:
    """The FastAPI app: `/v1/completions`, `/v1/chat/completions`, `/health`, `/instances`, `/metrics`.

    `warm_up`: send one request through each prefill/decode pair once both are up (see the module doc).
    `transfer="layerwise"`: prefill and decode get each request at once (docs/vllm.md).
    `expose_internals`: answers name the servers by URL (see the module doc).
    `registry`: follow the servers announced there too (see the module doc).
    `migrate`: move a draining decode's streams to another decode (migration.py, docs/elastic.md).
    `rebalance`: also move streams off a decode under KV pressure by this policy (rebalance.py; implies `migrate`).
    `moves`: how a stream moves (pre-copy, by default; migration.MoveSettings).
    `limits`: the bounds on one request and on the clients (limits.py); serve the app with `limits.server` for the
    deadlines on request heads."""
    proxy = Proxy(
        prefill,
        decode,
        health_interval=health_interval,
        timeout=timeout,
        warm_up=warm_up,
        transfer=transfer,
        connect_timeout=connect_timeout,
        expose_internals=expose_internals,
        registry=registry,
        migrate=migrate,
        rebalance=rebalance,
        limits=limits,
        moves=moves,
    )
    app = FastAPI(lifespan=proxy.lifespan)
    app.add_middleware(Admission, limits=proxy.limits)
    for path in ROUTES:
        app.add_api_route(path, _bind(proxy.complete, path), methods=["POST"])
    app.add_api_route("/health", proxy.health, methods=["GET"])
    app.add_api_route("/instances", proxy.instances, methods=["GET"])
    app.add_api_route("/metrics", proxy.prometheus, methods=["GET"])
    for action in ("cordon", "uncordon", "drain"):
        app.add_api_route(f"/admin/{action}", _bind(proxy.admin, action), methods=["POST"])
    return app


def _bind(handle: Any, path: str) -> Any:
    async def endpoint(request: Request) -> Any:
        return await handle(path, request)

    return endpoint
