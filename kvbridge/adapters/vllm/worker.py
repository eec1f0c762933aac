"""Worker side of KVBridgeConnector: vLLM's hooks on one rank's engine-neutral session sides. See docs/internals.md."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from kvbridge.adapters.vllm.cache import ASCEND_KV_TUPLE, byte_views, describe_kv_caches, resolved_layout
from kvbridge.adapters.vllm.inbox import find_engine_inbox
from kvbridge.adapters.vllm.layerwise import check_streamable
from kvbridge.adapters.vllm.metadata import KVBridgeMetadata, KVBridgeWorkerMeta
from kvbridge.adapters.vllm.settings import Settings
from kvbridge.adapters.vllm.stats import KVBridgeStats
from kvbridge.agent.kv_agent import KVAgent
from kvbridge.plan.rank_ports import side_channel_port
from kvbridge.plan.topology import ParallelConfig
from kvbridge.plugin.placement import device_of
from kvbridge.session.arrivals import RelayedInbox
from kvbridge.session.decode_side import DecodeSide
from kvbridge.session.outbox import Inbox, Outbox
from kvbridge.session.prefill_side import PrefillSide
from kvbridge.session.pull_control import CONTROL_TIMEOUT_S, PullControl
from kvbridge.transport import netguard

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)


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
        relayed: bool = False,
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
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.pp_rank, self.pp_size = pp_rank, pp_size
        # the rank's identity on the side channel and in plans: its rank among all DP ranks' TP ranks
        self.parallel = ParallelConfig(tp=tp_size, dp=dp_size)
        self.rank = dp_index * tp_size + tp_rank
        self.stats = KVBridgeStats()
        self._guards = netguard.StatesWatch()  # vLLM asks for stats twice a step
        # the engine core's input queue (in its process, or as it tells a worker process of it): an idle step that may
        # sleep long (transfers in flight) still ends the moment a request arrives
        inbox: Inbox | None = find_engine_inbox()
        self.arrivals: RelayedInbox | None = None
        if inbox is None and relayed:
            inbox = self.arrivals = RelayedInbox.for_rank(
                engine_id, dp_index, pp_rank, tp_rank, settings.idle_wait_ms / 1e3
            )
        self.outbox = Outbox(
            inbox,
            idle_wait_s=settings.idle_wait_ms / 1e3,
            stream_idle_wait_s=settings.stream_idle_wait_s(inbox_watched=inbox is not None),
        )
        # Bound now, ready once the KV cache is registered: an early peer waits instead of failing.
        self.prefill = PrefillSide(
            engine_id,
            self.rank,
            self.outbox,
            self.stats,
            host=settings.host,
            port=side_channel_port(
                settings.side_channel_port,
                tp_rank=tp_rank,
                tp_size=tp_size,
                pp_rank=pp_rank,
                pp_size=pp_size,
                dp_index=dp_index,
            ),
            secret=settings.secret,
            insecure=settings.insecure,
            lease_s=settings.lease_s,
            block_size=block_size,
            layerwise=settings.transfer == "layerwise",
        )
        self.ledger, self.server, self.producer = self.prefill.ledger, self.prefill.server, self.prefill.producer
        self.agent: KVAgent | None = None
        self.decode: DecodeSide | None = None

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
            # a worker process of the engine core (vLLM's multiprocess executor) hears of its requests from it
            relayed=parallel.distributed_executor_backend == "mp",
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
            landing=byte_views(kv_caches, layout=self.kv_layout),
            **s.transport_options(),
        )
        # One side-channel message waits at most CONTROL_TIMEOUT_S for its answer (a healthy peer answers in
        # milliseconds; one sent to a prefill that was then killed is never answered); waiting for a peer to be
        # ready or for its offer is bounded by pull_timeout_s.
        control = PullControl(
            self.agent,
            self.server,
            secret=s.secret,
            ready_timeout_s=s.pull_timeout_s,
            timeout_s=min(s.pull_timeout_s, CONTROL_TIMEOUT_S),
            read_first=s.read_first,
        )
        self.decode = DecodeSide(
            control,
            self.outbox,
            self.stats,
            tp_rank=self.tp_rank,
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
            pull_timeout_s=s.pull_timeout_s,
            layerwise=self.producer is not None,
        )
        self.prefill.register(self.agent, list(kv_caches))
        log.info(
            "KVBridgeConnector rank %d/%d: %d layers x %d blocks over %s, side channel %s:%d",
            self.tp_rank,
            self.tp_size,
            layout.model.layers,
            layout.num_blocks,
            self.agent.backend.name,
            *self.server.address,
        )

    @property
    def control(self) -> PullControl | None:
        return None if self.decode is None else self.decode.control

    def start_load_kv(self, meta: KVBridgeMetadata) -> None:
        """Decode: start the step's pulls; prefill: hold the step's finished requests (offers)."""
        assert self.decode is not None
        self.apply_layerwise(meta)
        self.prefill.offer(meta.offers)
        self.prefill.lend_from(meta.lending)
        received = time.time()
        for task in meta.pulls:
            self.decode.pull(task, received)

    def apply_layerwise(self, meta: KVBridgeMetadata) -> None:
        """Take this step's layer-wise work once, at whichever hook comes first.

        vLLM starts async loads after the forward, but the forward's layers need the step's streams."""
        lw = meta.layerwise
        if lw.applied or not lw:
            return
        lw.applied = True
        assert self.decode is not None
        self.prefill.apply(lw)
        for rid in lw.cancels:
            self.decode.cancel(rid)
        for task in lw.tasks:
            self.decode.stream(task)

    def save_kv_layer(self, meta: KVBridgeMetadata, layer_name: str) -> None:
        self.apply_layerwise(meta)
        self.prefill.save_layer(layer_name)

    def get_finished(
        self, _finished_req_ids: set[str], *, idle: bool = False, arrivals: int | None = None
    ) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose blocks prefill may free, and requests decode has loaded. See docs/internals.md.

        `arrivals`: the requests the engine core had taken from its input queue for this step (ArrivalRelay)."""
        if self.arrivals is not None and arrivals is not None:
            self.arrivals.step(arrivals)
        sending, recving = self.outbox.take(idle, pending=self.prefill.has_finished_streams())
        sending |= self.prefill.take_finished_streams()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.outbox.take_load_errors()

    def shutdown(self) -> None:
        if self.decode is not None:
            self.decode.close()
        self.prefill.close()
        if self.agent is not None:
            self.agent.close()
        if self.arrivals is not None:
            self.arrivals.close()

    def take_stats(self) -> KVBridgeStats | None:
        for g in self._guards.changed() or ():  # shown in /metrics from the first stats on, then on every change
            self.stats.record_guard(g.what.split()[0], g.open, g.admitted)
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def take_timings(self) -> KVBridgeWorkerMeta | None:
        timings = self.outbox.take_timings()
        return KVBridgeWorkerMeta(timings) if timings else None
