"""Scheduler side of a live move's pre-copy: the blocks of running decode requests marked with a move id.

Each step vLLM shows the connector the block table of every request it schedules (`kv_connector_block_state`). This
reads those of marked requests only, and tells the workers each one's blocks that are full and computed
(kvbridge.session.lending lends them).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvbridge.session.lending import Lendable, StepLending

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class MarkedRequests:
    """Marked running requests, and the full blocks of each the workers were told of."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._requests: dict[str, Request] = {}
        self._moves: dict[str, str] = {}  # engine request id -> move id
        # tokens computed before the last step scheduled: that step may still be running (a scheduler that runs
        # ahead of the model), the one before it has finished
        self._computed: dict[str, int] = {}
        self._told: dict[str, int] = {}  # full blocks the workers were told of
        self._step = StepLending()
        self._blind = False  # this vLLM shows a connector no block table: nothing is lent

    def see(self, request: Request, move: str) -> None:
        """A request marked with `move` (`kvbridge.session.requests.move_of`) is considered for a step."""
        self._requests[request.request_id] = request
        self._moves[request.request_id] = move

    def collect(self, scheduler_output: Any) -> StepLending:
        """The step's news for the workers (and what ended since the last step)."""
        tables = getattr(scheduler_output, "kv_connector_block_state", None)
        if tables is None and self._moves and not self._blind:
            self._blind = True
            log.warning("this vLLM shows a connector no block tables (kv_connector_block_state): no pre-copy lending")
        for rid in scheduler_output.preempted_req_ids or ():
            if rid in self._moves:
                self._step.preempted.append(self._moves[rid])
                self._computed.pop(rid, None)
                self._told.pop(rid, None)
        for rid in self._moves.keys() & (tables.req_ids if tables is not None else set()):
            done = self._computed.get(rid, 0)
            self._computed[rid] = self._requests[rid].num_computed_tokens  # before this step's tokens
            blocks = tables.get_block_ids(rid)
            full = min(done // self.block_size, len(blocks[0]) if blocks else 0)
            if blocks and full > self._told.get(rid, 0):
                self._told[rid] = full
                self._step.lendable.append(Lendable(self._moves[rid], rid, blocks[0][:full]))
        step, self._step = self._step, StepLending()
        return step

    def finished(self, request: Request, *, offered: bool) -> bool:
        """A marked request ended: whether the connector holds its blocks (until the workers report it).

        `offered`: its blocks are offered under its move id (a cut), whose lease's end reports it."""
        self._requests.pop(request.request_id, None)
        move = self._moves.pop(request.request_id, None)
        self._computed.pop(request.request_id, None)
        told = self._told.pop(request.request_id, 0)
        if move is None:
            return False
        self._step.unlend.append(move)
        if offered or not told:
            return offered  # nothing was ever lendable: nothing can be read from it
        self._step.held.append(request.request_id)
        return True
