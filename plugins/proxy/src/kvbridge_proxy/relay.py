"""A client's request relayed: its P/D request (or a batch's, split and merged: `fanout`) and the decode's answer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import attrs
import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvbridge.base.errors import ConfigError
from kvbridge.control.params import KVTransferParams
from kvbridge.session.timeline import HEADER, PULL_REPORT, Timeline
from kvbridge_proxy import fanout
from kvbridge_proxy.handover import Handover, Handovers
from kvbridge_proxy.layerwise import PrefillFailed, unless_prefill_fails
from kvbridge_proxy.limits import BUDGET, Budget, encoded
from kvbridge_proxy.metrics import ProxyMetrics
from kvbridge_proxy.moves import Moves
from kvbridge_proxy.moving_stream import MovingStream, refusal
from kvbridge_proxy.settings import ProxySettings
from kvbridge_proxy.wire import REQUEST_ID, error_body, prefill_body, read_body, until_disconnect

log = logging.getLogger("kvbridge_proxy.app")  # the proxy's one logger, whichever module logs (operators filter on it)

# A request with no answer after this long is logged once, with where it waits (its task's stack): the client sees a
# hang, and the log must say where it is.
LONG_WAIT_S = 60.0


def _awaits(coro: Any) -> list[str]:
    """Where a suspended coroutine waits: each frame of its chain of awaits, outermost first.

    (A task's own stack shows the outermost frame only.)"""
    lines = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            lines.append(f"  awaiting {coro!r}"[:300])
            break
        lines.append(f'  File "{frame.f_code.co_filename}", line {frame.f_lineno}, in {frame.f_code.co_name}')
        if frame.f_code is until_disconnect.__code__ and isinstance(frame.f_locals.get("task"), asyncio.Task):
            coro = frame.f_locals["task"].get_coro()  # it waits for its work on a task of its own: where that waits
            continue
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None) or getattr(coro, "gi_yieldfrom", None)
    return lines


@attrs.define
class _Waiting:
    """A request not answered yet: its id, when it came, and whether `Relay.long_waits` logged it."""

    request_id: str
    since: float
    said: bool = False


class Relay:
    """Serves the completion routes: each request's handover, then its answer relayed (merged, for a batch)."""

    def __init__(self, settings: ProxySettings, handovers: Handovers, moves: Moves, metrics: ProxyMetrics) -> None:
        self.handovers = handovers
        self.moves = moves
        self.metrics = metrics
        self.limits = settings.limits
        self.live_moves = settings.moving  # move a draining decode's streams elsewhere (moving_stream.py)
        # requests not answered yet (their first byte): the task serving each -> its id, when it came, and whether
        # `long_waits` said so already
        self._waiting: dict[asyncio.Task, _Waiting] = {}

    async def complete(self, path: str, request: Request) -> Any:
        """A completion or chat request: prefill, hand its params to a decode, relay the decode's answer.

        Per part of a batch, merged."""
        begun = time.perf_counter()
        client_id = request.headers.get("x-request-id")
        bad_id = client_id is not None and not REQUEST_ID.fullmatch(client_id)
        timeline = Timeline(client_id if client_id and not bad_id else str(uuid.uuid4()), begun=begun)
        task = asyncio.current_task()
        if task is None:  # (only outside an event loop's task)
            return await self._complete(path, request, timeline, begun, bad_id)
        self._waiting[task] = _Waiting(timeline.request_id, time.monotonic())
        try:
            return await self._complete(path, request, timeline, begun, bad_id)
        finally:
            del self._waiting[task]

    def long_waits(self) -> None:
        """Log each request unanswered for LONG_WAIT_S, once, with the stack of the task that waits for it."""
        now = time.monotonic()
        for task, waiting in list(self._waiting.items()):
            if now - waiting.since < LONG_WAIT_S or waiting.said:
                continue
            waiting.said = True
            where = "\n".join(_awaits(task.get_coro()))
            log.warning(
                "request %s: no answer after %.1f s; it waits in:\n%s", waiting.request_id, now - waiting.since, where
            )

    async def _complete(self, path: str, request: Request, timeline: Timeline, begun: float, bad_id: bool) -> Any:
        ids = {"x-request-id": timeline.request_id}
        if bad_id:
            client_id = request.headers.get("x-request-id")
            log.warning("refused a request to %s: x-request-id %r is not 1 to 128 printable ASCII", path, client_id)
            error = "x-request-id must be 1 to 128 printable ASCII characters, without spaces or ';'"
            return self.metrics.answer(400, error, ids, timeline)
        body = await read_body(request)
        if isinstance(body, JSONResponse):
            error = json.loads(bytes(body.body))["error"]["message"]
            return self.metrics.answer(body.status_code, error, ids, timeline)
        try:
            parts = fanout.split(path, body, self.limits.max_parts)
        except fanout.Refused as exc:
            log.warning("refused a request to %s: %s", path, exc)
            return self.metrics.answer(400, f"{exc.field}: {exc}", ids, timeline)
        over = self._over_budget(parts)
        if over is not None:
            log.warning("refused a request to %s: %s", path, over[1])
            return self.metrics.answer(*over, ids, timeline)
        BUDGET.set(Budget(self.limits.max_upstream_bytes))  # every part's upstream body, retries included, counts
        if len(parts) > 1 or parts[0].body is not body:
            return await self._complete_parts(path, request, parts, timeline, begun)
        moving = None
        if self.live_moves:
            why = refusal(path, body)
            if why is None:
                moving = MovingStream(path, body, timeline.request_id)
            else:
                log.info("request %s stays on its decode if that one drains: %s", timeline.request_id, why)
        handover = await self.handovers.open(path, request, body, timeline, moving)
        if isinstance(handover, Response):
            return handover
        out_headers = {**handover.headers, **ids}
        streamed = handover.resp.headers.get("content-type", "").startswith("text/event-stream")
        if moving is not None and streamed and handover.resp.status_code == 200:
            answer = await self.moves.relay(request, handover, moving, timeline, begun, out_headers)
        else:
            relay = self._relay_stream if streamed else self._relay_whole
            answer = await relay(request, handover, timeline, begun, out_headers)
        if getattr(answer, "status_code", 200) == 499 and handover.computing is not None:
            handover.computing.cancel()  # the client left: prefill stops too
        return answer

    def _over_budget(self, parts: list[fanout.Part]) -> tuple[int, str] | None:
        """The 413 (or 400) for a request whose parts' first tries alone would pass `max_upstream_bytes`.

        Refused before anything is sent: each part's prefill body, and its decode body less the params prefill adds."""
        try:
            size = sum(len(encoded(prefill_body(p.body))) + len(encoded(p.body)) for p in parts)
        except ValueError as exc:  # NaN or Infinity, which the JSON the servers read has no spelling for
            return 400, f"the request body cannot be sent on as JSON: {exc}"
        cap = self.limits.max_upstream_bytes
        if size <= cap:
            return None
        return 413, (
            f"the request's {len(parts)} P/D requests would send {size} bytes upstream, over the proxy's {cap} "
            "(--max-upstream-bytes)"
        )

    async def _complete_parts(
        self, path: str, request: Request, parts: list[fanout.Part], timeline: Timeline, begun: float
    ) -> Any:
        """A batch: its parts' P/D requests at once, their answers merged (`fanout`)."""
        subs = [Timeline(timeline.request_id, begun=begun) for _ in parts]
        opened = await until_disconnect(request, self._open_all(path, parts, subs))
        if opened is None:
            log.info("client left before decode took every part of %s: all cancelled", timeline.request_id)
            return self.metrics.answer(499, "client disconnected", None, timeline)
        ids = {"x-request-id": timeline.request_id}
        failed = next((h for h in opened if not isinstance(h, Handover)), None)
        if failed is None:
            failed = next((h for h in opened if h.resp.status_code != 200), None)
        if failed is not None:  # the first error answers for the batch, as vLLM fails a batch whole
            await self._close_all([h for h in opened if h is not failed], "another part of its batch failed")
            if not isinstance(failed, Handover):
                failed.headers["x-request-id"] = timeline.request_id
                return failed
            # a batch fails whole: its failed part is not sent again on its own
            alone = attrs.evolve(failed, again=None)
            return await self._relay_whole(request, alone, timeline, begun, {**failed.headers, **ids})
        timeline.phases.update(subs[0].phases)  # the first part's phases stand for the batch's
        headers = {**opened[0].headers, **ids}
        if all(h.resp.headers.get("content-type", "").startswith("text/event-stream") for h in opened):
            return await self._merge_stream(request, parts, opened, timeline, begun, headers)
        return await self._merge_whole(request, parts, opened, timeline, begun, headers)

    async def _open_all(
        self, path: str, parts: list[fanout.Part], subs: list[Timeline]
    ) -> list[Handover | JSONResponse]:
        """Every part's handover at once; cancelled, the ones already open are closed."""
        tasks = [asyncio.ensure_future(self.handovers.open(path, None, p.body, t)) for p, t in zip(parts, subs)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            opened = [t.result() for t in tasks if not t.cancelled() and t.exception() is None]
            await self._close_all(opened, "its client left before every part was sent")
            raise

    @staticmethod
    async def _close_all(opened: Sequence[Handover | JSONResponse], why: str) -> None:
        for h in opened:
            if isinstance(h, Handover):
                await h.close(why)

    async def _merge_whole(
        self,
        request: Request,
        parts: list[fanout.Part],
        opened: list[Handover],
        timeline: Timeline,
        begun: float,
        headers: dict[str, str],
    ) -> Response:
        """Non-streamed parts: read each answer whole, answer the batch with them merged."""

        async def read(h: Handover) -> bytes:
            try:
                return await h.resp.aread()
            finally:
                await h.resp.aclose()
                h.decode.in_flight -= 1

        contents = await until_disconnect(request, asyncio.gather(*(read(h) for h in opened)))
        if contents is None:
            for h in opened:
                h.release_prefill("its client left before the answer")
                if h.computing is not None:
                    h.computing.cancel()
            log.info("client left during decode of %s: decode requests cancelled", timeline.request_id)
            return self.metrics.answer(499, "client disconnected", headers, timeline)
        try:
            answers = [json.loads(c) for c in contents]
            merged = fanout.merge_whole(parts, answers, timeline.request_id)
        except (ValueError, TypeError, AttributeError, KeyError) as exc:
            return self.metrics.answer(
                502, f"a decode server answered what is not a completion: {exc}", headers, timeline
            )
        with contextlib.suppress(ValueError, ConfigError, AttributeError):
            timeline.add(KVTransferParams.from_dict(answers[0].get("kv_transfer_params")).kvbridge_timing, PULL_REPORT)
        self.metrics.finish(timeline, begun, opened[0].sent, time.perf_counter())
        self.metrics.requests.labels("200").inc()
        return JSONResponse(merged, headers={**headers, HEADER: timeline.header()})

    async def _merge_stream(
        self,
        request: Request,
        parts: list[fanout.Part],
        opened: list[Handover],
        timeline: Timeline,
        begun: float,
        headers: dict[str, str],
    ) -> Any:
        """Streamed parts: one stream of every part's chunks as they come.

        Each choice carries its index, the parts' usage is summed into one chunk, and one `[DONE]` ends it."""
        merge = fanout.StreamMerge(parts, timeline.request_id)
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def pump(k: int, h: Handover) -> None:
            try:
                async for line in h.resp.aiter_lines():
                    data = line.removeprefix("data:").strip() if line.startswith("data:") else None
                    if data == "[DONE]":
                        break
                    if data:
                        queue.put_nowait((k, json.loads(data)))
            except (httpx.TransportError, ValueError) as exc:
                log.warning(
                    "decode server %s failed streaming part %d of %s: %s", h.decode.url, k, timeline.request_id, exc
                )
                queue.put_nowait((k, error_body(f"decode server {h.decode.label} failed", 503)))
            finally:
                await h.resp.aclose()
                h.decode.in_flight -= 1
                queue.put_nowait((k, None))

        tasks = [asyncio.ensure_future(pump(k, h)) for k, h in enumerate(opened)]

        async def stop(finished: bool) -> None:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if not finished:  # the client left: prefill stops too
                for h in opened:
                    if h.computing is not None:
                        h.computing.cancel()

        first = await until_disconnect(request, queue.get())
        if first is None:
            await stop(False)
            for h in opened:
                h.release_prefill("its client left before the first token")
            log.info("client left before the first token of %s: decode requests cancelled", timeline.request_id)
            return self.metrics.answer(499, "client disconnected", headers, timeline)
        self.metrics.finish(timeline, begun, opened[0].sent, time.perf_counter())
        self.metrics.requests.labels("200").inc()

        async def events() -> AsyncIterator[bytes]:
            finished, item, running = False, first, len(tasks)
            try:
                while True:
                    k, event = item
                    if event is None:
                        running -= 1
                    elif (out := merge.chunk(k, event)) is not None:
                        yield f"data: {json.dumps(out, separators=(',', ':'))}\n\n".encode()
                    if not running:
                        break
                    item = await queue.get()
                usage = merge.usage_chunk()
                if usage is not None:
                    yield f"data: {json.dumps(usage, separators=(',', ':'))}\n\n".encode()
                yield b"data: [DONE]\n\n"
                finished = True
            finally:
                await stop(finished)

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={**headers, HEADER: timeline.header()}
        )

    async def _resend(
        self,
        relay: Callable[..., Awaitable[Any]],
        request: Request,
        handover: Handover,
        failed: httpx.TransportError,
        timeline: Timeline,
        begun: float,
        headers: dict[str, str],
    ) -> Any:
        """After the decode failed before answering the client anything: the request relayed from the next decode.

        By `relay` (`_relay_stream` or `_relay_whole`); the 503 when no other decode took it (`Handovers.hand_on`)."""
        decode, prefill_failed = handover.decode, isinstance(failed, PrefillFailed)
        if prefill_failed:
            error = f"layer-wise prefill failed: {failed}"
            log.warning("request %s: %s before decode server %s answered", timeline.request_id, error,
                        decode.url)  # fmt: skip
        else:
            log.warning("decode server %s failed before answering %s: %s", decode.url, timeline.request_id, failed)
            error = decode.failed(failed)
        resent = await self.handovers.hand_on(handover, error, timeline, prefill_failed=prefill_failed)
        if isinstance(resent, str):
            return self.metrics.answer(503, resent, headers, timeline)
        if not isinstance(resent, Handover):  # the pull way's own error answer
            return resent
        return await relay(request, resent, timeline, begun, {**headers, **resent.headers})

    async def _relay_whole(
        self, request: Request, handover: Handover, timeline: Timeline, begun: float, headers: dict[str, str]
    ) -> Response:
        """A non-streamed answer: read it whole, take the decode's reported pull phases from it.

        A decode that fails before its answer is whole has given the client nothing: the request goes to the next one
        (`Handover.again`), if any."""
        resp, decode, sent = handover.resp, handover.decode, handover.sent
        failed: httpx.TransportError | None = None
        try:
            content = await until_disconnect(request, unless_prefill_fails(handover.computing, resp.aread()))
        except httpx.TransportError as exc:  # the decode server died while answering
            content, failed = b"", exc
        finally:
            await resp.aclose()  # also when the client left: vLLM aborts the decode request
            decode.in_flight -= 1
        if failed is not None:
            return await self._resend(self._relay_whole, request, handover, failed, timeline, begun, headers)
        if content is None:
            handover.release_prefill("its client left before the answer")
            log.info("client left during decode of %s: decode request cancelled", timeline.request_id)
            return self.metrics.answer(499, "client disconnected", headers, timeline)
        if resp.status_code >= 400:  # the decode refused it (an error answer is whole): it reads nothing
            handover.release_prefill(f"its decode answered {resp.status_code}")
        with contextlib.suppress(ValueError, ConfigError, AttributeError):  # an error answer has no params
            reported = KVTransferParams.from_dict(resp.json().get("kv_transfer_params"))
            timeline.add(reported.kvbridge_timing, PULL_REPORT)
            decode.heard(reported)
        self.metrics.finish(timeline, begun, sent, time.perf_counter())
        self.metrics.requests.labels(str(resp.status_code)).inc()
        return Response(
            content,
            status_code=resp.status_code,
            headers={**headers, HEADER: timeline.header()},
            media_type=resp.headers.get("content-type", "application/json"),
        )

    async def _relay_stream(
        self, request: Request, handover: Handover, timeline: Timeline, begun: float, headers: dict[str, str]
    ) -> Any:
        """A streamed answer: the headers go out with its first chunk, so the timeline ends there.

        A decode that fails before its first chunk has given the client nothing: the request goes to the next one
        (`Handover.again`), if any."""
        resp, decode, sent = handover.resp, handover.decode, handover.sent
        chunks = resp.aiter_raw()
        failed: httpx.TransportError | None = None
        try:
            first = await until_disconnect(request, unless_prefill_fails(handover.computing, anext(chunks, b"")))
        except httpx.TransportError as exc:  # the decode server died before its first chunk
            first, failed = None, exc
        except BaseException:
            first = None
            raise
        finally:
            if first is None:
                await resp.aclose()
                decode.in_flight -= 1
        if failed is not None:
            return await self._resend(self._relay_stream, request, handover, failed, timeline, begun, headers)
        if first is None:
            handover.release_prefill("its client left before the first token")
            log.info("client left before the first token of %s: decode request cancelled", timeline.request_id)
            return self.metrics.answer(499, "client disconnected", headers, timeline)
        self.metrics.finish(timeline, begun, sent, time.perf_counter())
        self.metrics.requests.labels(str(resp.status_code)).inc()

        async def relay() -> AsyncIterator[bytes]:
            # When the client goes away Starlette stops this generator; closing the upstream
            # response drops the connection, and vLLM aborts the decode request.
            try:
                yield first
                async for chunk in chunks:
                    yield chunk
            finally:
                await resp.aclose()
                decode.in_flight -= 1

        return StreamingResponse(
            relay(),
            status_code=resp.status_code,
            media_type=resp.headers.get("content-type", "text/event-stream"),
            headers={**headers, HEADER: timeline.header()},
        )
