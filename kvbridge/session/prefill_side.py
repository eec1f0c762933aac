"""A prefill rank's side of a session. See docs/internals.md."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from kvbridge.agent.kv_agent import KVAgent
from kvbridge.base import watchdog
from kvbridge.base.errors import ConfigError
from kvbridge.control.channel import ControlServer
from kvbridge.control.ledger import Lease, LeaseState, Ledger
from kvbridge.control.messages import Offer
from kvbridge.session.lending import Lending, StepLending
from kvbridge.session.outbox import Outbox, Recorder
from kvbridge.session.stream import LayerwiseMeta, Producer

log = logging.getLogger(__name__)

MAX_EARLY_RELEASES = 100_000  # leases released before their step's offer, remembered until it comes


class PrefillSide:
    """One prefill rank: side channel, ledger, offers and (with `layerwise`) its streams' `Producer`."""

    def __init__(
        self,
        engine_id: str,
        rank: int,
        outbox: Outbox,
        stats: Recorder,
        *,
        host: str,
        port: int,
        secret: str | bytes | None,
        insecure: bool,
        lease_s: float,
        block_size: int,
        layerwise: bool,
    ) -> None:
        self.outbox = outbox
        self.stats = stats
        self.ledger = Ledger(self._released, timeout_s=lease_s)
        self.ledger.on_offer(lambda lease: self.stats.record_lease("offered", 1, len(lease.blocks)))
        self.lending = Lending(self.ledger, self.outbox.sent)
        self.producer = (
            Producer(self.ledger, self._abort, block_size, on_progress=self._progress) if layerwise else None
        )
        self.server = ControlServer(
            engine_id,
            rank,
            ledger=self.ledger,
            host=host,
            port=port,
            secret=secret,
            insecure=insecure,
            streams=self.producer.query if self.producer is not None else None,
            timed=stats.record_request,
            lender=self.lending.lend,
        )
        self.agent: KVAgent | None = None
        self._lock = threading.Lock()
        self._stepped: dict[str, str] = {}  # offer id -> engine request id: offered by the step, not released yet
        self._released_early: OrderedDict[str, str] = OrderedDict()  # released before the step's offer came

    def _abort(self, transfer_id: str, reason: str) -> None:
        """A stream's lease ends now; its readers are told (the Producer's abort)."""
        self.server.abort(transfer_id, reason)

    def _progress(self, transfer_id: str) -> None:
        """A stream's readers are to be woken: answer their held QueryStreams (the Producer's on_progress)."""
        self.server.wake(transfer_id)

    def register(self, agent: KVAgent, layer_names: Sequence[str]) -> None:
        """The KV cache exists: serve its `RankInfo`; take early offers where publishing needs nothing."""
        self.agent = agent
        agent.backend.expect_reads(0)  # every read of this rank's memory is announced from now on
        self.ledger.on_reading(agent.backend.expect_reads)
        if self.producer is not None:
            self.producer.register(agent, layer_names)
        self.server.register(agent.info(), accept_offers=agent.publish_is_free)

    def offer(self, offers: Sequence[Offer]) -> None:
        """The engine step's finished requests: publish their blocks and hold them for decode."""
        assert self.agent is not None
        for offer in offers:
            begun = time.monotonic()
            self._offer(offer)
            took = time.monotonic() - begun
            self.stats.record_phase("offer", self.agent.backend.name, "", took)
            watchdog.slow(log, f"offer of request {offer.request_id} on {self.server.name}", {"offer": took * 1e3})

    def _offer(self, offer: Offer) -> None:
        """Publish one offer's blocks and lease them."""
        assert self.agent is not None
        self.agent.publish(offer.blocks)  # computed by now; through staging, copied to the host mirror
        engine_id = offer.engine_request_id or offer.request_id  # the id the engine frees the blocks by
        with self._lock:
            if self._released_early.pop(offer.offer_id, None) is not None:
                self.lending.report_after(engine_id)  # the early offer was pulled and released already
                return  # nothing to lease
            self._stepped[offer.offer_id] = engine_id
        # the same lease as the early offer's, if that came; the decode side states the release count
        try:
            self.ledger.offer(offer.request_id, offer.blocks, offer_id=offer.offer_id)
        except ConfigError as exc:
            # An early offer this step does not confirm (another offer id: a stray or forged one) holds
            # the request: the step's offer is the truth. A decode reading the stray lease fails its DONE.
            log.warning("request %s: %s; replacing that lease with the engine step's offer", offer.request_id, exc)
            self.ledger.abort(offer.request_id)
            self.ledger.offer(offer.request_id, offer.blocks, offer_id=offer.offer_id)

    def lend_from(self, step: StepLending) -> None:
        """The step's news of requests a live move may pre-copy (kvbridge.session.lending)."""
        self.lending.preempted(step.preempted)
        self.lending.update(step.lendable)
        self.lending.ended(step.unlend, step.held)

    def apply(self, meta: LayerwiseMeta) -> None:
        """The step's stream starts, growth, progress and ends."""
        if self.producer is None:
            return
        self.producer.apply(meta)
        for added in meta.blocks.values():  # a stream's lease (offered at its first step) grows chunk by chunk
            self.stats.record_lease("extended", 0, len(added))

    def save_layer(self, layer_name: str) -> None:
        if self.producer is not None:
            self.producer.save_layer(layer_name)

    def _released(self, lease: Lease, reason: LeaseState) -> None:
        """Ledger callback (any thread): the request's blocks may be freed; the engine hears of it next."""
        self.stats.record_lease(reason.value, -1, -len(lease.blocks))
        if self.lending.released(lease):
            return
        if self.producer is not None and self.producer.released(lease.request_id):
            self.server.wake(lease.request_id)  # a reader's held QueryStream hears that the lease ended
            self.outbox.nudge()  # a stream: reported once the engine finished the request too (take_finished)
            return
        with self._lock:
            if not lease.offer_id:
                self.outbox.sent(lease.request_id)
                return
            engine_id = self._stepped.pop(lease.offer_id, None)
            if engine_id is not None:
                self.lending.report_after(engine_id)
                return
            self._released_early[lease.offer_id] = lease.request_id
            while len(self._released_early) > MAX_EARLY_RELEASES:  # offers no step ever confirms
                self._released_early.popitem(last=False)

    def has_finished_streams(self) -> bool:
        return self.producer is not None and self.producer.has_finished()

    def take_finished_streams(self) -> set[str]:
        return self.producer.take_finished() if self.producer is not None else set()

    def close(self) -> None:
        leases, blocks = self.ledger.held()
        (log.warning if leases else log.info)(
            "prefill rank %s closing with %d leases held (%d blocks)", self.server.name, leases, blocks
        )
        if self.producer is not None:
            self.producer.close()
        self.server.close()
