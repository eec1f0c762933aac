"""Worker side of KVBridgeConnector: a `KVAgent` and a `kvbridge.control` side channel per rank.

Every rank serves a `ControlServer` (its `RankInfo`, readiness, and the `Ledger` of the requests it
prefilled). Decode pulls run through `DecodeControl` on a small thread pool between engine steps
(vLLM's async load): find each prefill rank, wait for it to be ready and to hold the request,
BeginPull, read this rank's share (only the heads it holds), and report it to vLLM from the
transport's thread as soon as it is confirmed (by the prefill ranks' hold of its blocks, its DONEs
then follow; or by fenced DONEs). A pull that fails, or whose lease did not hold through the read,
marks its blocks as load errors, and vLLM's `kv_load_failure_policy` decides (recompute or fail). A
request decode will not read (dropped before its blocks were allocated, or all in decode's own prefix
cache) is aborted on the prefill side.
Prefill reports a request as finished sending when its lease is released, expires or is aborted.

A prefill rank takes a finished request's offer twice under one offer id: early, from the scheduler's
`Offer` message (when its memory needs no publishing in the step: `KVAgent.publish_is_free`), and from
the step's metadata. The lease is one; vLLM hears of its release only once the step's offer came, so
a request vLLM never handed to this worker is never reported to it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import attrs

from kvbridge import netguard
from kvbridge.adapters.vllm.cache import ASCEND_KV_TUPLE, byte_views, describe_kv_caches, resolved_layout
from kvbridge.adapters.vllm.inbox import find_engine_inbox
from kvbridge.adapters.vllm.layerwise import LayerwiseMeta, Producer, StreamTask, check_streamable, stream_pull
from kvbridge.adapters.vllm.metadata import KVBridgeMetadata, KVBridgeWorkerMeta, PullTask
from kvbridge.adapters.vllm.settings import Settings
from kvbridge.adapters.vllm.stats import KVBridgeStats
from kvbridge.agent import KVAgent
from kvbridge.control import ControlServer, DecodeControl, Lease, LeaseState, Ledger
from kvbridge.control.params import KVTransferParams
from kvbridge.control.pull import CONTROL_TIMEOUT_S
from kvbridge.errors import ConfigError, KVBridgeError
from kvbridge.landing import Receiver
from kvbridge.ranks import side_channel_port, stage_port
from kvbridge.regions import device_of
from kvbridge.topology import ParallelConfig

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)

MAX_EARLY_RELEASES = 100_000  # leases released before their step's offer, remembered until it comes


def is_mla(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> bool:
    """MLA (one latent per token) as vLLM's KV cache specs or model config say."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
        return any(isinstance(g.kv_cache_spec, MLAAttentionSpec) for g in kv_cache_config.kv_cache_groups)
    model = vllm_config.model_config
    return bool(model is not None and model.use_mla)


class WorkerSide:
    """One worker rank of the connector; `from_vllm` reads its place from vLLM's parallel state."""

    def __init__(
        self,
        engine_id: str,
        settings: Settings,
        *,
        block_size: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        dp_index: int = 0,
        dp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        kv_layout: str = "LBHNC",
        mla: bool = False,
        backend_name: str = "vLLM",
        cache_dtype: str = "auto",
    ) -> None:
        self.engine_id = engine_id
        self.kv_layout = kv_layout  # vLLM's resolved KVCacheLayout name (or "ascend-kv-tuple")
        self.cache_dtype = cache_dtype  # vLLM's kv_cache_dtype: fp8 caches are uint8 tensors, the name says which
        self.mla = mla
        self.backend_name = backend_name
        self.settings = settings
        self.block_size = block_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.pp_rank, self.pp_size = pp_rank, pp_size
        # the rank's identity on the side channel and in plans: its rank among all DP ranks' TP ranks
        self.parallel = ParallelConfig(tp=tp_size, dp=dp_size)
        self.rank = dp_index * tp_size + tp_rank
        port = side_channel_port(
            settings.side_channel_port,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            pp_size=pp_size,
            dp_index=dp_index,
        )
        self.agent: KVAgent | None = None
        self.control: DecodeControl | None = None
        self.ledger = Ledger(self._released, timeout_s=settings.lease_s)
        self.ledger.on_offer(lambda lease: self.stats.record_lease("offered", 1, len(lease.blocks)))
        # Bound now, ready once the KV cache is registered: an early peer waits instead of failing.
        self.server = ControlServer(
            engine_id,
            self.rank,
            ledger=self.ledger,
            host=settings.host,
            port=port,
            secret=settings.secret,
            insecure=settings.insecure,
        )
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvbridge-pull")
        # "transfer": "layerwise": this rank's prefill streams, and decode reads that last as long as prefill
        # computes (one thread each, so a long prompt does not hold up other requests' pulls)
        self.producer: Producer | None = None
        self._streams: ThreadPoolExecutor | None = None
        self._cancels: dict[str, threading.Event] = {}  # decode: layer-wise streams in flight
        self._pulling = 0  # decode: pulls in flight (under _lock)
        self._guards_seen: list[tuple[str, bool, int]] = []
        if settings.transfer == "layerwise":
            self.producer = Producer(self.ledger, self.server.abort, block_size)
            self.server.streams = self.producer.query
            self.producer.on_progress = self.server.wake  # answers the QueryStreams held for that stream
            self._streams = ThreadPoolExecutor(max_workers=32, thread_name_prefix="kvbridge-stream")
        self._lock = threading.Lock()
        # notified (under _lock) whenever get_finished has something new to report
        self._news = threading.Condition(self._lock)
        # the engine core's input queue, where this worker runs in its process: an idle step that may sleep
        # long (transfers in flight) still ends the moment a request arrives
        self._inbox = find_engine_inbox()
        self._stream_idle_wait_s = settings.stream_idle_wait_s(inbox_watched=self._inbox is not None)
        log.info(
            "idle engine steps %s",
            f"sleep up to {self._stream_idle_wait_s * 1e3:g} ms while transfers are in flight and end when a "
            "request arrives (the engine core's input queue is watched)"
            if self._inbox is not None
            else f"sleep at most {settings.idle_wait_ms:g} ms while pulls are in flight and "
            f"{self._stream_idle_wait_s * 1e3:g} ms while only streams are (no engine input queue here)",
        )
        self._sent: set[str] = set()
        self._stepped: dict[str, str] = {}  # offer id -> request id: offered by the step, not released yet
        self._released_early: OrderedDict[str, str] = OrderedDict()  # released before the step's offer came
        self._recved: set[str] = set()
        self._load_errors: set[int] = set()
        self._timings: dict[str, dict[str, float]] = {}  # finished pulls' phases (ms), for the scheduler
        self.stats = KVBridgeStats()

    @classmethod
    def from_vllm(
        cls, vllm_config: VllmConfig, engine_id: str, settings: Settings, kv_cache_config: KVCacheConfig | None = None
    ) -> WorkerSide:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
            model_parallel_is_initialized,
        )

        parallel = vllm_config.parallel_config
        pp_size = parallel.pipeline_parallel_size
        if model_parallel_is_initialized():
            tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        else:  # a worker driven without torch.distributed (the connector bench): its rank in the config
            tp_size = parallel.tensor_parallel_size
            tp_rank = parallel.rank % tp_size
        pp_rank = (parallel.rank // parallel.tensor_parallel_size) % pp_size if pp_size > 1 else 0
        return cls(
            engine_id,
            settings,
            block_size=vllm_config.cache_config.block_size,
            tp_rank=tp_rank,
            tp_size=tp_size,
            dp_index=parallel.data_parallel_index,
            dp_size=parallel.data_parallel_size,
            pp_rank=pp_rank,
            pp_size=pp_size,
            kv_layout=resolved_layout(vllm_config),
            mla=is_mla(vllm_config, kv_cache_config),
            backend_name=str(vllm_config.attention_config.backend or "vLLM's attention backend"),
            cache_dtype=str(vllm_config.cache_config.cache_dtype),
        )

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if any(isinstance(v, (tuple, list)) for v in kv_caches.values()):
            self.kv_layout = ASCEND_KV_TUPLE  # vllm-ascend hands each layer's K and V as a pair of tensors
        if self.producer is not None:
            check_streamable(self.kv_layout)
        layout, storages = describe_kv_caches(
            kv_caches,
            layout=self.kv_layout,
            block_size=self.block_size,
            tp_size=self.tp_size,
            mla=self.mla,
            backend=self.backend_name,
            cache_dtype=self.cache_dtype,
        )
        s = self.settings
        # storages are addresses: the device plugin comes from the KV tensors (cuda, npu, ...; cpu here)
        self.agent = KVAgent(
            self.engine_id,
            self.rank,
            self.parallel,
            layout,
            storages,
            device=device_of(list(kv_caches.values())).name,
            backend=s.migration_backend,
            protocol=s.protocol,
            hostname=s.host,
            metadata_server=s.metadata_server,
            **s.transport_options(),
        )
        views = byte_views(kv_caches, layout=self.kv_layout)
        self.agent.receiver = Receiver(self.agent.backend, layout, views, self.agent.device)
        if s.fault_injection:
            from kvbridge.chaos.inject import install

            install(self.agent.backend, s.fault_injection)
        # One side-channel message waits at most CONTROL_TIMEOUT_S for its answer (a healthy peer answers in
        # milliseconds; one sent to a prefill that was then killed is never answered); waiting for a peer to be
        # ready or for its offer is bounded by pull_timeout_s.
        self.control = DecodeControl(
            self.agent,
            self.server,
            secret=s.secret,
            ready_timeout_s=s.pull_timeout_s,
            timeout_s=min(s.pull_timeout_s, CONTROL_TIMEOUT_S),
        )
        if self.producer is not None:
            self.producer.register(self.agent, list(kv_caches))
        self.server.accept_offers = self.agent.publish_is_free
        self.server.register(self.agent.info())
        log.info(
            "KVBridgeConnector rank %d/%d: %d layers x %d blocks over %s, side channel %s:%d",
            self.tp_rank,
            self.tp_size,
            layout.model.layers,
            layout.num_blocks,
            self.agent.backend.name,
            *self.server.address,
        )

    # -- decode: pull; prefill: hold finished requests (offers) -------------------------------

    def start_load_kv(self, meta: KVBridgeMetadata) -> None:
        assert self.agent is not None
        self.apply_layerwise(meta)
        for offer in meta.offers:
            self.agent.publish(offer.blocks)  # computed by now; through staging, copied to the host mirror
            with self._lock:
                if self._released_early.pop(offer.offer_id, None) is not None:
                    self._finished_sending(offer.request_id)  # the early offer was pulled and released already
                    continue
                self._stepped[offer.offer_id] = offer.request_id
            # the same lease as the early offer's, if that came; the decode side states the release count
            try:
                self.ledger.offer(offer.request_id, offer.blocks, offer_id=offer.offer_id)
            except ConfigError as exc:
                # An early offer this step does not confirm (another offer id: a stray or forged one) holds
                # the request: the step's offer is the truth. A decode reading the stray lease fails its DONE.
                log.warning("request %s: %s; replacing that lease with the engine step's offer", offer.request_id, exc)
                self.ledger.abort(offer.request_id)
                self.ledger.offer(offer.request_id, offer.blocks, offer_id=offer.offer_id)
        received = time.time()
        for task in meta.pulls:
            if task.local_block_ids:
                with self._lock:
                    self._pulling += 1
                self._pool.submit(self._pull, task, received)
            else:
                self._release(task)

    # -- layer-wise streaming ("transfer": "layerwise", kvbridge.adapters.vllm.layerwise) ---------

    def apply_layerwise(self, meta: KVBridgeMetadata) -> None:
        """Take this step's layer-wise work once, at whichever hook comes first (vLLM starts async loads
        after the forward, but the forward's layers need the step's streams)."""
        lw: LayerwiseMeta = meta.layerwise
        if lw.applied or not lw:
            return
        lw.applied = True
        if self.producer is not None:
            self.producer.apply(lw)
            for added in lw.blocks.values():  # a stream's lease (offered at its first step) grows chunk by chunk
                self.stats.record_lease("extended", 0, len(added))
        for rid in lw.cancels:
            with self._lock:
                cancel = self._cancels.get(rid)
            if cancel is not None:
                cancel.set()
        for task in lw.tasks:
            if self._streams is None:
                log.error(
                    'request %s asks for layer-wise streaming, but this server runs "transfer": "pull"; '
                    "it is computed here instead",
                    task.request_id,
                )
                if task.local_block_ids:
                    with self._lock:
                        self._load_errors.update(task.local_block_ids)
                        self._finished_recving(task.request_id)
            elif task.local_block_ids:
                with self._lock:
                    self._cancels[task.request_id] = threading.Event()
                self._streams.submit(self._stream, task)
            else:
                self._release(PullTask(task.request_id, task.params, (), report=False))

    def save_kv_layer(self, meta: KVBridgeMetadata, layer_name: str) -> None:
        self.apply_layerwise(meta)
        if self.producer is not None:
            self.producer.save_layer(layer_name)

    def _stream(self, task: StreamTask) -> None:
        assert self.control is not None
        queued = max(0.0, time.time() - task.asked_at)
        transport = self.agent.backend.name if self.agent is not None else "none"
        peer = f"{task.params.remote_host}:{task.params.remote_port}"
        with self._lock:
            cancelled = self._cancels[task.request_id]
        error: BaseException | None = None
        try:
            result = stream_pull(self.control, task, self.settings.pull_timeout_s, cancelled)
            phases = {"queue_ms": round(queued * 1e3, 3), **result.phases}
            self.stats.record(
                transport,
                peer,
                result.phases["transfer_ms"] / 1e3,
                result.phases["control_ms"] / 1e3,
                result.nbytes,
                result.descriptors,
            )
            with self._lock:
                self._timings[task.request_id] = phases
            log.debug("request %s streamed: %s", task.request_id, phases)
        except Exception as exc:  # a bug too must surface as a load error, never as blocks counted as loaded
            error = exc
            if isinstance(exc, KVBridgeError):
                log.error("request %s: layer-wise read from %s failed: %s", task.request_id, peer, exc)
            else:
                log.exception("request %s: layer-wise read from %s failed", task.request_id, peer)
        with self._lock:
            self._cancels.pop(task.request_id, None)
            if error is not None:
                self.stats.record_failure(transport, peer, error)
                self._load_errors.update(task.local_block_ids)
            self._finished_recving(task.request_id)

    def _release(self, task: PullTask) -> None:
        """Decode reads nothing of the request: free it on every prefill rank now (once per engine: each
        stage's TP rank 0 frees its stage of prefill; with another PP size, stage 0 frees every stage)."""
        assert self.control is not None
        params = task.params
        if self.tp_rank == 0:
            stages = [self.pp_rank] if params.pp_size == self.pp_size else range(params.pp_size)
            for stage in stages:
                try:
                    self.control.abort(self._on_stage(params, stage), reason="decode reads none of its KV")
                except KVBridgeError as exc:  # the prefill lease then expires
                    log.error("request %s: cannot release its prefill blocks: %s", task.request_id, exc)
        if task.report:
            with self._lock:
                self._finished_recving(task.request_id)

    @staticmethod
    def _on_stage(params: KVTransferParams, stage: int) -> KVTransferParams:
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

    def _pull(self, task: PullTask, received: float) -> None:
        assert self.control is not None
        dispatched = max(0.0, received - task.asked_at)  # the engine's step: from its scheduler to this worker
        queued = max(0.0, time.time() - received)  # from the step to this thread
        begun = time.perf_counter()
        params = task.params
        timing: dict[str, float] = {}
        transport = self.agent.backend.name if self.agent is not None else "none"
        peer = f"{task.params.remote_host}:{task.params.remote_port}"  # one per prefill server: bounded
        reported = threading.Lock()  # held once the outcome went to vLLM

        def report(_rid: str, error: BaseException | None) -> None:
            """The pull's outcome to vLLM (its next get_finished), once: from the transport's thread as soon as
            the read is confirmed, or from this thread when the pull failed before or never ended."""
            if not reported.acquire(blocking=False):
                return
            phases: dict[str, float] = {}
            if error is None:
                try:
                    phases = {
                        "dispatch_ms": dispatched * 1e3,
                        "queue_ms": queued * 1e3,
                        "offer_wait_ms": timing["offer_wait_ms"],
                        # the control round trips before the transfer, less the wait for prefill's offer
                        "control_ms": max(0.0, (timing["announced_at"] - begun) * 1e3 - timing["offer_wait_ms"]),
                        "transfer_ms": (timing["transferred_at"] - timing["announced_at"]) * 1e3,
                        # confirming the read (the DONEs' answers, unless the prefill's hold covered it)
                        "done_ms": (time.perf_counter() - timing["transferred_at"]) * 1e3,
                    }
                except Exception as exc:  # a bug: the request is recomputed, never left waiting
                    log.exception("request %s: timing the pull failed", task.request_id)
                    error = exc
            with self._lock:
                if error is None:
                    self._timings[task.request_id] = {k: round(v, 3) for k, v in phases.items()}
                    # recorded before vLLM can hear of the request, so a reader of the stats after
                    # get_finished sees this pull
                    self.stats.record(
                        transport,
                        peer,
                        phases["transfer_ms"] / 1e3,
                        phases["control_ms"] / 1e3,
                        int(timing["nbytes"]),
                        int(timing["descriptors"]),
                    )
                else:
                    self.stats.record_failure(transport, peer, error)
                    self._load_errors.update(task.local_block_ids)
                if task.report:
                    self._finished_recving(task.request_id)
            if error is None:
                log.debug("request %s: %s", task.request_id, ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
            elif isinstance(error, KVBridgeError):
                log.error("request %s: pull from %s failed: %s", task.request_id, task.params.remote_engine_id, error)

        handle = None
        try:
            if params.pp_size != self.pp_size:
                if self.tp_rank == 0 and self.pp_rank == 0:  # nobody will read it: free prefill's blocks now
                    self._release(attrs.evolve(task, report=False))
                raise ConfigError(
                    f"request {task.request_id}: prefill engine {params.remote_engine_id} runs pipeline parallel "
                    f"size {params.pp_size}, this decode engine {self.pp_size}; each stage reads its layers from "
                    "the same stage of prefill, so run both engines with the same --pipeline-parallel-size"
                )
            params = self._on_stage(params, self.pp_rank)  # this stage's layers live on the same stage of prefill
            # `start` returns as soon as the transfers are submitted; `report` runs when they end (on the
            # transport's thread: no hop back to this one). This thread waits only to bound the pull.
            handle = self.control.start(task.request_id, params, task.local_block_ids, report, timing)
            handle.wait(self.settings.pull_timeout_s)
        except KVBridgeError as exc:
            report(task.request_id, exc)
        except Exception as exc:  # a bug must surface as a load error, never as unread blocks counted as loaded
            log.exception("request %s: pull from %s failed", task.request_id, task.params.remote_engine_id)
            report(task.request_id, exc)
        finally:
            with self._lock:
                self._pulling -= 1
        if handle is not None:  # failed or not: the handles that finished say how often they were resubmitted
            self.stats.record_retries(transport, peer, sum(h.retries for h in handle.handles))

    def _released(self, lease: Lease, reason: LeaseState) -> None:
        """Ledger callback (any thread): the request's blocks may be freed; vLLM hears of it in get_finished."""
        self.stats.record_lease(reason.value, -1, -len(lease.blocks))
        if self.producer is not None and self.producer.released(lease.request_id):
            self.server.wake(lease.request_id)  # a reader's held QueryStream hears that the lease ended
            with self._lock:  # a stream: reported once vLLM finished the request too (get_finished)
                self._tell()  # a waiting idle step looks at the producer's finished streams
            return
        with self._lock:
            if not lease.offer_id or self._stepped.pop(lease.offer_id, None) is not None:
                self._finished_sending(lease.request_id)
                return
            self._released_early[lease.offer_id] = lease.request_id
            while len(self._released_early) > MAX_EARLY_RELEASES:  # offers no step ever confirms
                self._released_early.popitem(last=False)

    # -- both ----------------------------------------------------------------------------------

    def _tell(self) -> None:
        """Wake an idle step waiting in get_finished: there is something to report (caller holds _lock)."""
        self._news.notify_all()
        if self._inbox is not None:
            self._inbox.nudge()

    def _finished_sending(self, request_id: str) -> None:
        """Hand a request whose blocks may be freed to the next get_finished (caller holds _lock)."""
        self._sent.add(request_id)
        self._tell()

    def _finished_recving(self, request_id: str) -> None:
        """Hand a loaded (or failed) request to the next get_finished (caller holds _lock)."""
        self._recved.add(request_id)
        self._tell()

    def get_finished(
        self, _finished_req_ids: set[str], *, idle: bool = False
    ) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose blocks prefill may free, and requests decode has loaded. In a step that computes
        nothing (`idle`), wait up to `idle_wait_ms` for one (`stream_idle_wait_ms` while only layer-wise
        streams are in flight), so that the engine does not spin on the cores and the GIL its transfers
        need."""
        with self._lock:
            streams_done = self.producer is not None and self.producer.has_finished()
            if idle and not (self._sent or self._recved or streams_done):
                self._idle_wait()
            sending, self._sent = self._sent, set()
            if self.producer is not None:
                sending |= self.producer.take_finished()
            recving, self._recved = self._recved, set()
        return sending or None, recving or None

    def _idle_wait(self) -> None:
        """Sleep an idle step (caller holds _lock) until something is reported, at most `idle_wait_ms`; with
        only transfers in flight, at most `stream_idle_wait_ms`: layer-wise streams always (a stream lasts
        as long as prefill computes), pulls where the engine's input queue is watched, and then a request
        that arrives ends the sleep at once."""
        short, long = self.settings.idle_wait_ms / 1e3, self._stream_idle_wait_s
        streams_only = bool(self._cancels) and not self._pulling
        watched = self._inbox is not None and bool(self._cancels or self._pulling)
        if long <= short or not (streams_only or watched):
            self._news.wait(short)
        elif self._inbox is None:  # only streams, and no way to see a request arrive
            self._news.wait(long)
        else:
            # Armed under _lock: whatever is reported from now on comes after the caller looked, and nudges.
            self._inbox.arm()
            self._lock.release()
            try:
                self._inbox.wait(long)
            finally:
                self._lock.acquire()

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for cancel in list(self._cancels.values()):
            cancel.set()
        if self._streams is not None:
            self._streams.shutdown(wait=False, cancel_futures=True)
        if self.producer is not None:
            self.producer.close()
        if self.control is not None:
            self.control.close()
        self.server.close()
        if self.agent is not None:
            self.agent.close()

    def take_stats(self) -> KVBridgeStats | None:
        guards = [(g.what, g.open, g.admitted) for g in netguard.states()]
        if guards != self._guards_seen:  # shown in /metrics from the first stats on, then on every change
            self._guards_seen = guards
            for what, open_, admitted in guards:
                self.stats.record_guard(what.split()[0], open_, admitted)
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def take_timings(self) -> KVBridgeWorkerMeta | None:
        with self._lock:
            timings, self._timings = self._timings, {}
        return KVBridgeWorkerMeta(timings) if timings else None
