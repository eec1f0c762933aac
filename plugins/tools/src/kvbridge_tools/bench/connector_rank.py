"""One rank of `kvbridge bench --engine vllm-connector`, run as a child process (`kvbridge_tools.harness.proc`).

The rank allocates its KV cache as vLLM 0.32's model runner does for the layout name
(`kvbridge_tools.bench.vllm_cache`), builds a real `KVBridgeConnector` in both roles from a `VllmConfig`
(the scheduler half in this process too: its calls are deterministic, so every rank of an engine
derives the same metadata the engine core would send it), hands the views to `register_kv_caches`,
and drives the connector through vLLM's API in the engine's order:

- prefill: `request_finished` -> kv_transfer_params; `build_connector_meta` -> `start_load_kv`
  (the worker offers the finished request's blocks); later `get_finished` reports them sent;
- decode: `get_num_new_matched_tokens` -> `update_state_after_alloc` -> `build_connector_meta` ->
  `start_load_kv` -> `get_finished` until every request is received; then the fingerprints are checked.

Beside the cache each rank registers a raw buffer with the same backend, so the decode rank can time
the raw transport on the same bytes (one descriptor per request, straight to the transport: host
mirror to host mirror where the device memory is staged), as `kvbridge bench` pair mode does.
With pipeline parallelism a rank holds its stage's layers only (vLLM's global layer names).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np

from kvbridge_tools.harness.proc import serve

log = logging.getLogger(__name__)

POLL_S = 0.002


class Rank:
    def __init__(self) -> None:
        self.worker: Any = None
        self.scheduler: Any = None
        self.raw_buffer: Any = None
        self.raw_peers: dict[str, Any] = {}

    def setup(
        self,
        *,
        side: str,
        engine_id: str,
        layout: str,
        model: str,
        tp: int,
        dp: int,
        rank: int,
        block_size: int,
        num_blocks: int,
        port: int,
        backend: str,
        protocol: str | None,
        device: str = "cpu",
        device_slot: int = 0,
        pp: int = 1,
        pp_rank: int = 0,
        cache_dtype: str = "auto",
        raw_bytes: int = 0,
        fault_injection: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Allocate this rank's cache, build the connector (both roles) and register the cache.

        `device`: a device plugin's name; an accelerator rank takes device `device_slot` modulo the
        devices present. `rank`: the rank in the (DP, TP) grid of pipeline stage `pp_rank` of `pp`.
        `raw_bytes`: size of the raw buffer registered beside the cache (0: none). `fault_injection`: the
        connector's key of that name (testing only, `kvbridge.transport.faults`).
        """
        self.close()
        import attrs
        import torch
        from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        import kvbridge
        from kvbridge.adapters.vllm.cache import ASCEND_KV_TUPLE, FP8_CACHE_DTYPES, byte_views
        from kvbridge.adapters.vllm.connector import KVBridgeConnector
        from kvbridge.base.types import MemoryKind
        from kvbridge.plan.presets import get_preset
        from kvbridge.plan.topology import HeadPlacement, ParallelConfig
        from kvbridge_tools.bench.vllm_cache import allocate

        started = time.perf_counter()
        self.side, self.model, self.layout = side, get_preset(model), layout
        if cache_dtype in FP8_CACHE_DTYPES:  # one byte per element, whatever the model computes in
            self.model = attrs.evolve(self.model, dtype=FP8_CACHE_DTYPES[cache_dtype])
        if self.model.layers % pp:
            raise ValueError(f"{self.model.name}: {self.model.layers} layers do not split into {pp} pipeline stages")
        per_stage = self.model.layers // pp
        self.layers = range(pp_rank * per_stage, (pp_rank + 1) * per_stage)
        self.block_size, self.tokens_of = block_size, {}
        config = ParallelConfig(tp=tp, dp=dp)
        place = HeadPlacement.of(self.model, config, side)
        coords = config.coords(rank)
        self.heads = place.heads(coords.shard)
        self.device = kvbridge.get_device(device)
        device_id = 0
        where = "cpu"
        if self.device.memory_kind != MemoryKind.DRAM:  # an accelerator: spread the ranks over its devices
            device_id = device_slot % getattr(torch, device).device_count()
            self.device.set_current(device_id)
            where = f"{device}:{device_id}"
        extra = {"migration_backend": backend, "side_channel_port": port, "host": "127.0.0.1", "pull_timeout_s": 60.0}
        # A scheduler per rank process here, where vLLM has one per engine: only the step offers.
        extra["early_offer"] = False
        if protocol:
            extra["protocol"] = protocol
        if fault_injection is not None:
            extra["fault_injection"] = fault_injection
        vc = VllmConfig(
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVBridgeConnector",
                kv_connector_module_path="kvbridge.adapters.vllm.connector",
                kv_role="kv_producer" if side == "prefill" else "kv_consumer",
                engine_id=engine_id,
                kv_connector_extra_config=extra,
            ),
            cache_config=CacheConfig(block_size=block_size, cache_dtype=cache_dtype),
        )
        # what the engine core resolved and each worker process knows of its place
        vc.cache_config.kv_cache_layout = "LBNHC" if layout == ASCEND_KV_TUPLE else layout
        pc = vc.parallel_config
        pc.tensor_parallel_size, pc.data_parallel_size, pc.pipeline_parallel_size = tp, dp, pp
        pc.data_parallel_rank = pc.data_parallel_index = coords.dp
        pc.rank = pp_rank * tp + coords.tp
        caches, kv_cache_config = allocate(
            layout,
            self.model,
            place.per_rank,
            num_blocks,
            block_size,
            where,
            layers=self.layers,
            cache_dtype=cache_dtype,
        )
        self.scheduler = KVBridgeConnector(vc, KVConnectorRole.SCHEDULER, kv_cache_config)
        self.worker = KVBridgeConnector(vc, KVConnectorRole.WORKER, kv_cache_config)
        self.worker.register_kv_caches(caches)
        self.views = byte_views(caches, layout=layout)
        self.contents = [v[0].shape[-1] for v in self.views]
        out = {"setup_s": time.perf_counter() - started, "heads": list(self.heads), "pid": os.getpid()}
        if raw_bytes:
            backend_ = self._backend()
            buf = self.device.allocate(raw_bytes, device_id)
            self.raw_buffer = torch.from_numpy(buf) if not isinstance(buf, torch.Tensor) else buf
            (region,) = backend_.register_memory(self.raw_buffer)
            # what the transport addresses: the host mirror where the device memory is staged
            self.raw_addr = int(backend_.peer_addresses([region.addr])[0])
            out |= {"raw_addr": self.raw_addr, "endpoint": backend_.endpoint_info().hex()}
        return out

    def _backend(self) -> Any:
        """The rank's device-bound backend (its KVAgent's)."""
        return self.worker._worker.agent.backend

    def raw(self, sources: list[dict[str, Any]], timeout: float = 60.0) -> dict[str, Any]:
        """Decode: the raw transport on the same bytes as the pulls, into this rank's raw buffer.

        One descriptor per request, all submitted at once as the connector submits a step's requests.

        `sources`: per request, the prefill rank's `endpoint` and `raw_addr` and the `bytes` to read.
        """
        from kvbridge.base.errors import ConfigError
        from kvbridge.transport import staging

        backend_ = self._backend()
        transport = staging.transport(backend_)
        need = sum(int(x["bytes"]) for x in sources)
        if self.raw_buffer is None or need > self.raw_buffer.numel():
            raise ConfigError(f"raw read of {need} bytes does not fit the raw buffer; size it at setup")
        peers = []
        for x in sources:
            if x["endpoint"] not in self.raw_peers:
                peer = backend_.connect(bytes.fromhex(x["endpoint"]))
                self.raw_peers[x["endpoint"]] = peer if transport is backend_ else peer.handle
            peers.append(self.raw_peers[x["endpoint"]])
        started = time.perf_counter()
        handles, offset = [], 0
        for x, peer in zip(sources, peers):
            n = int(x["bytes"])
            handles.append(transport.raw_transfer(peer, self.raw_addr + offset, int(x["raw_addr"]), n, op="read"))
            offset += n
        for h in handles:
            h.wait(timeout)
        return {"seconds": time.perf_counter() - started, "bytes": need}

    def _request(self, rid: str, tokens: int, params: dict[str, Any]) -> Any:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
        return Request(rid, list(range(tokens)), sampling, None)

    def _step(self) -> None:
        """One engine step: the scheduler's metadata to the worker, then start_load_kv."""
        meta = self.scheduler.build_connector_meta(None)
        self.worker.bind_connector_metadata(meta)
        try:
            self.worker.start_load_kv(None)
        finally:
            self.worker.clear_connector_metadata()

    def prefill(self, requests: list[dict[str, Any]]) -> dict[str, Any]:
        """Fill each request's blocks with fingerprints (this rank's heads), finish it, offer its blocks."""
        import torch
        from vllm.v1.request import RequestStatus

        from kvbridge.agent.landing import write_logical
        from kvbridge_tools.bench.vllm_cache import logical

        out = {}
        for r in requests:
            data = logical(self.model, r["index"], r["tokens"], self.heads, self.block_size, self.layers)
            data = torch.from_numpy(data)
            write_logical(self.views, self.contents, torch.tensor(r["blocks"]), (0, len(self.heads)), data)
            req = self._request(r["id"], r["tokens"], {"do_remote_decode": True})
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            req.num_computed_tokens = r["tokens"]
            delay, params = self.scheduler.request_finished(req, list(r["blocks"]))
            if not delay or params is None:
                raise RuntimeError(f"request {r['id']}: the connector did not hold its blocks for decode")
            out[r["id"]] = params
        self._step()
        return out

    def decode(self, requests: list[dict[str, Any]], verify: bool, timeout: float = 60.0) -> dict[str, Any]:
        """Schedule every request as vLLM's scheduler would, load, wait for get_finished, verify."""
        import torch
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock
        from vllm.v1.request import RequestStatus

        from kvbridge.agent.landing import read_logical
        from kvbridge_tools.bench.load_probes import minus, thread_cpu
        from kvbridge_tools.bench.vllm_cache import logical

        cpu_before = thread_cpu([os.getpid()])
        scheduled = []
        for r in requests:
            req = self._request(r["id"], r["tokens"], dict(r["params"]))
            scheduled.append((req, list(r["blocks"])))
            count, asynchronous = self.scheduler.get_num_new_matched_tokens(req, 0)
            if count != r["tokens"] or not asynchronous:
                raise RuntimeError(
                    f"request {r['id']}: connector matched {count} tokens (async {asynchronous}), "
                    f"expected {r['tokens']}"
                )
            blocks = KVCacheBlocks(([KVCacheBlock(b) for b in r["blocks"]],))
            self.scheduler.update_state_after_alloc(req, blocks, count)
        started = time.perf_counter()
        self._step()
        want = {r["id"] for r in requests}
        done: set[str] = set()
        deadline = time.monotonic() + timeout
        while not want <= done and time.monotonic() < deadline:
            _, recving = self.worker.get_finished(set())
            done |= recving or set()
            if not want <= done:
                time.sleep(POLL_S)
        seconds = time.perf_counter() - started
        # kvbridge's threads of this rank over the round; DONEs sent after a pull was reported may fall in the next
        cpu = minus(thread_cpu([os.getpid()]), cpu_before)
        for req, blocks in scheduled:  # each ends, as vLLM ends a decode request: its scheduler entry goes
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            self.scheduler.request_finished(req, blocks)
        errors = sorted(self.worker.get_block_ids_with_load_errors())
        stats = self.worker.get_kv_connector_stats()
        data = stats.data if stats is not None else {}
        bad: dict[str, int] = {}
        if verify:
            for r in requests:
                got = read_logical(self.views, torch.tensor(r["blocks"])).numpy()
                exp = logical(self.model, r["index"], r["tokens"], self.heads, self.block_size, self.layers)
                n, t = r["tokens"], got.shape
                flat = lambda a, t=t, n=n: a.transpose(0, 2, 1, 3, 4).reshape(t[0], t[2], -1, t[4])[:, :, :n]  # noqa: E731
                wrong = int(np.count_nonzero(flat(got) != flat(exp)))
                if wrong or r["id"] not in done:
                    bad[r["id"]] = wrong
        pulls = data.get("pulls", [])  # [transport, peer, transfer_s, control_s, bytes, descriptors] per pull
        return {
            "seconds": seconds,
            "missing": sorted(want - done),
            "load_errors": errors[:8],
            "bytes": int(sum(p[4] for p in pulls)),
            "descriptors": [int(p[5]) for p in pulls],
            "sizes": [int(p[4]) for p in pulls],  # bytes per request
            "transfer_s": float(sum(p[2] for p in pulls)),
            "phases": [[str(p[0]), float(p[3])] for p in data.get("phases", [])],  # [phase, seconds] (HANDOVER_PHASES)
            "thread_cpu_s": cpu,
            "bad": bad,
        }

    def sent(self, ids: list[str], timeout: float = 30.0) -> list[str]:
        """Prefill: wait until get_finished reports every request sent (its blocks freed); the missing ids."""
        want, done = set(ids), set()
        deadline = time.monotonic() + timeout
        while not want <= done and time.monotonic() < deadline:
            sending, _ = self.worker.get_finished(set())
            done |= sending or set()
            if not want <= done:
                time.sleep(POLL_S)
        return sorted(want - done)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()  # closes the backend: the raw buffer's registration and peers with it
        self.worker = self.scheduler = self.raw_buffer = None
        self.raw_peers = {}


def main() -> None:
    logging.basicConfig(level=os.environ.get("KVBRIDGE_LOG", "WARNING"), format="%(levelname)s %(name)s: %(message)s")
    rank = Rank()
    try:
        serve(
            {
                "setup": rank.setup,
                "prefill": rank.prefill,
                "decode": rank.decode,
                "raw": rank.raw,
                "sent": rank.sent,
                "close": rank.close,
            }
        )
    finally:
        rank.close()


if __name__ == "__main__":
    main()
