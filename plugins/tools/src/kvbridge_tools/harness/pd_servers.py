"""Small servers in threads that stand in for vLLM's P/D servers in the proxy's tests.

`Serving` runs an app with uvicorn on 127.0.0.1; `Upstream` answers like a vLLM server of a role in a P/D pair;
`Unaccepting` is a listener too busy to accept. Shared by plugins/proxy/tests and tests/ (membership, security).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from kvbridge_tools.harness.ports import free_port


class Serving:
    """A uvicorn server for `app` on `host` (127.0.0.1), in a thread, for the life of a `with` block.

    Entered inside a namespace host (`Host.entered`), it serves on that host, at its `address` as `host`."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1") -> None:
        self.host, self.port = host, free_port(span=1)
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> Serving:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()


class Upstream(Serving):
    """Answers like a vLLM server of `role` and records what it was sent.

    It answers after `slow_complete_s` (or at once `fail_status`, once that is set; a stream's headers at once and its
    first event after `slow_stream_s`, as a vLLM server streams), records the bodies it was sent
    and the X-Request-Id of each, and answers /health slowly (`slow_health_s`) for its first `slow_health` probes.
    A decode answer's choice says what it was asked (prompt, seed), its usage counts the prompt's characters
    and one completion token; streamed (`stream`), one chunk and, with `include_usage`, a usage chunk."""

    def __init__(
        self,
        role: str,
        *,
        slow_health: int = 0,
        slow_health_s: float = 0.0,
        slow_complete_s: float = 0.0,
        slow_stream_s: float = 0.0,
        host: str = "127.0.0.1",
    ) -> None:
        self.role, self.bodies, self.ids, self.health_calls = role, [], [], 0
        self.sizes: list[int] = []  # the bytes of each body it was sent
        self.side_channel_port = 5800  # where a prefill says its side channel is
        self.parallel: dict[str, int] = {}  # a prefill's tp_size, pp_size as its params say
        self.engine_id = "e"  # a prefill that restarts comes back with another
        self.fail_status: int | None = None  # set: it answers this, as a vLLM server shutting down answers 500
        self.prefix_cache: bool | None = None  # set: a decode's answer says whether it keeps what it pulled
        app = FastAPI()

        @app.post("/v1/completions")
        async def complete(request: Request) -> Any:
            raw = await request.body()
            body = json.loads(raw)
            self.sizes.append(len(raw))
            self.bodies.append(body)
            self.ids.append(request.headers.get("x-request-id"))
            if self.fail_status is not None and self.fail_status < 500:  # as vLLM refuses a request: its error object
                error = {"message": "refused", "type": "BadRequestError", "param": None, "code": self.fail_status}
                return JSONResponse({"error": error}, status_code=self.fail_status)
            if self.fail_status is not None:
                return Response("cannot schedule new futures after shutdown", status_code=self.fail_status)
            if role == "prefill":  # as KVBridgeConnector reports: where the KV is, how long prefill took
                params = {
                    "remote_engine_id": self.engine_id,
                    "remote_request_id": "r",
                    "remote_host": "127.0.0.1",
                    "remote_port": self.side_channel_port,
                    "remote_block_ids": [1, 2],
                    "kvbridge_timing": {"prefill_ms": 0.5},
                    **self.parallel,
                }
            else:  # and the decode's pull phases, in its (non-streamed) answer, and what it keeps if it says
                phases = {"dispatch_ms": 0.0, "queue_ms": 0.1, "offer_wait_ms": 0.05, "control_ms": 0.2}
                phases |= {"transfer_ms": 0.3, "done_ms": 0.4}
                phases |= {"at_resolving_ms": 0.0, "at_done_ms": 0.9}  # its pull states: marks, not phases
                said = {} if self.prefix_cache is None else {"kvbridge_prefix_cache": self.prefix_cache}
                params = {"kvbridge_timing": phases} | said
            # It takes at least as long as it says it took: the proxy's clock then bounds the phases.
            await asyncio.sleep(max(slow_complete_s, sum(params["kvbridge_timing"].values()) / 1e3))
            choice = {"text": role, "index": 0, "prompt": body.get("prompt"), "seed": body.get("seed")}
            usage = {"prompt_tokens": len(str(body.get("prompt"))), "completion_tokens": 1}
            usage["total_tokens"] = usage["prompt_tokens"] + 1
            cmpl = f"cmpl-{request.headers.get('x-request-id')}"
            if role == "decode" and body.get("stream"):
                events = [{"id": cmpl, "choices": [choice]}]
                if (body.get("stream_options") or {}).get("include_usage"):
                    events.append({"id": cmpl, "choices": [], "usage": usage})
                sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
                if slow_stream_s:

                    async def late() -> AsyncIterator[str]:
                        await asyncio.sleep(slow_stream_s)
                        yield sse

                    return StreamingResponse(late(), media_type="text/event-stream")
                return Response(sse, media_type="text/event-stream")
            return {"id": cmpl, "choices": [choice], "usage": usage, "kv_transfer_params": params}

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": "tiny", "object": "model"}]}

        @app.get("/health")
        async def health() -> dict:
            self.health_calls += 1
            if self.health_calls <= slow_health:
                await asyncio.sleep(slow_health_s)
            return {}

        super().__init__(app, host)


class Unaccepting:
    """A listener on 127.0.0.1 whose accept queue is full, so connects to it time out.

    As to a server too busy to accept or on a starved box (the proxy's ConnectTimeout).
    """

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.fillers = []
        for _ in range(2):  # backlog 0 holds one; the kernel drops SYNs beyond it
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(self.sock.getsockname())
            self.fillers.append(c)

    def __enter__(self) -> Unaccepting:
        return self

    def __exit__(self, *exc: object) -> None:
        for c in [*self.fillers, self.sock]:
            c.close()
