"""Worker side of KVBridgeConnector: a `KVAgent` and a `kvbridge.control` side channel per rank.

Every rank serves a `ControlServer` (its `RankInfo`, readiness, and the `Ledger` of the requests it
prefilled). Decode pulls run through `DecodeControl` on a small thread pool between engine steps
(vLLM's async load): find each prefill rank, wait for it to be ready and to hold the request,
BeginPull, read this rank's share (only the heads it holds), then fenced DONEs. A pull that fails,
or whose lease did not hold through the read, marks its blocks as load errors, and vLLM's
`kv_load_failure_policy` decides (recompute or fail). A request decode will not read (dropped before
its blocks were allocated, or all in decode's own prefix cache) is aborted on the prefill side.
Prefill reports a request as finished sending when its lease is released, expires or is aborted.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from kvbridge.adapters.vllm.cache import describe_kv_caches
from kvbridge.adapters.vllm.metadata import KVBridgeMetadata, PullTask
from kvbridge.adapters.vllm.settings import Settings
from kvbridge.adapters.vllm.stats import KVBridgeStats
from kvbridge.agent import KVAgent, PullResult
from kvbridge.backend import wait_all
from kvbridge.control import ControlServer, DecodeControl, Lease, LeaseState, Ledger
from kvbridge.errors import KVBridgeError
from kvbridge.topology import ParallelConfig

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)


class WorkerSide:
    """One worker rank of the connector; `from_vllm` reads its place from vLLM's parallel state."""

    def __init__(self, engine_id: str, settings: Settings, *, block_size: int, tp_rank: int = 0, tp_size: int = 1,
                 dp_index: int = 0) -> None:
        self.engine_id = engine_id
        self.settings = settings
        self.block_size = block_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        port = settings.side_channel_port + dp_index * tp_size + tp_rank
        self.agent: KVAgent | None = None
        self.control: DecodeControl | None = None
        self.ledger = Ledger(self._released, timeout_s=settings.lease_s)
        # Bound now, ready once the KV cache is registered: an early peer waits instead of failing.
        self.server = ControlServer(engine_id, self.tp_rank, ledger=self.ledger, host=settings.host, port=port,
                                    secret=settings.secret)
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvbridge-pull")
        self._lock = threading.Lock()
        self._sent: set[str] = set()
        self._recved: set[str] = set()
        self._load_errors: set[int] = set()
        self.stats = KVBridgeStats()

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig, engine_id: str, settings: Settings) -> WorkerSide:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return cls(engine_id, settings, block_size=vllm_config.cache_config.block_size,
                   tp_rank=get_tensor_model_parallel_rank(), tp_size=get_tensor_model_parallel_world_size(),
                   dp_index=vllm_config.parallel_config.data_parallel_index)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout, storages = describe_kv_caches(kv_caches, block_size=self.block_size, tp_size=self.tp_size)
        s = self.settings
        self.agent = KVAgent(self.engine_id, self.tp_rank, ParallelConfig(tp=self.tp_size), layout, storages,
                             backend=s.migration_backend, protocol=s.protocol, hostname=s.host,
                             metadata_server=s.metadata_server)
        if s.fault_injection:
            from kvbridge.chaos.inject import install

            install(self.agent.backend, s.fault_injection)
        self.control = DecodeControl(self.agent, self.server, secret=s.secret, ready_timeout_s=s.pull_timeout_s,
                                     timeout_s=s.pull_timeout_s)
        self.server.register(self.agent.info())
        log.info("KVBridgeConnector rank %d/%d: %d layers x %d blocks over %s, side channel %s:%d",
                 self.tp_rank, self.tp_size, layout.model.layers, layout.num_blocks, self.agent.backend.name,
                 *self.server.address)

    # -- decode: pull; prefill: hold finished requests (offers) -------------------------------

    def start_load_kv(self, meta: KVBridgeMetadata) -> None:
        assert self.agent is not None
        for request_id, blocks in meta.offers:
            self.agent.publish(blocks)  # computed by now; through staging, copied to the host mirror
            self.ledger.offer(request_id, blocks)  # the decode side states how many of its ranks read
        for task in meta.pulls:
            if task.local_block_ids:
                self._pool.submit(self._pull, task)
            else:
                self._release(task)

    def _release(self, task: PullTask) -> None:
        """Decode reads nothing of the request: free it on every prefill rank now (once per engine)."""
        assert self.control is not None
        if self.tp_rank == 0:
            try:
                self.control.abort(task.params, reason="decode reads none of its KV")
            except KVBridgeError as exc:  # the prefill lease then expires
                log.error("request %s: cannot release its prefill blocks: %s", task.request_id, exc)
        if task.report:
            with self._lock:
                self._recved.add(task.request_id)

    def _pull(self, task: PullTask) -> None:
        assert self.control is not None
        outcome: list[BaseException | None] = []
        result: PullResult | None = None
        elapsed = 0.0
        begun = time.perf_counter()
        try:
            handle = self.control.start(task.request_id, task.params, task.local_block_ids,
                                        on_finished=lambda _rid, error: outcome.append(error))
            # `start` returns as soon as the transfers are submitted. The stats time the transfer itself,
            # as vLLM's own connectors do: not the control round trips before it or the DONEs after it.
            start = time.perf_counter()
            wait_all(handle.handles, self.settings.pull_timeout_s)
            elapsed = time.perf_counter() - start
            result = handle.wait(self.settings.pull_timeout_s)  # on_finished has run when it returns
            error = outcome[0]
            log.debug("request %s: control %.1f ms, transfer %.1f ms, DONEs %.1f ms", task.request_id,
                      (start - begun) * 1e3, elapsed * 1e3, (time.perf_counter() - start - elapsed) * 1e3)
        except KVBridgeError as exc:
            error = exc
        except Exception as exc:  # a bug must surface as a load error, never as unread blocks counted as loaded
            log.exception("request %s: pull from %s failed", task.request_id, task.params.remote_engine_id)
            error = exc
        if error is None and result is not None:
            self.stats.record(elapsed, result.nbytes, result.descriptors)
        elif isinstance(error, KVBridgeError):
            log.error("request %s: pull from %s failed: %s", task.request_id, task.params.remote_engine_id, error)
        with self._lock:
            if error is not None:
                self.stats.record_failure()
                self._load_errors.update(task.local_block_ids)
            if task.report:
                self._recved.add(task.request_id)

    def _released(self, lease: Lease, _reason: LeaseState) -> None:
        """Ledger callback (any thread): the request's blocks may be freed; vLLM hears of it in get_finished."""
        with self._lock:
            self._sent.add(lease.request_id)

    # -- both ----------------------------------------------------------------------------------

    def get_finished(self, _finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            sending, self._sent = self._sent, set()
            recving, self._recved = self._recved, set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.control is not None:
            self.control.close()
        self.server.close()
        if self.agent is not None:
            self.agent.close()

    def take_stats(self) -> KVBridgeStats | None:
        return None if self.stats.is_empty() else self.stats.clone_and_reset()
