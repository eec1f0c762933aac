"""A decode rank's pulls between engine steps, each on a thread of its own. See docs/internals.md."""

from __future__ import annotations

import logging
import threading
import time

import attrs

from kvbridge.base import watchdog
from kvbridge.base.errors import ConfigError, KVBridgeError
from kvbridge.base.lanes import Lanes
from kvbridge.control.params import KVTransferParams
from kvbridge.plan.rank_ports import stage_port
from kvbridge.session.machine import TERMINAL, PullMachine, PullState
from kvbridge.session.outbox import Outbox, Recorder
from kvbridge.session.pull_control import PullControl
from kvbridge.session.tasks import PullTask, StreamTask

log = logging.getLogger(__name__)

PULLS_PER_PEER = 4  # whole-request pulls from one prefill server at once
STREAMS_PER_PEER = 32  # layer-wise streams from one prefill server at once (each waits on prefill's layers)


def on_stage(params: KVTransferParams, stage: int) -> KVTransferParams:
    """`params` pointed at pipeline stage `stage` of the prefill engine that sent them."""
    if params.pp_size == 1:
        return params
    port = stage_port(
        int(params.remote_port),
        remote_tp_size=params.tp_size,
        pp_rank=stage,
        pp_size=params.pp_size,
        dp_rank=params.dp_rank,
    )
    return attrs.evolve(params, remote_port=port)


class DecodeSide:
    """One decode rank's pulls and streams; `tp_rank`, `pp_rank`, `pp_size` place it in its engine."""

    def __init__(
        self,
        control: PullControl,
        outbox: Outbox,
        stats: Recorder,
        *,
        tp_rank: int,
        pp_rank: int,
        pp_size: int,
        pull_timeout_s: float,
        layerwise: bool,
    ) -> None:
        self.control = control
        self.outbox = outbox
        self.stats = control.stats = stats  # the control times the DONEs sent after a report
        self.tp_rank, self.pp_rank, self.pp_size = tp_rank, pp_rank, pp_size
        self.pull_timeout_s = pull_timeout_s
        self.transport = control.agent.backend.name
        # each prefill server's pulls on threads of their own: one that stalls holds none of another's
        self._pulls = Lanes(PULLS_PER_PEER, "kvbridge-pull")
        self._streams = Lanes(STREAMS_PER_PEER, "kvbridge-stream") if layerwise else None
        self._lock = threading.Lock()
        self._cancels: dict[str, threading.Event] = {}  # layer-wise streams in flight

    # -- whole-request pulls ---------------------------------------------------------------------

    def pull(self, task: PullTask, received: float) -> None:
        """Start `task` (the engine's step handed it over at `received`, wall clock), or release it."""
        if not task.local_block_ids:
            self.release(task)
            return
        self.outbox.begin(stream=False)
        self._pulls.submit(task.params.server, lambda: self._pull(task, received))

    def _pull(self, task: PullTask, received: float) -> None:
        machine = PullMachine(task.request_id, "pull")
        dispatched = max(0.0, received - task.asked_at)  # the engine's step: from its scheduler to this worker
        queued = max(0.0, time.time() - received)  # from the step to this thread
        params = task.params
        peer = params.server  # one per prefill server: bounded
        reported = threading.Lock()  # held once the outcome went to the engine

        def report(_rid: str, error: BaseException | None) -> None:
            """The pull's outcome to the engine, once. See docs/internals.md."""
            if not reported.acquire(blocking=False):
                return
            if handle is None and error is not None:  # failed before the control plane began (or ended) it
                machine.end(error)
            timing = machine.marks()
            if error is not None and machine.state not in TERMINAL:
                # the wait gave up while a transfer still runs: the machine ends when it returns, the request now
                timing[f"at_{PullState.FAILED.value}_ms"] = round((time.perf_counter() - machine.begun) * 1e3, 3)
            if error is None:
                offer_wait = machine.offer_wait_ms
                phases = {
                    "dispatch_ms": dispatched * 1e3,
                    "queue_ms": queued * 1e3,
                    "offer_wait_ms": offer_wait,
                    # the control round trips before the transfer, less the wait for prefill's offer
                    "control_ms": max(0.0, machine.ms(PullState.RESOLVING, PullState.READING) - offer_wait),
                    "transfer_ms": machine.ms(PullState.READING, PullState.LANDING),
                    # confirming the read (the DONEs' answers, unless the prefill's hold covered it); a read first
                    # waits from landing to confirming for its BeginPulls' answers (`begin_ms`)
                    "done_ms": machine.ms(PullState.CONFIRMING, PullState.DONE),
                }
                timing.update({k: round(v, 3) for k, v in {**phases, **machine.parts}.items()})
                # recorded before the engine can hear of the request, so a reader of the stats then sees it
                self._timed(task.request_id, peer, machine, phases, timing)
            else:
                self.stats.record_failure(self.transport, peer, error)
                if isinstance(error, KVBridgeError):
                    log.error("request %s: pull from %s failed: %s", task.request_id, params.remote_engine_id, error)
            # the transfers' resubmissions (so far, where the pull timed out while they ran), also before the engine
            # hears of the request
            retries = machine.retries or (sum(h.retries for h in handle.handles) if handle is not None else 0)
            self.stats.record_retries(self.transport, peer, retries)
            failed = task.local_block_ids if error is not None else ()
            self.outbox.recved(task.request_id, report=task.report, failed=failed, timing=timing)

        handle = None
        try:
            if params.pp_size != self.pp_size:
                if self.tp_rank == 0 and self.pp_rank == 0:  # nobody will read it: free prefill's blocks now
                    self.release(attrs.evolve(task, report=False))
                raise ConfigError(
                    f"request {task.request_id}: prefill engine {params.remote_engine_id} runs pipeline parallel "
                    f"size {params.pp_size}, this decode engine {self.pp_size}; each stage reads its layers from "
                    "the same stage of prefill, so run both engines with the same --pipeline-parallel-size"
                )
            params = on_stage(params, self.pp_rank)  # this stage's layers live on the same stage of prefill
            handle = self.control.start(task.request_id, params, task.local_block_ids, report, machine, skip=task.skip)
            handle.wait(self.pull_timeout_s)
        except KVBridgeError as exc:
            # A landed read that ends after the request was given up is never copied in. A direct read may still
            # write the blocks vLLM would recompute into: the pull is reported when it ends, as every pull is (its
            # transport's own timeout ends it), and this thread goes on to the next.
            if handle is not None and not handle.abandon():
                log.warning(
                    "request %s: given up while its read from %s runs (%s); it fails once the read ends",
                    task.request_id,
                    params.remote_engine_id,
                    exc,
                )
            else:
                report(task.request_id, exc)
        except Exception as exc:  # a bug must surface as a load error, never as unread blocks counted as loaded
            log.exception("request %s: pull from %s failed", task.request_id, params.remote_engine_id)
            report(task.request_id, exc)
        finally:
            self.outbox.end(stream=False)

    def _timed(
        self, request_id: str, peer: str, machine: PullMachine, phases: dict[str, float], timing: dict[str, float]
    ) -> None:
        """A pull that succeeded and its handover phases to the metrics, and one line when they add up to slow."""
        transfer_s, control_s = phases["transfer_ms"] / 1e3, phases["control_ms"] / 1e3
        contact, begin = machine.parts.get("contact_ms", 0.0), machine.parts.get("begin_ms", 0.0)
        prepare, land = machine.parts.get("prepare_ms", 0.0), machine.parts.get("land_ms", 0.0)
        if machine.read_first:  # the side channel's time, though the read hid it; the request waited the rest
            control_s, begin = (contact + begin) / 1e3, machine.ms(PullState.LANDING, PullState.CONFIRMING)
        self.stats.record(self.transport, peer, transfer_s, control_s, machine.nbytes, machine.descriptors)
        parts = {
            "offer_wait": machine.offer_wait_ms,
            "contact": contact,
            "begin_pull": begin,
            "prepare": prepare,  # the transfer in parts: descriptors built, the transport's time, a landed read copied
            "read": max(0.0, timing.get("transfer_ms", 0.0) - prepare - land),
            "land": land,
            "fence": timing.get("done_ms", 0.0),
        }
        for phase, ms in parts.items():
            self.stats.record_phase(phase, self.transport, peer, ms / 1e3)
        # a layer-wise read while prefill computed is not time lost: its exposed part only
        line = {"dispatch": timing.get("dispatch_ms", 0.0), "queue": timing.get("queue_ms", 0.0), **parts}
        line["read"] = timing.get("exposed_ms", line["read"])
        log.debug("request %s: %s", request_id, timing)
        watchdog.slow(log, f"handover of request {request_id} on {self.control.name} from {peer}", line)

    def release(self, task: PullTask) -> None:
        """Decode reads nothing of the request: free it on every prefill rank now. See docs/internals.md."""
        params = task.params
        if self.tp_rank == 0:
            stages = [self.pp_rank] if params.pp_size == self.pp_size else range(params.pp_size)
            for stage in stages:
                try:
                    self.control.abort(on_stage(params, stage), reason="decode reads none of its KV")
                except KVBridgeError as exc:  # the prefill lease then expires
                    log.error("request %s: cannot release its prefill blocks: %s", task.request_id, exc)
        if task.report:
            self.outbox.recved(task.request_id)

    # -- layer-wise pulls ------------------------------------------------------------------------

    def stream(self, task: StreamTask) -> None:
        """Start reading `task` layer by layer, or release it (no local blocks)."""
        if self._streams is None:
            log.error(
                'request %s asks for layer-wise streaming, but this server runs "transfer": "pull"; '
                "it is computed here instead",
                task.request_id,
            )
            if task.local_block_ids:
                self.outbox.recved(task.request_id, failed=task.local_block_ids)
        elif task.local_block_ids:
            with self._lock:
                self._cancels[task.request_id] = threading.Event()
            self.outbox.begin(stream=True)
            self._streams.submit(task.params.server, lambda: self._stream(task))
        else:
            self.release(PullTask(task.request_id, task.params, (), report=False))

    def cancel(self, request_id: str) -> None:
        """The engine dropped a request while it streams: stop reading, abort it on prefill."""
        with self._lock:
            cancel = self._cancels.get(request_id)
        if cancel is not None:
            cancel.set()

    def _stream(self, task: StreamTask) -> None:
        machine = PullMachine(task.request_id, "layerwise")
        queued = max(0.0, time.time() - task.asked_at)
        peer = task.params.server
        with self._lock:
            cancelled = self._cancels[task.request_id]
        error: BaseException | None = None
        timing: dict[str, float] = {}
        try:
            phases = self.control.stream(
                machine,
                task.params,
                task.local_block_ids,
                task.tokens,
                skip=task.skip,
                timeout_s=self.pull_timeout_s,
                cancelled=cancelled,
            )
            timing = {"queue_ms": round(queued * 1e3, 3), **phases, **machine.parts}
            self._timed(task.request_id, peer, machine, phases, timing)
        except Exception as exc:  # a bug too must surface as a load error, never as blocks counted as loaded
            error = exc
            machine.end(exc)
            if isinstance(exc, KVBridgeError):
                log.error("request %s: layer-wise read from %s failed: %s", task.request_id, peer, exc)
            else:
                log.exception("request %s: layer-wise read from %s failed", task.request_id, peer)
            self.stats.record_failure(self.transport, peer, exc)
        with self._lock:
            self._cancels.pop(task.request_id, None)
        self.outbox.end(stream=True)
        failed = task.local_block_ids if error is not None else ()
        self.outbox.recved(task.request_id, failed=failed, timing={**machine.marks(), **timing})

    def close(self) -> None:
        self._pulls.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            cancels = list(self._cancels.values())
        for cancel in cancels:
            cancel.set()
        if self._streams is not None:
            self._streams.shutdown(wait=False, cancel_futures=True)
        self.control.close()
