"""How a side channel answers one request: decode, authenticate, check and dispatch it, bytes in, a reply out."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

from kvbridge.base import wire
from kvbridge.base.errors import KVBridgeError, ProtocolError, described
from kvbridge.control.auth import Authenticator
from kvbridge.control.framing import MISADDRESSED, Address, decode_small, new_frame, own_card, same_host
from kvbridge.control.ledger import Ledger
from kvbridge.control.messages import (
    MAX_CARD_S,
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

# The side channel's one logger, whichever of its modules logs: one name for operators' filters.
log = logging.getLogger("kvbridge.control.channel")

AbortCallback = Callable[[str, str, str], None]  # request_id, origin, reason
StreamQuery = Callable[[str, int], StreamStatus]  # request_id, epoch -> how far prefill computed it
# request_id -> whether a lease was lent for it now (None: it names nothing lendable); see kvbridge.session.lending
Lender = Callable[[str], "bool | None"]


@attrs.define
class Timing:
    """One request's times in the serving loop (monotonic): queued from `since`, read, handler started and ended."""

    since: float
    read: float
    kind: str = ""
    sender: str = ""
    start: float = 0.0
    end: float = 0.0


@attrs.frozen
class Hold:
    """What the dispatcher answers for a request to be held (see `kvbridge.control.held`)."""

    msg: BeginPull | QueryStream


class Dispatcher:
    """Answers the requests of one rank's side channel (`ControlServer`), and admits the readers of its leases.

    `info` is what GetInfo answers (`ControlServer.register` replaces it); `streams` answers QueryStream; with
    `accept_offers`, `Offer` messages from this host go into the ledger. A BeginPull's reader (its card's transport
    addresses) is admitted while its lease lasts.
    """

    def __init__(
        self,
        name: str,
        host: str,
        *,
        auth: Authenticator,
        info: RegisteredMemory,
        ledger: Ledger | None,
        streams: StreamQuery | None,
        on_abort: AbortCallback | None,
        lender: Lender | None,
        max_message_bytes: int,
    ) -> None:
        """`host`: the address the side channel listens on (offers come from it)."""
        self.name = name
        self.info = info
        self.info_digest = ""  # of `info.info`, as its readers decode it (set by `ControlServer.register`)
        self.ledger = ledger
        self.streams = streams
        self.accept_offers = False
        self.max_message_bytes = max_message_bytes
        self._host = host
        self._auth = auth
        self._on_abort = on_abort
        self._lender = lender
        self._held_lock = threading.Lock()
        self._held_keys: dict[str, set[str]] = {}  # request id -> admission holds of its readers (netguard)

    def seal(self, reply_to: bytes | None, reply: Any) -> bytes:
        """The reply, framed and signed; a `Refused` naming its size instead of one too large for the client.

        The client's socket would drop a reply that large: the client would wait out its timeout and take this rank for
        dead.

        `reply_to` None: the request did not authenticate. Its refusal goes unsigned and names neither this
        rank nor the request (signing it would sign a `reply_to` the sender chose: a signing oracle), and a
        client takes an unsigned refusal as a failure only."""
        if reply_to is None:
            return wire.encode(new_frame(type(reply).__name__, "", wire.encode(reply)))
        data = wire.encode(self._auth.seal(new_frame(type(reply).__name__, self.name, wire.encode(reply), reply_to)))
        if len(data) <= self.max_message_bytes:
            return data
        why = (
            f"the {type(reply).__name__} reply of {self.name} is {len(data)} bytes encoded, over the side channel's "
            f"{self.max_message_bytes}-byte limit (max_message_bytes); ask for less, or raise max_message_bytes "
            "on both sides"
        )
        log.warning("%s", why)
        return self.seal(reply_to, Refused("too_large", why))

    def answer(
        self, payload: bytes, peer_host: str | None, *, park: bool, timing: Timing | None = None
    ) -> tuple[bytes | None, Any]:
        """Decode and answer one request: (its nonce, or None where it did not authenticate; the reply message).

        With `park` (the serving loop has room to hold it), the reply may be a `Hold`. `timing` gets the handler's start
        and end."""
        reply_to: bytes | None = None if self._auth.enabled else b""
        try:
            frame = decode_small(payload, Frame, self.max_message_bytes)
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
            body = decode_small(frame.body, cls, self.max_message_bytes)
            if timing is not None:
                timing.kind, timing.sender, timing.start = frame.kind, frame.sender, time.monotonic()
            reply: Any = self.dispatch(body, frame.sender, peer_host, park=park)
        except ProtocolError as exc:
            log.warning("%s refused a message from %s: %s", self.name, peer_host or "an unknown host", exc)
            reply = Refused("protocol", str(exc))
        except KVBridgeError as exc:
            log.warning("%s refused a request from %s: %s", self.name, peer_host or "an unknown host", exc)
            reply = Refused("error", str(exc))
        except Exception as exc:  # a bug must cost one reply, not the server
            log.exception("%s: handler failed", self.name)
            reply = Refused("internal", described(exc))
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

    def dispatch(self, msg: Any, sender: str, peer_host: str | None, *, park: bool = False) -> Any:
        """The reply to one decoded request from `sender`, or (with `park`) a `Hold` for a request to wait."""
        if isinstance(msg, Abort):
            # said before the ledger's release line, which cannot say who ended the lease or why
            log.info(
                "%s: request %s aborted by %s: %s",
                self.name,
                msg.request_id,
                msg.origin or sender,
                msg.reason or "no reason given",
            )
            if self.ledger is not None:
                self.ledger.abort(msg.request_id)  # wakes a held QueryStream for it (on_finish)
            if self._on_abort is not None:
                self._on_abort(msg.request_id, msg.origin or sender, msg.reason)
            return Ack()
        if isinstance(msg, GetInfo):
            return self._unserved(leases=False) or (
                attrs.evolve(self.info, card=own_card(self.name)) if self._auth.enabled else self.info
            )
        if isinstance(msg, Offer):  # refused or taken by `offer`, as an offer made by a call is
            return self._offer(msg, sender, peer_host)
        refused = self._unserved(leases=True)
        if refused is not None:
            return refused
        assert self.ledger is not None
        if isinstance(msg, BeginPull):
            self._check_card(msg.card, sender)
            lendable = self._lender is not None and self.ledger.state(msg.request_id) is LeaseState.UNKNOWN
            if lendable and self._lender(msg.request_id) is False:  # nor will there be: not worth a wait
                return Refused("nothing_to_lend", f"rank {self.name} runs no request {msg.request_id!r} lends from")
            if park and msg.wait_ms > 0 and self.ledger.state(msg.request_id) is LeaseState.UNKNOWN:
                return Hold(msg)
            return self.begin(msg, peer_host)
        if isinstance(msg, Done):
            return self.ledger.done(msg.request_id, msg.decode_rank, msg.epoch, msg.expected_pulls)
        if isinstance(msg, QueryLease):
            return self.ledger.query(msg.request_id, msg.epoch)
        if isinstance(msg, QueryStream):
            if self.streams is None:
                return Refused("no_streams", f"rank {self.name} does not stream layer by layer (transfer: pull)")
            status = self.streams(msg.request_id, msg.epoch)
            if park and msg.wait_ms > 0 and not self.stream_moved(msg, status):
                return Hold(msg)
            return status
        raise ProtocolError(f"no handler for {type(msg).__name__}")

    def begin(self, msg: BeginPull, peer_host: str | None, waited_s: float = 0.0) -> LeaseStatus:
        """Begin the pull a BeginPull asks for (after `waited_s` held): its watcher remembered, its reader admitted."""
        assert self.ledger is not None
        watcher = self._watcher(msg, peer_host)
        key = self._hold_reader(msg)
        status = self.ledger.begin(msg.request_id, msg.decode_rank, watcher, msg.expected_pulls, blocks=msg.blocks)
        if not status.valid:
            if key is not None:
                self.release_readers(msg.request_id)
            return attrs.evolve(status, waited_ms=round(waited_s * 1e3, 3))
        # admitted from now to the lease's end, then for the grace (also true where no card was needed: permanent)
        return attrs.evolve(
            status,
            waited_ms=round(waited_s * 1e3, 3),
            admitted_s=netguard.ADMISSION.grace_s,
            info_digest=self.info_digest,
        )

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

    def release_readers(self, request_id: str) -> None:
        """End the admissions of `request_id`'s readers (after the grace): its lease ended."""
        with self._held_lock:
            keys = self._held_keys.pop(request_id, ())
        for key in keys:
            netguard.ADMISSION.release(key)

    def _offer(self, msg: Offer, sender: str, peer_host: str | None) -> Ack | Refused:
        """An `Offer` message: from this engine's own scheduler, so from this host."""
        if not same_host(self._host, peer_host):
            raise ProtocolError(
                f"Offer of {msg.request_id!r} from {sender!r} at {peer_host or 'an unknown host'}: offers come from "
                "the engine's own scheduler, on this host"
            )
        return self.offer(msg)

    def offer(self, msg: Offer) -> Ack | Refused:
        """Take an offer from this engine's own scheduler, ahead of the engine step that makes it too.

        By message or by a call in the same process (`ControlServer.take_offer`): refused alike. Raises what
        `Ledger.offer` raises."""
        refused = self._unserved(leases=True)
        if refused is not None:
            return refused
        assert self.ledger is not None
        if not self.accept_offers:
            return Refused("offers_in_step", f"rank {self.name} takes offers in the engine step only")
        self.ledger.offer(msg.request_id, msg.blocks, offer_id=msg.offer_id)
        return Ack()

    def _unserved(self, *, leases: bool) -> Refused | None:
        """Why this rank cannot answer yet (its KV cache not registered), or at all where it needs `leases`."""
        if not self.info.ready:
            return Refused("not_ready", f"rank {self.name} has not registered its KV cache yet")
        if leases and self.ledger is None:
            return Refused("no_ledger", f"rank {self.name} holds no leases (is it a decode rank?)")
        return None

    @staticmethod
    def stream_moved(msg: QueryStream, status: StreamStatus) -> bool:
        """Whether a QueryStream is answered now: its stream changed since `seen`, or its lease is not valid."""
        return status.version != msg.seen or not status.lease.valid

    def _watcher(self, msg: BeginPull, peer_host: str | None) -> Address | None:
        """The side channel to tell on abort, if the BeginPull named one this rank may connect to.

        That is its sender's own host (the request's TCP source; on loopback, any loopback address) and a valid port."""
        if not msg.notify_port:
            return None
        if not 0 < msg.notify_port < 65536:
            raise ProtocolError(f"BeginPull for {msg.request_id!r} names notify port {msg.notify_port}")
        if same_host(msg.notify_host, peer_host):
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
