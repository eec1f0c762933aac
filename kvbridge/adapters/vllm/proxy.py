"""An XpYd proxy for vLLM prefill/decode servers, speaking the OpenAI API (`kvbridge proxy`).

The flow is the one vLLM's NIXL example proxies use, so servers configured for those work here
and the other way round: the prefill server gets the request with `max_tokens: 1` and
`kv_transfer_params: {"do_remote_decode": true}`; the `kv_transfer_params` its response carries
go into the decode request, whose answer (streamed or not) is passed through to the client.
Instances are picked round-robin among the healthy ones; a health loop takes a dead instance
out (at once when it refuses connections, after a few timed-out probes when it is only slow) and
puts it back when it answers again. A decode server that refuses the connection is skipped for
the next one, since prefill holds the KV for whichever decode asks. Responses name the servers
that made them in `x-kvbridge-prefill` and `x-kvbridge-decode`, a 503 from a decode server that
failed after taking the request included. A client that disconnects closes the upstream request,
which vLLM turns into an abort.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import attrs
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvbridge.errors import ConfigError

log = logging.getLogger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions")
PROBE_TIMEOUT_S = 5.0
SLOW_PROBES = 3
MAX_BODY_BYTES = 32 * 1024 * 1024  # a prompt near any max_model_len fits many times over


@attrs.define(eq=False)
class Instance:
    url: str
    role: str
    healthy: bool = True
    slow_probes: int = 0  # health probes in a row that timed out


class Pool:
    """Round-robin over the healthy instances of one role."""

    def __init__(self, role: str, urls: Sequence[str]) -> None:
        if not urls:
            raise ConfigError(f"the proxy needs at least one {role} server URL (--{role} http://HOST:PORT)")
        self.role = role
        self.instances = [Instance(u.rstrip("/"), role) for u in urls]
        self._counter = itertools.count()

    def pick(self) -> Instance:
        healthy = [i for i in self.instances if i.healthy]
        if not healthy:
            raise NoInstance(f"no healthy {self.role} server among {[i.url for i in self.instances]}")
        return healthy[next(self._counter) % len(healthy)]


class NoInstance(ConfigError):
    """Every instance of a role is down."""


class DecodeFailed(Exception):
    """The decode server took the request and then failed before answering (it died, say)."""

    def __init__(self, url: str, cause: httpx.TransportError) -> None:
        super().__init__(f"decode server {url} failed: {type(cause).__name__}: {cause}")
        self.url = url


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill server gets: one token, no streaming, asks to hold KV for a decode."""
    out = dict(body)
    out["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    return out


async def read_body(request: Request) -> dict[str, Any] | JSONResponse:
    """The request's JSON object, or a 4xx that says what is wrong (logged): bounded in size, never a 500.
    `kv_transfer_params` are the proxy's to set: a client's own could make decode read from a host it names."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            log.warning("refused a request to %s: body over %d bytes", request.url.path, MAX_BODY_BYTES)
            return JSONResponse({"error": f"request body over {MAX_BODY_BYTES} bytes"}, status_code=413)
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        log.warning("refused a request to %s: body is not JSON (%s)", request.url.path, exc)
        return JSONResponse({"error": f"the request body is not JSON: {exc}"}, status_code=400)
    if not isinstance(body, dict):
        log.warning("refused a request to %s: body is a JSON %s, not an object", request.url.path, type(body).__name__)
        return JSONResponse({"error": "the request body must be a JSON object"}, status_code=400)
    if "kv_transfer_params" in body:
        log.warning("refused a request to %s: the client set kv_transfer_params", request.url.path)
        return JSONResponse({"error": "kv_transfer_params are set by the proxy, not by clients"}, status_code=400)
    return body


def _bind(handle: Any, path: str) -> Any:
    async def endpoint(request: Request) -> Any:
        return await handle(path, request)

    return endpoint


async def until_disconnect(request: Request, work: Any) -> Any:
    """Run `work`; if the client disconnects first, cancel it (closing the upstream request) and return None."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(prefill: Sequence[str], decode: Sequence[str], *, health_interval: float = 2.0,
               timeout: float = 600.0) -> FastAPI:
    """The FastAPI app: `/v1/completions`, `/v1/chat/completions`, `/health`, `/instances`."""
    pools = {"prefill": Pool("prefill", prefill), "decode": Pool("decode", decode)}
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0), trust_env=False,
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def probe(inst: Instance) -> None:
        # A server that refuses connections or answers an error is down now. One that is only slow
        # to answer /health is busy (a loaded vLLM can take seconds), and taking it out would shift
        # all its traffic onto the others; it is down after SLOW_PROBES slow answers in a row.
        try:
            resp = await client.get(f"{inst.url}/health", timeout=PROBE_TIMEOUT_S)
            ok, inst.slow_probes = resp.status_code == 200, 0
        except httpx.TimeoutException:
            inst.slow_probes += 1
            ok = inst.healthy and inst.slow_probes < SLOW_PROBES
        except httpx.HTTPError:
            ok = False
        if ok != inst.healthy:
            log.warning("%s server %s is %s", inst.role, inst.url, "back" if ok else "down: taken out")
        inst.healthy = ok

    async def health_loop() -> None:
        while True:
            await asyncio.gather(*(probe(i) for p in pools.values() for i in p.instances))
            await asyncio.sleep(health_interval)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(health_loop())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await client.aclose()

    app = FastAPI(lifespan=lifespan)

    async def call_prefill(path: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[str, dict[str, Any]]:
        """POST to a prefill server; on a connection failure take it out and try the next one."""
        for _ in range(len(pools["prefill"].instances)):
            inst = pools["prefill"].pick()
            try:
                resp = await client.post(f"{inst.url}{path}", json=prefill_body(body), headers=headers)
            except httpx.TransportError as exc:
                log.warning("prefill server %s failed (%s): taken out", inst.url, exc)
                inst.healthy = False
                continue
            resp.raise_for_status()
            return inst.url, resp.json()
        raise NoInstance(f"no prefill server answered for {path}")

    async def send_decode(path: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[Instance, httpx.Response]:
        """Start the decode request (streamed). A decode server that refuses the connection never saw
        the request, and prefill still holds the KV for whichever decode asks, so try the next one."""
        for _ in range(len(pools["decode"].instances)):
            inst = pools["decode"].pick()
            upstream = client.build_request("POST", f"{inst.url}{path}", json=body, headers=headers)
            try:
                return inst, await client.send(upstream, stream=True)
            except httpx.ConnectError as exc:
                log.warning("decode server %s refused the connection (%s): taken out", inst.url, exc)
                inst.healthy = False
            except httpx.TransportError as exc:
                inst.healthy = False
                raise DecodeFailed(inst.url, exc) from exc
        raise NoInstance(f"no decode server accepted {path}")

    async def handle(path: str, request: Request) -> Any:
        body = await read_body(request)
        if isinstance(body, JSONResponse):
            return body
        request_id = request.headers.get("x-request-id") or str(uuid.uuid4())
        headers = {"X-Request-Id": request_id}
        try:
            answer = await until_disconnect(request, call_prefill(path, body, headers))
            if answer is None:
                log.info("client left during prefill of %s: prefill request cancelled", request_id)
                return JSONResponse({"error": "client disconnected"}, status_code=499)
            first_url, first = answer
        except NoInstance as exc:
            return JSONResponse({"error": str(exc)}, status_code=503)
        except httpx.HTTPStatusError as exc:
            return JSONResponse({"error": f"prefill failed: {exc.response.text}"}, status_code=exc.response.status_code)
        params = first.get("kv_transfer_params")
        decode_body = dict(body)
        if params:
            decode_body["kv_transfer_params"] = params
        else:
            log.warning("prefill answer for %s carries no kv_transfer_params; decode recomputes the prompt",
                        request_id)
        try:
            decode, resp = await send_decode(path, decode_body, headers)
        except NoInstance as exc:
            return JSONResponse({"error": str(exc)}, status_code=503)
        except DecodeFailed as exc:
            return JSONResponse({"error": str(exc)}, status_code=503,
                                headers={"x-kvbridge-prefill": first_url, "x-kvbridge-decode": exc.url})

        async def relay() -> AsyncIterator[bytes]:
            # When the client goes away Starlette stops this generator; closing the upstream
            # response drops the connection, and vLLM aborts the decode request.
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()

        return StreamingResponse(relay(), status_code=resp.status_code,
                                 media_type=resp.headers.get("content-type", "application/json"),
                                 headers={"x-kvbridge-prefill": first_url, "x-kvbridge-decode": decode.url})

    for path in ROUTES:
        app.add_api_route(path, _bind(handle, path), methods=["POST"])

    @app.get("/health")
    async def health() -> Any:
        ok = all(any(i.healthy for i in p.instances) for p in pools.values())
        return JSONResponse({"ok": ok}, status_code=200 if ok else 503)

    @app.get("/instances")
    async def instances() -> Any:
        return {role: [{"url": i.url, "healthy": i.healthy} for i in p.instances] for role, p in pools.items()}

    return app
