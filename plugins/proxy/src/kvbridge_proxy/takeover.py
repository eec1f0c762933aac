"""The next decode's side of a live move: a movable stream's upstream, and the requests that take the stream over.

A move's requests go to the one decode that holds (or will hold) the stream's KV: its pull (`Takeover.pull`) and then
the stream's continuation (`Takeover.resume`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import Any

import attrs
import httpx

from kvbridge.base.errors import ConfigError, described
from kvbridge.control.params import KVTransferParams
from kvbridge_proxy.handover import Handovers
from kvbridge_proxy.membership import Membership
from kvbridge_proxy.moving_stream import MovingStream, pull_outcome
from kvbridge_proxy.upstreams import DROPPED, Background, Instance

log = logging.getLogger("kvbridge_proxy.app")  # the proxy's one logger, whichever module logs (operators filter on it)

MOVE_CONNECT_TRIES = 2  # a move's requests go to the one decode that holds its KV: a busy one is asked again


@attrs.define(eq=False)
class Upstream:
    """A decode's streamed answer read event by event on a task of its own, for a stream that may move.

    `next()` gives ("event", dict), ("done", None), ("failed", the error) or, when the stream was asked to move,
    ("cut", why). `marked`: the request carried the stream's move id (the decode offers its blocks when cut)."""

    decode: Instance
    resp: httpx.Response
    moving: MovingStream
    marked: bool
    queue: asyncio.Queue = attrs.Factory(asyncio.Queue)
    pump: asyncio.Task | None = None
    ending: bool = False  # it sent its last token (a finish reason, or [DONE]): nothing left to move
    _closed: bool = False

    @classmethod
    def open(cls, decode: Instance, resp: httpx.Response, moving: MovingStream, *, marked: bool) -> Upstream:
        """Start reading; the caller already counted the request in `decode.in_flight`."""
        up = cls(decode, resp, moving, marked)
        up.pump = asyncio.ensure_future(up._read())
        decode.streams.add(moving)
        return up

    async def _read(self) -> None:
        try:
            async for line in self.resp.aiter_lines():
                data = line[len("data:") :].strip() if line.startswith("data:") else ""
                if data == "[DONE]":
                    self.ending = True
                    self.queue.put_nowait(("done", None))
                    return
                if data:
                    event = json.loads(data)
                    if not isinstance(event, dict):
                        raise ValueError("an event that is not a JSON object")
                    choices = event.get("choices")
                    if isinstance(choices, list) and any(
                        isinstance(c, dict) and c.get("finish_reason") for c in choices
                    ):
                        self.ending = True
                    self.queue.put_nowait(("event", event))
            self.queue.put_nowait(("failed", httpx.RemoteProtocolError("the stream ended without [DONE]")))
        except (httpx.TransportError, ValueError) as exc:
            self.queue.put_nowait(("failed", exc))

    def push_back(self, item: tuple[str, Any]) -> None:
        """Put an item read ahead first again (the queue holds nothing else yet: the caller read the only one)."""
        rest = [self.queue.get_nowait() for _ in range(self.queue.qsize())]
        for x in [item, *rest]:
            self.queue.put_nowait(x)

    async def next(self) -> tuple[str, Any]:
        """The next event, or a cut once asked for (between two events, never before the prompt's ids are known)."""
        moving = self.moving
        # A decode that already finished the request (it sent its finish reason) offers nothing to pull, and nothing
        # is left to generate: the stream ends as it is, cut asked for or not (a cut then would ask the next decode
        # for one token more than the client asked for).
        if not (moving.movable and moving.prompt is not None) or self.ending or moving.spent:
            return await self.queue.get()
        # A cut goes before what is queued (a decode faster than its client is cut all the same).
        if moving.cut_requested:
            return ("cut", moving.cut_reason)
        if not self.queue.empty():
            return self.queue.get_nowait()
        get = asyncio.ensure_future(self.queue.get())
        cut = asyncio.ensure_future(moving.wait_cut())
        try:
            await asyncio.wait({get, cut}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cut.cancel()
            if not get.done() and not cut.done():  # cancelled itself (the client left)
                get.cancel()
        if get.done():
            return get.result()
        if self.ending:  # the finish reason came in while the cut was asked for: it wins, as above
            return await get
        get.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await get
        return ("cut", moving.cut_reason)

    async def close(self) -> None:
        """Drop the decode's answer (vLLM aborts the request); idempotent."""
        if self._closed:
            return
        self._closed = True
        self.decode.streams.discard(self.moving)
        if self.pump is not None:
            self.pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.pump
        try:
            await self.resp.aclose()
        finally:
            self.decode.in_flight -= 1


class Takeover:
    """The requests of a move to the decode that takes a stream over, and the release of what a move leaves behind."""

    def __init__(
        self, client: httpx.AsyncClient, membership: Membership, handovers: Handovers, background: Background
    ) -> None:
        self.client = client
        self.membership = membership
        self.handovers = handovers
        self.background = background

    async def leave(self, up: Upstream, moving: MovingStream, why: str) -> None:
        """Close the stream's upstream and release the blocks its decode offers for a move that will not come."""
        await up.close()
        if up.marked and up.decode.identity is not None:
            params = attrs.evolve(up.decode.identity, remote_request_id=moving.move_id)
            await self.handovers.release_lease(params, why)

    async def send_moved(
        self, target: Instance, body: dict[str, Any], headers: dict[str, str], *, stream: bool, what: str
    ) -> httpx.Response | None:
        """POST a move's request to `target`: its response, or None (logged) when it failed.

        Only `target` holds the stream's KV, so a request it may never have seen is asked once more: a connect timeout
        (a busy server, as in `send_decode`: not taken out) and a connection that dropped before any answer (a kept-
        alive connection the server closed as it was reused; a request it had begun was aborted with it). What fails
        again, or fails any other way, takes it out."""
        request = self.client.build_request("POST", f"{target.url}/v1/completions", json=body, headers=headers)
        for attempt in range(MOVE_CONNECT_TRIES):
            again = attempt + 1 < MOVE_CONNECT_TRIES
            try:
                return await self.client.send(request, stream=stream)
            except httpx.ConnectTimeout:
                log.warning(
                    "decode server %s did not accept the connection for %s in time (busy?)%s",
                    target.url,
                    what,
                    ": once more" if again else "",
                )
            except DROPPED as exc:
                if not again:
                    self.membership.take_out(target, f"failed {what} ({described(exc)})")
                    return None
                log.warning("decode server %s dropped %s (%s): once more", target.url, what, type(exc).__name__)
            except httpx.TransportError as exc:
                self.membership.take_out(target, f"failed {what} ({described(exc)})")
                return None
        return None

    async def pull(
        self,
        moving: MovingStream,
        target: Instance,
        source: KVTransferParams,
        *,
        lease: str | None = None,
        tokens: int | None = None,
    ) -> str | None:
        """Have `target` pull the stream's KV from `source` (the decode it left): what its connector reports happened.

        vLLM puts no `kv_transfer_params` in a stream, so the pull is a one-token request answered whole, whose params
        carry the target's report of its pull (`kvbridge_timing`, its pull states); the stream then goes on from the
        target's prefix cache. "pulled", "recomputed" (the pull failed and the target computed the KV itself: vLLM's
        `kv_load_failure_policy="recompute"`), or None when the target refused or failed the request (policy "fail").
        `lease` and `tokens`: a pre-copy stage's lease and the context it reads (MovingStream.pull_body); such a stage
        that read nothing, as the target held all but what it computed of that context, is "held"."""
        body = moving.pull_body(source, lease=lease, tokens=tokens)
        headers = {"X-Request-Id": f"kvbridge-{uuid.uuid4().hex}"}
        what = "pulling a moved stream" if lease is None else "pre-copying a stream"
        target.in_flight += 1
        try:
            resp = await self.send_moved(target, body, headers, stream=False, what=what)
            if resp is None:
                return None
        except BaseException:  # the client left: the target offers the aborted request's blocks under the move id
            if target.identity is not None and lease is None:
                lease_of = attrs.evolve(target.identity, remote_request_id=moving.move_id)
                self.background.spawn(self.handovers.release_lease(lease_of, "its client left"))
            raise
        finally:
            target.in_flight -= 1
        try:
            answer = resp.json()
            params = KVTransferParams.from_dict(answer.get("kv_transfer_params"))
            timing = params.kvbridge_timing or {}
            ok = resp.status_code == 200 and "error" not in answer and isinstance(timing, dict)
        except (ValueError, AttributeError, ConfigError):
            ok = False
        if not ok:
            log.warning(
                "decode %s failed pulling moved stream %s: %d %s",
                target.url,
                moving.move_id,
                resp.status_code,
                resp.text[:300],
            )
            return None
        target.heard(params)
        outcome = pull_outcome(timing)
        states = {k: v for k, v in timing.items() if k.startswith("at_")}
        if lease is not None and not states:
            # a stage that found nothing new to read (the reader held or computed it): it covered its context still
            log.info("stream %s: %s held what pre-copy stage %s would read", moving.move_id, target.url, lease)
            return "held"
        if outcome != "pulled":
            log.warning(
                "stream %s: %s did not pull it from %s, it computed it (its pull: %s)",
                moving.move_id,
                target.url,
                source.remote_engine_id,
                states or "not reported",
            )
        return outcome

    async def resume(self, moving: MovingStream, target: Instance) -> Upstream | None:
        """Send the continuation to `target`; its upstream once its first event came, or None (logged).

        The target computes what its cache lacks: nothing but the last token after a pull (`pull`)."""
        body = moving.resume_body(None, mark=target.identity is not None)
        headers = {"X-Request-Id": f"kvbridge-{uuid.uuid4().hex}"}
        target.in_flight += 1
        sent = time.perf_counter()
        try:
            resp = await self.send_moved(target, body, headers, stream=True, what="taking a moved stream")
            if resp is None:
                target.in_flight -= 1
                return None
            if resp.status_code != 200:
                text = (await resp.aread())[:300]
                await resp.aclose()
        except httpx.TransportError as exc:  # reading a refusal's body
            target.in_flight -= 1
            self.membership.take_out(target, f"failed taking a moved stream ({described(exc)})")
            return None
        except BaseException:
            target.in_flight -= 1
            raise
        if resp.status_code != 200:
            target.in_flight -= 1
            log.warning("decode %s refused moved stream %s: %d %s", target.url, moving.move_id, resp.status_code, text)
            return None
        answered = time.perf_counter()
        moved = Upstream.open(target, resp, moving, marked="kv_transfer_params" in body)
        try:
            first = await moved.queue.get()  # not next(): the cut that brought it here is still set
        except BaseException:  # the client left while the next decode was starting
            self.background.spawn(self.leave(moved, moving, "its client left"))
            raise
        log.info(
            "stream %s: %s answered %s in %.1f ms, its first event came %.1f ms later",
            moving.move_id,
            target.url,
            headers["X-Request-Id"],
            (answered - sent) * 1e3,
            (time.perf_counter() - answered) * 1e3,
        )
        if first[0] != "event" or "error" in first[1]:
            await moved.close()
            log.warning("decode server %s failed moved stream %s: %s", target.url, moving.move_id, first[1])
            return None
        moved.push_back(first)
        return moved
