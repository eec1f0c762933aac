"""Layer-wise streaming (`"transfer": "layerwise"`): decode reads each layer's KV while prefill computes
the next layers, into decode blocks allocated before prefill starts. A pipelined pull, not a push
(docs/vllm.md says why): the decode side still does every read, so leases, fenced DONEs, aborts and
load errors are those of pull mode.

The proxy sends the request to both servers at once with one `transfer_id` (`kvbridge proxy
--transfer layerwise`). Then:

- prefill scheduler: when the request is first scheduled, its blocks so far and prompt length go to
  the workers (`StreamStart`), and each step the blocks added and the prompt tokens computed once the
  step's layers have run (chunked prefill computes a prompt over several steps);
- prefill worker: offers a lease keyed by the transfer id at once (grown as blocks are added), and
  after each layer's attention (`save_kv_layer`) marks that layer readable up to the step's tokens,
  after the device plugin made the layer's writes visible (`KVAgent.publish` of that layer's
  blocks: the device's work done, and the copy to host mirrors where the transport stages). On a
  device that queues work the forward only records a mark (`KVAgent.record`); a publisher thread
  waits for it and publishes, in the order the layers were saved;
- decode worker: `BeginPull` (waits for the lease), then polls `QueryStream` and reads, per group of
  layers that became readable together, the blocks that are complete (every token computed, or the
  prompt's tail), until every layer holds the whole prompt; then the DONE. Over a transport that may
  write after a failed read (`late_writes`: Mooncake TCP) each read lands in a buffer first and is copied
  into the cache once it succeeded (`kvbridge.landing`), as pull mode's are. A lease that is not valid
  at any poll, or at a fenced DONE, is a load error (vLLM's `kv_load_failure_policy` decides). The DONE
  is fenced unless the prefill held the reads: a request of one output token on an engine that runs one
  batch at a time cannot be preempted after its prompt's last layer, so from then on only its lease
  frees the blocks (`Ledger.hold_reads`), and the answer that says so lets decode report at once and
  send the DONE after, as pull mode does.
- prefill reports the request finished sending only when both its lease ended (DONEs, expiry, abort)
  and vLLM finished the request, so blocks are never freed under a read in flight. A prefill request
  that is aborted or preempted aborts its lease first (the decode side is told and recomputes).

Every vLLM layout streams: in a block-outermost one (BL*, BH*: a block holds every layer) a layer is
read as its slice of each block. Refused at start-up in this mode: vllm-ascend (K, V) tuples, and
context parallelism; refused
at first contact (a load error naming the cause): a prefill whose KV arrangement differs from decode's
(the landing path rearranges whole requests only).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from kvbridge.backend import TransferHandle
from kvbridge.block_ids import block_array
from kvbridge.control.messages import STREAM_FIRST_VERSION, StreamStatus
from kvbridge.control.params import KVTransferParams
from kvbridge.control.pull import hold_deadline
from kvbridge.errors import ConfigError, KVBridgeError, LoadError, TransferTimeout
from kvbridge.layout import KVLayout
from kvbridge.memory import total_bytes
from kvbridge.planner import pull_descriptors
from kvbridge.topology import ParallelConfig

if TYPE_CHECKING:
    from kvbridge.agent import KVAgent
    from kvbridge.control.ledger import Ledger
    from kvbridge.control.pull import DecodeControl, Leases
    from kvbridge.landing import Landed

log = logging.getLogger(__name__)

LAYERWISE = "layerwise"
TRANSFERS = ("pull", LAYERWISE)
# Decode asks prefill for its progress with a long poll: prefill holds the QueryStream until it wakes
# its readers (or the lease ends), at most this long, so decode reads as soon as there is something to
# read without busy polling (which took the prefill's GIL hundreds of times per second while it
# computed). Longer than a step (a poll that times out costs a round trip for nothing); decode notices
# its own cancellation between polls.
STREAM_WAIT_S = 0.5
# Against a prefill that answers at once (no long poll), decode polls this often, backing off.
POLL_MIN_S, POLL_MAX_S = 0.0005, 0.002
# Before the prompt's last two steps, prefill wakes its readers at the end of a step only when this long
# passed since it last did: each wake-up costs a poll answered and a read planned, submitted and moved,
# beside a prefill that shares the host's cores, and fewer, larger reads hide behind the compute as well.
# It always wakes them at the step before the last (that read then hides behind the last step) and after
# each layer of the last step (only the last layer's read trails the compute).
WAKE_INTERVAL_S = 0.1
# Before a step ends or preempts a stream, layers still being published (the device had not run them)
# are waited for, this long at most: by then the device ran the step, so it is only the publisher's copy.
PUBLISH_DRAIN_S = 10.0


def check_streamable(layout_name: str, *, pcp: int = 1, dcp: int = 1) -> None:
    """Raise ConfigError at start-up for what layer-wise mode cannot stream, saying what to do."""
    if layout_name == "ascend-kv-tuple":
        raise ConfigError(
            '"transfer": "layerwise" cannot stream vllm-ascend\'s (K, V) tuples yet; use "transfer": "pull"'
        )
    if pcp > 1 or dcp > 1:
        raise ConfigError(
            '"transfer": "layerwise" does not support context parallelism (PCP/DCP) yet; use "transfer": "pull"'
        )


def is_layerwise(params: dict[str, Any] | None) -> bool:
    return bool(params) and params.get("transfer_mode") == LAYERWISE  # type: ignore[union-attr]


@attrs.frozen
class StreamStart:
    """Prefill: stream `request_id` under `transfer_id`; `blocks` allocated so far, `computed` tokens already
    in the cache for every layer (prefix-cache hits), `tokens` the prompt's length. `held_at_end`: vLLM
    finishes the request in the step that ends its prompt (`max_tokens` 1, one batch at a time), so from
    that step's last layer on only the lease frees its blocks, and readers' reads are held."""

    request_id: str
    transfer_id: str
    blocks: tuple[int, ...] = attrs.field(converter=tuple)
    tokens: int
    computed: int = 0
    held_at_end: bool = False


@attrs.frozen
class StreamTask:
    """Decode: read `request_id`'s prompt KV layer by layer as prefill computes it (no local blocks: only
    abort it on prefill). `skip`: leading prompt blocks decode's own prefix cache holds."""

    request_id: str
    params: KVTransferParams
    local_block_ids: tuple[int, ...] = attrs.field(converter=tuple)
    tokens: int
    skip: int = 0
    asked_at: float = attrs.field(factory=time.time)


@dataclass
class LayerwiseMeta:
    """One step's layer-wise work, inside `KVBridgeMetadata.layerwise`."""

    starts: list[StreamStart] = field(default_factory=list)
    blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)  # request id -> blocks added this step
    computed: dict[str, int] = field(default_factory=dict)  # request id -> prompt tokens done after this step
    ends: dict[str, bool] = field(default_factory=dict)  # request id -> aborted (vLLM finished it)
    preempted: list[str] = field(default_factory=list)  # blocks freed for a recompute: the stream is cut
    tasks: list[StreamTask] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)  # decode requests dropped while streaming
    applied: bool = False  # set by the worker that applied it (vLLM binds it once per step)

    def __bool__(self) -> bool:
        return bool(
            self.starts or self.blocks or self.computed or self.ends or self.preempted or self.tasks or self.cancels
        )


# -- scheduler side ------------------------------------------------------------------------------


class LayerwiseScheduler:
    """The scheduler's part: which prefill requests stream (and how far they got), which decode requests
    read layer by layer."""

    def __init__(self, block_size: int, *, enabled: bool, one_batch_at_a_time: bool = False) -> None:
        self.block_size = block_size
        self.enabled = enabled  # this server runs "transfer": "layerwise" (its workers stream)
        # No async scheduling and no pipeline batch queue (vLLM's `max_concurrent_batches` 1): a step's
        # outputs are processed before the next step is scheduled, so a request of one output token
        # finishes in the step that ends its prompt and is never preempted after it.
        self.one_batch_at_a_time = one_batch_at_a_time
        # request id -> transfer id, prompt tokens, whether it finishes with its prompt (max_tokens 1)
        self._producers: dict[str, tuple[str, int, bool]] = {}
        self._started: set[str] = set()
        self._meta = LayerwiseMeta()

    # prefill

    def note_producer(self, request: Any) -> None:
        """A prefill request asking to be streamed (seen when the scheduler first considers it)."""
        params = request.kv_transfer_params
        if not (params and params.get("do_remote_decode") and is_layerwise(params)):
            return
        if not self.enabled:
            log.error(
                'request %s asks for layer-wise streaming, but this server runs "transfer": "pull"; it is '
                "offered when finished instead (decode's read of it then times out and recomputes)",
                request.request_id,
            )
            params["transfer_mode"] = "pull"
            return
        transfer_id = params.get("transfer_id")
        if not transfer_id:
            log.error(
                "request %s asks for layer-wise streaming without a transfer_id; it is not streamed (the "
                "proxy must give both sides the same transfer_id: kvbridge proxy --transfer layerwise)",
                request.request_id,
            )
            return
        one_token = getattr(request, "max_tokens", None) == 1
        self._producers.setdefault(
            request.request_id, (str(transfer_id), len(request.prompt_token_ids or ()), one_token)
        )

    def collect(self, scheduler_output: Any) -> LayerwiseMeta:
        """This step's layer-wise metadata (streams started, blocks added, tokens computed, ends)."""
        meta, self._meta = self._meta, LayerwiseMeta()
        if scheduler_output is None:  # a caller outside vLLM's step (tests of the pull path): nothing scheduled
            return meta
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            entry = self._producers.get(new.req_id)
            if entry is None or new.req_id in self._started:
                continue
            transfer_id, tokens, one_token = entry
            self._started.add(new.req_id)
            held = one_token and self.one_batch_at_a_time
            meta.starts.append(
                StreamStart(new.req_id, transfer_id, new.block_ids[0], tokens, new.num_computed_tokens, held)
            )
            meta.computed[new.req_id] = min(tokens, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid not in self._started or rid in meta.ends:
                continue
            if rid in cached.resumed_req_ids:  # preempted earlier: its stream was aborted then
                continue
            tokens = self._producers[rid][1]
            done = cached.num_computed_tokens[i]
            if done >= tokens:
                continue  # decoding its output tokens: the prompt's KV is all readable already
            added = cached.new_block_ids[i]
            if added and added[0]:
                meta.blocks[rid] = tuple(added[0])
            meta.computed[rid] = min(tokens, done + scheduled.get(rid, 0))
        for rid in scheduler_output.preempted_req_ids or ():
            if rid in self._started:  # its blocks are freed now: the lease must end before they are reused
                self._started.discard(rid)  # not streamed again after its recompute: decode recomputes too
                meta.preempted.append(rid)
                meta.computed.pop(rid, None)
                meta.blocks.pop(rid, None)
        return meta

    def producer_finished(self, request: Any, normally: bool) -> bool | None:
        """True: hold the blocks until the workers report the stream's lease ended; None: not streamed."""
        rid = request.request_id
        entry = self._producers.pop(rid, None)
        if entry is None:
            return None
        if rid not in self._started:
            return False  # never scheduled: no lease, nothing to hold (decode's wait for it times out)
        self._started.discard(rid)
        self._meta.ends.setdefault(rid, not normally)
        return True

    # decode

    def add_task(self, task: StreamTask) -> None:
        self._meta.tasks.append(task)

    def cancel(self, request_id: str) -> None:
        self._meta.cancels.append(request_id)


# -- prefill worker ------------------------------------------------------------------------------


@attrs.define
class _Stream:
    request_id: str
    blocks: list[int]
    tokens: int
    ready: list[int]  # per layer: prompt tokens computed and visible to readers
    queued: list[int]  # per layer: prompt tokens handed to publishing (ahead of `ready` while the device runs)
    step: int = 0  # prompt tokens computed once the current step's layers have run
    ended: bool = False
    released: bool = False
    preempted: bool = False  # vLLM freed the blocks itself: nothing to report
    held_at_end: bool = False  # StreamStart.held_at_end
    held: bool = False  # every layer saved with held_at_end: only the lease frees the blocks now
    begun: int = 0  # prompt tokens computed before the current step
    woken_at: float = attrs.field(factory=time.monotonic)  # readers last woken (or the stream started)
    version: int = STREAM_FIRST_VERSION  # grows when readers are woken (StreamStatus.version)


@attrs.frozen(eq=False)
class _Saved:
    """One stream's layer saved in a step, to publish: its blocks up to `step` tokens."""

    transfer_id: str
    stream: _Stream
    layer: int
    step: int
    blocks: tuple[int, ...]
    wake: bool  # tell the readers once it is published


class _Publisher:
    """Publishes saved layers once the device ran them, in the order they were saved, on one thread."""

    def __init__(
        self, agent: KVAgent, publish: Callable[..., None], failed: Callable[[_Saved, BaseException], None]
    ) -> None:
        self._agent, self._publish, self._failed = agent, publish, failed
        self._items: deque[tuple[Any, list[_Saved]]] = deque()
        self._pending = 0
        self._closed = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kvbridge-publish", daemon=True)
        self._thread.start()

    def put(self, mark: Any, work: list[_Saved]) -> None:
        with self._cv:
            self._items.append((mark, work))
            self._pending += 1
            self._cv.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Wait until everything put so far is published (False: still running after `timeout_s`)."""
        with self._cv:
            done = self._cv.wait_for(lambda: self._pending == 0, timeout_s)
        if not done:
            log.warning("layers saved %.0f s ago are still not published (is the device stuck?)", timeout_s)
        return done

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._items or self._closed)
                if not self._items:
                    return
                mark, work = self._items.popleft()
            try:
                try:
                    self._agent.wait_recorded(mark)
                except Exception as exc:
                    for w in work:
                        self._failed(w, exc)
                    continue
                for w in work:
                    try:
                        self._publish(w, waited=True)
                    except Exception as exc:
                        self._failed(w, exc)
            finally:
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(PUBLISH_DRAIN_S)


class Producer:
    """A prefill worker rank's streams: leases offered when a request starts, per-layer readiness."""

    def __init__(
        self,
        ledger: Ledger,
        abort: Callable[[str, str], Any],
        block_size: int,
        *,
        wake_interval_s: float = WAKE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ledger = ledger
        self.wake_interval_s = wake_interval_s
        self._clock = clock
        self._abort = abort  # ControlServer.abort: frees the lease and tells the decode ranks reading it
        self.block_size = block_size
        self.agent: KVAgent | None = None
        self.layers: dict[str, int] = {}
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}  # transfer id -> stream
        self._by_request: dict[str, str] = {}  # vLLM request id -> transfer id
        self._finished: set[str] = set()  # request ids whose blocks vLLM may free now
        # told the transfer id whenever a stream changes (ControlServer.wake answers its held QueryStreams)
        self.on_progress: Callable[[str], None] | None = None
        self._publisher: _Publisher | None = None  # started on the first layer a device must finish first

    def _changed(self, transfer_id: str) -> None:
        if self.on_progress is not None:
            self.on_progress(transfer_id)

    def register(self, agent: KVAgent, layer_names: Sequence[str]) -> None:
        self.agent = agent
        self.layers = {name: i for i, name in enumerate(layer_names)}

    def apply(self, meta: LayerwiseMeta) -> None:
        assert self.agent is not None
        if (meta.ends or meta.preempted) and self._publisher is not None:
            # what ends a stream acts on what its readers were told: every layer saved so far first
            self._publisher.drain(PUBLISH_DRAIN_S)
        for s in meta.starts:
            with self._lock:
                if s.transfer_id in self._streams:
                    log.error("transfer id %s (request %s) is streaming already; ignored", s.transfer_id, s.request_id)
                    continue
                self._streams[s.transfer_id] = _Stream(
                    s.request_id,
                    list(s.blocks),
                    s.tokens,
                    [s.computed] * len(self.layers),
                    [s.computed] * len(self.layers),
                    s.computed,
                    held_at_end=s.held_at_end,
                    begun=s.computed,
                    woken_at=self._clock(),
                )
                self._by_request[s.request_id] = s.transfer_id
            if s.computed:  # prefix-cache hits: in the cache already, every layer
                self.agent.publish(s.blocks[: -(-s.computed // self.block_size)])
            # the decode side states its release count; vLLM frees a preempted stream's blocks by itself
            self.ledger.offer(s.transfer_id, s.blocks, holds_reads=False)
        for rid, added in meta.blocks.items():
            tid = self._by_request.get(rid)
            if tid is not None:
                # Readers are not woken for blocks alone: they read blocks once layers of them are saved,
                # and the answer that says so lists them.
                with self._lock:
                    self._streams[tid].blocks.extend(added)
                self.ledger.extend(tid, added)
        for rid, computed in meta.computed.items():
            tid = self._by_request.get(rid)
            if tid is not None:
                with self._lock:
                    s = self._streams[tid]
                    s.begun, s.step = s.step, computed
        for rid in meta.preempted:
            tid = self._by_request.get(rid)
            if tid is None:
                continue
            with self._lock:
                self._streams[tid].preempted = True
            self._abort(tid, "prefill preempted the request")
            self._maybe_finish(tid)
        for rid, aborted in meta.ends.items():
            tid = self._by_request.get(rid)
            if tid is None:
                continue
            with self._lock:
                s = self._streams[tid]
                s.ended = True
            # Before vLLM may reuse the blocks: a read in flight then fails its fenced DONE. Not once the
            # reads are held: the prompt's KV is whole, vLLM holds the blocks until the lease ends, as for
            # a finished pull-mode request, and readers were told their reads need no fence.
            if aborted and not s.held:
                self._abort(tid, "prefill aborted or preempted the request")
            self._maybe_finish(tid)

    def save_layer(self, layer_name: str) -> None:
        """After layer `layer_name`'s attention queued this step's KV: make it readable. On a device that
        queues work (CUDA, NPU, MLU) the forward does not wait for it: the layer is published on a thread
        of its own once the device ran it (`KVAgent.record`), so the engine keeps the device fed."""
        layer = self.layers.get(layer_name)
        if layer is None or self.agent is None:
            return
        bs = self.block_size
        work: list[_Saved] = []
        with self._lock:
            for tid, s in self._streams.items():
                if s.preempted or s.step <= s.queued[layer]:
                    continue
                first, last = s.queued[layer] // bs, -(-s.step // bs)
                # Readers wake per layer only in the step that ends the prompt; an earlier chunk has the
                # next chunk's compute to hide behind, so at a step's end is enough, and only every
                # WAKE_INTERVAL_S or before the last step (`_wakes_at_step_end`). The version moves with
                # the wake-ups only, so a query that arrives mid-step is held to the next wake-up and reads
                # all that became readable at once.
                wake = s.step >= s.tokens or (layer == len(self.layers) - 1 and self._wakes_at_step_end(s))
                work.append(_Saved(tid, s, layer, s.step, tuple(s.blocks[first:last]), wake))
                s.queued[layer] = s.step
        if not work:
            return
        mark = self.agent.record()
        if mark is None:  # host memory (nothing to wait for), or a device that cannot mark its work
            for w in work:
                self._publish(w)
            return
        if self._publisher is None:
            self._publisher = _Publisher(self.agent, self._publish, self._failed)
        self._publisher.put(mark, work)

    def _publish(self, w: _Saved, waited: bool = False) -> None:
        """Make `w`'s layer readable (the device's wait, or only the staging copy once `waited`) and
        tell its readers."""
        assert self.agent is not None
        s = w.stream
        self.agent.publish(w.blocks, layers=(w.layer,), waited=waited)
        with self._lock:
            if s.preempted:  # its lease was aborted since: nothing to tell
                return
            others = all(r >= s.tokens for i, r in enumerate(s.ready) if i != w.layer)
        held = False
        if s.held_at_end and w.step >= s.tokens and others:
            # The prompt's last layer: vLLM finishes the request in this step, so its blocks are freed
            # only through the lease from now on. Held before readers hear of it, so the answer that
            # lets them read the last layer also tells them their reads need no fenced DONE.
            held = self.ledger.hold_reads(w.transfer_id)
        with self._lock:
            s.held = s.held or held
            s.ready[w.layer] = w.step
            if w.wake:
                s.version += 1
        if w.wake:
            self._changed(w.transfer_id)

    def _failed(self, w: _Saved, error: BaseException) -> None:
        """A layer could not be published (the device failed): its readers must not read on."""
        log.error("transfer %s: layer %d could not be published: %s", w.transfer_id, w.layer, error)
        self._abort(w.transfer_id, f"prefill could not publish layer {w.layer}: {error}")

    def close(self) -> None:
        if self._publisher is not None:
            self._publisher.close()

    def _wakes_at_step_end(self, s: _Stream) -> bool:
        """Whether readers are woken at the end of a step that does not end the prompt: when the next step
        may end it (no more tokens left than this step computed), or WAKE_INTERVAL_S after the last time."""
        now = self._clock()
        if s.tokens - s.step <= s.step - s.begun or now - s.woken_at >= self.wake_interval_s:
            s.woken_at = now
            return True
        return False

    def query(self, transfer_id: str, epoch: int) -> StreamStatus:
        """The stream's status for a reader (`ControlServer.streams`); its lease lists the blocks so far
        (`Ledger.extend` grows it with the stream)."""
        lease = self.ledger.query(transfer_id, epoch)
        with self._lock:
            s = self._streams.get(transfer_id)
            if s is None:
                return StreamStatus(lease)
            return StreamStatus(lease, s.tokens, tuple(s.ready), s.version)

    def released(self, transfer_id: str) -> bool:
        """Ledger release of `transfer_id`; False when it is not a stream (a pull-mode lease)."""
        with self._lock:
            s = self._streams.get(transfer_id)
            if s is None:
                return False
            s.released = True
        self._maybe_finish(transfer_id)
        return True

    def _maybe_finish(self, transfer_id: str) -> None:
        with self._lock:
            s = self._streams.get(transfer_id)
            if s is None or not ((s.ended or s.preempted) and s.released):
                return
            del self._streams[transfer_id]
            self._by_request.pop(s.request_id, None)
            if not s.preempted:
                self._finished.add(s.request_id)

    def has_finished(self) -> bool:
        with self._lock:
            return bool(self._finished)

    def take_finished(self) -> set[str]:
        with self._lock:
            out, self._finished = self._finished, set()
        return out


# -- decode worker -------------------------------------------------------------------------------


@attrs.frozen
class StreamResult:
    nbytes: int
    descriptors: int
    phases: dict[str, float]  # ms: control, transfer (busy), hidden (while prefill computed), exposed, done


def _busy(intervals: list[tuple[float, float]], until: float | None = None) -> float:
    """Seconds covered by the union of `intervals` (cut at `until`)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if until is not None:
            b = min(b, until)
        if b <= a:
            continue
        a = max(a, end)
        if b > a:
            total += b - a
            end = b
    return total


def stream_pull(control: DecodeControl, task: StreamTask, timeout_s: float, cancelled: threading.Event) -> StreamResult:
    """Read `task` layer by layer as prefill computes it, then DONE: fenced, or after the report where every
    prefill rank held the reads. Raises LoadError (recompute), TransferTimeout, or the transport's error;
    DONEs (or release-only ones) go out in every case."""
    agent = control.agent
    params = task.params
    rid = str(params.remote_request_id)
    prefill = ParallelConfig(tp=params.tp_size, pcp=params.pcp_size, dcp=params.dcp_size, dp=params.dp_size)
    plan = agent.plan(prefill, task.tokens, prefill_dp=params.dp_rank)
    bs = agent.layout.model.block_size
    total = -(-task.tokens // bs)
    layers = agent.layout.model.layers
    # by block position (converted once per stream, not per read); decode's prefix hits are skipped (-1)
    local = np.concatenate([np.full(task.skip, -1, dtype=np.int64), block_array(task.local_block_ids)])
    notify = [(control._client(params, r)[0], 1) for r in plan.unpulled] if agent.rank == plan.notifier else []
    ranks = sorted({p.prefill_rank for p in plan.pulls_for(agent.rank)})
    leases: Leases = {}
    handles: list[TransferHandle] = []
    landings: list[tuple[TransferHandle, Landed]] = []  # reads into landing buffers, not yet in the cache
    spans: list[list[float]] = []
    nbytes = ndesc = 0
    began = time.time()
    try:
        peers = {}
        for rank in ranks:
            client, addr = control._client(params, rank)
            info = control._info(client, addr, params.remote_engine_id, rid)
            if agent.receiver is not None and not agent.receiver.direct(info.layout):
                raise LoadError(
                    f"request {rid!r}: prefill rank {rank} arranges its KV cache unlike this decode rank; "
                    'layer-wise streaming needs the same layout and block size on both sides (or "transfer": "pull")',
                    peer=client.url,
                    request=rid,
                    cause="layout",
                )
            # A transport that may still write after a failed read (Mooncake TCP) reads into landing
            # buffers, copied into the cache once each read succeeded, as pull mode does.
            lands = agent.receiver is not None and all(
                agent.receiver.lands(info.layout, p) for p in plan.pulls_for(agent.rank) if p.prefill_rank == rank
            )
            peers[rank] = (client, info, agent.connect(info), lands)
            count = plan.release_count(rank)
            status = client.begin_pull(
                rid, control.name, notify=control.server.address, expected_pulls=count, wait_s=control.ready_timeout_s
            )
            leases[rank] = (client, status.epoch, count)
        control_s = time.time() - began
        sent = {rank: [task.skip] * layers for rank in ranks}  # per rank and layer: block positions requested
        subs: dict[tuple[int, tuple[int, ...]], tuple[KVLayout, KVLayout]] = {}
        delay, last_progress, computing_until = POLL_MIN_S, time.monotonic(), time.time()
        versions = dict.fromkeys(ranks, STREAM_FIRST_VERSION)
        finished: set[int] = set()  # ranks whose every layer holds the whole prompt
        held_until = math.inf  # the earliest end of the prefill ranks' holds of the reads (-inf: no hold)
        while True:
            if cancelled.is_set():
                raise LoadError(f"request {rid!r}: decode dropped it while streaming", request=rid, cause="cancelled")
            progressed, complete = False, True
            round_began = time.monotonic()
            _land_finished(landings)
            for rank in ranks:
                client, info, peer, lands = peers[rank]
                wait = 0.0 if rank in finished else STREAM_WAIT_S
                asked, asked_at = time.monotonic(), time.time()
                st = client.query_stream(rid, leases[rank][1], seen=versions[rank], wait_s=wait)
                versions[rank] = st.version
                if not st.lease.valid:
                    raise LoadError(
                        f"request {rid!r}: lease on {client.url} is {st.lease.state.value} mid-stream; recompute",
                        peer=client.url,
                        request=rid,
                        cause=st.lease.state.value,
                    )
                if st.tokens and st.tokens != task.tokens:
                    raise LoadError(
                        f"request {rid!r}: prefill streams a prompt of {st.tokens} tokens, decode holds {task.tokens}; "
                        "the proxy must send both servers the same prompt",
                        peer=client.url,
                        request=rid,
                        cause="prompt",
                    )
                have = len(st.lease.blocks)
                ready = [min(have, total if r >= task.tokens else r // bs) for r in (st.ready or (0,) * layers)]
                groups: dict[tuple[int, int], list[int]] = {}
                rank_complete = True
                for layer in range(layers):
                    if ready[layer] > sent[rank][layer]:
                        groups.setdefault((sent[rank][layer], ready[layer]), []).append(layer)
                    if ready[layer] < total:
                        rank_complete = False
                if rank_complete:
                    if rank not in finished:
                        # The lease was valid at every answer so far (each one checks it), so nothing reused
                        # the blocks before this one; from it on, a prefill that holds reads keeps them for
                        # this rank until its DONE or the deadline.
                        held_until = min(held_until, hold_deadline(asked, st.lease))
                    finished.add(rank)
                else:
                    complete = False
                # When the prompt's compute ended, as a lower bound on this host's clock: after this query
                # arrived (so after it was sent) if the answer says layers are still to come, and, if the
                # query was held, not before it had been held for `held_ms` (nothing had moved when it
                # arrived; a held answer that completes the stream was sent when its last layer was saved).
                # Reads before that overlapped the compute.
                held_s = _held_s(st.held_ms, time.time() - asked_at)
                if not rank_complete or held_s > 0:
                    computing_until = max(computing_until, asked_at + held_s)
                for (a, b), group in groups.items():
                    key = (rank, tuple(group))
                    if key not in subs:
                        subs[key] = (_sub(agent.layout, group), _sub(info.layout, group))
                    mine, theirs = subs[key]
                    for p in plan.pulls_for(agent.rank):
                        if p.prefill_rank != rank:
                            continue
                        first = {"src_first": p.src_first + a * p.src_step, "dst_first": p.dst_first + a * p.dst_step}
                        sub = attrs.evolve(p, num_blocks=b - a, **first)
                        land = None
                        if lands:
                            land = agent.receiver.prepare(
                                rid, sub, info.layout, st.lease.blocks, local, task.tokens, layers=group
                            )
                            desc = land.descriptors
                        else:
                            desc = pull_descriptors(sub, mine, theirs, local, st.lease.blocks)
                        span = [time.time(), 0.0]  # submitted, completed (set by the transport's thread)
                        try:
                            h = agent.backend.transfer(peer, desc, "read")
                        except BaseException:
                            if land is not None:
                                land.finish(False, moved=False)
                            raise
                        if land is not None:
                            landings.append((h, land))
                        h.add_done_callback(lambda _h, span=span: span.__setitem__(1, time.time()))
                        handles.append(h)
                        spans.append(span)
                        nbytes += total_bytes(desc)
                        ndesc += len(desc)
                    for layer in group:
                        sent[rank][layer] = b
                    progressed = True
            if complete:
                break
            now = time.monotonic()
            if progressed:
                last_progress, delay = now, POLL_MIN_S
            elif now - last_progress > timeout_s:
                raise TransferTimeout(
                    f"request {rid!r}: prefill computed no new layer for {timeout_s}s; raise pull_timeout_s for "
                    "prompts that take longer per step",
                    request=rid,
                    cause="timeout",
                )
            elif now - round_began < POLL_MIN_S:  # answered at once, unchanged: a prefill that does not hold
                delay = min(delay * 2, POLL_MAX_S)
                time.sleep(delay)  # bounded by the timeout above
        _settle(handles, timeout_s)
        error = next((e for e in (h.exception() for h in handles) if e is not None), None)
        if error is not None:
            raise error
        _land_finished(landings)  # every read succeeded: the rest go into the cache now
        ended = time.time()
        # a callback may still be running when wait_all returns: its transfer ended by now
        intervals = [(a, b or ended) for a, b in spans]
        done_at = time.perf_counter()
        if time.monotonic() < held_until:
            # Every read ended within the prefill ranks' holds: the bytes are intact, the DONEs only free
            # the prefill's blocks, after the report.
            control._send_later(rid, leases, notify)
        else:
            # Fenced DONEs, answered before the report: a stream whose request may still be preempted
            # promises no hold (vLLM frees a preempted request's blocks by itself), so only the DONE's
            # answer says the read was intact.
            failed = control._send_dones(rid, leases, notify, None)
            if failed is not None:
                raise failed
        busy = _busy(intervals)
        hidden = _busy(intervals, until=computing_until)
        phases = {
            "control_ms": control_s * 1e3,
            "transfer_ms": busy * 1e3,
            "hidden_ms": hidden * 1e3,
            "exposed_ms": (busy - hidden) * 1e3,
            "tail_ms": (ended - computing_until) * 1e3,  # from the last proof of compute to all bytes here
            "done_ms": (time.perf_counter() - done_at) * 1e3,
        }
        return StreamResult(nbytes, ndesc, {k: round(v, 3) for k, v in phases.items()})
    except BaseException as exc:
        _settle(handles, timeout_s)  # never leave a read running into blocks vLLM recomputes or reuses
        for h, land in landings:  # a read that failed, or still runs, may write late: its buffer retires
            land.finish(False, moved=not (h.done() and h.exception() is None))
        if cancelled.is_set():  # decode dropped the request: prefill need not keep it for anyone
            for client, _epoch, _count in leases.values():
                try:
                    client.abort(rid, reason="decode dropped the request")
                except KVBridgeError as why:
                    log.warning("request %s: could not abort it on %s: %s", rid, client.url, why)
        # the DONEs end this rank's reads (an aborted lease is held for a reader until its DONE)
        control.release_unread(rid, params, plan, leases, notify, exc)
        raise


def _land_finished(landings: list[tuple[TransferHandle, Landed]]) -> None:
    """Copy the landed reads that succeeded into the cache and give their buffers back; the others stay
    (still running, or failed: the caller's error path retires them)."""
    for item in list(landings):
        h, land = item
        if h.done() and h.exception() is None:
            landings.remove(item)  # before the copy: a copy that fails still gives its buffer back
            land.finish(True)


def _held_s(held_ms: float, round_trip_s: float) -> float:
    """A StreamStatus's `held_ms` in seconds, at most the round trip it was part of (it comes off the wire)."""
    return min(held_ms / 1e3, round_trip_s) if math.isfinite(held_ms) and held_ms > 0 else 0.0


def _settle(handles: Sequence[TransferHandle], timeout_s: float) -> None:
    """Wait for every read to end, failed ones included (`wait_all` stops at the first error)."""
    deadline = time.monotonic() + timeout_s
    for h in handles:
        try:
            h.wait(max(0.0, deadline - time.monotonic()))
        except KVBridgeError:
            pass  # its exception() says why; a read still running after the deadline is the transport's to end


def _sub(layout: KVLayout, layers: Sequence[int]) -> KVLayout:
    """The layout of `layers` only (their regions), for planning a read of those layers."""
    return attrs.evolve(layout, regions=[r for r in layout.regions if r.layer in layers])
