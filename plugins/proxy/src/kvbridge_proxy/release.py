"""Releasing a lease no decode will read: an Abort to every rank that holds it, asked again until it answers.

A prefill's lease when no decode took the request, or a moved stream's on the decode it left: its blocks are free at
once, not when the lease ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from kvbridge.base.errors import KVBridgeError, PeerGone, TransferTimeout
from kvbridge.control.client import ControlClient
from kvbridge.control.params import KVTransferParams
from kvbridge.plan.rank_ports import side_channel_port
from kvbridge_proxy.upstreams import Background

log = logging.getLogger("kvbridge_proxy.app")  # the proxy's one logger, whichever module logs (operators filter on it)

# A rank that does not answer the release in this long keeps its lease, and is asked again. Each release opens a new
# connection: this is past Linux's first SYN retransmission (1 s), so one SYN or SYN-ACK lost on a link is no timeout.
RELEASE_TIMEOUT_S = 1.5
# A rank that did not answer is asked again after 1, 2, 4, ... s, for this long: a stalled engine answers later, and
# until then its lease holds blocks (a draining server waits for them, up to its shutdown timeout).
FIRST_RETRY_S = 1.0
RELEASE_RETRY_S = 64.0


# `LeaseRelease.release`: what the rooms that may leave a lease unread are given.
ReleaseLease = Callable[[KVTransferParams, str], Awaitable[None]]


class LeaseRelease:
    """Releases leases on the ranks that hold them (`release`); what no rank answered, in the background."""

    def __init__(self, secret: bytes | None, background: Background) -> None:
        self.secret = secret
        self.background = background

    async def release(self, params: KVTransferParams, why: str) -> None:
        """Tell each rank holding a lease on the request's KV that no decode will read it (an Abort, side channel).

        A prefill's lease, or a moved stream's on the decode it left. So its blocks are free now, not when the lease
        ends. Needs the shared secret where the server has one (KVBRIDGE_SECRET or KVBRIDGE_SECRET_FILE in the proxy's
        environment); without it the lease ends by itself. A rank that does not answer is asked again in the
        background (`RELEASE_RETRY_S`); an Abort that comes before the offer it ends is kept by the rank's ledger."""
        if params.remote_request_id is None or params.remote_host is None or params.remote_port is None:
            return
        request_id = str(params.remote_request_id)
        host = str(params.remote_host)

        def abort(stage: int, rank: int, again: bool = False) -> bool:
            """False where the rank did not answer: it is asked again."""
            # Every stage's ranks hold blocks of the request: with pp_size > 1 the later stages' too (their ports follow
            # the engine's numbering, kvbridge.plan.rank_ports; remote_port is the engine's base, dp_rank its DP rank).
            try:
                port = side_channel_port(
                    int(params.remote_port),  # type: ignore[arg-type]
                    tp_rank=rank,
                    tp_size=params.tp_size,
                    pp_rank=stage,
                    pp_size=params.pp_size,
                    dp_index=params.dp_rank,
                )
                with ControlClient(host, port, secret=self.secret, sender="proxy", timeout_s=RELEASE_TIMEOUT_S) as c:
                    c.abort(request_id, reason=why)
                log.info("released request %s on stage %d rank %d (%s:%d)", request_id, stage, rank, host, port)
                return True
            except (TransferTimeout, PeerGone) as exc:
                (log.info if again else log.warning)(
                    "could not release request %s on stage %d rank %d (%s); asking again", request_id, stage, rank, exc
                )
                return False
            except KVBridgeError as exc:
                log.warning(
                    "could not release request %s on stage %d rank %d (%s); its lease ends by itself%s",
                    request_id,
                    stage,
                    rank,
                    exc,
                    "" if self.secret else " (the proxy has no KVBRIDGE_SECRET)",
                )
                return True

        async def ask(ranks: list[tuple[int, int]], again: bool = False) -> list[tuple[int, int]]:
            done = await asyncio.gather(*(asyncio.to_thread(abort, s, r, again) for s, r in ranks))
            return [rank for rank, ok in zip(ranks, done, strict=True) if not ok]

        async def ask_again(ranks: list[tuple[int, int]]) -> None:
            delay, until = FIRST_RETRY_S, time.monotonic() + RELEASE_RETRY_S
            while ranks and time.monotonic() + delay < until:
                await asyncio.sleep(delay)
                ranks, delay = await ask(ranks, again=True), delay * 2
            if ranks:
                log.warning(
                    "gave up releasing request %s on (stage, rank) %s: its lease ends by itself", request_id, ranks
                )

        left = await ask([(s, r) for s in range(params.pp_size) for r in range(params.tp_size)])
        if left:
            self.background.spawn(ask_again(left))
