"""The side channel's clients: `ControlClient` talks to one rank's `ControlServer`, `ClientPool` to many."""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

import attrs
import zmq
from zmq.utils.monitor import parse_monitor_message

from kvbridge.agent.kv_agent import RankInfo
from kvbridge.base import watchdog, wire
from kvbridge.base.block_ids import BlockIds
from kvbridge.base.errors import ConfigError, LoadError, PeerGone, ProtocolError, TransferTimeout
from kvbridge.control.auth import Authenticator
from kvbridge.control.framing import (
    MAX_MESSAGE_BYTES,
    MISADDRESSED,
    Address,
    T,
    bracketed,
    decode_small,
    engine_of,
    ipv6,
    new_frame,
    own_card,
)
from kvbridge.control.messages import (
    MAX_CARD_S,
    REPLIES,
    Abort,
    Ack,
    BeginPull,
    Done,
    Frame,
    GetInfo,
    LeaseState,
    LeaseStatus,
    QueryLease,
    QueryStream,
    Refused,
    RegisteredMemory,
    StreamStatus,
)
from kvbridge.transport import netguard

# The side channel's one logger, whichever of its modules logs: one name for operators' filters.
log = logging.getLogger("kvbridge.control.channel")

# A client holds its (one-request-at-a-time) socket while the server holds its BeginPull: it asks for at
# most this long per round, so other requests to the same rank interleave while an offer is late.
PARK_SLICE_S = 0.1
# A decode keeps a prefill rank's transport addresses admitted this long after its last authenticated answer
# (then the grace): the peer relation its pulls need.
RELATION_S = 120.0
# A request its caller may call off (`cancelled`) looks at that this often while it waits for its answer (as long
# as a held round, so a BeginPull held for its offer wakes once more a round at most).
CANCEL_LOOK_S = PARK_SLICE_S
# A request not answered within this has its socket's connection watched (a ZeroMQ monitor) until it is: a rank whose
# process is gone refuses the reconnection, or closes the connection its request went out on, and the request fails
# then instead of at its timeout. ZeroMQ hides both from a REQ socket, which reconnects in the background and keeps
# the request queued. Past a held BeginPull's round, so a healthy answer never pays for a monitor.
WATCH_AFTER_S = 2.5 * PARK_SLICE_S
# A connection attempt that failed (refused: nothing listens on the port; unreachable) or a connection that closed:
# the request cannot be answered by the process it was sent to. A partition drops packets and shows neither. Each
# watch has an inproc address of its own: a socket's previous monitor frees its address only later.
GONE_EVENTS, _WATCHES = zmq.EVENT_CLOSED | zmq.EVENT_DISCONNECTED, itertools.count()


class ControlClient:
    """Talks to one rank's side channel. Thread-safe, and concurrent requests do not wait for each other.

    Each request takes a REQ socket of its own from a small idle pool (a new one when none is idle), so
    a request the peer does not answer (held by a stopped or busy peer, or lost with the connection of
    a peer that was restarted on the same port) delays only its caller. A socket whose request timed
    out or failed is closed, never reused: a REQ socket with a lost request would swallow the next.
    """

    IDLE_SOCKETS = 4  # kept open for reuse; more are opened while more requests are in flight

    def __init__(
        self,
        host: str,
        port: int,
        *,
        secret: str | bytes | None = None,
        timeout_s: float = 5.0,
        sender: str = "",
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        receiver: str = "",
        context: zmq.Context | None = None,
    ) -> None:
        """A client of one rank's side channel.

        `receiver`: the rank's `engine_id/rank`, named in every request (the server refuses a request named for another
        rank); "" learns it from the first authenticated reply (a GetInfo is sent first for it). `context`: the ZeroMQ
        context of its sockets (default: the process's shared one)."""
        self.url = f"tcp://{bracketed(host)}:{port}"
        self.host = host
        self.timeout_s = timeout_s
        self.sender = sender
        self.receiver = receiver
        self._ctx = context
        self._auth = Authenticator(secret)
        self._max = max_message_bytes
        self._lock = threading.Lock()
        self._idle: list[zmq.Socket] = []
        self._closed = False
        self.silent = False  # its last request went unanswered (a killed or stalled peer) until one is answered
        self._learned = ""  # the rank that sent the last authenticated reply
        self._peer: tuple[str, tuple[str, ...]] | None = None  # the rank's name and card hosts (its GetInfo reply)

    def _take(self) -> zmq.Socket:
        with self._lock:
            if self._closed:
                raise ConfigError(f"control client for {self.url} is closed")
            if self._idle:
                return self._idle.pop()
        try:
            sock = (self._ctx or zmq.Context.instance()).socket(zmq.REQ)
        except zmq.ZMQError as exc:  # out of sockets (the context's limit, or file descriptors), or closed
            raise PeerGone(
                f"cannot open a socket to side channel {self.url}: {exc}", peer=self.url, cause=str(exc)
            ) from None
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self._max + 1024)
            sock.setsockopt(zmq.IPV6, ipv6(self.host))
            sock.connect(self.url)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ConfigError(
                f"cannot connect to side channel {self.url}: {exc}; check the host and port it was given "
                "(kv_transfer_params remote_host/remote_port, or the registry); an IPv6 address goes in brackets"
            ) from None
        return sock

    def _give_back(self, sock: zmq.Socket, reusable: bool) -> None:
        with self._lock:
            if reusable and not self._closed and len(self._idle) < self.IDLE_SOCKETS:
                self._idle.append(sock)
                return
        sock.close(linger=0)

    def request(self, msg: Any, timeout_s: float | None = None, cancelled: threading.Event | None = None) -> Any:
        """Send one request message and return the reply message.

        A `Refused` is returned, not raised; an unsigned refusal where replies are signed is raised, as ProtocolError.
        `cancelled`: once set, the wait for the answer ends with LoadError (cause "cancelled"), the peer counted as
        silent (what it may still answer is never read).
        """
        if not self.receiver and not isinstance(msg, GetInfo):
            self._request(GetInfo(), timeout_s, cancelled)  # its signed reply names the rank
        reply = self._request(msg, timeout_s, cancelled)
        if isinstance(reply, Refused) and reply.kind == MISADDRESSED and self._learned != self.receiver:
            asked, self.receiver = self.receiver, self._learned
            if engine_of(asked) != engine_of(self._learned):
                # A restarted engine: what the request names went with the old one. Asked again, the new
                # one would hold a BeginPull for the whole offer wait, for a request it never had.
                raise LoadError(
                    f"side channel {self.url} now serves engine {engine_of(self._learned)!r}, not "
                    f"{engine_of(asked)!r} (restarted): what {type(msg).__name__} names is gone with it; recompute",
                    peer=self.url,
                    request=getattr(msg, "request_id", None),
                    cause="engine restarted",
                )
            reply = self._request(msg, timeout_s, cancelled)  # another rank of the engine now serves this address
        return reply

    def _request(self, msg: Any, timeout_s: float | None, cancelled: threading.Event | None = None) -> Any:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        kind = type(msg).__name__
        receiver = "" if isinstance(msg, GetInfo) else self.receiver
        frame = self._auth.seal(new_frame(kind, self.sender, wire.encode(msg), receiver=receiver))
        data = wire.encode(frame)
        if len(data) > self._max:  # the server's socket would drop it: a timeout that blames the peer
            raise ProtocolError(
                f"{kind} to side channel {self.url} is {len(data)} bytes encoded, over the {self._max}-byte limit "
                "(max_message_bytes); send fewer blocks per request, or raise max_message_bytes on both sides"
            )
        sock = self._take()
        answered = False
        try:
            sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
            sock.send(data)
            data = self._answer(sock, timeout_s, cancelled, kind)
            answered = True
            watchdog.progress()  # the calling thread's pull, if any: its peer answered
        except zmq.Again:
            raise TransferTimeout(
                f"side channel {self.url} did not answer {kind} within {timeout_s}s; check that the engine "
                "rank is running and its side-channel address is right",
                peer=self.url,
                cause="timeout",
            ) from None
        except zmq.ZMQError as exc:
            raise PeerGone(f"side channel {self.url} failed on {kind}: {exc}", peer=self.url, cause=str(exc)) from None
        finally:
            self.silent = not answered
            self._give_back(sock, answered)
        reply_frame = decode_small(data, Frame, self._max)
        unsigned = not reply_frame.mac and (self._auth.enabled or not reply_frame.sender)
        if unsigned and reply_frame.kind == Refused.__name__:
            # The server could not authenticate the request (or someone between forged this): a failure, never data.
            try:
                why = wire.decode(reply_frame.body, Refused, max_bytes=self._max).message[:200]
            except ProtocolError:
                why = "no reason given"
            raise ProtocolError(
                f"side channel {self.url} refused {kind} without authenticating it ({why}); configure the same "
                "shared secret on both engines"
            )
        self._auth.check(reply_frame, expect_reply_to=frame.nonce)
        if reply_frame.sender:
            self._learned = reply_frame.sender
            self.receiver = self.receiver or reply_frame.sender
        cls = REPLIES.get(reply_frame.kind)
        if cls is None:
            raise ProtocolError(f"side channel {self.url} answered {kind} with unknown kind {reply_frame.kind!r}")
        reply = wire.decode(reply_frame.body, cls, max_bytes=self._max)
        if self._auth.enabled:
            self._relate(reply_frame.sender, reply)
        return reply

    def _answer(self, sock: zmq.Socket, timeout_s: float, cancelled: threading.Event | None, kind: str) -> bytes:
        """The answer on `sock` within `timeout_s` (else zmq.Again).

        LoadError once `cancelled` is set; PeerGone where the rank's process is gone (`WATCH_AFTER_S`)."""
        sent, poller = time.monotonic(), zmq.Poller()
        deadline = sent + timeout_s
        poller.register(sock, zmq.POLLIN)
        watch: zmq.Socket | None = None
        watching = False
        try:
            while True:
                if cancelled is not None and cancelled.is_set():
                    why = f"{kind} to side channel {self.url} called off before its answer came"
                    raise LoadError(why, peer=self.url, cause="cancelled")
                now = time.monotonic()
                if not watching and now - sent >= WATCH_AFTER_S:
                    watching = True
                    try:
                        watch = sock.get_monitor_socket(GONE_EVENTS, addr=f"inproc://kvbridge-watch-{next(_WATCHES)}")
                        poller.register(watch, zmq.POLLIN)
                    except zmq.ZMQError as exc:  # out of sockets: the timeout still ends the wait
                        with contextlib.suppress(zmq.ZMQError):
                            sock.disable_monitor()
                        log.debug("side channel %s: cannot watch the connection of %s: %s", self.url, kind, exc)
                left = deadline - now
                if left <= 0:
                    raise zmq.Again
                wait = left if watching else min(left, sent + WATCH_AFTER_S - now)
                if cancelled is not None:
                    wait = min(wait, CANCEL_LOOK_S)
                ready = dict(poller.poll(max(1, int(wait * 1000))))
                if sock in ready:
                    return sock.recv()
                if watch is not None and watch in ready:
                    closed = parse_monitor_message(watch.recv_multipart())["event"] == zmq.EVENT_DISCONNECTED
                    how = "closed the connection" if closed else "refused the connection"
                    raise PeerGone(
                        f"side channel {self.url} {how} before it answered {kind}: nothing serves there now (the "
                        f"engine rank stopped or restarted{'' if closed else ', or the address is wrong'})",
                        peer=self.url,
                        cause="disconnected" if closed else "refused",
                    )
        finally:
            if watch is not None:
                sock.disable_monitor()
                watch.close(linger=0)

    def _relate(self, sender: str, reply: Any) -> None:
        """Admit the rank's transport addresses named by its signed card, `RELATION_S` after its last answer.

        Never the host dialled (a relay's, or what a name resolves to). Then the grace.
        A card counts in a fresh reply to this client's own request (checked above) from the rank it describes."""
        card = reply.card if isinstance(reply, RegisteredMemory) else None
        if card is not None:
            if card.name != sender or f"{reply.engine_id}/{reply.rank}" != sender:
                raise ProtocolError(f"side channel {self.url}: {sender!r} answered with the card of {card.name!r}")
            if not time.time() < card.expires <= time.time() + MAX_CARD_S:
                raise ProtocolError(f"side channel {self.url}: the card of {sender!r} is not fresh")
            self._peer = (sender, card.hosts)
        if self._peer is not None and self._peer[0] == sender and self._peer[1]:
            key = f"peer {self.sender} {self.url} {sender}"
            netguard.ADMISSION.hold(key, self._peer[1], f"{sender} answered on side channel {self.url}", ttl=RELATION_S)

    def _expect(self, reply: Any, cls: type[T], what: str) -> T:
        if isinstance(reply, Refused):
            raise ProtocolError(f"side channel {self.url} refused {what} ({reply.kind}): {reply.message}")
        if not isinstance(reply, cls):
            raise ProtocolError(f"side channel {self.url} answered {what} with {type(reply).__name__}")
        return reply

    def _ready_request(
        self, msg: Any, wait_s: float, *, until_offered: bool = False, cancelled: threading.Event | None = None
    ) -> Any:
        """Send `msg`, retrying for at most `wait_s` seconds while the peer is not ready yet.

        With `until_offered`, also while it does not know the request yet: its offer may trail its answer to the proxy.

        With `until_offered` (a BeginPull), the server holds the request until the offer lands, at most
        `PARK_SLICE_S` a round; the reply's `waited_ms` is then the whole wait for the offer, seen from here.
        """
        begun = time.monotonic()
        deadline = begun + wait_s
        delay = 0.01
        unoffered: float | None = None  # when the peer first said it does not know the request
        while True:
            sent = time.monotonic()
            if until_offered:
                hold = max(0.0, min(PARK_SLICE_S, deadline - sent))
                msg = attrs.evolve(msg, wait_ms=int(hold * 1000))
                reply = self.request(msg, timeout_s=self.timeout_s + hold, cancelled=cancelled)
            else:
                reply = self.request(msg, cancelled=cancelled)
            if isinstance(reply, Refused) and reply.kind == "not_ready":
                why = f"{reply.message} ({self.url})"
            elif until_offered and isinstance(reply, LeaseStatus) and reply.state is LeaseState.UNKNOWN:
                why = f"request {reply.request_id!r} was never offered on {self.url}"
                unoffered = sent if unoffered is None else unoffered
                if reply.waited_ms and time.monotonic() < deadline:
                    continue  # the server held it for the offer: ask again at once
            else:
                if isinstance(reply, LeaseStatus) and unoffered is not None:
                    # the earlier rounds that found no offer, and this round's hold on the server
                    waited = (sent - unoffered) * 1e3 + reply.waited_ms
                    reply = attrs.evolve(reply, waited_ms=round(waited, 3))
                return reply
            if time.monotonic() + delay > deadline:
                if isinstance(reply, LeaseStatus):
                    return reply
                raise TransferTimeout(
                    f"{why} after waiting {wait_s}s; start pulling once the peer is ready "
                    "(its KV cache is allocated after any profiling run), or raise the ready timeout",
                    peer=self.url,
                    cause="peer not ready",
                )
            if cancelled is None:
                time.sleep(delay)  # bounded by the deadline above
            elif cancelled.wait(delay):
                raise LoadError(f"{type(msg).__name__} to {self.url} called off", peer=self.url, cause="cancelled")
            delay = min(delay * 2, 0.5)

    def get_info(self, wait_s: float = 0.0) -> RankInfo:
        """The rank's `RankInfo` (layout, parallel config, endpoint), waiting up to `wait_s` for it to be ready."""
        reply = self.registered_memory(wait_s)
        if reply.info is None:
            raise ProtocolError(f"side channel {self.url} reported ready without its RankInfo")
        return reply.info

    def registered_memory(self, wait_s: float = 0.0) -> RegisteredMemory:
        """The whole GetInfo reply (with `meta`)."""
        return self._expect(self._ready_request(GetInfo(), wait_s), RegisteredMemory, "GetInfo")

    def begin_pull(
        self,
        request_id: str,
        decode_rank: str,
        *,
        notify: Address | None = None,
        expected_pulls: int = 0,
        wait_s: float = 0.0,
        blocks: Iterable[int] = (),
        cancelled: threading.Event | None = None,
    ) -> LeaseStatus:
        """Announce a read of `blocks` of `request_id`; raise LoadError unless its lease is active (recompute).

        Waits up to `wait_s` for the peer to be ready and to have offered the request (the server holds
        the BeginPull until the offer lands); the status's `waited_ms` is how long the offer was waited for.
        `notify`: this rank's side channel, told if the prefill side aborts (the prefill rank remembers it
        only if it is the host this client connects from). `expected_pulls`: the prefill rank's release
        count from the plan (used when its offer left it open). `blocks`: the prefill block ids to be read;
        a block outside the lease gets the BeginPull refused (ProtocolError). `cancelled`: once set, the wait ends
        (LoadError, cause "cancelled"; the peer counts as silent, so a release it is owed waits until it answers).
        """
        host, port = notify or ("", 0)
        card = own_card(self.sender) if self._auth.enabled and self.sender else None
        msg = BeginPull(request_id, decode_rank, host, port, expected_pulls, BlockIds(blocks), card=card)
        reply = self._ready_request(msg, wait_s, until_offered=True, cancelled=cancelled)
        status = self._expect(reply, LeaseStatus, "BeginPull")
        if not status.valid:
            raise LoadError(
                f"request {request_id!r} has no active lease on {self.url} (it is {status.state.value}); "
                "its KV cannot be pulled, recompute it",
                peer=self.url,
                request=request_id,
                cause=status.state.value,
            )
        return status

    def done(
        self, request_id: str, decode_rank: str, epoch: int = 0, *, expected_pulls: int = 0, check: bool = True
    ) -> LeaseStatus:
        """Report DONE. With `check`, raise LoadError if the lease did not stay valid through the read.

        `epoch` 0 reports no read (the plan's notifier releasing a rank nobody reads, with
        `expected_pulls=1`, and `check=False`).
        """
        msg = Done(request_id, decode_rank, epoch, expected_pulls)
        status = self._expect(self.request(msg), LeaseStatus, "Done")
        if check and not status.valid:
            raise LoadError(
                f"lease epoch {epoch} of request {request_id!r} on {self.url} was {status.state.value} when the "
                "read finished: the blocks may have been reused during the read; recompute this request",
                peer=self.url,
                request=request_id,
                cause=status.state.value,
            )
        return status

    def query_lease(self, request_id: str, epoch: int = 0) -> LeaseStatus:
        return self._expect(self.request(QueryLease(request_id, epoch)), LeaseStatus, "QueryLease")

    def query_stream(self, request_id: str, epoch: int = 0, *, seen: int = 0, wait_s: float = 0.0) -> StreamStatus:
        """How far the prefill rank computed `request_id`, layer by layer (layer-wise streaming).

        With `wait_s`, answered once its `version` is no longer `seen` (or its lease is not valid), at most `wait_s`
        later."""
        msg = QueryStream(request_id, epoch, seen, int(wait_s * 1000))
        return self._expect(self.request(msg, timeout_s=self.timeout_s + wait_s), StreamStatus, "QueryStream")

    def abort(self, request_id: str, *, origin: str = "", reason: str = "") -> None:
        """Tell the rank that `request_id` was aborted (it frees what it holds)."""
        self._expect(self.request(Abort(request_id, origin or self.sender, reason)), Ack, "Abort")

    def close(self) -> None:
        """Close the idle sockets now; one in use closes when its request ends."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close(linger=0)

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@attrs.define
class ClientPool:
    """One `ControlClient` per address, created on first use, closed together."""

    secret: str | bytes | None = None
    timeout_s: float = 5.0
    sender: str = ""
    context: zmq.Context | None = None  # of every client's sockets (default: the process's shared one)
    _clients: dict[Address, ControlClient] = attrs.field(factory=dict, init=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)

    def get(self, host: str, port: int) -> ControlClient:
        with self._lock:
            client = self._clients.get((host, port))
            if client is None:
                client = ControlClient(
                    host, port, secret=self.secret, timeout_s=self.timeout_s, sender=self.sender, context=self.context
                )
                self._clients[(host, port)] = client
            return client

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()
