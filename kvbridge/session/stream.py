"""A prefill rank's layer-wise streams (`"transfer": "layerwise"`). See docs/internals.md."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import attrs

from kvbridge.base.threadname import NamedThread
from kvbridge.control.messages import STREAM_FIRST_VERSION, StreamStatus
from kvbridge.session.tasks import StreamTask

if TYPE_CHECKING:
    from kvbridge.agent.kv_agent import KVAgent
    from kvbridge.control.ledger import Ledger

log = logging.getLogger(__name__)

# Before the prompt's last two steps, prefill wakes its readers at the end of a step only when this long
# passed since it last did: each wake-up costs a poll answered and a read planned, submitted and moved,
# beside a prefill that shares the host's cores, and fewer, larger reads hide behind the compute as well.
# It always wakes them at the step before the last (that read then hides behind the last step) and after
# each layer of the last step (only the last layer's read trails the compute).
WAKE_INTERVAL_S = 0.1
# Before a step ends or preempts a stream, layers still being published (the device had not run them)
# are waited for, this long at most: by then the device ran the step, so it is only the publisher's copy.
PUBLISH_DRAIN_S = 10.0


@attrs.frozen
class StreamStart:
    """Prefill: stream `request_id` under `transfer_id`. See docs/internals.md."""

    request_id: str
    transfer_id: str
    blocks: tuple[int, ...] = attrs.field(converter=tuple)
    tokens: int
    computed: int = 0
    held_at_end: bool = False


@dataclass
class LayerwiseMeta:
    """One engine step's layer-wise work (vLLM: inside `KVBridgeMetadata.layerwise`)."""

    starts: list[StreamStart] = field(default_factory=list)
    blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)  # request id -> blocks added this step
    computed: dict[str, int] = field(default_factory=dict)  # request id -> prompt tokens done after this step
    ends: dict[str, bool] = field(default_factory=dict)  # request id -> aborted (the engine finished it)
    preempted: list[str] = field(default_factory=list)  # blocks freed for a recompute: the stream is cut
    tasks: list[StreamTask] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)  # decode requests dropped while streaming
    applied: bool = False  # set by the worker that applied it (the engine may hand it over more than once)

    def __bool__(self) -> bool:
        return bool(
            self.starts or self.blocks or self.computed or self.ends or self.preempted or self.tasks or self.cancels
        )


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
    preempted: bool = False  # the engine freed the blocks itself: nothing to report
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
        self._thread = NamedThread(target=self._run, name="kvbridge-publish", daemon=True)
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
        on_progress: Callable[[str], None] | None = None,
        wake_interval_s: float = WAKE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """A prefill rank's stream producer; `abort`, `on_progress` tie it to the server. See docs/internals.md."""
        self.ledger = ledger
        self.wake_interval_s = wake_interval_s
        self._clock = clock
        self._abort = abort
        self.block_size = block_size
        self.agent: KVAgent | None = None
        self.layers: dict[str, int] = {}
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}  # transfer id -> stream
        self._by_request: dict[str, str] = {}  # the engine's request id -> transfer id
        self._finished: set[str] = set()  # request ids whose blocks the engine may free now
        self._on_progress = on_progress
        self._publisher: _Publisher | None = None  # started on the first layer a device must finish first

    def _changed(self, transfer_id: str) -> None:
        if self._on_progress is not None:
            self._on_progress(transfer_id)

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
            # the decode side states its release count; the engine frees a preempted stream's blocks by itself
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
            # Before the engine may reuse the blocks: a read in flight then fails its fenced DONE. Not once the
            # reads are held: the prompt's KV is whole, the engine holds the blocks until the lease ends, as for
            # a finished pull-mode request, and readers were told their reads need no fence.
            if aborted and not s.held:
                self._abort(tid, "prefill aborted or preempted the request")
            self._maybe_finish(tid)

    def save_layer(self, layer_name: str) -> None:
        """After layer `layer_name`'s attention queued this step's KV: make it readable. See docs/internals.md."""
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
        """Make `w`'s layer readable (after the device's wait, or the staging copy once `waited`); tell its readers."""
        assert self.agent is not None
        s = w.stream
        self.agent.publish(w.blocks, layers=(w.layer,), waited=waited)
        with self._lock:
            if s.preempted:  # its lease was aborted since: nothing to tell
                return
            others = all(r >= s.tokens for i, r in enumerate(s.ready) if i != w.layer)
        held = False
        if s.held_at_end and w.step >= s.tokens and others:
            # The prompt's last layer: the engine finishes the request in this step, so its blocks are freed
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
        """Whether readers are woken at the end of a step that does not end the prompt. See docs/internals.md."""
        now = self._clock()
        if s.tokens - s.step <= s.step - s.begun or now - s.woken_at >= self.wake_interval_s:
            s.woken_at = now
            return True
        return False

    def query(self, transfer_id: str, epoch: int) -> StreamStatus:
        """The stream's status for a reader (`ControlServer.streams`).

        Its lease lists the blocks so far (`Ledger.extend` grows it with the stream)."""
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
