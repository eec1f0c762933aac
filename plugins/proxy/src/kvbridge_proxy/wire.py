"""What the proxy reads from clients and sends upstream: request bodies, their checks, and a client's disconnect."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from kvbridge.control.params import KVTransferParams

log = logging.getLogger("kvbridge_proxy.app")  # the proxy's one logger, whichever module logs (operators filter on it)

MAX_BODY_BYTES = 32 * 1024 * 1024  # a prompt near any max_model_len fits many times over
# Levels of JSON nesting a request may have: far more than a chat request's tools schemas take, and far below
# what Python's JSON (and so the proxy's own encoding of the upstream request) can recurse into.
MAX_JSON_DEPTH = 128
# A client's x-request-id: printable ASCII, no space or ';' (the timing header's separator), bounded.
REQUEST_ID = re.compile(r"[\x21-\x3a\x3c-\x7e]{1,128}")


# Keys that shape only what is sampled after the prompt, or how the answer is written: prefill's one token is thrown
# away, so it is sent none of them (less to send; and `min_tokens` above 1 would be refused with `max_tokens` 1).
# Nothing that shapes the prompt (messages, tools, chat template, special tokens, truncation) is left out.
NOT_FOR_PREFILL = (
    "stream_options",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "bad_words",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "echo",
    "min_tokens",
)


def prefill_body(body: dict[str, Any], params: KVTransferParams | None = None) -> dict[str, Any]:
    """The request the prefill server gets: one token, no streaming, asks to hold KV for a decode."""
    out = {k: v for k, v in body.items() if k not in NOT_FOR_PREFILL}
    out["kv_transfer_params"] = (params or KVTransferParams(do_remote_decode=True)).to_dict()
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def error_body(message: str, code: int) -> dict[str, Any]:
    """An error as vLLM's OpenAI server writes one (its `ErrorResponse`): `{"error": {message, type, param, code}}`.

    A client then reads the proxy's own errors as it reads those the proxy passes on from a server."""
    try:
        kind = "".join(HTTPStatus(code).phrase.replace("-", " ").split())
    except ValueError:  # 499, a client that closed its request: not in the standard's list
        kind = "ClientClosedRequest"
    return {"error": {"message": message, "type": kind.removesuffix("Error") + "Error", "param": None, "code": code}}


def error_answer(message: str, code: int, headers: dict[str, str] | None = None) -> JSONResponse:
    """`error_body` as an HTTP answer with status `code`."""
    return JSONResponse(error_body(message, code), status_code=code, headers=headers)


async def read_body(request: Request) -> dict[str, Any] | JSONResponse:
    """The request's JSON object, or a 4xx that says what is wrong (logged): bounded in size, never a 500.

    `kv_transfer_params` are the proxy's to set: a client's own (also in `vllm_xargs`, which vLLM merges into the same
    place) could make decode read from a host it names."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            log.warning("refused a request to %s: body over %d bytes", request.url.path, MAX_BODY_BYTES)
            return error_answer(f"request body over {MAX_BODY_BYTES} bytes", 413)
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
        deep = _deeper_than(body, MAX_JSON_DEPTH)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        log.warning("refused a request to %s: body is not JSON (%s)", request.url.path, exc)
        return error_answer(f"the request body is not JSON: {exc}", 400)
    except RecursionError:
        deep = True
    if deep:
        log.warning("refused a request to %s: JSON nested deeper than %d levels", request.url.path, MAX_JSON_DEPTH)
        error = f"the request body's JSON is nested too deeply (over {MAX_JSON_DEPTH} levels)"
        return error_answer(error, 400)
    if not isinstance(body, dict):
        log.warning("refused a request to %s: body is a JSON %s, not an object", request.url.path, type(body).__name__)
        return error_answer("the request body must be a JSON object", 400)
    xargs = body.get("vllm_xargs")
    if "kv_transfer_params" in body or (isinstance(xargs, dict) and "kv_transfer_params" in xargs):
        where = "kv_transfer_params" if "kv_transfer_params" in body else "vllm_xargs.kv_transfer_params"
        log.warning("refused a request to %s: the client set %s", request.url.path, where)
        return error_answer(f"{where}: kv_transfer_params are set by the proxy, not by clients", 400)
    return body


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether JSON `value` nests more than `limit` levels (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return False


async def until_disconnect(request: Request | None, work: Any) -> Any:
    """Run `work`; if the client disconnects first, cancel it (closing the upstream request) and return None.

    No `request`: the caller watches the client (a part of a batch)."""
    if request is None:
        return await work
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


def sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event, separators=(',', ':'))}\n\n".encode()
