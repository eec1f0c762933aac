"""Layer-wise streaming (`"transfer": "layerwise"`), vLLM's scheduler half. See docs/internals.md."""

from __future__ import annotations

import logging
from typing import Any

from kvbridge.base.errors import ConfigError
from kvbridge.session.stream import LayerwiseMeta, StreamStart
from kvbridge.session.tasks import StreamTask

log = logging.getLogger(__name__)


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


class LayerwiseScheduler:
    """The scheduler's part: which prefill requests stream (and how far they got), which decode ones read."""

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

    def note_producer(self, request: Any, transfer_id: str | None) -> bool:
        """A prefill request asking to be streamed (seen when the scheduler first considers it).

        False: this server runs pull mode, and the request is served so (offered when finished)."""
        if not self.enabled:
            log.error(
                'request %s asks for layer-wise streaming, but this server runs "transfer": "pull"; it is '
                "offered when finished instead (decode's read of it then times out and recomputes)",
                request.request_id,
            )
            return False
        if not transfer_id:
            log.error(
                "request %s asks for layer-wise streaming without a transfer_id; it is not streamed (the "
                "proxy must give both sides the same transfer_id: kvbridge proxy --transfer layerwise)",
                request.request_id,
            )
            return True
        one_token = getattr(request, "max_tokens", None) == 1
        self._producers.setdefault(request.request_id, (transfer_id, len(request.prompt_token_ids or ()), one_token))
        return True

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
