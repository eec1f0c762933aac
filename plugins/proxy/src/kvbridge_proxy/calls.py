"""The proxy's requests to prefill and decode servers, each tried on the next server when one fails.

Every upstream body is counted against its client request's budget (`limits.BUDGET`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import httpx

from kvbridge.base.errors import described
from kvbridge.control.params import KVTransferParams
from kvbridge.session.timeline import FAILOVER_PHASE, Timeline
from kvbridge_proxy.limits import BUDGET, encoded
from kvbridge_proxy.membership import Membership
from kvbridge_proxy.metrics import ProxyMetrics, connect_timing
from kvbridge_proxy.moving_stream import MovingStream
from kvbridge_proxy.upstreams import Instance, NoInstance
from kvbridge_proxy.wire import prefill_body

log = logging.getLogger("kvbridge_proxy.app")  # the proxy's one logger, whichever module logs (operators filter on it)


class OverBudget(NoInstance):
    """Sending the next upstream request would pass the client request's `max_upstream_bytes` (retries did)."""


def _charge(content: bytes) -> None:
    """Count an upstream body against the client request's budget (`limits.BUDGET`); OverBudget past it."""
    budget = BUDGET.get()
    over = None if budget is None else budget.charge(len(content))
    if over is not None:
        raise OverBudget(over)


class DecodeFailed(Exception):
    """The decode server took the request and then failed before answering (it died, say)."""

    def __init__(self, inst: Instance, cause: httpx.TransportError) -> None:
        super().__init__(inst.failed(cause))
        self.inst = inst


class Calls:
    """POSTs a request to a prefill server (`call_prefill`) or starts one on a decode server (`send_decode`)."""

    def __init__(self, client: httpx.AsyncClient, membership: Membership, metrics: ProxyMetrics) -> None:
        self.client = client
        self.membership = membership
        self.metrics = metrics

    async def call_prefill(
        self,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        params: KVTransferParams | None = None,
        instance: Instance | None = None,
        timeline: Timeline | None = None,
        tried: list[Instance] | None = None,
        exclude: Sequence[Instance] = (),
        prefer: Instance | None = None,
    ) -> tuple[Instance, dict[str, Any]]:
        """POST to a prefill server (`instance`, or round robin), trying the next one when one fails.

        `tried`: each server sent the request is appended to it as it is sent. `exclude`: servers that already failed
        this request (a layer-wise prefill), not sent it again; `prefer`: the server tried first where it serves.

        On a connection failure the server is taken out and the next one tried; on a server error (5xx) the
        next one is tried, and that server is not sent this request again. Not with `instance`: a layer-wise decode
        already reads from that one. A 5xx is what a vLLM server answers once it began shutting down (SIGTERM),
        before the proxy's next registry read says it is draining: no KV is held for it.
        """
        pool = self.membership.pools["prefill"]
        failed: httpx.Response | None = None
        # Not asked again for this request: round robin is shared with every other request in flight, so without
        # this a retry could land on the same shutting-down server until the attempts ran out (a chaos run's 500).
        refused: list[Instance] = list(exclude)
        for attempt in range(1 if instance is not None else len(pool.instances) + 1):
            if attempt and not any(i.healthy for i in pool.instances) and not await self.membership.revive(pool):
                break
            try:
                if prefer is not None and prefer.serving and prefer not in refused:
                    inst, prefer = prefer, None
                else:
                    inst = instance or await self.membership.pick("prefill", exclude=refused)
            except NoInstance:
                if failed is None:
                    raise
                break  # every serving prefill answered a server error: the client gets the last one
            content = encoded(prefill_body(body, params))
            _charge(content)
            inst.in_flight += 1
            if tried is not None:
                tried.append(inst)
            try:
                resp = await self.client.post(
                    f"{inst.url}{path}",
                    content=content,
                    headers={**headers, "content-type": "application/json"},
                    extensions=connect_timing(timeline, "prefill"),
                )
            except httpx.ConnectTimeout:
                log.warning("prefill server %s did not accept the connection in time (busy?): next", inst.url)
                continue
            except httpx.TransportError as exc:
                self.membership.take_out(inst, f"failed ({described(exc)})")
                continue
            finally:
                inst.in_flight -= 1
            if resp.status_code >= 500 and instance is None:
                log.warning("prefill server %s answered %d (shutting down?): next", inst.url, resp.status_code)
                self.metrics.failovers.labels(inst.role).inc()
                failed = resp
                refused.append(inst)
                continue
            resp.raise_for_status()
            return inst, resp.json()
        if failed is not None:
            failed.raise_for_status()
        raise NoInstance(f"no prefill server answered for {path}")

    async def send_decode(
        self,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        moving: MovingStream | None = None,
        tried: list[Instance] | None = None,
        timeline: Timeline | None = None,
    ) -> tuple[Instance, httpx.Response, float]:
        """Start the decode request (streamed): the decode, its answer, when the request to it began (perf_counter).

        A decode server that refuses the connection never saw the request, and prefill still holds the KV for whichever
        decode asks, so try the next one. So does one that answers a server error (5xx) at once: what a vLLM server
        answers once it began shutting down, before the proxy's next registry read says it is draining; the last such
        answer is returned when no other decode is left. And so does one that took the request and failed before
        answering (it died): DecodeFailed only when no other decode is left. A `moving` stream is marked for the decode
        picked (`MovingStream.mark`). `tried`: decodes that failed this request already (added to). Each failed
        attempt's time goes to the timeline's `decode_failed_ms`. The caller decrements the instance's in_flight."""
        pool = self.membership.pools["decode"]
        late: list[str] = []
        refused: list[Instance] = [] if tried is None else tried  # not tried again for this request
        dropped: DecodeFailed | None = None
        # One more try than instances: a busy server that was slow to accept gets a second chance.
        for attempt in range(len(pool.instances) + 1):
            if attempt and not any(i.healthy for i in pool.instances) and not await self.membership.revive(pool):
                break
            try:
                inst = await self.membership.pick("decode", exclude=refused)
            except NoInstance:
                if refused:
                    break
                raise
            upstream = self._decode_request(inst, path, body, headers, moving, timeline)
            inst.in_flight += 1
            began = time.perf_counter()
            try:
                resp = await self.client.send(upstream, stream=True)
                # a last server error is the answer only where none other serves, those taken out probed first
                if resp.status_code < 500 or not await self.membership.revive(pool, exclude=[*refused, inst]):
                    return inst, resp, began
                failed_attempt(timeline, began)
                await resp.aclose()
                inst.in_flight -= 1
                refused.append(inst)
                self.metrics.failovers.labels(inst.role).inc()
                log.warning("decode server %s answered %d (shutting down?): next", inst.url, resp.status_code)
            except httpx.ConnectError as exc:
                inst.in_flight -= 1
                failed_attempt(timeline, began)
                self.membership.take_out(inst, f"refused the connection ({described(exc)})")
            except httpx.ConnectTimeout:
                # Not down: its accept queue is full or this box is starved. It never saw the request;
                # the health probe decides whether it is gone.
                inst.in_flight -= 1
                failed_attempt(timeline, began)
                late.append(inst.label)
                log.warning("decode server %s did not accept the connection in time (busy?): next", inst.url)
            except httpx.TransportError as exc:
                inst.in_flight -= 1
                failed_attempt(timeline, began)
                # (the request named: a report ties the time it lost here to this decode)
                self.membership.take_out(inst, f"failed after taking request {timeline.request_id} ({described(exc)})")
                refused.append(inst)
                self.metrics.failovers.labels(inst.role).inc()
                dropped = DecodeFailed(inst, exc)
            except BaseException:  # cancelled (the client left, or another part of its batch failed)
                inst.in_flight -= 1
                raise
        if dropped is not None:
            raise dropped
        slow = f" ({', '.join(late)} did not accept the connection in time)" if late else ""
        raise NoInstance(f"no decode server accepted {path}{slow}")

    def _decode_request(
        self,
        inst: Instance,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        moving: MovingStream | None,
        timeline: Timeline | None,
    ) -> httpx.Request:
        """The decode request to `inst`, its body counted against the client request's budget."""
        content = encoded(body if moving is None else moving.mark(body, inst.identity))
        _charge(content)
        return self.client.build_request(
            "POST",
            f"{inst.url}{path}",
            content=content,
            headers={**headers, "content-type": "application/json"},
            extensions=connect_timing(timeline, "decode"),
        )


def failed_attempt(timeline: Timeline | None, began: float) -> None:
    """A decode attempt that began at `began` failed: its time, to now, goes to the timeline's `decode_failed_ms`.

    Its connect, if it made one, is part of that time, not the decode's."""
    if timeline is not None:
        timeline.phases.pop("decode_connect_ms", None)
        lost = (time.perf_counter() - began) * 1e3
        timeline.phases[FAILOVER_PHASE] = timeline.phases.get(FAILOVER_PHASE, 0.0) + lost
