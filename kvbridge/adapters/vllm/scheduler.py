"""Scheduler side of KVBridgeConnector: what to pull and which finished requests to hold. See docs/internals.md."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from kvbridge.adapters.vllm.inbox import engine_input_queue
from kvbridge.adapters.vllm.layerwise import LayerwiseScheduler
from kvbridge.adapters.vllm.marked import MarkedRequests
from kvbridge.adapters.vllm.metadata import KVBridgeMetadata, KVBridgeWorkerMeta
from kvbridge.adapters.vllm.settings import Settings
from kvbridge.base.errors import ConfigError
from kvbridge.control.client import ClientPool
from kvbridge.control.messages import Offer
from kvbridge.control.params import KVTransferParams
from kvbridge.plan.rank_ports import group_port
from kvbridge.session.arrivals import ArrivalRelay
from kvbridge.session.early_offers import EarlyOffers
from kvbridge.session.holding import Holding
from kvbridge.session.lending import StepLending
from kvbridge.session.requests import RequestParams
from kvbridge.session.tasks import PullTask, StreamTask

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class SchedulerSide:
    """Prefill keeps `do_remote_decode` requests' blocks; decode loads `do_remote_prefill`'s. See docs/internals.md."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str, settings: Settings) -> None:
        self.engine_id = engine_id
        self.settings = settings
        parallel = vllm_config.parallel_config
        self.tp_size = parallel.tensor_parallel_size
        self.block_size = vllm_config.cache_config.block_size
        # what it pulls is kept for a later request (a live move's continuation) only with prefix caching
        self.prefix_cache = bool(vllm_config.cache_config.enable_prefix_caching)
        self.pp_size = parallel.pipeline_parallel_size  # decode refuses another PP size (each stage reads its own)
        self.dp_rank, self.dp_size = parallel.data_parallel_index, parallel.data_parallel_size
        # published: the engine's base port; peers add a rank's global index to it (kvbridge.plan.rank_ports)
        self.side_channel_port = group_port(settings.side_channel_port, tp_size=self.tp_size, pp_size=self.pp_size)
        # this engine's worker ranks (every stage and TP rank of this DP rank), told of offers at once
        own = group_port(settings.side_channel_port, tp_size=self.tp_size, pp_size=self.pp_size, dp_index=self.dp_rank)
        self.early_offers = EarlyOffers(
            [(settings.host, own + i) for i in range(self.tp_size * self.pp_size)],
            early=settings.early_offer,
            clients=ClientPool(secret=settings.secret, timeout_s=1.0, sender=f"{engine_id}/scheduler"),
        )
        # worker processes (vLLM's multiprocess executor) hear of each request that arrives: their idle steps sleep
        inbox = engine_input_queue() if parallel.distributed_executor_backend == "mp" else None
        self.arrivals = ArrivalRelay.to_ranks(inbox, engine_id, self.dp_rank, self.pp_size, self.tp_size)
        self._pulls: list[PullTask] = []
        self._offers: list[Offer] = []
        self.holding = Holding()  # what a drain waits for (`Membership` sets its `draining`)
        self._requests: dict[str, RequestParams] = {}  # each request vLLM showed, until request_finished
        self._timings: dict[str, dict[str, float]] = {}  # what the workers measured, until the request ends
        # decode requests whose KV is still arriving (a pull or stream the workers report in finished_recving)
        self._receiving: set[str] = set()
        self.marked = MarkedRequests(self.block_size)
        self.layerwise = LayerwiseScheduler(
            self.block_size,
            enabled=settings.transfer == "layerwise",
            # 0 where vLLM does not say: streams then keep their fenced DONEs
            one_batch_at_a_time=getattr(vllm_config, "max_concurrent_batches", 0) == 1,
        )

    def on_new_request(self, request: Request) -> None:
        """Decode the request's params as it arrives (vLLM reads them itself right after)."""
        self._entry(request)

    def _entry(self, request: Request) -> RequestParams:
        """The request's decoded params, decoded on first sight."""
        entry = self._requests.get(request.request_id)
        if entry is None:
            entry = RequestParams.read(request.request_id, request.kv_transfer_params)
            if entry is None:  # logged; vLLM reads the params right after on_new_request
                request.kv_transfer_params, entry = None, RequestParams()
            self._requests[request.request_id] = entry
        return entry

    def _pull(self, request: Request, entry: RequestParams) -> KVTransferParams | None:
        """What the request still pulls, worked out on first need; None once pulled, or (logged) where it names none."""
        if entry.remote_prefill and entry.pull is None:
            try:
                entry.pull = entry.to_pull(self.block_size)
            except ConfigError as exc:
                log.error("request %s: %s; its prompt is computed here instead", request.request_id, exc)
                entry.remote_prefill = False
        return entry.pull

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        entry = self._entry(request)  # also where a vLLM without on_new_request shows the request first
        if entry.layerwise and entry.remote_decode:
            assert entry.decoded is not None
            if not self.layerwise.note_producer(request, entry.decoded.transfer_id):
                entry.served_pulled()
        if entry.move_id is not None:
            self.marked.see(request, entry.move_id)
        decoded = self._pull(request, entry)
        if decoded is not None:
            # a moved request's source holds the KV of all but its last token (vLLM computes that one anyway)
            held = len(request.prompt_token_ids or ())
            if decoded.resumes_move:
                held = min(held, int(decoded.remote_num_tokens or 0))
            count = held - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        entry = self._entry(request)
        if self._pull(request, entry) is None:
            return
        # A full hit in decode's own prefix cache loads nothing, but prefill must still be told.
        local = blocks.get_unhashed_block_ids() if num_external_tokens > 0 else []
        self._add_pull(request, entry, local, report=num_external_tokens > 0)

    def _add_pull(self, request: Request, entry: RequestParams, local: list[int], report: bool) -> None:
        params, entry.pull, entry.remote_prefill = entry.pull, None, False  # one pull, also after a preemption
        assert params is not None
        if report:
            self._receiving.add(request.request_id)
        if params.transfer_mode == "layerwise":  # read while prefill computes: all the prompt's blocks
            tokens = len(request.prompt_token_ids or ())
            skip = max(0, -(-tokens // self.block_size) - len(local)) if local else 0
            self.layerwise.add_task(StreamTask(request.request_id, params, local, tokens, skip))
            return
        try:
            self._pulls.append(PullTask.from_params(request.request_id, params, local, self.block_size, report))
        except ConfigError as exc:  # only reachable with report=False: nothing was to be loaded
            log.error("request %s: cannot release its prefill blocks: %s", request.request_id, exc)

    def _cut_for_move(self, request: Request, entry: RequestParams, block_ids: list[int], *, receiving: bool) -> bool:
        """A decode request marked for a live move, then cut: hold its blocks under that id. See docs/internals.md.

        Not one dropped while its KV was still arriving (`receiving`): the proxy cuts a stream only after an event, so
        its client left; its blocks are the pull's to write, and vLLM frees them once the pull is reported. Offered,
        they would be freed twice (the lease's end reports them too), which stops vLLM's engine on an assertion."""
        from vllm.v1.request import RequestStatus

        if request.status != RequestStatus.FINISHED_ABORTED or entry.move_id is None or not block_ids:
            return False
        if receiving:
            log.info("request %s: dropped while its KV was still arriving: not offered for a move", request.request_id)
            return False
        log.info(
            "request %s: cut for a live move; %d blocks (%d tokens) offered under lease %s",
            request.request_id,
            len(block_ids),
            request.num_computed_tokens,
            entry.move_id,
        )
        return True

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._receiving.difference_update(output.finished_recving or ())
        self.holding.freed(output.finished_sending or ())
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KVBridgeWorkerMeta):
            self._timings.update(meta.timings)

    def build_connector_meta(self, scheduler_output: Any) -> KVBridgeMetadata:
        self.holding.report()
        layerwise = self.layerwise.collect(scheduler_output)
        meta = KVBridgeMetadata(
            pulls=self._pulls,
            offers=self._offers,
            layerwise=layerwise,
            lending=self.marked.collect(scheduler_output) if scheduler_output is not None else StepLending(),
            idle=scheduler_output is not None and not scheduler_output.total_num_scheduled_tokens,
            arrivals=self.arrivals.consumed() if self.arrivals is not None else None,
        )
        self._pulls, self._offers = [], []
        return meta

    def shutdown(self) -> None:
        self.early_offers.close()
        if self.arrivals is not None:
            self.arrivals.close()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.holding.finished(request.request_id, *self._finished(request, block_ids))

    def _finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        entry = self._entry(request)
        del self._requests[request.request_id]  # vLLM calls this once, as the request leaves
        timing = self._timings.pop(request.request_id, None)
        if not entry.given:
            return False, None
        cut = self._cut_for_move(request, entry, block_ids, receiving=request.request_id in self._receiving)
        held = self.marked.finished(request, offered=cut)  # a live move may still read it (docs/elastic.md)
        if self._pull(request, entry) is not None:  # dropped before any block was allocated: release prefill's
            if not self.holding.keeps_refused(request.request_id, getattr(request, "abort_immediately", False)):
                self._add_pull(request, entry, [], report=False)
            return False, None
        if cut:
            assert entry.move_id is not None
            self._offers.append(self.early_offers.make(entry.move_id, block_ids, request.request_id))
            return True, None
        if request.status == RequestStatus.FINISHED_ABORTED and entry.layerwise and not entry.remote_decode:
            self.layerwise.cancel(request.request_id)  # dropped while streaming: stop reading, abort on prefill
        answered = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        streamed = self.layerwise.producer_finished(request, answered)
        if streamed is False:
            return held, None
        if not entry.remote_decode:
            # A decode answers with what its workers measured of the pull, for the proxy's timeline, and whether it
            # keeps what it pulled: a live move's continuation finds it in the prefix cache, or computes it all.
            pulled = answered and entry.decoded is not None and entry.decoded.do_remote_prefill
            kept = self.prefix_cache if pulled else None
            if timing is None and kept is None:
                return held, None
            return held, KVTransferParams(kvbridge_timing=timing, kvbridge_prefix_cache=kept).to_dict()
        lease_id = request.request_id
        if streamed is None:  # pull mode: offer the finished request's blocks
            if not answered:
                return False, None  # aborted prefill: nobody will pull, free now
            if not block_ids:
                return False, None
            lease_id = entry.lease_id or lease_id
            engine_id = "" if lease_id == request.request_id else request.request_id
            self._offers.append(self.early_offers.make(lease_id, block_ids, engine_id))
        return True, KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=self.engine_id,
            remote_request_id=lease_id,
            remote_block_ids=[list(block_ids)],
            remote_host=self.settings.host,
            remote_port=self.side_channel_port,
            tp_size=self.tp_size,
            pp_size=self.pp_size,
            dp_size=self.dp_size,
            dp_rank=self.dp_rank,
            remote_num_tokens=request.num_computed_tokens,
            # arrival to finish in this engine: queueing and computing the prompt
            kvbridge_timing={"prefill_ms": round((time.time() - request.arrival_time) * 1e3, 3)},
        ).to_dict()
