"""A layer-wise request's prefill, watched while its decode answers: the prefill and the decode run at once.

A layer-wise decode waits for its prefill's stream (up to its `pull_timeout_s`, then recomputes), so a prefill that
fails first (a server error while it shuts down, say) has the request sent again the pull way (`Handovers.hand_on`;
a 4xx, the request's own fault, goes to the client), and one that ends well tells the proxy where its side channel is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import TypeVar

import httpx

from kvbridge.base.errors import ConfigError, described
from kvbridge.control.params import KVTransferParams
from kvbridge.session.timeline import Timeline
from kvbridge_proxy.membership import Membership
from kvbridge_proxy.upstreams import Instance

T = TypeVar("T")
log = logging.getLogger("kvbridge_proxy.app")


class PrefillFailed(httpx.TransportError):
    """A layer-wise request's prefill failed before its decode answered anything.

    That decode waits for a stream that never comes (up to its `pull_timeout_s`), so the proxy drops it and sends the
    request again the pull way, to another prefill. A transport error of the answer's, so the relays hand it on."""


def refused_by_prefill(computing: asyncio.Future | None) -> httpx.Response | None:
    """The layer-wise prefill's 4xx answer, where that is how it failed.

    The request's own fault: the client gets it, as the pull way gives it (sent again, it would be refused again)."""
    exc = computing.exception() if computing is not None and ended_in_error(computing) else None
    return exc.response if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code < 500 else None


def ended_in_error(computing: asyncio.Future | None) -> bool:
    """Whether a layer-wise prefill call ended in an error (not cancelled by the proxy)."""
    done = computing is not None and computing.done() and not computing.cancelled()
    return done and computing.exception() is not None


async def unless_prefill_fails(computing: asyncio.Future | None, pending: Awaitable[T]) -> T:
    """`pending` (a layer-wise decode's answer, or part of it), unless `computing`, its prefill, fails first.

    Then `pending` is cancelled (closing its upstream request, so vLLM aborts the decode request) and PrefillFailed
    raised. A prefill that ends well, or that the proxy cancelled itself, leaves `pending` to finish."""
    if computing is None:
        return await pending
    task = asyncio.ensure_future(pending)
    try:
        if not ended_in_error(computing):
            await asyncio.wait({task, computing}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and not ended_in_error(computing):  # the prefill ended well: the answer is coming
            await asyncio.wait({task})
    except asyncio.CancelledError:
        task.cancel()
        raise
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    exc = computing.exception()
    raise PrefillFailed(
        f"answered {exc.response.status_code}" if isinstance(exc, httpx.HTTPStatusError) else described(exc)
    )


def prefill_ended(task: asyncio.Future, prefill: Instance, timeline: Timeline, membership: Membership) -> None:
    """A layer-wise prefill request's end: its failure logged, or its answer's timing and identity learned."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:  # its decode answer then fails (`unless_prefill_fails`) and the request goes the pull way
        log.warning("layer-wise prefill of %s on %s failed: %s", timeline.request_id, prefill.url, described(exc))
        return
    _inst, answer = task.result()
    with contextlib.suppress(ConfigError):
        params = KVTransferParams.from_dict(answer.get("kv_transfer_params"))
        timeline.add(params.kvbridge_timing, ("prefill_ms",))
        membership.learn(prefill.url, params)  # a restarted prefill answers with its new identity
