"""A decode rank lending the full blocks of a request it is still running (a live move's pre-copy).

The proxy moves a running stream off a decode A in stages (docs/elastic.md, "Pre-copy"): while A keeps decoding,
the next decode B pulls the blocks A has filled, under a lease named `precopy_id(M, stage)` where M is the stream's
move id. A full block of a running request is never written again, so it can be read while the request runs.
What must not happen is the engine freeing it under a reader: a marked request that ends is held by the engine's
connector (`ended`) until every lease lent from it ended too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import attrs

from kvbridge.base.errors import ConfigError
from kvbridge.control.ledger import Lease, Ledger

log = logging.getLogger(__name__)

PRECOPY = "~precopy"
# A stream's source lends the full blocks of all but this many of the tokens the proxy has seen: the step that sampled
# the last one (N) computed token N - 1 and told the workers of the blocks of the tokens computed before the step
# before it (N - 3: the engine's scheduler may run a step ahead of the model)
LENT_LAG = 3


def precopy_id(move_id: str, stage: int) -> str:
    """The lease id a pre-copy stage of move `move_id` reads under."""
    return f"{move_id}{PRECOPY}{stage}"


def precopied(lease_id: str) -> str | None:
    """The move id a pre-copy lease id names, or None for any other lease id."""
    move, sep, stage = lease_id.rpartition(PRECOPY)
    return move if sep and move and stage.isdigit() else None


@attrs.frozen
class Lendable:
    """A running request marked with move id `move_id`: its blocks that are full and computed."""

    move_id: str
    engine_request_id: str
    blocks: tuple[int, ...] = attrs.field(converter=tuple)


@attrs.define
class StepLending:
    """What the workers hear of marked requests in one step."""

    lendable: list[Lendable] = attrs.Factory(list)
    unlend: list[str] = attrs.Factory(list)  # move ids: ended, nothing more to lend
    preempted: list[str] = attrs.Factory(list)  # move ids: their blocks were freed, lent leases end now
    held: list[str] = attrs.Factory(list)  # engine request ids held until no lent lease reads them


class Lending:
    """One rank's lent leases and the engine requests they hold; `report` tells the engine a request may be freed.

    Called from the engine's thread (`update`, `ended`, `report_after`), the side channel's (`lend`) and any thread
    that ends a lease (`released`)."""

    def __init__(self, ledger: Ledger, report: Callable[[str], None]) -> None:
        self._ledger = ledger
        self._report = report
        self._lock = threading.Lock()
        self._lendable: dict[str, Lendable] = {}  # move id -> its running request's full blocks
        self._lent: dict[str, str] = {}  # lent lease id -> engine request id
        self._holds: dict[str, int] = {}  # engine request id -> lent leases not ended
        self._waiting: set[str] = set()  # engine request ids that ended and wait for their lent leases

    def update(self, lendable: Sequence[Lendable]) -> None:
        """The step's news: running marked requests whose full blocks grew."""
        with self._lock:
            for entry in lendable:
                self._lendable[entry.move_id] = entry

    def lend(self, lease_id: str) -> bool | None:
        """Offer a pre-copy lease on the blocks its running request has filled: whether one was lent.

        None when `lease_id` names no pre-copy (the caller goes on as for any lease)."""
        move = precopied(lease_id)
        if move is None:
            return None
        with self._lock:
            entry = self._lendable.get(move)
            if entry is None or not entry.blocks:
                log.info("pre-copy %s: no running request to lend from (it ended, or filled no block yet)", lease_id)
                return False
            if lease_id in self._lent:  # lent already (to another rank of the reader): that lease serves it
                return True
            # counted before the lease exists: it may end (and be counted off) the moment it is offered
            self._lent[lease_id] = entry.engine_request_id
            self._holds[entry.engine_request_id] = self._holds.get(entry.engine_request_id, 0) + 1
        try:  # outside the lock: offering reaps expired leases, whose callbacks come back here
            # no hold promised: a preempted request's blocks are freed by the engine alone (`preempted`), so each
            # read is checked against the lease after it ended (the decode side's fence)
            self._ledger.offer(lease_id, entry.blocks, offer_id=f"lent-{lease_id}", holds_reads=False)
        except ConfigError as exc:
            log.warning("pre-copy %s: %s", lease_id, exc)
            self._end(lease_id)
            return False
        log.info(
            "pre-copy %s: lent %d full blocks of running request %s",
            lease_id,
            len(entry.blocks),
            entry.engine_request_id,
        )
        return True

    def released(self, lease: Lease) -> bool:
        """Ledger callback: whether `lease` was lent (then handled here: its request is freed once nothing holds it)."""
        return self._end(lease.request_id)

    def _end(self, lease_id: str) -> bool:
        with self._lock:
            engine_id = self._lent.pop(lease_id, None)
            if engine_id is None:
                return False
            left = self._holds[engine_id] - 1
            if left:
                self._holds[engine_id] = left
                return True
            del self._holds[engine_id]
            free = engine_id in self._waiting
            self._waiting.discard(engine_id)
        if free:
            self._report(engine_id)
        return True

    def ended(self, move_ids: Sequence[str], engine_ids: Sequence[str]) -> None:
        """The engine ended these marked requests: nothing more is lent from them.

        `engine_ids`: those it holds until reported, each reported now or when its last lent lease ends."""
        with self._lock:
            for move in move_ids:
                self._lendable.pop(move, None)
        for engine_id in engine_ids:
            self.report_after(engine_id)

    def preempted(self, move_ids: Sequence[str]) -> None:
        """The engine freed these requests' blocks (a preemption): their lent leases end now.

        A read that was not over by then fails its fence (no lent lease promises a hold)."""
        with self._lock:
            for move in move_ids:
                self._lendable.pop(move, None)
            gone = set(move_ids)
            ending = [lease_id for lease_id in self._lent if precopied(lease_id) in gone]
        for lease_id in ending:
            self._ledger.abort(lease_id)

    def report_after(self, engine_id: str) -> None:
        """Report `engine_id` to the engine once no lent lease holds its blocks (now, if none does)."""
        with self._lock:
            if self._holds.get(engine_id):
                self._waiting.add(engine_id)
                return
        self._report(engine_id)
