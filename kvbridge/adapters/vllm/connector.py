"""`KVBridgeConnector`: vLLM's `KVConnectorBase_V1` on kvbridge transports, pull mode.

Select it with `--kv-transfer-config '{"kv_connector": "KVBridgeConnector", "kv_role": "kv_both", ...}'`
(docs/vllm.md). The role only says what a server is meant for; each request's `kv_transfer_params` decides.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvbridge.adapters.vllm.cache import CUDA_DEFAULT_LAYOUT
from kvbridge.adapters.vllm.membership import Membership
from kvbridge.adapters.vllm.metadata import KVBridgeMetadata, KVBridgeWorkerMeta
from kvbridge.adapters.vllm.scheduler import SchedulerSide
from kvbridge.adapters.vllm.settings import Settings
from kvbridge.adapters.vllm.stats import KVBridgePromMetrics, KVBridgeStats
from kvbridge.adapters.vllm.worker import WorkerSide
from kvbridge.base import placement
from kvbridge.base.nativelog import quiet_native_logs
from kvbridge.control.membership import freeze_heap_for_exit

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def share_vllm_logging() -> None:
    """Send kvbridge's log records through vLLM's handlers, at vLLM's level, into the server log beside vLLM's own."""
    ours, theirs = logging.getLogger("kvbridge"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:  # the operator configured ours; vLLM configures only its own logger
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False


def default_kv_cache_layout(settings: Settings, vllm_config: VllmConfig, *, on_cuda: bool) -> str | None:
    """The layout to ask vLLM for: the operator's, else BLHNC where vLLM would use it, else None (vLLM's).

    BLHNC (block-outermost: one descriptor per block) only in pull mode, on CUDA, with a model config, for a model
    that is not hybrid, and unless the operator's attention backend declares layouts without it; docs/vllm.md,
    "Which layout the connector asks for", says why each and what it trades."""
    if settings.kv_cache_layout is not None:
        return settings.kv_cache_layout
    if settings.transfer != "pull" or not on_cuda:
        return None
    model = vllm_config.model_config
    if model is None or model.is_hybrid:
        return None
    backend = vllm_config.attention_config.backend
    if backend is not None:
        layouts = backend.get_class().supported_kv_cache_layouts()
        if layouts is not None and CUDA_DEFAULT_LAYOUT not in {layout.name for layout in layouts}:
            return None
    return CUDA_DEFAULT_LAYOUT


class KVBridgeConnector(KVConnectorBase_V1):
    """Decode reads each request's prompt KV from the prefill server that computed it."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        share_vllm_logging()
        # Native transport logs at warnings and above beside vLLM's, all of them when kvbridge logs debug.
        quiet_native_logs(max(logging.getLogger("kvbridge").getEffectiveLevel(), logging.WARNING))
        config = vllm_config.kv_transfer_config
        assert config is not None and config.engine_id is not None
        settings = Settings.from_extra_config(config.kv_connector_extra_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._membership: Membership | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(vllm_config, config.engine_id, settings)
            if settings.registry is not None:
                self._membership = Membership(vllm_config, self._scheduler, kv_cache_config.num_blocks)
        else:
            placement.pin_this_thread(settings.cpu_affinity, settings.io_cpus)  # first: the threads started after
            with placement.on_io_cpus():  # (side channel, pulls; the transport's native ones: register_kv_caches)
                self._worker = WorkerSide.from_vllm(vllm_config, config.engine_id, settings, kv_cache_config)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """The layout the operator asked for in kv_connector_extra_config, else `default_kv_cache_layout`'s.

        vLLM uses the latter when its attention backends support it. None: kvbridge moves what vLLM resolves."""
        config = vllm_config.kv_transfer_config
        if config is None:
            return None
        from vllm.platforms import current_platform

        settings = Settings.from_extra_config(config.kv_connector_extra_config)
        return default_kv_cache_layout(settings, vllm_config, on_cuda=current_platform.is_cuda())

    # -- scheduler side ------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        # vLLM calls this from its model thread; the transport starts here, and its native threads inherit the
        # starter's CPUs: kvbridge's, not the model's
        with placement.on_io_cpus():
            self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVBridgeMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous (between steps, also layer-wise ones): nothing to wait for per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Layer-wise mode: this layer's KV of the step is computed; decode may read it. Pull mode: nothing."""
        if self._worker is not None and self._worker.producer is not None:
            meta = self._get_connector_metadata()
            assert isinstance(meta, KVBridgeMetadata)
            self._worker.save_kv_layer(meta, layer_name)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the step's forward may overwrite preempted requests' blocks: end their streams' leases."""
        if self._worker is not None and isinstance(kv_connector_metadata, KVBridgeMetadata):
            self._worker.apply_layerwise(kv_connector_metadata)

    def wait_for_save(self) -> None:
        """Nothing is pushed; layer-wise work of a step without attention layers is taken here."""
        if self._worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, KVBridgeMetadata)
            self._worker.apply_layerwise(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if not isinstance(meta, KVBridgeMetadata):
            return self._worker.get_finished(finished_req_ids)
        return self._worker.get_finished(finished_req_ids, idle=meta.idle, arrivals=meta.arrivals)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> KVBridgeStats | None:
        return None if self._worker is None else self._worker.take_stats()

    def build_connector_worker_meta(self) -> KVBridgeWorkerMeta | None:
        return None if self._worker is None else self._worker.take_timings()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBridgeStats:
        return KVBridgeStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVBridgePromMetrics:
        """The `kvbridge_*` series in this server's /metrics (docs/operations.md lists them)."""
        return KVBridgePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        freeze_heap_for_exit()  # at once in a process told to stop; one that goes on living, only at its exit
        if self._membership is not None:
            self._membership.close()
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
