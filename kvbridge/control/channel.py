"""The side channel of one engine rank: its ZeroMQ server (ROUTER); its clients (REQ) are in `client`.

The server answers GetInfo (registered memory + readiness), BeginPull / Done / QueryLease
(the prefill ledger), Offer (from the engine's own scheduler) and Abort. A BeginPull for a request
not offered yet is held (at most the `wait_ms` it names) and answered the moment the offer lands,
so a decode never polls for an offer that trails the prefill's answer. Every request and reply is
a `Frame` (see `messages`), size-bounded by the socket itself (ZMQ_MAXMSGSIZE) and by `wire.decode`, schema-checked and,
with a shared secret, HMAC-authenticated with a replay guard. A bad message gets a `Refused`
reply; nothing a peer sends can stop the server.

Closed by default: a server on an address other hosts can reach needs the shared secret (see
`kvbridge.base.secret`) or an explicit `insecure=True`. An abort is only ever sent back to the side
channel a BeginPull named when that address is the host the BeginPull came from (its TCP source),
so a peer cannot make this rank connect to a third party.

The server's parts: `dispatch` answers one request, `held` keeps the requests held, `notifier` sends the aborts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import zmq

from kvbridge.agent.kv_agent import RankInfo
from kvbridge.base import watchdog
from kvbridge.base.errors import ConfigError, KVBridgeError
from kvbridge.base.secret import check_listen
from kvbridge.base.threadname import NamedThread
from kvbridge.control.auth import Authenticator
from kvbridge.control.client import ClientPool
from kvbridge.control.discovery import DiscoveryRegistry, RankRecord
from kvbridge.control.dispatch import AbortCallback, Dispatcher, Hold, Lender, StreamQuery, Timing
from kvbridge.control.framing import MAX_MESSAGE_BYTES, Address, bracketed, ipv6
from kvbridge.control.held import HeldRequests
from kvbridge.control.ledger import Ledger
from kvbridge.control.messages import Abort, Ack, LeaseState, Offer, Refused, RegisteredMemory
from kvbridge.control.notifier import Notifier
from kvbridge.transport import netguard

log = logging.getLogger(__name__)

# Messages ZeroMQ queues per connection each way: its default, 1000 messages of up to MAX_MESSAGE_BYTES, would let one
# peer park gigabytes of requests before the server read any. A REQ client has one request in flight per connection.
QUEUED_PER_PEER = 4
CLOSE_GRACE_S = 0.5  # close() lets pending abort notifications go out this long, then drops them
Timed = Callable[[str, float, float, float], None]  # kind, queued_s, wait_s, handler_s of each request answered

# This process's side channels by the address each bound: an engine whose scheduler and workers share a process
# (vLLM's uni executor) offers to its own ranks by a call, not a message (`local_server`).
_LOCAL: dict[Address, ControlServer] = {}
_LOCAL_LOCK = threading.Lock()


def local_server(host: str, port: int) -> ControlServer | None:
    """The side channel this process serves at `host`:`port`, or None (another process, or none)."""
    with _LOCAL_LOCK:
        return _LOCAL.get((host, port))


class ControlServer:
    """Side channel of one rank. Binds at construction; serves on a daemon thread until `close()`.

    Start-up ordering: the server answers at once but reports "not ready" until `register()`
    is called with the rank's KV layout and transport endpoint (after the KV cache exists, for
    example after a profiling run fixed the block count). Peers wait, bounded, for readiness.

    `streams` answers QueryStream on a prefill rank that streams layer by layer (`kvbridge.session.stream`).
    `register(..., accept_offers=True)`: take `Offer` messages (from this host only) into the ledger. Off by
    default; an engine adapter turns it on where offering needs nothing from the engine's step (host memory
    the transport reads directly: nothing to synchronize or stage).
    """

    def __init__(
        self,
        engine_id: str,
        rank: int = 0,
        *,
        ledger: Ledger | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: str | bytes | None = None,
        insecure: bool = False,
        on_abort: AbortCallback | None = None,
        streams: StreamQuery | None = None,
        registry: DiscoveryRegistry | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        poll_interval_s: float = 1.0,
        notify_timeout_s: float = 2.0,
        timed: Timed | None = None,
        lender: Lender | None = None,
    ) -> None:
        """`secret`: the shared secret (`kvbridge.base.secret.load_secret()` reads it from the environment or a file).

        Required on a non-loopback `host` unless `insecure=True` (logged as a warning). `timed` is told each answered
        request's times (for the engine's metrics). `lender` is asked to lend a lease a BeginPull names that nobody
        offered (a live move's pre-copy)."""
        check_listen(f"side channel of {engine_id}/{rank}", host, secret, insecure=insecure)
        self.engine_id = engine_id
        self.rank = rank
        self.ledger = ledger
        self.name = f"{engine_id}/{rank}"
        self._auth = Authenticator(secret)
        self._secret = secret
        self._registry = registry
        self.max_message_bytes = max_message_bytes
        self._poll_ms = max(1, int(poll_interval_s * 1000))
        self._notify_timeout_s = notify_timeout_s
        self._timed = timed
        self._dispatcher = Dispatcher(
            self.name,
            host,
            auth=self._auth,
            info=RegisteredMemory(engine_id=engine_id, rank=rank, ready=False),
            ledger=ledger,
            streams=streams,
            on_abort=on_abort,
            lender=lender,
            max_message_bytes=max_message_bytes,
        )
        self._ctx = zmq.Context()
        self._sock, port = _listen(self._ctx, self.name, host, port, max_message_bytes)
        self.address: Address = (host, port)
        with _LOCAL_LOCK:
            _LOCAL[self.address] = self
        # An offer made on another thread (the engine's step) wakes the serving loop through this pair.
        self._wake_in, wake_out = _wake_pair(self._ctx, f"inproc://kvbridge-wake-{id(self)}")
        self._stop = threading.Event()
        self._held = HeldRequests(self._dispatcher, self._send, wake_out, self._stop)
        if ledger is not None:
            ledger.on_offer(self._offered)
            ledger.on_finish(self._finished)
        self._notifier: Notifier | None = None
        self._lock = threading.Lock()
        self._thread = NamedThread(target=self._serve, name=f"kvbridge-ctl-{self.name}", daemon=True)
        self._thread.start()
        try:
            self._publish()
        except KVBridgeError:
            self.close()
            raise
        log.info(
            "side channel of %s serving on tcp://%s:%d%s",
            self.name,
            host,
            port,
            " (authenticated)" if self._auth.enabled else "",
        )

    @property
    def ready(self) -> bool:
        return self._dispatcher.info.ready

    @property
    def streams(self) -> StreamQuery | None:
        """How this rank answers QueryStream (None: it does not stream layer by layer)."""
        return self._dispatcher.streams

    @streams.setter
    def streams(self, streams: StreamQuery | None) -> None:
        self._dispatcher.streams = streams

    @property
    def accept_offers(self) -> bool:
        """Whether `Offer` messages are taken into the ledger (see `register`)."""
        return self._dispatcher.accept_offers

    @accept_offers.setter
    def accept_offers(self, accept: bool) -> None:
        self._dispatcher.accept_offers = accept

    def register(self, info: RankInfo, meta: dict[str, str] | None = None, *, accept_offers: bool = False) -> None:
        """Publish this rank's registered memory (`KVAgent.info()`) and mark it ready to be pulled from.

        `accept_offers`: take early `Offer` messages from now on (see the class docstring)."""
        if (info.engine_id, info.rank) != (self.engine_id, self.rank):
            raise ConfigError(f"side channel of {self.name} cannot serve the RankInfo of {info.engine_id}/{info.rank}")
        self._dispatcher.accept_offers = accept_offers
        self._dispatcher.info = RegisteredMemory(self.engine_id, self.rank, True, info, dict(meta or {}))
        self._dispatcher.info_digest = RankInfo.decode(info.encode()).digest()  # as a reader computes it
        self._publish()

    def abort(self, request_id: str, reason: str = "", peers: Iterable[Address] = ()) -> int:
        """Abort `request_id` here: free its lease (if any) and tell the other side.

        The decode ranks that began pulling it are told automatically; `peers` adds side
        channels to tell (a decode rank passes the prefill ranks it reads). Returns how many
        peers are being told (asynchronously; a peer that is gone is logged, its lease expires).
        """
        targets = {tuple(p) for p in peers}
        if self.ledger is not None:
            targets.update(tuple(w) for w in self.ledger.abort(request_id))  # type: ignore[arg-type]
        msg = Abort(request_id=request_id, origin=self.name, reason=reason)
        with self._lock:
            if self._stop.is_set():
                return 0
            if self._notifier is None:
                clients = ClientPool(secret=self._secret, timeout_s=self._notify_timeout_s, sender=self.name)
                self._notifier = Notifier(self.name, clients)
            for host, port in targets:
                self._notifier.send((str(host), int(port)), msg)
        return len(targets)

    # -- request handling (pure: bytes in, bytes out; used directly by the fuzz tests) ---------

    def handle(self, payload: bytes, peer_host: str | None = None) -> bytes:
        """Answer one request. Never raises: anything wrong becomes a `Refused` reply, logged with its reason.

        `peer_host`: the TCP source address of the request (None: unknown). A BeginPull's notify address
        is remembered only when it is that host (or both are loopback).
        """
        reply_to, reply = self._dispatcher.answer(payload, peer_host, park=False)
        return self._dispatcher.seal(reply_to, reply)

    def take_offer(self, offer: Offer) -> Ack | Refused:
        """An early offer from this process's own scheduler, into the ledger without a message (`local_server`).

        Answered as the `Offer` message would be. Raises what `Ledger.offer` raises."""
        return self._dispatcher.offer(offer)

    def _offered(self, lease: Any) -> None:
        """Ledger callback (any thread): wake the serving loop if a BeginPull waits for this request."""
        self.wake(lease.request_id)

    def _finished(self, lease: Any, _state: LeaseState) -> None:
        """Ledger callback: a held QueryStream for this request is answered now, not when its wait runs out.

        Its readers' admissions end (after the grace). Called from any thread: the serving one when it reaps or counts
        a DONE."""
        self._dispatcher.release_readers(lease.request_id)
        self.wake(lease.request_id)

    def wake(self, request_id: str) -> None:
        """Any thread: `request_id` changed (offered, its stream progressed, its lease ended); answer what waits for it.

        A held `QueryStream` is looked at again only when its request is woken or its wait runs out, so whoever answers
        `streams` wakes the request whenever its answer would change (the ledger wakes it when its lease ends, however
        it ends)."""
        self._held.wake(request_id)

    # -- the serving thread ------------------------------------------------------------------

    def _serve(self) -> None:
        # The loop sleeps until a message, a wake-up, a held request's deadline or a lease's deadline,
        # at most poll_interval_s: on a prefill rank every wake-up takes the engine's GIL from its
        # compute, so it wakes for nothing else.
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        timeout_ms = self._poll_ms
        beat = watchdog.watch(f"side channel {self.name} (serving loop)")
        began = time.monotonic()
        try:
            while not self._stop.is_set():
                failed, since = False, began
                try:
                    # A frame waiting already came in during the round just ended: queued at most since it began.
                    waiting = bool(self._sock.get(zmq.EVENTS) & zmq.POLLIN)
                    beat.idle()
                    events = dict(poller.poll(timeout_ms))
                    began = beat.busy()
                    if self._sock in events:
                        self._serve_one(since if waiting else began)
                    if self._wake_in in events:
                        while self._wake_in.poll(0):
                            self._wake_in.recv()
                except Exception:  # the loop must outlive any bug
                    log.exception("%s: side-channel loop error", self.name)
                    failed = True
                due: list[float] = []
                # Reaping first, on its own: leases must expire whatever else goes wrong in this loop.
                if self.ledger is not None:
                    try:
                        self.ledger.reap()
                        if (lease := self.ledger.next_deadline_s()) is not None:
                            due.append(lease)
                    except Exception:
                        log.exception("%s: reaping leases failed", self.name)
                        failed = True
                woken = self._held.take_woken()  # taken after this round parked what it held (wake()) and reaped
                if self._held.parked:
                    try:
                        if (nearest := self._held.answer_due(time.monotonic(), woken)) is not None:
                            due.append(nearest)
                    except Exception:
                        log.exception("%s: answering held requests failed", self.name)
                        failed = True
                timeout_ms = max(1, min(self._poll_ms, int(min(due) * 1000) + 1)) if due else self._poll_ms
                if failed:  # no hot loop if the error repeats
                    self._stop.wait(min(self._poll_ms, 50) / 1000)
        finally:
            watchdog.WATCHDOG.forget(beat)
            self._sock.close(linger=0)
            self._wake_in.close(linger=0)

    def _serve_one(self, since: float) -> None:
        """Read and answer (or hold) one frame, waiting in the socket since `since` at most."""
        try:
            frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        timing = Timing(since, time.monotonic())
        parts = [f.bytes for f in frames]
        try:
            peer_host: str | None = frames[-1].get("Peer-Address")
        except zmq.ZMQError:  # not a TCP peer
            peer_host = None
        # REQ peers send [identity, (request id with REQ_CORRELATE), b"", payload]; DEALER peers
        # [identity, payload]. The envelope goes back unchanged; anything else is dropped.
        if 3 <= len(parts) <= 4 and parts[-2] == b"":
            envelope = parts[:-1]
        elif len(parts) == 2:
            envelope = parts[:1]
        else:
            log.warning(
                "%s dropped a %d-part message from %s: not a REQ or DEALER request",
                self.name,
                len(parts),
                peer_host or "an unknown host",
            )
            return
        reply_to, reply = self._dispatcher.answer(parts[-1], peer_host, park=self._held.has_room(), timing=timing)
        if isinstance(reply, Hold):
            assert reply_to is not None  # only an authenticated request is held
            self._held.hold(envelope, reply_to, reply, peer_host)
        else:
            self._send([*envelope, self._dispatcher.seal(reply_to, reply)])
        if timing.end:  # its handler ran (the request authenticated and was well formed)
            self._took(timing, peer_host)

    def _took(self, t: Timing, peer_host: str | None) -> None:
        """A handled request's times: to the engine's metrics, and one line when slow."""
        queued, wait, handler = t.read - t.since, t.start - t.read, t.end - t.start
        if self._timed is not None:
            self._timed(t.kind, queued, wait, handler)
        where = f"{t.kind} on side channel {self.name} from {t.sender or '?'} at {peer_host or '?'}"
        watchdog.slow(log, where, {"queued": queued * 1e3, "wait": wait * 1e3, "handler": handler * 1e3})

    def _send(self, parts: list[bytes]) -> None:
        try:
            self._sock.send_multipart(parts, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the peer went away before its answer
            log.debug("%s could not reply: %s", self.name, exc)

    def _publish(self) -> None:
        if self._registry is not None:
            host, port = self.address
            self._registry.publish(RankRecord(self.engine_id, self.rank, host, port, self.ready))

    def close(self) -> None:
        """Stop serving, withdraw from the registry, and release the socket. Safe to call twice."""
        with self._lock:
            if self._stop.is_set():
                return
            self._stop.set()
        with _LOCAL_LOCK:
            if _LOCAL.get(self.address) is self:
                del _LOCAL[self.address]
        self._held.nudge()  # the loop may be asleep for up to poll_interval_s
        self._thread.join(timeout=10)
        self._held.close()
        if self._notifier is not None:
            self._notifier.close(min(CLOSE_GRACE_S, self._notify_timeout_s))
        if self._registry is not None:
            try:
                self._registry.remove(self.engine_id, self.rank)
            except KVBridgeError as exc:
                log.warning("%s could not withdraw from the registry: %s", self.name, exc)
        self._ctx.term()

    def __enter__(self) -> ControlServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _listen(ctx: zmq.Context, name: str, host: str, port: int, max_message_bytes: int) -> tuple[zmq.Socket, int]:
    """The side channel's ROUTER socket, bound to `host`:`port` (0: a free port), and the port it bound."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + 1024)  # + multipart envelope
    sock.setsockopt(zmq.RCVHWM, QUEUED_PER_PEER)
    sock.setsockopt(zmq.SNDHWM, QUEUED_PER_PEER)
    sock.setsockopt(zmq.IPV6, ipv6(host))
    try:
        with netguard.binding():  # not a transport's listener: no guard may filter it
            if port:
                sock.bind(f"tcp://{bracketed(host)}:{port}")
            else:
                port = sock.bind_to_random_port(f"tcp://{bracketed(host)}")
    except zmq.ZMQError as exc:
        sock.close()
        ctx.term()
        raise ConfigError(
            f"side channel of {name} cannot bind tcp://{host}:{port}: {exc}; pick a free port or host"
        ) from None
    return sock, port


def _wake_pair(ctx: zmq.Context, address: str) -> tuple[zmq.Socket, zmq.Socket]:
    """The serving loop's wake-up socket (it polls it) and the one that wakes it, connected at `address`."""
    wake_in = ctx.socket(zmq.PULL)
    wake_in.bind(address)
    wake_out = ctx.socket(zmq.PUSH)
    wake_out.setsockopt(zmq.LINGER, 0)
    wake_out.connect(address)
    return wake_in, wake_out
