"""A prefill scheduler offering finished requests to its own ranks at once (early offers). See docs/internals.md."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from kvbridge.base.errors import KVBridgeError
from kvbridge.base.threadname import name_in_os
from kvbridge.control.channel import local_server
from kvbridge.control.client import ClientPool
from kvbridge.control.messages import Offer, Refused

log = logging.getLogger(__name__)


class EarlyOffers:
    """Offer ids unique across the engine's restarts, and the early offers to `ranks` (host, port)."""

    def __init__(self, ranks: Sequence[tuple[str, int]], *, early: bool, clients: ClientPool) -> None:
        self.ranks = list(ranks)
        self.early = early  # False once a rank refused them: its memory is published in the step
        self._clients = clients
        self._sender: ThreadPoolExecutor | None = None
        self._prefix = uuid.uuid4().hex[:12]
        self._count = 0

    def make(self, request_id: str, blocks: Sequence[int], engine_request_id: str = "") -> Offer:
        """The offer of a finished request under lease id `request_id`, sent early to the ranks where they take it.

        `engine_request_id`: the engine's id of the request when the lease has another (a moved decode request)."""
        self._count += 1
        offer = Offer(request_id, tuple(blocks), f"{self._prefix}-{self._count}", engine_request_id)
        if self.early:
            others = self._take_here(offer)
            if others and self.early:
                if self._sender is None:
                    self._sender = ThreadPoolExecutor(
                        max_workers=1, thread_name_prefix="kvbridge-offer", initializer=name_in_os
                    )
                self._sender.submit(self._send, offer, others)
        return offer

    def _take_here(self, offer: Offer) -> list[tuple[str, int]]:
        """Offer to the ranks this process serves, by a call; the ranks left to send a message to."""
        others = []
        for host, port in self.ranks:
            server = local_server(host, port)
            if server is None:
                others.append((host, port))
                continue
            try:
                self._answered(host, port, offer, server.take_offer(offer))
            except KVBridgeError as exc:
                log.debug(
                    "early offer of %s to %s:%d refused (the step offers it): %s", offer.request_id, host, port, exc
                )
        return others

    def _send(self, offer: Offer, ranks: Sequence[tuple[str, int]]) -> None:
        """Tell the engine's ranks in other processes of a finished request now (the step offers it anyway)."""
        for host, port in ranks:
            try:
                reply = self._clients.get(host, port).request(offer)
            except KVBridgeError as exc:
                log.debug(
                    "early offer of %s to %s:%d failed (the step offers it): %s", offer.request_id, host, port, exc
                )
                continue
            self._answered(host, port, offer, reply)
            if not self.early:
                return

    def _answered(self, host: str, port: int, offer: Offer, reply: object) -> None:
        """A rank's answer to an early offer, by message or by call: a rank that takes offers in the step ends them."""
        if not isinstance(reply, Refused):
            return
        if reply.kind == "offers_in_step":
            log.info("worker rank %s:%d publishes KV in the engine step: no early offers", host, port)
            self.early = False
            return
        log.debug("early offer of %s refused by %s:%d: %s", offer.request_id, host, port, reply.message)

    def close(self) -> None:
        if self._sender is not None:
            self._sender.shutdown(wait=True, cancel_futures=True)
        self._clients.close()
