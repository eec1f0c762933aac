"""Release-only DONEs owed to prefill ranks that stopped answering, sent once they answer again.

A prefill rank that is stopped (SIGSTOP, a long GC or swap, a saturated host) keeps the requests sent to it in its
socket and serves them when it runs again, after the decode rank gave up on them. A BeginPull served that late makes
the decode rank a reader of a lease it will never read: the prefill holds those blocks until the rank's DONE, or to
the lease's end. So the decode rank owes that rank a release-only DONE. Sending it on the pull's own thread would
cost the pull a second control timeout against the same silent peer; here one thread per decode rank sends them,
one probe per silent peer at a time, backing off, until the peer answers or `horizon_s` passes (then the lease has
expired anyway).
"""

from __future__ import annotations

import logging
import threading
import time

import attrs

from kvbridge.base.errors import KVBridgeError
from kvbridge.base.threadname import NamedThread
from kvbridge.control.client import ControlClient

log = logging.getLogger(__name__)

HORIZON_S = 300.0  # past any lease a prefill engine holds (its default is 40 s): the lease is gone by then
FIRST_RETRY_S = 0.5
MAX_RETRY_S = 5.0


@attrs.define
class _Peer:
    client: ControlClient
    owed: dict[str, tuple[int, float]] = attrs.Factory(dict)  # request id -> (release count, give up at)
    due: float = 0.0
    delay: float = FIRST_RETRY_S


class OwedReleases:
    """The release-only DONEs one decode rank (`sender`) owes silent prefill ranks."""

    def __init__(self, sender: str, *, horizon_s: float = HORIZON_S) -> None:
        self.sender = sender
        self.horizon_s = horizon_s
        self._peers: dict[str, _Peer] = {}  # side channel url -> what it is owed
        self._cond = threading.Condition()
        self._thread: NamedThread | None = None
        self._closed = False

    def owe(self, client: ControlClient, request_id: str, count: int) -> None:
        """Send a release-only DONE of `request_id` (`count` pulls) to `client`'s rank once it answers."""
        with self._cond:
            if self._closed:
                log.warning(
                    "request %s: decode closing; %s is not released (its lease expires)", request_id, client.url
                )
                return
            peer = self._peers.setdefault(client.url, _Peer(client, due=time.monotonic()))
            peer.owed[request_id] = (count, time.monotonic() + self.horizon_s)
            if self._thread is None:
                self._thread = NamedThread(target=self._run, name=f"kvbridge-owed-{self.sender}", daemon=True)
                self._thread.start()
            self._cond.notify()

    def close(self, wait_s: float) -> None:
        """Stop; an attempt under way ends within its client's timeout, waited for at most `wait_s` seconds."""
        with self._cond:
            self._closed = True
            owed = sum(len(p.owed) for p in self._peers.values())
            self._cond.notify()
            thread = self._thread
        if owed:
            log.warning(
                "decode %s closing with %d release DONEs unsent; those leases expire instead", self.sender, owed
            )
        if thread is not None:
            thread.join(wait_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                peer = self._next()
                while peer is None or peer.due > time.monotonic():
                    if self._closed:
                        return
                    self._cond.wait(None if peer is None else peer.due - time.monotonic())
                    peer = self._next()
                if self._closed:
                    return
            self._try(peer)

    def _next(self) -> _Peer | None:
        """The peer due first (lock held); drops those owed nothing."""
        for url in [url for url, p in self._peers.items() if not p.owed]:
            del self._peers[url]
        return min(self._peers.values(), key=lambda p: p.due, default=None)

    def _try(self, peer: _Peer) -> None:
        """Send what `peer` is owed, oldest first; at the first failure, back off."""
        with self._cond:
            now = time.monotonic()
            for rid in [rid for rid, (_count, until) in peer.owed.items() if until <= now]:
                del peer.owed[rid]
                log.warning("request %s: %s never answered again; its lease has expired", rid, peer.client.url)
            owed = list(peer.owed.items())
        for rid, (count, _until) in owed:
            try:
                peer.client.done(rid, self.sender, 0, expected_pulls=count, check=False)
            except KVBridgeError as exc:
                if not peer.client.silent:  # it answered, and refused: asking again gets the same answer
                    log.warning("request %s: %s refused its release DONE: %s", rid, peer.client.url, exc)
                    with self._cond:
                        peer.owed.pop(rid, None)
                    continue
                with self._cond:
                    wait, peer.delay = peer.delay, min(MAX_RETRY_S, peer.delay * 2)
                    peer.due = time.monotonic() + wait
                log.debug("request %s: %s still silent (%s); trying again in %.1fs", rid, peer.client.url, exc, wait)
                return
            log.info("request %s: %s answers again: released what this rank gave up reading", rid, peer.client.url)
            with self._cond:
                peer.owed.pop(rid, None)
                peer.delay = FIRST_RETRY_S
