"""The upstream servers the proxy routes to: one `Instance` each, a `Pool` per role, and the HTTP client to them."""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
from collections.abc import Collection, Sequence
from typing import Any

import attrs
import httpx

from kvbridge.base.errors import ConfigError, described
from kvbridge.control.params import KVTransferParams
from kvbridge_proxy.moving_stream import MovingStream

log = logging.getLogger("kvbridge_proxy.app")  # the proxy's one logger, whichever module logs (operators filter on it)

# Seconds to open a connection to an upstream. On loopback a connect takes microseconds unless the server's
# accept queue is full or the box is starved; such a server never saw the request, so the proxy tries again.
CONNECT_TIMEOUT_S = 5.0
KEEP_ALIVE_S = 3.0
# TCP keepalive on every upstream connection: probes after 5 s idle, every 2 s, 3 unanswered end it. A server that went
# away without a word (killed, its reset lost on a lossy link; or its host gone) leaves a connection that looks open for
# as long as nobody sends, and the proxy, waiting for its answer, sends nothing more: a request would wait the whole
# timeout (docs/measurements/chaos.md). A probe is answered by the peer's kernel, however busy its server.
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
# A connection that dropped before any answer: most often a kept-alive one the server closed as it was reused. The
# server may well be up; a request that it never answered is asked once more before it counts.
DROPPED = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


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
    # where its side channel is (from its registry record): a stream moved off it is pulled from there
    identity: KVTransferParams | None = None
    streams: set[MovingStream] = attrs.Factory(set)  # the movable streams it serves now (--live-moves)
    lapsed: float = 0.0  # when its record was last found gone (time.monotonic()); 0.0 while it has one
    # a decode's answers to pulled requests say whether its prefix cache keeps what it pulls (None: not said yet):
    # a stream moved to one that does not is computed there whole, so nothing is pulled or pre-copied for it
    prefix_cache: bool | None = None

    @property
    def serving(self) -> bool:
        """Whether it takes new requests."""
        return self.healthy and not self.draining and not self.cordoned

    def heard(self, answer: KVTransferParams) -> None:
        """Take what a decode's answer to a pulled request says of its prefix cache (`prefix_cache`)."""
        said = answer.kvbridge_prefix_cache
        if said is None or said == self.prefix_cache:
            return
        self.prefix_cache = said
        if not said:  # (a move to it says so as a warning: without --live-moves nothing is lost)
            log.info(
                "decode server %s runs without prefix caching: a stream moved to it is computed there whole, so "
                "streams move to decodes with prefix caching where there are any, and none is pulled to it",
                self.url,
            )

    def failed(self, cause: BaseException | str) -> str:
        """Its failure as clients read it: an error's text only where they may read the server's URL as well.

        Without expose_internals a client learns the kind of error, not its message (which may name an address); a
        str is the proxy's own words (why a stream was cut), shown as it is."""
        if isinstance(cause, BaseException):
            cause = described(cause) if self.label == self.url else type(cause).__name__
        return f"{self.role} server {self.label} failed: {cause}"


class Pool:
    """Round-robin over the healthy instances of one role that are not draining."""

    def __init__(self, role: str, urls: Sequence[str], *, expose: bool = False, registry: bool = False) -> None:
        if not urls and not registry:
            raise ConfigError(
                f"the proxy needs at least one {role} server URL (--{role} http://HOST:PORT) or a --registry"
            )
        named = [url.rstrip("/") for url in urls]
        twice = sorted({url for url in named if named.count(url) > 1})
        if twice:  # it would be two instances of one server: twice its share of requests, and two health checks
            raise ConfigError(f"{role} server(s) {twice} given more than once: name each server once")
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
        self._left = {u: i for u, i in self._left.items() if remembered(i)}
        inst = self._left.pop(url.rstrip("/"), None)
        if inst is None or inst.identity != identity:
            inst = self._new(url, announced=True)
        inst.identity = identity
        self.instances.append(inst)
        return inst

    def leave(self, inst: Instance) -> None:
        """Out of rotation; its requests in flight finish."""
        self.instances.remove(inst)
        if inst.announced and remembered(inst):
            self._left[inst.url] = inst

    def healthy(self) -> list[Instance]:
        """The healthy instances that take new requests; NoInstance when there are none."""
        healthy = [i for i in self.instances if i.serving]
        if not healthy:
            raise NoInstance.among(self)
        return healthy

    def pick(self, *, exclude: Collection[Instance] = ()) -> Instance:
        healthy = [i for i in self.healthy() if i not in exclude]
        if not healthy:
            raise NoInstance(f"no other healthy {self.role} server than {[i.label for i in exclude]}")
        return healthy[next(self._counter) % len(healthy)]


def since(monotonic: float) -> float:
    return time.monotonic() - monotonic


def remembered(inst: Instance) -> bool:
    """Whether a server that left the registry is kept to come back as itself (`Pool.join`)."""
    return bool(inst.streams or inst.in_flight or inst.cordoned)


class NoInstance(ConfigError):
    """Every instance of a role is down."""

    @classmethod
    def among(cls, pool: Pool) -> NoInstance:
        return cls(f"no healthy {pool.role} server among {[i.label for i in pool.instances]}")


class _Transport(httpx.AsyncHTTPTransport):
    """httpx's transport, where a connection reset as it opened is a ConnectError: the next server is tried.

    httpcore (1.0.9) sets the keepalive options on anyio's raw socket right after the connect. Where the server reset
    the connection in between (killed as it accepted), that socket is gone, and its AttributeError escaped as the
    proxy's own 500 (docs/measurements/chaos.md, layer-wise under faults)."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await super().handle_async_request(request)
        except AttributeError as exc:
            if "setsockopt" not in str(exc):
                raise
            raise httpx.ConnectError(f"the connection was reset as it opened ({exc})", request=request) from None


def new_client(timeout: float, connect_timeout: float) -> httpx.AsyncClient:
    """The client of every upstream request."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout, connect=connect_timeout),
        trust_env=False,
        transport=_Transport(
            # kept-alive connections are let go before vLLM's server closes them (VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
            # 5 s): one it closed just as it was reused fails the request sent on it
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=KEEP_ALIVE_S),
            socket_options=list(KEEPALIVE),
        ),
    )


class Background:
    """Clean-ups that must outlive a cancelled request, each on a task of its own."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, cleanup: Any) -> None:
        """Run a clean-up on a task of its own.

        When a client left, Starlette's cancel scope cancels every await of the request's own task."""
        task = asyncio.ensure_future(cleanup)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for the clean-ups under way (a proxy stopping); cancel the rest. How many were cut.

        A release cut short leaves its lease to end by itself (`lease_s`), holding its blocks till then."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)
        left = set(self._tasks)
        for task in left:
            task.cancel()
        if left:
            await asyncio.gather(*left, return_exceptions=True)
            log.warning("stopping: %d clean-ups (lease releases) cut short after %.1f s", len(left), timeout_s)
        return len(left)
