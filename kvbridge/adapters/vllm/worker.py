"""Worker side of KVBridgeConnector: a `KVAgent` per rank, a side channel on prefill, pulls on decode.

Decode pulls run on a small thread pool between engine steps (vLLM's async load): fetch each prefill
rank's `RankInfo` once, let the agent plan and read this rank's share (only the heads it holds),
then DONE to every prefill rank the plan has it read (and, on the plan's notifier rank, to the
prefill ranks nobody reads). A pull that fails, or whose DONE says the lease expired, marks its
blocks as load errors, and vLLM's `kv_load_failure_policy` decides (recompute or fail).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from kvbridge.adapters.vllm.cache import describe_kv_caches
from kvbridge.adapters.vllm.channel import Done, SideChannelClient, SideChannelServer
from kvbridge.adapters.vllm.leases import Leases
from kvbridge.adapters.vllm.metadata import KVBridgeMetadata, PullTask
from kvbridge.adapters.vllm.settings import Settings
from kvbridge.adapters.vllm.stats import KVBridgeStats
from kvbridge.agent import KVAgent, RankInfo
from kvbridge.errors import KVBridgeError, LoadError
from kvbridge.topology import ParallelConfig, Plan

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)


class WorkerSide:
    def __init__(self, vllm_config: VllmConfig, engine_id: str, settings: Settings) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        self.engine_id = engine_id
        self.settings = settings
        self.block_size = vllm_config.cache_config.block_size
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        parallel = vllm_config.parallel_config
        self.port = settings.side_channel_port + parallel.data_parallel_index * self.tp_size + self.tp_rank
        self.agent: KVAgent | None = None
        self.server: SideChannelServer | None = None
        self.client = SideChannelClient(timeout_s=settings.pull_timeout_s)
        self.leases = Leases(settings.lease_s)
        self._infos: dict[tuple[str, int], RankInfo] = {}
        self._info_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvbridge-pull")
        self._lock = threading.Lock()
        self._recved: set[str] = set()
        self._load_errors: set[int] = set()
        self.stats = KVBridgeStats()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout, storages = describe_kv_caches(kv_caches, block_size=self.block_size, tp_size=self.tp_size)
        s = self.settings
        self.agent = KVAgent(self.engine_id, self.tp_rank, ParallelConfig(tp=self.tp_size), layout, storages,
                             backend=s.migration_backend, protocol=s.protocol, hostname=s.host,
                             metadata_server=s.metadata_server)
        # Prefill ranks answer RankInfo requests and count DONEs into the leases.
        self.server = SideChannelServer(s.host, self.port, self.agent.info(), self.leases.done)
        log.info("KVBridgeConnector rank %d/%d: %d layers x %d blocks over %s, side channel %s",
                 self.tp_rank, self.tp_size, layout.model.layers, layout.num_blocks, self.agent.backend.name,
                 self.server.address)

    # -- decode: pull; prefill: hold finished requests (offers) -------------------------------

    def start_load_kv(self, meta: KVBridgeMetadata) -> None:
        for request_id in meta.offers:
            self.leases.offer(request_id)
        for task in meta.pulls:
            self._pool.submit(self._pull, task)

    def _info(self, task: PullTask, rank: int) -> RankInfo:
        key = (task.remote_engine_id, rank)
        with self._info_lock:
            info = self._infos.get(key)
        if info is None:
            info = self.client.info(self._address(task, rank), task.remote_engine_id)
            with self._info_lock:
                self._infos[key] = info
        return info

    @staticmethod
    def _address(task: PullTask, rank: int) -> str:
        return f"{task.remote_host}:{task.remote_port + rank}"

    def _plan(self, task: PullTask) -> tuple[Plan, list[tuple[int, int]]]:
        """The request's plan and the (prefill rank, expected DONEs) this rank must tell."""
        assert self.agent is not None
        tokens = max(1, len(task.local_block_ids)) * self.block_size
        plan = self.agent.plan(ParallelConfig(tp=task.remote_tp), tokens)
        ranks = sorted({p.prefill_rank for p in plan.pulls_for(self.tp_rank)})
        if self.tp_rank == plan.notifier:
            ranks += [r for r in plan.unpulled if r not in ranks]
        return plan, [(r, plan.release_count(r)) for r in ranks]

    def _pull(self, task: PullTask) -> None:
        assert self.agent is not None
        ok = True
        targets: list[tuple[int, int]] = []
        try:
            plan, targets = self._plan(task)
            if task.local_block_ids:
                infos = [self._info(task, r) for r in plan.prefill_ranks]
                start = time.perf_counter()  # the transfer itself; a first contact's RankInfo fetch is not in it
                tokens = len(task.local_block_ids) * self.block_size
                result = self.agent.pull(task.request_id, infos, task.remote_block_ids, task.local_block_ids,
                                         tokens).wait(self.settings.pull_timeout_s)
                self.stats.record(time.perf_counter() - start, result.nbytes, result.descriptors)
        except KVBridgeError as exc:
            ok = False
            self._forget(task.remote_engine_id)
            log.error("request %s: pull from %s failed: %s", task.request_id, task.remote_engine_id, exc)
        except Exception:  # a bug must surface as a load error, never as unread blocks counted as loaded
            ok = False
            log.exception("request %s: pull from %s failed", task.request_id, task.remote_engine_id)
        for rank, expected in targets:  # released even after a failure, so prefill need not wait for its lease
            done = Done(task.remote_request_id, self.tp_rank, expected, pulled=ok and bool(task.local_block_ids))
            try:
                ack = self.client.done(self._address(task, rank), done)
                if not ack.ok and task.local_block_ids and expected:
                    raise LoadError(ack.reason, peer=self._address(task, rank), request=task.request_id,
                                    cause="lease expired")
            except KVBridgeError as exc:
                ok = ok and not (expected and task.local_block_ids)  # unconfirmed read: not trusted
                log.error("request %s: DONE to prefill rank %d: %s", task.request_id, rank, exc)
        with self._lock:
            if not ok:
                self.stats.record_failure()
                self._load_errors.update(task.local_block_ids)
            if task.report:
                self._recved.add(task.request_id)

    def _forget(self, engine_id: str) -> None:
        """Drop what is cached about an engine (it may have restarted at the same address)."""
        with self._info_lock:
            for key in [k for k in self._infos if k[0] == engine_id]:
                del self._infos[key]

    # -- both ----------------------------------------------------------------------------------

    def get_finished(self, _finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending = self.leases.take_released()
        with self._lock:
            recving, self._recved = self._recved, set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.server is not None:
            self.server.close()
        self.client.close()
        if self.agent is not None:
            self.agent.close()

    def take_stats(self) -> KVBridgeStats | None:
        return None if self.stats.is_empty() else self.stats.clone_and_reset()
