"""Scheduler side of KVBridgeConnector: what to pull and which finished requests to hold. See docs/internals.md."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import attrs

from kvbridge.adapters.vllm.layerwise import LayerwiseScheduler
from kvbridge.adapters.vllm.marked import MarkedRequests
from kvbridge.adapters.vllm.metadata import KVBridgeMetadata, KVBridgeWorkerMeta
from kvbridge.adapters.vllm.settings import Settings
from kvbridge.base.errors import ConfigError
from kvbridge.control.client import ClientPool
from kvbridge.control.messages import Offer
from kvbridge.control.params import KVTransferParams
from kvbridge.plan.rank_ports import group_port
from kvbridge.session.lending import StepLending, precopied
from kvbridge.session.offers import Offers
from kvbridge.session.tasks import PullTask, StreamTask

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def checked_params(request: Request) -> dict[str, Any] | None:
    """The request's `kv_transfer_params`, or None when they are no dict or, asking for a transfer, do not decode.

    None is also set on the request, and logged: such a request is served as a colocated server would."""
    params = request.kv_transfer_params
    if params is None:
        return None
    if not isinstance(params, dict):
        problem = f"kv_transfer_params must be a JSON object, got {type(params).__name__}"
    elif not (params.get("do_remote_prefill") or params.get("do_remote_decode")):
        return params
    else:
        try:
            KVTransferParams.from_dict(params)
            return params
        except ConfigError as exc:
            problem = str(exc)
    log.error(
        "request %s: %s; served as a colocated server would, the params ignored (the proxy sets them: "
        "kvbridge proxy, or vLLM's P/D proxies)",
        request.request_id,
        problem,
    )
    request.kv_transfer_params = None
    return None


class SchedulerSide:
    """Prefill keeps `do_remote_decode` requests' blocks; decode loads `do_remote_prefill`'s. See docs/internals.md."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str, settings: Settings) -> None:
        self.engine_id = engine_id
        self.settings = settings
        parallel = vllm_config.parallel_config
        self.tp_size = parallel.tensor_parallel_size
        self.block_size = vllm_config.cache_config.block_size
        self.pp_size = parallel.pipeline_parallel_size  # decode refuses another PP size (each stage reads its own)
        self.dp_rank, self.dp_size = parallel.data_parallel_index, parallel.data_parallel_size
        # published: the engine's base port; peers add a rank's global index to it (kvbridge.plan.rank_ports)
        self.side_channel_port = group_port(settings.side_channel_port, tp_size=self.tp_size, pp_size=self.pp_size)
        # this engine's worker ranks (every stage and TP rank of this DP rank), told of offers at once
        own = group_port(settings.side_channel_port, tp_size=self.tp_size, pp_size=self.pp_size, dp_index=self.dp_rank)
        self.offering = Offers(
            [(settings.host, own + i) for i in range(self.tp_size * self.pp_size)],
            early=settings.early_offer,
            clients=ClientPool(secret=settings.secret, timeout_s=1.0, sender=f"{engine_id}/scheduler"),
        )
        self._pulls: list[PullTask] = []
        self._offers: list[Offer] = []
        self._remote: dict[str, KVTransferParams] = {}  # decoded params of requests still to pull
        self._timings: dict[str, dict[str, float]] = {}  # what the workers measured, until the request ends
        self.marked = MarkedRequests(self.block_size)
        self.layerwise = LayerwiseScheduler(
            self.block_size,
            enabled=settings.transfer == "layerwise",
            # 0 where vLLM does not say: streams then keep their fenced DONEs
            one_batch_at_a_time=getattr(vllm_config, "max_concurrent_batches", 0) == 1,
        )

    def on_new_request(self, request: Request) -> None:
        """Check the request's params as it arrives (vLLM reads them itself right after)."""
        checked_params(request)

    def _decode_params(self, request: Request) -> KVTransferParams | None:
        """The request's params if it is still to be pulled (decoded on first sight), else None."""
        params = checked_params(request)
        if not params or not params.get("do_remote_prefill"):
            return None
        decoded = self._remote.get(request.request_id)
        if decoded is None:
            try:
                decoded = KVTransferParams.from_dict(params).migration_resolved()
                decoded.require_remote()
                if precopied(decoded.kvbridge_migration_id or "") is not None:
                    # a pre-copy reads whole blocks the source has surely filled: one block short of what the proxy
                    # saw (the source may not have told its workers of the last one yet); this side computes the rest
                    whole = max(0, int(decoded.remote_num_tokens or 0) // self.block_size - 1) * self.block_size
                    decoded = attrs.evolve(decoded, remote_num_tokens=whole)
            except ConfigError as exc:
                log.error("request %s: %s; its prompt is computed here instead", request.request_id, exc)
                params["do_remote_prefill"] = False
                return None
            self._remote[request.request_id] = decoded
        return decoded

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        checked_params(request)  # also where a vLLM without on_new_request shows the request first
        self.layerwise.note_producer(request)
        self.marked.see(request)
        decoded = self._decode_params(request)
        if decoded is not None:
            # a migrated request's source holds the KV of all but its last token (vLLM computes that one anyway)
            held = len(request.prompt_token_ids or ())
            if decoded.kvbridge_migration_id is not None:
                held = min(held, int(decoded.remote_num_tokens or 0))
            count = held - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self._decode_params(request) is None:
            return
        # A full hit in decode's own prefix cache loads nothing, but prefill must still be told.
        local = blocks.get_unhashed_block_ids() if num_external_tokens > 0 else []
        self._add_pull(request, local, report=num_external_tokens > 0)

    def _add_pull(self, request: Request, local: list[int], report: bool) -> None:
        assert request.kv_transfer_params is not None
        request.kv_transfer_params["do_remote_prefill"] = False  # one pull per request, also after a preemption
        params = self._remote.pop(request.request_id)
        if params.transfer_mode == "layerwise":  # read while prefill computes: all the prompt's blocks
            tokens = len(request.prompt_token_ids or ())
            skip = max(0, -(-tokens // self.block_size) - len(local)) if local else 0
            self.layerwise.add_task(StreamTask(request.request_id, params, local, tokens, skip))
            return
        try:
            self._pulls.append(PullTask.from_params(request.request_id, params, local, self.block_size, report))
        except ConfigError as exc:  # only reachable with report=False: nothing was to be loaded
            log.error("request %s: cannot release its prefill blocks: %s", request.request_id, exc)

    def _migrating(self, request: Request, params: dict[str, Any], block_ids: list[int]) -> bool:
        """A decode request marked for migration, then cut: hold its blocks under that id. See docs/internals.md."""
        from vllm.v1.request import RequestStatus

        migration = params.get("kvbridge_migration_id")
        if request.status != RequestStatus.FINISHED_ABORTED or params.get("do_remote_decode") or not migration:
            return False
        if not isinstance(migration, str) or not block_ids or precopied(migration) is not None:
            return False
        log.info(
            "request %s: cut for migration; %d blocks (%d tokens) offered under lease %s",
            request.request_id,
            len(block_ids),
            request.num_computed_tokens,
            migration,
        )
        return True

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KVBridgeWorkerMeta):
            self._timings.update(meta.timings)

    def build_connector_meta(self, scheduler_output: Any) -> KVBridgeMetadata:
        layerwise = self.layerwise.collect(scheduler_output)
        meta = KVBridgeMetadata(
            pulls=self._pulls,
            offers=self._offers,
            layerwise=layerwise,
            lending=self.marked.collect(scheduler_output) if scheduler_output is not None else StepLending(),
            idle=scheduler_output is not None and not scheduler_output.total_num_scheduled_tokens,
        )
        self._pulls, self._offers = [], []
        return meta

    def shutdown(self) -> None:
        self.offering.close()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = checked_params(request)
        timing = self._timings.pop(request.request_id, None)
        if not params:
            return False, None
        cut = self._migrating(request, params, block_ids)
        held = self.marked.finished(request, offered=cut)  # a live move may still read it (docs/elastic.md)
        if self._decode_params(request) is not None:
            # Decode dropped the request (abort) before any block was allocated: release prefill's.
            self._add_pull(request, [], report=False)
            return False, None
        if cut:
            self._offers.append(self.offering.make(params["kvbridge_migration_id"], block_ids, request.request_id))
            return True, None
        if (
            request.status == RequestStatus.FINISHED_ABORTED
            and params.get("transfer_mode") == "layerwise"
            and not params.get("do_remote_decode")
        ):
            self.layerwise.cancel(request.request_id)  # dropped while streaming: stop reading, abort on prefill
        streamed = self.layerwise.producer_finished(
            request, request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        )
        if streamed is False:
            return held, None
        if not params.get("do_remote_decode"):
            # A decode answers with what its workers measured of the pull, for the proxy's timeline.
            return held, None if timing is None else KVTransferParams(kvbridge_timing=timing).to_dict()
        if streamed is None:  # pull mode: offer the finished request's blocks
            if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
                return False, None  # aborted prefill: nobody will pull, free now
            if not block_ids:
                return False, None
            self._offers.append(self.offering.make(request.request_id, block_ids))
        return True, KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=self.engine_id,
            remote_request_id=request.request_id,
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
