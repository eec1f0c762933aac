"""What one client can make `kvbridge proxy` do, bounded (docs/vllm.md, "The proxy's limits"; docs/security.md).

Three kinds of bound, each a `Limits` field and a `kvbridge proxy` option:

- amplification: a request becomes at most `max_parts` P/D requests, and all it sends upstream (every prefill and
  decode body, retries included) is at most `max_upstream_bytes` (`Budget`);
- time: a connection sends its request head within `header_timeout_s` of opening (or of its last answer), and its
  body within `body_timeout_s` of the head (`Guarded`, `Admission`);
- room: at most `max_connections` requests in progress and as many connections waiting for a head, and
  `max_connections_per_client` of each per client address; the rest get a 503. `/health` is served past the caps.

uvicorn's own `limit_concurrency` is not used: it answers `/health` with its 503 too.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import json
import logging
import math
from typing import Any

import attrs
import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvbridge.base.errors import ConfigError
from kvbridge_proxy.fanout import MAX_PARTS
from kvbridge_proxy.wire import error_body

log = logging.getLogger(__name__)

# Four times the body limit (app.MAX_BODY_BYTES, 32 MiB): each part goes to a prefill and a decode, so a request of the
# largest body gets through with one retry, and a batch sends at most four times what its client may send.
MAX_UPSTREAM_BYTES = 128 * 1024 * 1024
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 60.0
KEEP_ALIVE_S = 5.0  # uvicorn's default
MAX_CONNECTIONS = 1024
MAX_CONNECTIONS_PER_CLIENT = 64
MAX_HEADER_BYTES = 16 * 1024  # h11's default, said here: a request head (line and headers) larger is a 400
ALWAYS_SERVED = frozenset({"/health"})  # answered past the caps: a load balancer's probe sees the proxy alive


def _positive(_inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ConfigError(f"the proxy's {attr.name} must be a finite number above 0, got {value!r}")


@attrs.frozen
class Limits:
    """The proxy's bounds on one request and on its clients (module doc); the defaults are `kvbridge proxy`'s."""

    max_parts: int = attrs.field(default=MAX_PARTS, validator=_positive)
    max_upstream_bytes: int = attrs.field(default=MAX_UPSTREAM_BYTES, validator=_positive)
    header_timeout_s: float = attrs.field(default=HEADER_TIMEOUT_S, validator=_positive)
    body_timeout_s: float = attrs.field(default=BODY_TIMEOUT_S, validator=_positive)
    keep_alive_s: float = attrs.field(default=KEEP_ALIVE_S, validator=_positive)
    max_connections: int = attrs.field(default=MAX_CONNECTIONS, validator=_positive)
    max_connections_per_client: int = attrs.field(default=MAX_CONNECTIONS_PER_CLIENT, validator=_positive)


def encoded(payload: dict[str, Any]) -> bytes:
    """A request body as the proxy sends it upstream (as httpx encodes `json=`: compact, UTF-8, no NaN)."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


class Budget:
    """The bytes one client request may still send upstream (`max_upstream_bytes`), all its parts together."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.spent = 0

    def charge(self, size: int) -> str | None:
        """Count `size` bytes about to be sent; the refusal, naming the setting, when they would pass the cap."""
        if self.spent + size > self.cap:
            return (
                f"the request would send over {self.cap} bytes upstream (--max-upstream-bytes; "
                f"{self.spent} sent, {size} more asked)"
            )
        self.spent += size
        return None


# The budget of the client request being served. A context variable because each part's handover runs on a task of
# its own, which copies the context: every part charges the same Budget.
BUDGET: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("kvbridge_proxy_budget", default=None)


def _client(scope: dict[str, Any]) -> str:
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


async def _answer(send: Any, status: int, error: str) -> None:
    body = json.dumps(error_body(error, status)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers.append((b"connection", b"close"))  # the rest of its body, if any, is never read
    if status == 503:
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Admission:
    """ASGI middleware: the request caps (503 past them, `/health` excepted) and the body deadline (408)."""

    def __init__(self, app: Any, limits: Limits) -> None:
        self.app = app
        self.limits = limits
        self.total = 0
        self.per_client: collections.Counter[str] = collections.Counter()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in ALWAYS_SERVED:
            await self.app(scope, receive, send)
            return
        client = _client(scope)
        full = None
        if self.per_client[client] >= self.limits.max_connections_per_client:
            full = f"{self.limits.max_connections_per_client} requests from {client} in progress "
            full += "(--max-connections-per-client)"
        elif self.total >= self.limits.max_connections:
            full = f"{self.limits.max_connections} requests in progress (--max-connections)"
        if full is not None:
            log.warning("refused a request to %s from %s: %s", scope["path"], client, full)
            await _answer(send, 503, f"the proxy is full: {full}; try again")
            return
        self.total += 1
        self.per_client[client] += 1
        try:
            await self._deadlined(scope, receive, send, client)
        finally:
            self.total -= 1
            self.per_client[client] -= 1
            if not self.per_client[client]:
                del self.per_client[client]

    async def _deadlined(self, scope: dict[str, Any], receive: Any, send: Any, client: str) -> None:
        """The app, whose reads of the body end at the deadline: then the client gets a 408, not the app's answer."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.body_timeout_s
        state = {"body_done": False, "late": False, "answered": False}

        async def timed_receive() -> Any:
            if state["body_done"] or state["late"]:
                return await receive()  # after the body: the app waits for a disconnect, however long
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                state["late"] = True
                return {"type": "http.disconnect"}  # what the app does when a client leaves mid-body
            if message["type"] != "http.request" or not message.get("more_body", False):
                state["body_done"] = True
            return message

        async def guarded_send(message: Any) -> None:
            if state["late"]:
                return  # the app's answer to the "disconnect": the client gets the 408 instead
            if message["type"] == "http.response.start":
                state["answered"] = True
            await send(message)

        try:
            await self.app(scope, timed_receive, guarded_send)
        except Exception:
            if not state["late"]:
                raise
        if state["late"] and not state["answered"]:
            why = f"the request body did not arrive within {self.limits.body_timeout_s:g} s (--body-timeout)"
            log.warning("refused a request to %s from %s: %s", scope["path"], client, why)
            await _answer(send, 408, why)


def _refusal(error: str) -> bytes:
    body = json.dumps(error_body(error, 503)).encode()
    head = "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    head += f"content-length: {len(body)}\r\nconnection: close\r\nretry-after: 1\r\n\r\n"
    return head.encode() + body


def guarded_protocol(limits: Limits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline for each request head, and a cap on connections waiting for one.

    A connection waits for a head from when it opens, and again after each answer (keep-alive). One that waits longer
    than `header_timeout_s` is closed. When an address has more than `max_connections_per_client` waiting, or the
    proxy more than `max_connections`, the one that has waited longest is closed (answered 503 when it never sent a
    request; an idle keep-alive one is only closed, as its client expects): a client that holds connections open
    without a head loses them to the next connection, whoever opens it."""
    # the connections waiting for a head, oldest first: in all, and per client address
    waiting: dict[Guarded, None] = {}
    by_client: dict[str, dict[Guarded, None]] = collections.defaultdict(dict)

    class Guarded(H11Protocol):
        timer: asyncio.TimerHandle | None = None
        host = "unknown"
        served = False  # it was answered once: waiting now is keep-alive

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.host = str(self.client[0]) if self.client else "unknown"
            self.wait_head()

        def wait_head(self) -> None:
            if self.timer is not None:
                self.timer.cancel()
            self.timer = self.loop.call_later(limits.header_timeout_s, self.late_head)
            waiting[self] = None
            mine = by_client[self.host]
            mine[self] = None
            if len(mine) > limits.max_connections_per_client:
                full = f"{limits.max_connections_per_client} connections from {self.host} waiting to send a request "
                next(iter(mine)).refuse(full + "(--max-connections-per-client)")
            elif len(waiting) > limits.max_connections:
                full = f"{limits.max_connections} connections waiting to send a request (--max-connections)"
                next(iter(waiting)).refuse(full)

        def head_came(self) -> None:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            waiting.pop(self, None)
            mine = by_client.get(self.host)
            if mine is not None:
                mine.pop(self, None)
                if not mine:
                    del by_client[self.host]

        def refuse(self, full: str) -> None:
            log.warning("closed a connection from %s waiting to send a request: %s", self.host, full)
            self.head_came()
            if not self.served:
                self.transport.write(_refusal(f"the proxy is full: {full}; try again"))
            self.transport.close()

        def late_head(self) -> None:
            self.timer = None
            log.info("closed a connection from %s: no request head within %g s", self.host, limits.header_timeout_s)
            self.head_came()
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the head came (or the connection is done with)
                self.head_came()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.served = True
            # One answered before its body was read (a 413, /health) is closed already: h11 makes it MUST_CLOSE.
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self.wait_head()  # keep-alive: the next head has the same deadline

        def connection_lost(self, exc: Exception | None) -> None:
            self.head_came()
            super().connection_lost(exc)

    return Guarded


def server(app: Any, host: str, port: int, limits: Limits, *, log_level: str = "warning") -> Any:
    """The uvicorn server for the proxy's app, with `limits`' deadlines and caps on its connections."""
    import uvicorn

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=guarded_protocol(limits),
        timeout_keep_alive=math.ceil(limits.keep_alive_s),
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        limit_concurrency=None,  # its 503 would answer /health too: Admission caps requests instead
    )
    return uvicorn.Server(config)
