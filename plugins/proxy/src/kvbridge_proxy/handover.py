"""The P/D handover: a request's prefill, then the decode that takes the KV prefill holds for it.

Pull mode: prefill first, its `kv_transfer_params` into the decode request. Layer-wise: both at once with one transfer
id. A prefill lease no decode will read is released at once (`kvbridge_proxy.release`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import httpx
from fastapi import Request
from fastapi.responses import JSONResponse

from kvbridge.base.errors import ConfigError
from kvbridge.control.params import KVTransferParams
from kvbridge.session.timeline import Timeline
from kvbridge_proxy.calls import Calls, DecodeFailed, failed_attempt
from kvbridge_proxy.layerwise import (
    PrefillFailed,
    ended_in_error,
    prefill_ended,
    refused_by_prefill,
    unless_prefill_fails,
)
from kvbridge_proxy.membership import Membership
from kvbridge_proxy.metrics import ProxyMetrics
from kvbridge_proxy.moving_stream import MovingStream
from kvbridge_proxy.release import ReleaseLease
from kvbridge_proxy.settings import ProxySettings
from kvbridge_proxy.upstreams import Background, Instance, NoInstance
from kvbridge_proxy.wire import until_disconnect

log = logging.getLogger("kvbridge_proxy.app")  # the proxy's one logger, whichever module logs (operators filter on it)


@attrs.frozen
class PullWay:
    """How a request goes the pull way: to `prefer` first, never to one of `exclude`.

    A layer-wise request goes so to a prefill whose side channel is not known yet (its answer tells the proxy), or
    away from one that failed it."""

    prefer: Instance | None = None
    exclude: tuple[Instance, ...] = ()


@attrs.frozen
class PDRequest:
    """One P/D request the proxy sends: to `path`, `body` (the decode's, once prefill answered), with `headers`.

    `client`: the client's connection, watched for it leaving (None for a part of a batch, which the batch watches, or
    a request sent again); `moving`: its stream, where it may move (`MovingStream`)."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    timeline: Timeline
    client: Request | None = None
    moving: MovingStream | None = None


@attrs.define(eq=False)
class Handover:
    """One P/D request whose decode answer is coming.

    `resp` (streamed, not read yet), the answer's headers naming the servers (with expose_internals), when the decode
    request was sent, and in layer-wise mode the prefill request (`computing`), cancelled when nobody reads its KV any
    more."""

    decode: Instance
    resp: httpx.Response
    headers: dict[str, str]
    sent: float
    computing: asyncio.Future | None = None
    # The same decode request to another decode server, once this one failed before answering anything: prefill's
    # lease still holds the KV for whichever decode asks (or, read and released already, the next one recomputes).
    again: Callable[[], Awaitable[Handover | JSONResponse]] | None = None
    # Releases the prefill's lease in the background (`release_prefill`); a failover keeps it (`again` reads it).
    unread: Callable[[str], None] | None = None

    def release_prefill(self, why: str) -> None:
        """Release the prefill's lease now: dropped before the decode answered anything (its client left), or refused.

        The decode may never have seen the request (vLLM's server drops a request cancelled before its engine took
        it, and no connector hears of it), or answered an error: nobody else would, and the lease would hold its
        blocks until it expired. A decode reading it meanwhile is fenced: the blocks go at its DONE, or when the hold
        its answer promised ends (a decode that died says no DONE)."""
        if self.unread is not None:
            self.unread(why)

    async def close(self, why: str) -> None:
        """Drop it unread: vLLM aborts the decode request (and the prefill one in layer-wise mode), the lease goes."""
        self.release_prefill(why)
        if self.computing is not None:
            self.computing.cancel()
        try:
            await self.resp.aclose()
        finally:
            self.decode.in_flight -= 1


class Handovers:
    """Hands each P/D request from a prefill server to a decode server (`open`)."""

    def __init__(
        self,
        settings: ProxySettings,
        client: httpx.AsyncClient,
        membership: Membership,
        metrics: ProxyMetrics,
        background: Background,
        release_lease: ReleaseLease,
    ) -> None:
        self.calls = Calls(client, membership, metrics)
        self.membership = membership
        self.metrics = metrics
        self.background = background
        self.expose = settings.expose_internals
        self.transfer = settings.transfer
        # To release a prefill's lease at once when no decode took the request (else it waits lease_s).
        self.release_lease = release_lease

    def _names(self, *servers: Instance) -> dict[str, str]:
        """The headers naming the servers of an answer (`x-kvbridge-prefill`, `-decode`), with expose_internals.

        Without expose_internals there are none."""
        return {f"x-kvbridge-{i.role}": i.url for i in servers} if self.expose else {}

    def _again(
        self, pd: PDRequest, prefill: Instance, tried: list[Instance], unread: Callable[[str], None]
    ) -> Callable[[], Awaitable[Handover]]:
        """`Handover.again`: the decode request `pd` to a decode not in `tried` (the one just failed is added).

        The same decode request reads the same lease: `unread` releases it."""

        async def again() -> Handover:
            decode, resp, sent = await self._send_decode(pd, tried)
            names = self._names(prefill, decode)
            return Handover(
                decode, resp, names, sent, again=self._again(pd, prefill, [*tried, decode], unread), unread=unread
            )

        return again

    def _send_decode(self, pd: PDRequest, tried: list[Instance]) -> Awaitable[tuple[Instance, httpx.Response, float]]:
        return self.calls.send_decode(pd.path, pd.body, pd.headers, pd.moving, tried, pd.timeline)

    async def hand_on(
        self, handover: Handover, error: str, timeline: Timeline, *, prefill_failed: bool = False
    ) -> Handover | JSONResponse | str:
        """The request sent again (layer-wise: the pull way), its decode or prefill having failed; else the 503's text.

        A layer-wise prefill's 4xx is the answer itself (`refused_by_prefill`): nothing is sent again.

        The 503 where there is no `Handover.again` or no other decode took it; the failed attempt's time, from its
        decode request's send on, is the timeline's `decode_failed_ms` (summed over failovers)."""
        request_id = timeline.request_id
        failed_attempt(timeline, handover.sent)
        refused = refused_by_prefill(handover.computing) if prefill_failed else None
        if refused is not None:
            return self.metrics.passed_on(refused, timeline)
        if not prefill_failed:  # (where only its prefill failed, the decode was dropped, not at fault)
            handover.decode.healthy = False
        if handover.again is None:
            handover.release_prefill("its decode failed")
            return error
        try:
            resent = await handover.again()
        except (NoInstance, DecodeFailed) as exc:
            handover.release_prefill("no other decode took it")
            log.warning("request %s: no other decode server took it: %s", request_id, exc)
            return f"{error}; no other decode server took it ({exc})"
        self.metrics.failovers.labels("prefill" if prefill_failed else "decode").inc()
        if isinstance(resent, Handover):
            log.warning("request %s sent again, to decode server %s", request_id, resent.decode.url)
        return resent

    # -- handlers ------------------------------------------------------------------------------

    async def open(
        self,
        path: str,
        request: Request | None,
        body: dict[str, Any],
        timeline: Timeline,
        moving: MovingStream | None = None,
    ) -> Handover | JSONResponse:
        """One P/D request, up to the decode's answer coming (a Handover), or the error answer to give."""
        # Leases are keyed on this id (prefill's vLLM request id): never on a client's, which two may share.
        headers = {"X-Request-Id": f"kvbridge-{uuid.uuid4().hex}"}
        log.info("request %s: P/D request %s", timeline.request_id, headers["X-Request-Id"])  # the servers log this
        decodes = self.membership.pools["decode"]
        if not await self.membership.revive(decodes):  # else prefill would hold KV no decode reads until its lease ends
            return self.metrics.answer(503, str(NoInstance.among(decodes)), None, timeline)
        pd = PDRequest(path, body, headers, timeline, request, moving)
        way = PullWay()
        if self.transfer == "layerwise":
            streamed = await self._handover_layerwise(pd)
            if not isinstance(streamed, PullWay):
                return streamed
            way = streamed
        return await self.pull_way(pd, way)

    async def pull_way(self, pd: PDRequest, way: PullWay = PullWay()) -> Handover | JSONResponse:
        """The request's prefill (as `way` says), then its decode with the KV prefill holds for it."""
        timeline = pd.timeline
        prefilled = await self._prefill(pd, way)
        if isinstance(prefilled, JSONResponse):
            return prefilled
        prefill, first, params = prefilled
        prefill_done = time.perf_counter()
        self.membership.learn(prefill.url, params)
        timeline.add(params.kvbridge_timing, ("prefill_ms",))
        decode_body = dict(pd.body)
        if first.get("kv_transfer_params"):
            decode_body["kv_transfer_params"] = attrs.evolve(params, kvbridge_timing=None).to_dict()
        else:
            log.warning(
                "prefill answer for %s carries no kv_transfer_params; decode recomputes the prompt", timeline.request_id
            )
        timeline.phases["proxy_ms"] = (time.perf_counter() - prefill_done) * 1e3
        tried: list[Instance] = []

        def unread(why: str) -> None:  # the lease prefill answered it holds
            self.background.spawn(self.release_lease(params, why))

        try:
            # (a decode answers a request that is not streamed only once it is whole: the client may leave before)
            decoding = attrs.evolve(pd, body=decode_body, client=None)
            started = await until_disconnect(pd.client, self._send_decode(decoding, tried))
        except NoInstance as exc:
            unread(f"no decode took it: {exc}")
            return self.metrics.answer(503, str(exc), self._names(prefill), timeline)
        except DecodeFailed as exc:
            unread(f"no decode took it: {exc}")
            return self.metrics.answer(503, str(exc), self._names(prefill, exc.inst), timeline)
        except asyncio.CancelledError:  # a part of a batch whose client left
            unread("cancelled before the decode answered")
            raise
        if started is None:
            unread("its client left before the decode answered")
            log.info("client left before decode answered %s: decode request cancelled", timeline.request_id)
            return self.metrics.answer(499, "client disconnected", self._names(prefill), timeline)
        decode, resp, sent = started
        again = self._again(decoding, prefill, [*tried, decode], unread)
        return Handover(decode, resp, self._names(prefill, decode), sent, again=again, unread=unread)

    async def _prefill(
        self, pd: PDRequest, way: PullWay
    ) -> tuple[Instance, dict[str, Any], KVTransferParams] | JSONResponse:
        """The pull way's prefill: the server, its answer and the params in it; or the error answer to give."""
        timeline = pd.timeline
        # The prefill's lease is keyed on this id too, so a lease whose answer never came back can still be released.
        to_prefill = KVTransferParams(do_remote_decode=True, transfer_id=uuid.uuid4().hex)
        sent_to: list[Instance] = []

        def unread(why: str) -> None:  # it may have finished, its answer on the way: nobody will read its KV
            if sent_to:
                self.background.spawn(self._release_unread(sent_to[-1], to_prefill, why))

        try:
            sending = self.calls.call_prefill(
                pd.path,
                pd.body,
                pd.headers,
                to_prefill,
                timeline=timeline,
                tried=sent_to,
                exclude=way.exclude,
                prefer=way.prefer,
            )
            answer = await until_disconnect(pd.client, sending)
            if answer is None:
                log.info("client left during prefill of %s: prefill request cancelled", timeline.request_id)
                unread("client left during prefill")
                return self.metrics.answer(499, "client disconnected", None, timeline)
            prefill, first = answer
            return prefill, first, KVTransferParams.from_dict(first.get("kv_transfer_params"))
        except NoInstance as exc:
            return self.metrics.answer(503, str(exc), None, timeline)
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code < 500:  # the request's own fault: vLLM's answer, as the server gave it
                return self.metrics.passed_on(exc.response, timeline)
            return self.metrics.answer(exc.response.status_code, f"prefill failed: {exc.response.text}", None, timeline)
        except ConfigError as exc:
            return self.metrics.answer(
                502, f"prefill server answered unusable kv_transfer_params: {exc}", None, timeline
            )
        except asyncio.CancelledError:  # a part of a batch whose client left
            unread("cancelled during prefill")
            raise

    def _unread(self, prefill: Instance, sent: KVTransferParams) -> Callable[[str], None]:
        """`Handover.unread`: what `prefill` holds under `sent.transfer_id` released in the background."""
        return lambda why: self.background.spawn(self._release_unread(prefill, sent, why))

    async def _release_unread(self, prefill: Instance, sent: KVTransferParams, why: str) -> None:
        """Release the lease `prefill` may hold under `sent.transfer_id` (an Abort before its offer is kept).

        On every DP rank of the engine (the proxy does not know which took it). Where the prefill's side channel is not
        known yet (its first request), its lease ends by itself."""
        contact = self.membership.side_channels.get(prefill.url)
        if contact is None:
            log.info("prefill %s not known yet: request %s's lease ends by itself", prefill.url, sent.transfer_id)
            return
        for dp_rank in range(contact.dp_size):
            await self.release_lease(attrs.evolve(contact, remote_request_id=sent.transfer_id, dp_rank=dp_rank), why)

    async def _handover_layerwise(self, pd: PDRequest) -> Handover | JSONResponse | PullWay:
        """Send the request to a prefill and a decode server at once, with one transfer id.

        Decode reads each layer while prefill computes the next. Else the way to send it the pull way: to this prefill,
        whose side channel is not known yet (its answer tells the proxy where it is), or to another, as this one failed
        before the decode answered (the decode request is dropped)."""
        timeline = pd.timeline
        try:
            prefill = await self.membership.pick("prefill")
        except NoInstance as exc:
            return self.metrics.answer(503, str(exc), None, timeline)
        identity = self.membership.identity(prefill.url)
        if identity is None:
            return PullWay(prefer=prefill)
        transfer_id = uuid.uuid4().hex  # unique even when clients reuse their x-request-id
        mode = {"transfer_mode": "layerwise", "transfer_id": transfer_id}
        to_prefill = KVTransferParams(do_remote_decode=True, **mode)
        to_decode = attrs.evolve(identity, do_remote_prefill=True, remote_request_id=transfer_id, **mode)
        computing = asyncio.ensure_future(self.calls.call_prefill(pd.path, pd.body, pd.headers, to_prefill, prefill))
        computing.add_done_callback(lambda task: prefill_ended(task, prefill, timeline, self.membership))
        decoding = attrs.evolve(pd, body={**pd.body, "kv_transfer_params": to_decode.to_dict()}, client=None)
        unread = self._unread(prefill, to_prefill)  # (a prefill request that ended before it was cancelled: its lease)
        try:
            started = await until_disconnect(
                pd.client, unless_prefill_fails(computing, self._send_decode(decoding, []))
            )
        except PrefillFailed as exc:
            refused = refused_by_prefill(computing)
            if refused is not None:
                return self.metrics.passed_on(refused, timeline)
            log.info("request %s: prefill %s failed (%s): the pull way", timeline.request_id, prefill.url, exc)
            return PullWay(exclude=(prefill,))
        except (NoInstance, DecodeFailed) as exc:
            computing.cancel()  # nobody reads it: vLLM aborts the prefill request, its lease is aborted
            unread("no decode took it")
            names = self._names(prefill, exc.inst) if isinstance(exc, DecodeFailed) else self._names(prefill)
            return self.metrics.answer(503, str(exc), names, timeline)
        except BaseException:
            computing.cancel()
            unread("cancelled before decode took it")
            raise
        if started is None:
            computing.cancel()
            unread("client left before decode took it")
            log.info("client left before decode took %s: both requests cancelled", timeline.request_id)
            return self.metrics.answer(499, "client disconnected", None, timeline)
        decode, resp, sent = started

        async def pull_way() -> Handover | JSONResponse:  # `Handover.again`: its decode or its prefill failed first
            prefill_failed = ended_in_error(computing)
            if not prefill_failed:  # its decode failed: nobody reads what this prefill computes (a new id goes now)
                computing.cancel()
                unread("its decode failed: sent the pull way")
            way = PullWay(exclude=(prefill,) if prefill_failed else ())
            return await self.pull_way(attrs.evolve(pd, client=None), way)

        return Handover(decode, resp, self._names(prefill, decode), sent, computing, again=pull_way, unread=unread)
