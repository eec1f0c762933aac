"""Worker side of KVBridgeConnector: registers the KV cache, serves prefill ranks, pulls on decode.

Decode pulls run on a small thread pool between engine steps (vLLM's async load): fetch the prefill
rank's info once, build descriptors (vectorized), read them through the kvbridge transport, then
DONE to every prefill rank read. A pull that fails, or whose DONE says the lease expired, marks its
blocks as load errors, and vLLM's `kv_load_failure_policy` decides (recompute or fail).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import kvbridge
from kvbridge.adapters.vllm.cache import CacheLayout, describe_kv_caches, pull_descriptors, pullers, source_ranks
from kvbridge.adapters.vllm.channel import Done, DoneAck, RankInfo, SideChannelClient, SideChannelServer
from kvbridge.adapters.vllm.leases import Leases
from kvbridge.adapters.vllm.metadata import KVBridgeMetadata, PullTask
from kvbridge.adapters.vllm.settings import Settings
from kvbridge.adapters.vllm.stats import KVBridgeStats
from kvbridge.backend import Peer
from kvbridge.errors import KVBridgeError, LoadError

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
        self.layout: CacheLayout | None = None
        self.backend: kvbridge.MigrationBackend | None = None
        self.server: SideChannelServer | None = None
        self.client = SideChannelClient(timeout_s=settings.pull_timeout_s)
        self.leases = Leases(settings.lease_s)
        self._peers: dict[tuple[str, int], tuple[Peer, RankInfo]] = {}
        self._peer_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvbridge-pull")
        self._lock = threading.Lock()
        self._recved: set[str] = set()
        self._load_errors: set[int] = set()
        self.stats = KVBridgeStats()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout, storages = describe_kv_caches(
            kv_caches, block_size=self.block_size, tp_rank=self.tp_rank, tp_size=self.tp_size
        )
        s = self.settings
        self.backend = kvbridge.create_backend(
            s.migration_backend, protocol=s.protocol, hostname=s.host, metadata_server=s.metadata_server
        )
        self.backend.register_memory(storages)
        self.layout = layout
        info = RankInfo(engine_id=self.engine_id, layout=layout, endpoint=self.backend.endpoint_info())
        self.server = SideChannelServer(s.host, self.port, info, self._on_done)
        log.info("KVBridgeConnector rank %d/%d: %d layers x %d blocks of %d bytes over %s, side channel %s",
                 self.tp_rank, self.tp_size, len(layout.layer_addrs), layout.num_blocks, layout.block_bytes,
                 self.backend.name, self.server.address)

    # -- prefill: hold finished requests until every puller is done ---------------------------

    def _on_done(self, msg: Done) -> DoneAck:
        return self.leases.done(msg)

    # -- decode: pull --------------------------------------------------------------------------

    def start_load_kv(self, meta: KVBridgeMetadata) -> None:
        for request_id in meta.offers:
            self.leases.offer(request_id)
        for task in meta.pulls:
            self._pool.submit(self._pull, task)

    def _peer(self, task: PullTask, rank: int) -> tuple[Peer, RankInfo]:
        key = (task.remote_engine_id, rank)
        with self._peer_lock:
            if key not in self._peers:
                assert self.backend is not None
                info = self.client.info(self._address(task, rank), task.remote_engine_id)
                self._peers[key] = (self.backend.connect(info.endpoint), info)
            return self._peers[key]

    @staticmethod
    def _address(task: PullTask, rank: int) -> str:
        return f"{task.remote_host}:{task.remote_port + rank}"

    def _pull(self, task: PullTask) -> None:
        assert self.layout is not None and self.backend is not None
        ok = True
        ranks = source_ranks(self.layout, task.remote_tp)
        try:
            if task.local_block_ids:
                start = time.perf_counter()
                handles = []
                for rank in ranks:
                    peer, info = self._peer(task, rank)
                    desc = pull_descriptors(self.layout, info.layout, task.local_block_ids, task.remote_block_ids)
                    handles.append(self.backend.transfer(peer, desc, "read"))
                kvbridge.wait_all(handles, timeout=self.settings.pull_timeout_s)
                self.stats.record(time.perf_counter() - start, sum(h.nbytes for h in handles),
                                  sum(h.descriptors for h in handles))
        except KVBridgeError as exc:
            ok = False
            self._forget_peers(task.remote_engine_id)
            log.error("request %s: pull from %s failed: %s", task.request_id, task.remote_engine_id, exc)
        except Exception:  # a bug must surface as a load error, never as unread blocks counted as loaded
            ok = False
            log.exception("request %s: pull from %s failed", task.request_id, task.remote_engine_id)
        for rank in ranks:  # released even after a failure, so prefill need not wait for its lease
            expected = pullers(rank, task.remote_tp, self.tp_size, self.layout.total_heads)
            done = Done(task.remote_request_id, self.tp_rank, expected, pulled=ok and bool(task.local_block_ids))
            try:
                ack = self.client.done(self._address(task, rank), done)
                if not ack.ok and task.local_block_ids:
                    raise LoadError(ack.reason, peer=self._address(task, rank), request=task.request_id,
                                    cause="lease expired")
            except KVBridgeError as exc:
                ok = ok and not task.local_block_ids
                log.error("request %s: DONE to prefill rank %d: %s", task.request_id, rank, exc)
        with self._lock:
            if not ok:
                self.stats.record_failure()
                self._load_errors.update(task.local_block_ids)
            if task.report:
                self._recved.add(task.request_id)

    def _forget_peers(self, engine_id: str) -> None:
        with self._peer_lock:
            for key in [k for k in self._peers if k[0] == engine_id]:
                peer, _ = self._peers.pop(key)
                if self.backend is not None:
                    self.backend.disconnect(peer)

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
        if self.backend is not None:
            self.backend.close()

    def take_stats(self) -> KVBridgeStats | None:
        return None if self.stats.is_empty() else self.stats.clone_and_reset()
