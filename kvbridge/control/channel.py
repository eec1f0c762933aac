"""The side channel of one engine rank: a ZeroMQ server (ROUTER) and its clients (REQ).

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
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import ipaddress
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import attrs
import zmq

from kvbridge.agent.kv_agent import RankInfo
from kvbridge.base import watchdog, wire
from kvbridge.base.block_ids import BlockIds
from kvbridge.base.errors import ConfigError, KVBridgeError, LoadError, PeerGone, ProtocolError, TransferTimeout
from kvbridge.base.secret import check_listen, is_loopback
from kvbridge.control.auth import Authenticator, new_nonce
from kvbridge.control.discovery import DiscoveryRegistry, RankRecord
from kvbridge.control.ledger import Ledger
from kvbridge.control.messages import (
    MAX_CARD_HOSTS,
    MAX_CARD_S,
    MAX_FIELDS,
    MAX_ID_BYTES,
    REPLIES,
    REQUESTS,
    Abort,
    Ack,
    BeginPull,
    Done,
    Frame,
    GetInfo,
    LeaseState,
    LeaseStatus,
    Offer,
    PeerCard,
    QueryLease,
    QueryStream,
    Refused,
    RegisteredMemory,
    StreamStatus,
)
from kvbridge.transport import netguard

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # a layout of thousands of regions fits; nothing legitimate is larger
# Messages ZeroMQ queues per connection each way (its default, 1000, let one peer park about 4 GiB of requests
# before the server read any). A REQ client has one request in flight per connection.
QUEUED_PER_PEER = 4
MISADDRESSED = "misaddressed"  # the Refused kind for a request that names another rank
MAX_PARKED = 4096  # BeginPulls held for their offer at once; beyond it they are answered at once (client retries)
# A client holds its (one-request-at-a-time) socket while the server holds its BeginPull: it asks for at
# most this long per round, so other requests to the same rank interleave while an offer is late.
PARK_SLICE_S = 0.1
MAX_NOTIFIED_PEERS = 256  # peers with abort notifications pending at once (a thread each); beyond, the leases expire
CLOSE_GRACE_S = 0.5  # close() lets pending abort notifications go out this long, then drops them
CARD_S = 120.0  # how long a PeerCard this rank signs is valid
# A decode keeps a prefill rank's transport addresses admitted this long after its last authenticated answer
# (then the grace): the peer relation its pulls need.
RELATION_S = 120.0
Address = tuple[str, int]
AbortCallback = Callable[[str, str, str], None]  # request_id, origin, reason
StreamQuery = Callable[[str, int], StreamStatus]  # request_id, epoch -> how far prefill computed it
Timed = Callable[[str, float, float, float], None]  # kind, queued_s, wait_s, handler_s of each request answered
# request_id -> whether a lease was lent for it now (None: it names nothing lendable); see kvbridge.session.lending
Lender = Callable[[str], "bool | None"]

T = TypeVar("T")


def _decode_small(data: bytes, cls: type[T], max_bytes: int) -> T:
    """A Frame or a request body: only a few fields, short strings and bytes (see MAX_FIELDS)."""
    return wire.decode(data, cls, max_bytes=max_bytes, max_items=MAX_FIELDS, max_str=MAX_ID_BYTES)


def _engine(name: str) -> str:
    """The engine of a side channel's name, `engine_id/rank`."""
    return name.rpartition("/")[0]


def _frame(kind: str, sender: str, body: bytes, reply_to: bytes = b"", receiver: str = "") -> Frame:
    return Frame(
        kind=kind, sender=sender, nonce=new_nonce(), ts=time.time(), body=body, reply_to=reply_to, receiver=receiver
    )


@attrs.define
class _Parked:
    """A held request: a BeginPull until its request is offered, a QueryStream until its stream changes.

    A QueryStream is held at most until its wait runs out. Each keeps what its reply needs."""

    envelope: list[bytes]
    reply_to: bytes
    msg: BeginPull | QueryStream
    peer_host: str | None
    since: float  # monotonic
    deadline: float


@attrs.define
class _Timing:
    """One request's times in the serving loop (monotonic): queued from `since`, read, handler started and ended."""

    since: float
    read: float
    kind: str = ""
    sender: str = ""
    start: float = 0.0
    end: float = 0.0


@attrs.frozen
class _Hold:
    """What the dispatcher answers for a request to be held (see `_Parked`)."""

    msg: BeginPull | QueryStream


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
        self.streams = streams
        self.name = f"{engine_id}/{rank}"
        self._auth = Authenticator(secret)
        self._secret = secret
        self._on_abort = on_abort
        self._registry = registry
        self.max_message_bytes = max_message_bytes
        self._poll_ms = max(1, int(poll_interval_s * 1000))
        self._notify_timeout_s = notify_timeout_s
        self._timed = timed
        self._lender = lender
        self._info = RegisteredMemory(engine_id=engine_id, rank=rank, ready=False)
        self.accept_offers = False
        self._parked: dict[str, list[_Parked]] = {}  # request id -> BeginPulls held for its offer
        self._held_lock = threading.Lock()
        self._held_keys: dict[str, set[str]] = {}  # request id -> admission holds of its readers (netguard)
        self._nparked = 0
        # (deadline, request id) of every held request, a heap; stale entries (answered) are skipped when popped
        self._due: list[tuple[float, str]] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + 1024)  # + multipart envelope
        self._sock.setsockopt(zmq.RCVHWM, QUEUED_PER_PEER)
        self._sock.setsockopt(zmq.SNDHWM, QUEUED_PER_PEER)
        self._sock.setsockopt(zmq.IPV6, _ipv6(host))
        try:
            with netguard.binding():  # not a transport's listener: no guard may filter it
                if port:
                    self._sock.bind(f"tcp://{_bracketed(host)}:{port}")
                else:
                    port = self._sock.bind_to_random_port(f"tcp://{_bracketed(host)}")
        except zmq.ZMQError as exc:
            self._sock.close()
            self._ctx.term()
            raise ConfigError(
                f"side channel of {self.name} cannot bind tcp://{host}:{port}: {exc}; pick a free port or host"
            ) from None
        self.address: Address = (host, port)
        # An offer made on another thread (the engine's step) wakes the serving loop through this pair.
        wake = f"inproc://kvbridge-wake-{id(self)}"
        self._wake_in = self._ctx.socket(zmq.PULL)
        self._wake_in.bind(wake)
        self._wake_out = self._ctx.socket(zmq.PUSH)
        self._wake_out.setsockopt(zmq.LINGER, 0)
        self._wake_out.connect(wake)
        self._wake_lock = threading.Lock()
        self._woken: set[str] = set()  # requests woken since the serving loop last looked (under _wake_lock)
        if ledger is not None:
            ledger.on_offer(self._offered)
            ledger.on_finish(self._finished)
        self._stop = threading.Event()
        self._notifier: _Notifier | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name=f"kvbridge-ctl-{self.name}", daemon=True)
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
        return self._info.ready

    def register(self, info: RankInfo, meta: dict[str, str] | None = None, *, accept_offers: bool = False) -> None:
        """Publish this rank's registered memory (`KVAgent.info()`) and mark it ready to be pulled from.

        `accept_offers`: take early `Offer` messages from now on (see the class docstring)."""
        if (info.engine_id, info.rank) != (self.engine_id, self.rank):
            raise ConfigError(f"side channel of {self.name} cannot serve the RankInfo of {info.engine_id}/{info.rank}")
        self.accept_offers = accept_offers
        self._info = RegisteredMemory(self.engine_id, self.rank, True, info, dict(meta or {}))
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
                self._notifier = _Notifier(self.name, clients)
            for host, port in targets:
                self._notifier.send((str(host), int(port)), msg)
        return len(targets)

    # -- request handling (pure: bytes in, bytes out; used directly by the fuzz tests) ---------

    def handle(self, payload: bytes, peer_host: str | None = None) -> bytes:
        """Answer one request. Never raises: anything wrong becomes a `Refused` reply, logged with its reason.

        `peer_host`: the TCP source address of the request (None: unknown). A BeginPull's notify address
        is remembered only when it is that host (or both are loopback).
        """
        reply_to, reply = self._answer(payload, peer_host, park=False)
        return self._seal(reply_to, reply)

    def _seal(self, reply_to: bytes | None, reply: Any) -> bytes:
        """The reply, framed and signed; a `Refused` naming its size instead of one too large for the client.

        The client's socket would drop a reply that large: the client would wait out its timeout and take this rank for
        dead.

        `reply_to` None: the request did not authenticate. Its refusal goes unsigned and names neither this
        rank nor the request (signing it would sign a `reply_to` the sender chose: a signing oracle), and a
        client takes an unsigned refusal as a failure only."""
        if reply_to is None:
            return wire.encode(_frame(type(reply).__name__, "", wire.encode(reply)))
        data = wire.encode(self._auth.seal(_frame(type(reply).__name__, self.name, wire.encode(reply), reply_to)))
        if len(data) <= self.max_message_bytes:
            return data
        why = (
            f"the {type(reply).__name__} reply of {self.name} is {len(data)} bytes encoded, over the side channel's "
            f"{self.max_message_bytes}-byte limit (max_message_bytes); ask for less, or raise max_message_bytes "
            "on both sides"
        )
        log.warning("%s", why)
        return self._seal(reply_to, Refused("too_large", why))

    def _answer(
        self, payload: bytes, peer_host: str | None, *, park: bool, timing: _Timing | None = None
    ) -> tuple[bytes | None, Any]:
        """Decode and answer one request: (its nonce, or None where it did not authenticate; the reply message).

        With `park`, the reply may be a `_Hold`. `timing` gets the handler's start and end."""
        reply_to: bytes | None = None if self._auth.enabled else b""
        try:
            frame = _decode_small(payload, Frame, self.max_message_bytes)
            self._auth.check(frame)
            reply_to = frame.nonce
            # Nothing is admitted here: a frame proves the secret, not who sent it (a replay or a relay). A BeginPull
            # admits what its signed card names, once kind, receiver and direction are checked (`_hold_reader`).
            cls = REQUESTS.get(frame.kind)
            if cls is None:
                raise ProtocolError(f"unknown request kind {frame.kind!r}; this side channel serves {sorted(REQUESTS)}")
            if frame.reply_to:
                raise ProtocolError(f"{frame.kind} from {frame.sender!r} answers a request: a reply sent back as one")
            if (misaddressed := self._misaddressed(frame, peer_host)) is not None:
                return reply_to, misaddressed
            body = _decode_small(frame.body, cls, self.max_message_bytes)
            if timing is not None:
                timing.kind, timing.sender, timing.start = frame.kind, frame.sender, time.monotonic()
            reply: Any = self._dispatch(body, frame.sender, peer_host, park=park)
        except ProtocolError as exc:
            log.warning("%s refused a message from %s: %s", self.name, peer_host or "an unknown host", exc)
            reply = Refused("protocol", str(exc))
        except KVBridgeError as exc:
            log.warning("%s refused a request from %s: %s", self.name, peer_host or "an unknown host", exc)
            reply = Refused("error", str(exc))
        except Exception as exc:  # a bug must cost one reply, not the server
            log.exception("%s: handler failed", self.name)
            reply = Refused("internal", f"{type(exc).__name__}: {exc}")
        if timing is not None and timing.start:
            timing.end = time.monotonic()
        return reply_to, reply

    def _misaddressed(self, frame: Frame, peer_host: str | None) -> Refused | None:
        """A refusal unless the request names this rank (a GetInfo may name none: it is how a client learns the name).

        So a frame recorded on its way to another rank that shares the secret is refused here."""
        if frame.receiver == self.name or (not frame.receiver and frame.kind == GetInfo.__name__):
            return None
        why = (
            f"{frame.kind} from {frame.sender!r} is addressed to {frame.receiver or 'no rank'!r}, not {self.name!r} "
            "(replayed from another rank, or sent by an older kvbridge: run the same version on both sides)"
        )
        log.warning("%s refused a message from %s: %s", self.name, peer_host or "an unknown host", why)
        return Refused(MISADDRESSED, why)

    def _dispatch(self, msg: Any, sender: str, peer_host: str | None, *, park: bool = False) -> Any:
        if isinstance(msg, Abort):
            if self.ledger is not None:
                self.ledger.abort(msg.request_id)  # wakes a held QueryStream for it (on_finish)
            if self._on_abort is not None:
                self._on_abort(msg.request_id, msg.origin or sender, msg.reason)
            return Ack()
        if not self._info.ready:
            return Refused("not_ready", f"rank {self.name} has not registered its KV cache yet")
        if isinstance(msg, GetInfo):
            return attrs.evolve(self._info, card=own_card(self.name)) if self._auth.enabled else self._info
        if self.ledger is None:
            return Refused("no_ledger", f"rank {self.name} holds no leases (is it a decode rank?)")
        if isinstance(msg, BeginPull):
            self._check_card(msg.card, sender)
            lendable = self._lender is not None and self.ledger.state(msg.request_id) is LeaseState.UNKNOWN
            if lendable and self._lender(msg.request_id) is False:  # nor will there be: not worth a wait
                return Refused("nothing_to_lend", f"rank {self.name} runs no request {msg.request_id!r} lends from")
            if (
                park
                and msg.wait_ms > 0
                and self._nparked < MAX_PARKED
                and self.ledger.state(msg.request_id) is LeaseState.UNKNOWN
            ):
                return _Hold(msg)
            return self._begin(msg, peer_host)
        if isinstance(msg, Offer):
            return self._offer(msg, sender, peer_host)
        if isinstance(msg, Done):
            return self.ledger.done(msg.request_id, msg.decode_rank, msg.epoch, msg.expected_pulls)
        if isinstance(msg, QueryLease):
            return self.ledger.query(msg.request_id, msg.epoch)
        if isinstance(msg, QueryStream):
            if self.streams is None:
                return Refused("no_streams", f"rank {self.name} does not stream layer by layer (transfer: pull)")
            status = self.streams(msg.request_id, msg.epoch)
            if park and msg.wait_ms > 0 and self._nparked < MAX_PARKED and not self._stream_moved(msg, status):
                return _Hold(msg)
            return status
        raise ProtocolError(f"no handler for {type(msg).__name__}")

    def _begin(self, msg: BeginPull, peer_host: str | None, waited_s: float = 0.0) -> LeaseStatus:
        assert self.ledger is not None
        watcher = self._watcher(msg, peer_host)
        key = self._hold_reader(msg)
        status = self.ledger.begin(msg.request_id, msg.decode_rank, watcher, msg.expected_pulls, blocks=msg.blocks)
        if key is not None and not status.valid:
            self._release_readers(msg.request_id)
        return attrs.evolve(status, waited_ms=round(waited_s * 1e3, 3)) if waited_s else status

    def _check_card(self, card: PeerCard | None, sender: str) -> None:
        """A BeginPull's card must be its sender's own, and fresh (it was signed with the frame)."""
        if card is None or not self._auth.enabled:
            return
        if card.name != sender:
            raise ProtocolError(f"BeginPull from {sender!r} carries the card of {card.name!r}: not its own")
        if not time.time() < card.expires <= time.time() + MAX_CARD_S:
            raise ProtocolError(f"BeginPull from {sender!r} carries a card expiring at {card.expires:.0f}: not fresh")

    def _hold_reader(self, msg: BeginPull) -> str | None:
        """Admit the reader's transport addresses (its card's) while its lease on this request lasts, plus the grace.

        Only for an active lease: a BeginPull for a request not offered, or finished, admits nobody. Raises GuardFull
        (the reader is refused) when this process's guards cannot take another host."""
        assert self.ledger is not None
        card = msg.card
        if card is None or not card.hosts or not self._auth.enabled:
            return None
        if self.ledger.state(msg.request_id) is not LeaseState.ACTIVE:
            return None
        key = f"lease {self.name} {msg.request_id} {card.name}"
        netguard.ADMISSION.hold(key, card.hosts, f"{card.name} reads {msg.request_id} from {self.name}")
        with self._held_lock:
            self._held_keys.setdefault(msg.request_id, set()).add(key)
        return key

    def _release_readers(self, request_id: str) -> None:
        with self._held_lock:
            keys = self._held_keys.pop(request_id, ())
        for key in keys:
            netguard.ADMISSION.release(key)

    def _offer(self, msg: Offer, sender: str, peer_host: str | None) -> Ack | Refused:
        """An offer from this engine's own scheduler, ahead of the engine step that makes it too."""
        assert self.ledger is not None
        if not self.accept_offers:
            return Refused("offers_in_step", f"rank {self.name} takes offers in the engine step only")
        if not _same_host(self.address[0], peer_host):
            raise ProtocolError(
                f"Offer of {msg.request_id!r} from {sender!r} at {peer_host or 'an unknown host'}: offers come from "
                "the engine's own scheduler, on this host"
            )
        self.ledger.offer(msg.request_id, msg.blocks, offer_id=msg.offer_id)
        return Ack()

    @staticmethod
    def _stream_moved(msg: QueryStream, status: StreamStatus) -> bool:
        """Whether a QueryStream is answered now: its stream changed since `seen`, or its lease is not valid."""
        return status.version != msg.seen or not status.lease.valid

    def _offered(self, lease: Any) -> None:
        """Ledger callback (any thread): wake the serving loop if a BeginPull waits for this request."""
        self.wake(lease.request_id)

    def _finished(self, lease: Any, _state: LeaseState) -> None:
        """Ledger callback: a held QueryStream for this request is answered now, not when its wait runs out.

        Its readers' admissions end (after the grace). Called from any thread: the serving one when it reaps or counts
        a DONE."""
        self._release_readers(lease.request_id)
        self.wake(lease.request_id)

    def wake(self, request_id: str) -> None:
        """Any thread: `request_id` changed (offered, its stream progressed, its lease ended); answer what waits for it.

        A held `QueryStream` is looked at again only when its request is woken or its wait runs out, so whoever answers
        `streams` wakes the request whenever its answer would change (the ledger wakes it when its lease ends, however
        it ends)."""
        with self._wake_lock:
            # Noted even when nothing is held yet: a query being parked right now is looked at again
            # after it is (each round of the loop parks before it takes the woken set, and takes it
            # whether or not anything is held: the set holds a round's wake-ups at most).
            self._woken.add(request_id)
            if request_id not in self._parked:  # a racy read: at worst one needless wake-up
                return
            if not self._stop.is_set():
                with contextlib.suppress(zmq.Again):  # the loop has wake-ups pending already
                    self._wake_out.send(b"", zmq.NOBLOCK)

    def _answer_parked(self, now: float, woken: set[str]) -> float | None:
        """Answer the held requests that are due; returns the seconds to the next deadline (None: nothing held).

        Due: the held BeginPulls whose request was offered, the held QueryStreams whose request was `woken` and whose
        stream moved, and those whose wait ran out. Only requests `woken` (every offer wakes its request) or past a
        deadline are looked at: looking at every held request each round cost a round per message times the requests
        held, which grows with the square of the decodes waiting at once."""
        nearest: float | None = None
        due = {rid for rid in woken if rid in self._parked}
        while self._due and self._due[0][0] <= now:
            due.add(heapq.heappop(self._due)[1])
        for rid in due & self._parked.keys():
            held = collections.deque(self._parked.pop(rid))
            waiting: list[_Parked] = []
            try:
                while held:
                    p = held[0]
                    reply = self._held_reply(p, now, rid in woken)
                    if reply is None:
                        waiting.append(held.popleft())
                        nearest = p.deadline - now if nearest is None else min(nearest, p.deadline - now)
                        continue
                    held.popleft()  # answered: out of `_parked` before anything else can fail
                    self._nparked -= 1
                    self._send([*p.envelope, self._seal(p.reply_to, reply)])
            finally:  # whatever failed, the entries not answered stay held, each once
                waiting.extend(held)
                if waiting:
                    self._parked[rid] = waiting
        while self._due and self._due[0][1] not in self._parked:  # answered already
            heapq.heappop(self._due)
        if self._due:
            nearest = self._due[0][0] - now if nearest is None else min(nearest, self._due[0][0] - now)
        return nearest

    def _held_reply(self, p: _Parked, now: float, woken: bool) -> Any:
        """The reply to a held request now, or None to keep holding it.

        Never raises: a failing answer (the engine's `streams`, say) costs that request a `Refused`, not the serving
        loop its round."""
        assert self.ledger is not None
        try:
            if isinstance(p.msg, QueryStream):
                assert self.streams is not None  # it was held because streams answered it
                if not (woken or now >= p.deadline):
                    return None
                status = self.streams(p.msg.request_id, p.msg.epoch)
                if now >= p.deadline or self._stream_moved(p.msg, status):
                    return attrs.evolve(status, held_ms=round(max(1e-3, (now - p.since) * 1e3), 3))
                return None
            if self.ledger.state(p.msg.request_id) is LeaseState.UNKNOWN and now < p.deadline:
                return None
            return self._begin(p.msg, p.peer_host, waited_s=now - p.since)
        except KVBridgeError as exc:
            log.warning("%s refused a held %s for %s: %s", self.name, type(p.msg).__name__, p.msg.request_id, exc)
            return Refused("protocol" if isinstance(exc, ProtocolError) else "error", str(exc))
        except Exception as exc:  # a bug must cost one reply, not the loop (leases depend on its reaping)
            log.exception("%s: answering a held %s for %s failed", self.name, type(p.msg).__name__, p.msg.request_id)
            return Refused("internal", f"{type(exc).__name__}: {exc}")

    def _watcher(self, msg: BeginPull, peer_host: str | None) -> Address | None:
        """The side channel to tell on abort, if the BeginPull named one this rank may connect to.

        That is its sender's own host (the request's TCP source; on loopback, any loopback address) and a valid port."""
        if not msg.notify_port:
            return None
        if not 0 < msg.notify_port < 65536:
            raise ProtocolError(f"BeginPull for {msg.request_id!r} names notify port {msg.notify_port}")
        if _same_host(msg.notify_host, peer_host):
            return (msg.notify_host, msg.notify_port)
        log.warning(
            "%s: BeginPull for %s from %s asks to be told of aborts at %s:%d, not its own host: not "
            "remembered (its lease expires instead); bind the decode side channel to the address it "
            "connects from",
            self.name,
            msg.request_id,
            peer_host or "an unknown host",
            msg.notify_host,
            msg.notify_port,
        )
        return None

    # -- the serving thread ------------------------------------------------------------------

    def _serve(self) -> None:
        # The loop sleeps until a message, a wake-up, a held request's deadline or a lease's deadline,
        # at most poll_interval_s: on a prefill rank every wake-up takes the engine's GIL from its
        # compute, so it wakes for nothing else (a fixed 50 ms tick cost a streaming prefill about 10
        # GIL handoffs per second of prompt).
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
                with self._wake_lock:  # taken after this round parked what it held (wake()) and reaped
                    woken, self._woken = self._woken, set()
                if self._parked:
                    try:
                        if (nearest := self._answer_parked(time.monotonic(), woken)) is not None:
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
        timing = _Timing(since, time.monotonic())
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
        reply_to, reply = self._answer(parts[-1], peer_host, park=True, timing=timing)
        if isinstance(reply, _Hold):
            assert reply_to is not None  # only an authenticated request is held
            msg, now = reply.msg, time.monotonic()
            held = _Parked(envelope, reply_to, msg, peer_host, now, now + msg.wait_ms / 1000)
            self._parked.setdefault(msg.request_id, []).append(held)
            self._nparked += 1
            heapq.heappush(self._due, (held.deadline, msg.request_id))
        else:
            self._send([*envelope, self._seal(reply_to, reply)])
        if timing.end:  # its handler ran (the request authenticated and was well formed)
            self._took(timing, peer_host)

    def _took(self, t: _Timing, peer_host: str | None) -> None:
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
            self._registry.publish(RankRecord(self.engine_id, self.rank, host, port, self._info.ready))

    def close(self) -> None:
        """Stop serving, withdraw from the registry, and release the socket. Safe to call twice."""
        with self._lock:
            if self._stop.is_set():
                return
            self._stop.set()
        with self._wake_lock, contextlib.suppress(zmq.ZMQError):
            self._wake_out.send(b"", zmq.NOBLOCK)  # the loop may be asleep for up to poll_interval_s
        self._thread.join(timeout=10)
        with self._wake_lock:
            self._wake_out.close(linger=0)
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


class _Notifier:
    """Sends abort notifications, each peer from a queue and a thread of its own.

    A peer that is gone costs each of its notifications the notify timeout, and only its own queue waits for that. After
    a timeout the peer's queued notifications are dropped (they would wait as long; the leases they end expire)."""

    def __init__(self, name: str, clients: ClientPool) -> None:
        self.name = name
        self._clients = clients
        self._lock = threading.Lock()
        # peer -> notifications not sent yet; a peer is listed while its thread runs (send() starts one if not)
        self._queues: dict[Address, collections.deque[Abort]] = {}
        self._threads: set[threading.Thread] = set()
        self._closed = False

    def send(self, addr: Address, msg: Abort) -> None:
        with self._lock:
            if self._closed:
                return
            queue = self._queues.get(addr)
            if queue is not None:
                queue.append(msg)
                return
            if len(self._queues) >= MAX_NOTIFIED_PEERS:
                log.warning(
                    "%s: %d peers have abort notifications pending; not telling %s:%d about %s (its lease expires)",
                    self.name,
                    len(self._queues),
                    *addr,
                    msg.request_id,
                )
                return
            self._queues[addr] = collections.deque([msg])
            thread = threading.Thread(
                target=self._drain, args=(addr,), name=f"kvbridge-abort-{self.name}-{addr[0]}:{addr[1]}", daemon=True
            )
            self._threads.add(thread)
        thread.start()

    def _drain(self, addr: Address) -> None:
        ended = False
        try:
            while True:
                with self._lock:
                    queue = self._queues[addr]
                    if not queue:
                        del self._queues[addr]  # under the lock: send() starts a new thread from now on
                        ended = True
                        return
                    msg = queue.popleft()
                try:
                    self._clients.get(*addr).abort(msg.request_id, origin=msg.origin, reason=msg.reason)
                except TransferTimeout as exc:
                    with self._lock:
                        dropped = len(queue)
                        queue.clear()
                    log.warning(
                        "%s could not tell %s:%d about abort of %s%s: %s",
                        self.name,
                        *addr,
                        msg.request_id,
                        f" (nor of {dropped} more queued for it)" if dropped else "",
                        exc,
                    )
                except KVBridgeError as exc:
                    log.warning("%s could not tell %s:%d about abort of %s: %s", self.name, *addr, msg.request_id, exc)
                except Exception:  # a bug costs this notification, not the peer's queue its thread
                    log.exception("%s: telling %s:%d about abort of %s failed", self.name, *addr, msg.request_id)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())
                # Ended any other way (its thread killed by an error not caught above): without its thread the
                # queue would only grow. Dropped instead, so the next notification starts a thread again.
                left = None if ended else self._queues.pop(addr, None)
            if left:
                log.warning(
                    "%s dropped %d abort notifications for %s:%d; their leases expire", self.name, len(left), *addr
                )

    def close(self, grace_s: float) -> None:
        """Take no more; give what is pending `grace_s` to go out, then drop it.

        A send in flight ends by itself, within the notify timeout."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        deadline = time.monotonic() + grace_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            dropped = sum(len(q) for q in self._queues.values())
            for queue in self._queues.values():
                queue.clear()
        if dropped:
            log.warning("%s closed with %d abort notifications not sent; their leases expire", self.name, dropped)
        self._clients.close()


def _ipv6(host: str) -> bool:
    """ZeroMQ's IPv6 on for an IPv6 address or `*` (both families); a name stays IPv4 (`localhost` must not be ::1)."""
    return ":" in host or host == "*"


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host  # as a ZeroMQ endpoint names it


def own_card(name: str) -> PeerCard:
    """This process's card as rank `name`: its guarded transports' addresses, valid for `CARD_S`."""
    return PeerCard(name, netguard.transport_hosts()[:MAX_CARD_HOSTS], time.time() + CARD_S)


def _same_host(claimed: str, source: str | None) -> bool:
    """Is `claimed` (a notify host) the `source` host a request came from? Both loopback counts as the same."""
    if source is None:
        return False
    if is_loopback(claimed) and is_loopback(source):
        return True
    try:
        return ipaddress.ip_address(claimed.strip("[]")) == ipaddress.ip_address(source.strip("[]"))
    except ValueError:
        return False


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
        self.url = f"tcp://{_bracketed(host)}:{port}"
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
            sock.setsockopt(zmq.IPV6, _ipv6(self.host))
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

    def request(self, msg: Any, timeout_s: float | None = None) -> Any:
        """Send one request message and return the reply message.

        A `Refused` is returned, not raised; an unsigned refusal where replies are signed is raised, as ProtocolError.
        """
        if not self.receiver and not isinstance(msg, GetInfo):
            self._request(GetInfo(), timeout_s)  # its signed reply names the rank
        reply = self._request(msg, timeout_s)
        if isinstance(reply, Refused) and reply.kind == MISADDRESSED and self._learned != self.receiver:
            asked, self.receiver = self.receiver, self._learned
            if _engine(asked) != _engine(self._learned):
                # A restarted engine: what the request names went with the old one. Asked again, the new
                # one would hold a BeginPull for the whole offer wait, for a request it never had.
                raise LoadError(
                    f"side channel {self.url} now serves engine {_engine(self._learned)!r}, not "
                    f"{_engine(asked)!r} (restarted): what {type(msg).__name__} names is gone with it; recompute",
                    peer=self.url,
                    request=getattr(msg, "request_id", None),
                    cause="engine restarted",
                )
            reply = self._request(msg, timeout_s)  # another rank of the same engine now serves this address
        return reply

    def _request(self, msg: Any, timeout_s: float | None) -> Any:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        kind = type(msg).__name__
        receiver = "" if isinstance(msg, GetInfo) else self.receiver
        frame = self._auth.seal(_frame(kind, self.sender, wire.encode(msg), receiver=receiver))
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
            sock.setsockopt(zmq.RCVTIMEO, max(1, int(timeout_s * 1000)))
            sock.send(data)
            data = sock.recv()
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
        reply_frame = _decode_small(data, Frame, self._max)
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

    def _ready_request(self, msg: Any, wait_s: float, *, until_offered: bool = False) -> Any:
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
                reply = self.request(msg, timeout_s=self.timeout_s + hold)
            else:
                reply = self.request(msg)
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
            time.sleep(delay)  # bounded by the deadline above
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
    ) -> LeaseStatus:
        """Announce a read of `blocks` of `request_id`; raise LoadError unless its lease is active (recompute).

        Waits up to `wait_s` for the peer to be ready and to have offered the request (the server holds
        the BeginPull until the offer lands); the status's `waited_ms` is how long the offer was waited for.
        `notify`: this rank's side channel, told if the prefill side aborts (the prefill rank remembers it
        only if it is the host this client connects from). `expected_pulls`: the prefill rank's release
        count from the plan (used when its offer left it open). `blocks`: the prefill block ids to be read;
        a block outside the lease gets the BeginPull refused (ProtocolError).
        """
        host, port = notify or ("", 0)
        card = own_card(self.sender) if self._auth.enabled and self.sender else None
        msg = BeginPull(request_id, decode_rank, host, port, expected_pulls, BlockIds(blocks), card=card)
        status = self._expect(self._ready_request(msg, wait_s, until_offered=True), LeaseStatus, "BeginPull")
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
