"""Live moves (`--live-moves`): a running stream continued on another decode when its own drains or dies.

The proxy reads such a stream (`moving_stream.MovingStream`) event by event (`Upstream`); at a cut the next decode
pulls its KV from the one it leaves (or pre-copies most of it first, or computes it) and the stream goes on from there
(docs/elastic.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import AsyncIterator
from typing import Any

import attrs
import httpx
from fastapi import Request
from fastapi.responses import StreamingResponse

from kvbridge.base.errors import described
from kvbridge.control.params import KVTransferParams
from kvbridge.session.lending import precopy_id
from kvbridge.session.timeline import HEADER, Timeline
from kvbridge_proxy.handover import Handover, Handovers
from kvbridge_proxy.layerwise import PrefillFailed, unless_prefill_fails
from kvbridge_proxy.membership import Membership
from kvbridge_proxy.metrics import ProxyMetrics
from kvbridge_proxy.moving_stream import MovingStream
from kvbridge_proxy.settings import ProxySettings
from kvbridge_proxy.takeover import Takeover, Upstream
from kvbridge_proxy.upstreams import Background, Instance, NoInstance, Pool
from kvbridge_proxy.wire import error_body, sse, until_disconnect

log = logging.getLogger("kvbridge_proxy.app")  # the proxy's one logger, whichever module logs (operators filter on it)

# A pre-copied stream waits at most this long for its turn to be cut (`MoveSettings.cuts_at_once`): the stream before
# it may be stuck behind a client that does not read its events, and its turn with it.
TURN_WAIT_S = 10.0


class Moves:
    """Moves running streams between decodes: relays a movable stream (`relay`) and cuts it over when asked."""

    def __init__(
        self,
        settings: ProxySettings,
        client: httpx.AsyncClient,
        membership: Membership,
        handovers: Handovers,
        metrics: ProxyMetrics,
        background: Background,
    ) -> None:
        self.client = client
        self.membership = membership
        self.handovers = handovers
        self.metrics = metrics
        self.background = background
        self.move_settings = settings.moves
        self.takeover = Takeover(client, membership, handovers, background)
        self._changes: dict[str, asyncio.Event] = {}  # decode URL -> set when a stream leaving it changes
        # decode URL -> the cuts to it under way (`MoveSettings.cuts_at_once`), while a stream holds or awaits one
        self._cut_slots: weakref.WeakValueDictionary[str, asyncio.Semaphore] = weakref.WeakValueDictionary()

    async def relay(
        self,
        request: Request,
        handover: Handover,
        moving: MovingStream,
        timeline: Timeline,
        begun: float,
        headers: dict[str, str],
    ) -> Any:
        """A streamed answer the proxy reads event by event, to move it to another decode when its own drains.

        The move happens between two events: what the client got is what the next decode continues from."""
        up = Upstream.open(handover.decode, handover.resp, moving, marked=handover.decode.identity is not None)
        try:
            first = await until_disconnect(request, unless_prefill_fails(handover.computing, up.next()))
        except PrefillFailed as exc:  # a layer-wise decode would wait for a stream that never comes
            first = ("prefill failed", exc)
        if first is None or first[0] in ("failed", "prefill failed"):
            await self.takeover.leave(up, moving, "its client left before the first token")
            if first is None:
                handover.release_prefill("its client left before the first token")
                log.info("client left before the first token of %s: decode request cancelled", timeline.request_id)
                return self.metrics.answer(499, "client disconnected", headers, timeline)
            resent = await self._hand_on(handover, first, timeline)
            if isinstance(resent, str):
                return self.metrics.answer(503, resent, headers, timeline)
            if not isinstance(resent, Handover):  # the pull way's own error answer
                return resent
            return await self.relay(request, resent, moving, timeline, begun, {**headers, **resent.headers})
        self.metrics.finish(timeline, begun, handover.sent, time.perf_counter())
        self.metrics.requests.labels("200").inc()

        async def events() -> AsyncIterator[bytes]:
            nonlocal up
            item: tuple[str, Any] = first
            finished = False
            try:
                while True:
                    kind, payload = item
                    if kind == "event":
                        yield sse(moving.take(payload))
                        moving.at_event()
                        if up.decode.draining:
                            moving.request_cut("its decode drains")
                        moving.cut_again(wanted=not up.decode.serving)
                    elif kind == "done" or moving.spent:  # (spent: its decode died after the last token: it is whole)
                        yield b"data: [DONE]\n\n"
                        finished = True
                        return
                    elif kind == "cut" and self._precopies(moving, up):
                        pass  # it goes on here while the next decode pulls what it filled; the cut comes after
                    else:  # the decode died or the cut: continue on another decode
                        if moving.precopy is not None:
                            moving.precopy.cancel()  # its decode died: what it lent is gone
                        try:
                            why = payload if kind == "cut" else described(payload)
                            moved = await self._move(moving, up, why, pull=kind == "cut")
                        finally:
                            moving.release_cut_slot()
                        if moved is None:
                            yield sse(error_body(up.decode.failed(payload), 503))
                            yield b"data: [DONE]\n\n"
                            finished = True
                            return
                        up = moved
                    item = await up.next()
            finally:
                if moving.precopy is not None:
                    moving.precopy.cancel()  # it releases what it holds
                moving.movable = False  # it is over: the streams waiting to be cut with it wait no more
                moving.release_cut_slot()
                self._changed(up.decode)
                self.background.spawn(up.close() if finished else self.takeover.leave(up, moving, "its client left"))

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={**headers, HEADER: timeline.header()}
        )

    async def _hand_on(self, handover: Handover, failed: tuple[str, BaseException], timeline: Timeline) -> Any:
        """The request sent again, its decode or layer-wise prefill having failed before the first event (`hand_on`)."""
        prefill_failed, cause = failed[0] == "prefill failed", failed[1]
        what = "layer-wise prefill" if prefill_failed else f"decode server {handover.decode.url}"
        log.warning("request %s: %s failed before the first event: %s", timeline.request_id, what, described(cause))
        error = f"layer-wise prefill failed: {cause}" if prefill_failed else handover.decode.failed(cause)
        return await self.handovers.hand_on(handover, error, timeline, prefill_failed=prefill_failed)

    async def _move(self, moving: MovingStream, up: Upstream, why: str, *, pull: bool) -> Upstream | None:
        """Continue `moving` on another decode: its KV pulled from the one it leaves (`pull`), else computed there.

        None when it cannot continue (nobody can take it, or the decode died before the proxy knew the prompt's ids).
        A cut that finds no other decode leaves the stream where it is (`up`, still open)."""
        source = up.decode
        if moving.prompt is None:
            await up.close()
            return None
        precopied, moving.precopied = moving.precopied, None
        try:
            target = next_decode(
                self.membership.pools["decode"],
                source,
                precopied[0] if precopied is not None and pull else moving.prefer,
            )
        except NoInstance as exc:
            if pull:
                log.warning("stream %s stays on %s for now: %s", moving.move_id, source.url, exc)
                moving.stay(self.membership.health_interval)  # the next health round may bring one back
                return up
            await up.close()
            return None
        move = moving.move or self.move_settings.mode
        offered = source.identity if pull and up.marked else None
        # a pre-copied stream's tail is computed where its pre-copy went (MoveSettings.tail), not pulled
        precomputed = precopied is not None and precopied[1] > 0 and precopied[0] is target
        tail = precomputed and self.move_settings.tail == "compute"
        # a decode without prefix caching keeps nothing it pulls for the continuation: it computes it all
        pulled = offered if move != "recompute" and not tail and target.prefix_cache is not False else None
        cut, closed = time.perf_counter(), []
        # vLLM aborts the request; a marked one's blocks are offered under its move id. Only a pull reads them: the
        # continuation of a move that computes its tail (or all of it) is sent while the source closes.
        closing = asyncio.ensure_future(up.close())
        closing.add_done_callback(lambda _: closed.append(time.perf_counter()))
        try:
            if pulled is not None:
                await closing
            if offered is not None and pulled is None:  # nobody will read the blocks it offers
                self.background.spawn(self._release_offer(offered, moving, "unread"))
            for n, identity in enumerate([pulled, None] if pulled is not None or tail else [None]):
                if n:  # the pull failed (or the pre-copied decode): the next decode computes it all
                    try:
                        target = self.membership.pools["decode"].pick(exclude=(source,))
                    except NoInstance:
                        break
                outcome = "precopied" if tail and not n else "recomputed"
                if identity is not None:
                    reported = await self.takeover.pull(moving, target, identity)
                    if reported is None:
                        continue
                    outcome = reported
                    if outcome == "pulled" and precomputed:
                        outcome = "precopied"
                # the KV is in the target's cache now (pulled, or computed there): the stream goes on from it
                moved = await self.takeover.resume(moving, target)
                if moved is None:
                    continue
                if pulled is not None and outcome == "recomputed":  # nobody read the offered blocks: free them now
                    # off the move's path: a dead source would hold the move's log and metric for the release's timeout
                    self.background.spawn(self._release_offer(pulled, moving, "recomputed"))
                if target.prefix_cache is False:  # what it read (its answer said so) is gone: it computed it all
                    outcome = "recomputed"
                self._moved(moving, source, target, f"{why}, {outcome}", outcome, (cut, closed[0] if closed else None))
                self._changed(source)
                return moved
            if pulled is not None:
                self.background.spawn(self._release_offer(pulled, moving, "the move failed"))
            self.metrics.live_moves.labels("failed").inc()
            log.warning("stream %s could not move off %s (%s): it ends with an error", moving.move_id, source.url, why)
            return None
        finally:
            await closing

    def _release_offer(self, offered: KVTransferParams, moving: MovingStream, why: str) -> Any:
        """Release the blocks a decode offers under the stream's move id (a coroutine)."""
        return self.handovers.release_lease(attrs.evolve(offered, remote_request_id=moving.move_id), why)

    def _moved(
        self,
        moving: MovingStream,
        source: Instance,
        target: Instance,
        how: str,
        outcome: str,
        cut: tuple[float, float | None],
    ) -> None:
        """Count and log a move whose next decode sent its first event.

        `cut`: when it began, and when the source closed (None: it is closing still)."""
        gap = time.perf_counter() - cut[0]
        closing = (
            "the source still closing" if cut[1] is None else f"closing the source {(cut[1] - cut[0]) * 1e3:.1f} ms"
        )
        self.metrics.live_moves.labels(outcome).inc()
        self.metrics.handover_gap.observe(gap)
        log.warning(
            "stream %s (request %s) moved from %s to %s after %d tokens (%s): first event %.1f ms after the cut (%s)",
            moving.move_id,
            moving.request_id,
            source.url,
            target.url,
            len(moving.generated),
            how,
            gap * 1e3,
            closing,
        )
        moving.moved()

    def _precopies(self, moving: MovingStream, up: Upstream) -> bool:
        """Start pre-copying a stream whose cut came, where it can be (then the cut waits for it): whether it did."""
        source = up.decode
        if moving.precopied is not None or not up.marked or source.identity is None:
            return False  # (precopied: this cut's pre-copy ran already)
        if (moving.move or self.move_settings.mode) != "precopy" or moving.prompt is None:
            return False
        if len(moving.prompt) + len(moving.generated) <= self.move_settings.tail_tokens:
            return False  # as little as the cut would pull anyway
        try:
            target = next_decode(self.membership.pools["decode"], source, moving.prefer)
        except NoInstance:
            return False  # the cut finds none either, and the stream stays
        if target.identity is None or target.prefix_cache is False:
            return False  # (no prefix caching: it would keep nothing a stage pulls)
        moving.begin_precopy(asyncio.ensure_future(self._precopy(moving, source, target)))
        return True

    async def _precopy(self, moving: MovingStream, source: Instance, target: Instance) -> None:
        """Have `target` pull, in stages, the blocks the stream fills on `source` while it runs on; then cut it.

        The cut waits for the other streams leaving `source` (`MoveSettings.cut_together_s`)."""
        began, covered = time.perf_counter(), [0, 0]  # tokens the stages left in target's cache, and stages run
        assert source.identity is not None  # (`_precopies` checked)
        try:
            try:
                pulled = await self._stages(moving, source.identity, target, covered, self.move_settings.stages)
            finally:
                moving.staged = True
                self._changed(source)
            staged = time.perf_counter()
            await self._together(moving, source, staged + self.move_settings.cut_together_s)
            slot = self._cut_slots.setdefault(target.url, asyncio.Semaphore(self.move_settings.cuts_at_once))
            with contextlib.suppress(asyncio.TimeoutError):  # (then it is cut without a turn)
                await asyncio.wait_for(slot.acquire(), TURN_WAIT_S)
                moving.cut_slot = slot  # released once its move is over
            if pulled:  # its wait made a longer tail: one stage more while it runs on keeps the cut's tail short
                await self._stages(moving, source.identity, target, covered, 1)
        except asyncio.CancelledError:  # the stream ended or its client left: nothing is cut
            moving.precopy = None
            log.warning(
                "stream %s ended (or its client left) during its pre-copy to %s (%d tokens pre-copied in %.1f ms): "
                "nothing to move",
                moving.move_id,
                target.url,
                covered[0],
                (time.perf_counter() - began) * 1e3,
            )
            raise
        log.info(
            "stream %s: pre-copied %d tokens to %s in %.1f ms, then waited %.1f ms for the other streams leaving %s "
            "and its turn; cut with %d tokens",
            moving.move_id,
            covered[0],
            target.url,
            (staged - began) * 1e3,
            (time.perf_counter() - staged) * 1e3,
            source.url,
            len(moving.prompt or ()) + len(moving.generated),
        )
        moving.end_precopy(target, covered[0])

    async def _together(self, moving: MovingStream, source: Instance, deadline: float) -> None:
        """Until `deadline` (perf_counter), wait while another stream leaving `source` has its pre-copy to come or run.

        Cut together, no stream's continuation waits on the next decode behind another's pre-copy."""
        while any(
            other is not moving and other.precopy_pending(leaving=not source.serving) for other in source.streams
        ):
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changes.setdefault(source.url, asyncio.Event()).wait(), left)

    def _changed(self, source: Instance) -> None:
        """A stream leaving `source` ended its stages, moved or ended: the streams waiting to be cut look again."""
        changed = self._changes.pop(source.url, None)
        if changed is not None:
            changed.set()

    async def _stages(
        self, moving: MovingStream, source: KVTransferParams, target: Instance, covered: list[int], stages: int
    ) -> bool:
        """Up to `stages` more pre-copy stages, each pulling what the context added; whether none failed.

        They end when at most `tail_tokens` are left. `covered`: the tokens pulled so far, and the stages run. A stage
        that fails or times out ends them (logged): the cut goes on."""
        try:
            for stage in range(covered[1] + 1, covered[1] + stages + 1):
                context = len(moving.prompt or ()) + len(moving.generated)
                if covered[0] and context - covered[0] <= self.move_settings.tail_tokens:
                    break
                lease = precopy_id(moving.move_id, stage)
                outcome = None
                try:
                    pulling = self.takeover.pull(moving, target, source, lease=lease, tokens=context)
                    outcome = await asyncio.wait_for(pulling, self.move_settings.stage_timeout_s)
                finally:  # a lease read whole ended with its reader's DONE; any other is released here
                    if outcome != "pulled":
                        self.background.spawn(
                            self.handovers.release_lease(attrs.evolve(source, remote_request_id=lease), "pre-copy")
                        )
                if outcome not in ("pulled", "held") or target.prefix_cache is False:
                    log.warning(
                        "stream %s: pre-copy stage %d to %s %s",
                        moving.move_id,
                        stage,
                        target.url,
                        "failed"
                        if outcome is None
                        else "was computed, its pull failed"
                        if outcome == "recomputed"
                        else "read what its cache does not keep (it runs without prefix caching)",
                    )
                    return False
                covered[0], covered[1] = context, stage
                self.metrics.precopy_stages.inc()
        except asyncio.TimeoutError:
            log.warning(
                "stream %s: a pre-copy stage to %s took over %.0f s",
                moving.move_id,
                target.url,
                self.move_settings.stage_timeout_s,
            )
            return False
        except Exception:  # (a cancel is no Exception: it reaches `_precopy`)
            log.exception("stream %s: pre-copy to %s failed", moving.move_id, target.url)
            return False
        return True


def next_decode(pool: Pool, source: Instance, prefer: Instance | None) -> Instance:
    """Where a stream leaving `source` goes: `prefer` while it takes requests, else the pool's pick (NoInstance).

    A decode known to run without prefix caching (`Instance.heard`) computes a moved stream whole: it is taken only
    where no other decode takes the stream, and then `prefer` first (the rebalancer chose it for its free blocks)."""
    uncached = [i for i in pool.instances if i.prefix_cache is False]
    usable = prefer if prefer is not None and prefer is not source and prefer.serving else None
    if usable is not None and usable not in uncached:
        return usable
    with contextlib.suppress(NoInstance):
        return pool.pick(exclude=(source, *uncached))
    return usable if usable is not None else pool.pick(exclude=(source,))
