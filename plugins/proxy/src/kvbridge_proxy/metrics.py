"""The proxy's Prometheus series (docs/operations.md), and the two ends of a request that count in them."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import httpx
import prometheus_client as prom
from fastapi.responses import JSONResponse

from kvbridge.session.timeline import HEADER, Timeline
from kvbridge_proxy.upstreams import Instance, Pool
from kvbridge_proxy.wire import error_answer, error_body

log = logging.getLogger("kvbridge_proxy.app")  # the proxy's one logger, whichever module logs (operators filter on it)

PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ProxyMetrics:
    """The proxy's Prometheus series, in a registry of its own (one per app)."""

    def __init__(self) -> None:
        self.registry = prom.CollectorRegistry()
        self.phase = prom.Histogram(
            "kvbridge_proxy_phase_seconds",
            "Requests' timeline phases, the KV handover (the decode's pull phases "
            "together) and the total (docs/operations.md).",
            ["phase"],
            buckets=PHASE_BUCKETS,
            registry=self.registry,
        )
        self.requests = prom.Counter(
            "kvbridge_proxy_requests_total", "Requests answered, by HTTP status code.", ["code"], registry=self.registry
        )
        self.failovers = prom.Counter(
            "kvbridge_proxy_failovers_total",
            "Upstreams left for the next one: refused or dropped the connection, or died before answering anything.",
            ["role"],
            registry=self.registry,
        )
        self.healthy = prom.Gauge(
            "kvbridge_proxy_upstream_healthy",
            "1 while the upstream is in rotation.",
            ["role", "upstream"],
            registry=self.registry,
        )
        self.in_flight = prom.Gauge(
            "kvbridge_proxy_upstream_in_flight",
            "Requests sent to the upstream, not yet answered.",
            ["role", "upstream"],
            registry=self.registry,
        )
        self.live_moves = prom.Counter(
            "kvbridge_proxy_live_moves_total",
            "Streams moved to another decode (--live-moves), by outcome: precopied (the next decode read most of the "
            "KV before the cut, the rest after), pulled (it read the KV after the cut), "
            "recomputed (it computed the prompt and the tokens so far), failed (the stream ended with an error).",
            ["outcome"],
            registry=self.registry,
        )
        self.precopy_stages = prom.Counter(
            "kvbridge_proxy_precopy_stages_total",
            "Pre-copy stages of moving streams whose blocks the next decode pulled before the cut.",
            registry=self.registry,
        )
        self.handover_gap = prom.Histogram(
            "kvbridge_proxy_live_move_gap_seconds",
            "From the cut of a moved stream to the next decode's first event.",
            buckets=PHASE_BUCKETS,
            registry=self.registry,
        )
        for outcome in ("precopied", "pulled", "recomputed", "failed"):
            self.live_moves.labels(outcome)

    def watch(self, pools: dict[str, Pool]) -> None:
        """Series of the pools' upstreams from the start."""
        for inst in (i for p in pools.values() for i in p.instances):
            self.track(inst)
        for role in pools:
            self.failovers.labels(role)

    def track(self, inst: Instance) -> None:
        """Series of a new upstream, read at scrape time: the instances are the truth."""
        self.healthy.labels(inst.role, inst.label).set_function(lambda: float(inst.serving))
        self.in_flight.labels(inst.role, inst.label).set_function(lambda: float(inst.in_flight))

    def forget(self, inst: Instance) -> None:
        """An upstream that left: its series go."""
        for gauge in (self.healthy, self.in_flight):
            with contextlib.suppress(KeyError):
                gauge.remove(inst.role, inst.label)

    def observe(self, timeline: Timeline) -> None:
        for name, ms in timeline.phases.items():
            self.phase.labels(name.removesuffix("_ms")).observe(ms / 1e3)
        handover = timeline.handover_ms()
        if handover is not None:  # the KV handover: the decode's whole pull
            self.phase.labels("handover").observe(handover / 1e3)
        self.phase.labels("total").observe(timeline.total_ms / 1e3)

    def answer(
        self, code: int, error: str, headers: dict[str, str] | None = None, timeline: Timeline | None = None
    ) -> JSONResponse:
        """An error answer; with the request's timeline, it carries the phases known so far (and logs them)."""
        self.requests.labels(str(code)).inc()
        headers = dict(headers or {})
        if timeline is not None:
            timeline.total_ms = (time.perf_counter() - timeline.begun) * 1e3
            headers[HEADER] = timeline.header()
            log.info("kvbridge-timing %s (answered %d)", timeline.header(), code)
        return error_answer(error, code, headers)

    def passed_on(self, resp: httpx.Response, timeline: Timeline) -> JSONResponse:
        """A server's error answer to the client as the server gave it (a 4xx: what the request itself got wrong)."""
        self.requests.labels(str(resp.status_code)).inc()
        timeline.total_ms = (time.perf_counter() - timeline.begun) * 1e3
        log.info("kvbridge-timing %s (answered %d by a server)", timeline.header(), resp.status_code)
        try:
            body = resp.json()  # vLLM's error object
        except ValueError:
            body = error_body(resp.text, resp.status_code)
        return JSONResponse(body, status_code=resp.status_code, headers={HEADER: timeline.header()})

    def finish(self, timeline: Timeline, begun: float, sent: float, first_byte: float) -> None:
        """Close the timeline at the first byte of the decode's answer."""
        decode_ms = (first_byte - sent) * 1e3 - timeline.phases.get("decode_connect_ms", 0.0)
        timeline.phases["decode_first_token_ms"] = max(0.0, decode_ms - (timeline.handover_ms() or 0.0))
        timeline.total_ms = (first_byte - begun) * 1e3
        self.observe(timeline)
        log.info("kvbridge-timing %s", timeline.header())


def connect_timing(timeline: Timeline | None, role: str) -> dict[str, Any]:
    """httpx `extensions` for an upstream request that time its TCP connect into `timeline` as `<role>_connect_ms`.

    A kept-alive connection has none, and the phase is dropped: it is the connect of the connection this request
    went on. On a lossy link a lost SYN costs the kernel's initial retransmission timeout, a whole second."""
    if timeline is None:
        return {}
    phase = f"{role}_connect_ms"
    timeline.phases.pop(phase, None)
    started: list[float] = []

    async def trace(event: str, _info: dict[str, Any]) -> None:
        if event == "connection.connect_tcp.started":
            started.append(time.perf_counter())
        elif event in ("connection.connect_tcp.complete", "connection.connect_tcp.failed") and started:
            timeline.phases[phase] = (time.perf_counter() - started[-1]) * 1e3

    return {"trace": trace}
