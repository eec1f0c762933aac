"""The proxy's own routes: `/v1/models`, `/health`, `/instances`, `/metrics` and the operator's `/admin` calls."""

from __future__ import annotations

import hmac
import logging
from typing import Any

import httpx
import prometheus_client as prom
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvbridge.base.secret import admin_token
from kvbridge_proxy.membership import PROBE_TIMEOUT_S, Membership
from kvbridge_proxy.metrics import ProxyMetrics
from kvbridge_proxy.moving_stream import MOVES
from kvbridge_proxy.settings import ProxySettings
from kvbridge_proxy.upstreams import NoInstance
from kvbridge_proxy.wire import error_answer, read_body

log = logging.getLogger("kvbridge_proxy.app")  # the proxy's one logger, whichever module logs (operators filter on it)


class Admin:
    """What the proxy says of itself and what an operator may tell it."""

    def __init__(
        self, settings: ProxySettings, membership: Membership, metrics: ProxyMetrics, secret: bytes | None
    ) -> None:
        self.membership = membership
        self.metrics = metrics
        self.secret = secret
        self.live_moves = settings.moving

    async def health(self) -> Any:
        ok = all(any(i.healthy for i in p.instances) for p in self.membership.pools.values())
        return JSONResponse({"ok": ok}, status_code=200 if ok else 503)

    async def models(self) -> Any:
        """`GET /v1/models`, which OpenAI clients ask before a request: what a serving decode (else prefill) lists."""
        for role in ("decode", "prefill"):
            try:
                server = self.membership.pools[role].pick()
            except NoInstance:
                continue
            try:
                answer = await self.membership.client.get(f"{server.url}/v1/models", timeout=PROBE_TIMEOUT_S)
            except httpx.HTTPError as exc:
                log.warning("GET /v1/models: %s server %s did not answer: %s", role, server.label, exc)
                continue
            if answer.status_code == 200:
                return Response(answer.content, media_type="application/json")
            log.warning("GET /v1/models: %s server %s answered %d", role, server.label, answer.status_code)
        return self.metrics.answer(503, "no server serves now to list the models; see /instances")

    async def instances(self) -> Any:
        state: dict[str, Any] = {
            # streams: the movable streams it serves now (what a drain would move)
            role: [
                {"url": i.label, "healthy": i.healthy, "in_flight": i.in_flight, "streams": len(i.streams)}
                for i in p.instances
            ]
            for role, p in self.membership.pools.items()
        }
        if self.membership.members is not None:  # which servers are draining, and how many registry reads were done
            for role, p in self.membership.pools.items():
                for entry, inst in zip(state[role], p.instances):
                    entry["draining"] = inst.draining
        for role, p in self.membership.pools.items():
            for entry, inst in zip(state[role], p.instances):
                entry["cordoned"] = inst.cordoned
                if role == "decode":  # whether it keeps what it pulls, as its answers said (None: not yet)
                    entry["prefix_cache"] = inst.prefix_cache
            state["registry_rounds"] = self.membership.membership_rounds
        state["health_rounds"] = self.membership.health_rounds
        labels = {i.url: i.label for p in self.membership.pools.values() for i in p.instances}
        # (prefill, decode) pairs whose first contact is made
        state["warmed"] = sorted((labels[p], labels[d]) for p, d in self.membership.warm if p in labels and d in labels)
        return state

    async def admin(self, action: str, request: Request) -> Any:
        """`POST /admin/{cordon,uncordon,drain}` `{"server": URL or label}`, with the admin token as bearer token.

        A drain may say how its streams move (`"move"`: precopy, stop-and-copy or recompute; the proxy's by default).

        The token is derived from the shared secret (`kvbridge proxy --admin-token`), never the secret itself.

        cordon: no new request goes there; uncordon: it takes them again; drain: cordon, and with --live-moves move its
        streams to other decodes now. The server itself keeps running: stop it afterwards (docs/elastic.md)."""
        if not self.secret:
            return error_answer("the admin calls need the proxy's KVBRIDGE_SECRET (none is set)", 403)
        token = request.headers.get("authorization", "").removeprefix("Bearer ").encode()
        if not hmac.compare_digest(token, str(admin_token(self.secret)).encode()):
            log.warning("refused an admin %s: bad or missing bearer token", action)
            error = "Authorization: Bearer <the admin token: `kvbridge proxy --admin-token`> is required"
            return error_answer(error, 401)
        body = await read_body(request)
        if isinstance(body, JSONResponse):
            return body
        name, move = body.get("server"), body.get("move")
        if move is not None and (action != "drain" or move not in MOVES):
            return error_answer(f"'move' is for a drain, one of {list(MOVES)}; got {move!r}", 400)
        found = [i for p in self.membership.pools.values() for i in p.instances if name in (i.url, i.label)]
        if not isinstance(name, str) or not found:
            known = [i.label for p in self.membership.pools.values() for i in p.instances]
            return error_answer(f"no server {name!r}; the proxy knows {known}", 404)
        for inst in found:
            inst.cordoned = action != "uncordon"
            moved = list(inst.streams) if action == "drain" and self.live_moves else []
            for stream in moved:
                stream.request_cut("an operator drained its decode", move=move)
            log.warning(
                "%s server %s %sed by an operator (%d streams to move)", inst.role, inst.url, action, len(moved)
            )
        return {
            "server": name,
            "action": action,
            "streams_moving": sum(len(i.streams) for i in found if action == "drain"),
        }

    async def prometheus(self) -> Response:
        return Response(prom.generate_latest(self.metrics.registry), media_type=prom.CONTENT_TYPE_LATEST)
