"""One side (prefill or decode) of `kvbridge bench --prefill ... --decode ...`, run as a child process.

Every rank of the side gets its own KVAgent: its own transport endpoint, its own KV buffer,
registered once. All ranks of a side share this process (see docs/planning.md for why).
Driven by `kvbridge_tools.bench.parallel` through `kvbridge_tools.harness.proc` JSON-line calls.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np

from kvbridge.agent.kv_agent import KVAgent, PullResult, RankInfo
from kvbridge.plan.layout import KVLayout, lmdeploy_layout, vllm_layout
from kvbridge.plan.presets import ModelSpec, get_preset
from kvbridge.plan.topology import HeadPlacement, ParallelConfig
from kvbridge.plugin.registry import create_backend, get_device
from kvbridge.transport.contract import MigrationBackend
from kvbridge_tools.bench.shares import Share, fill, mismatches
from kvbridge_tools.harness.proc import serve

log = logging.getLogger(__name__)

# vllm-cpu: vLLM's CPU backend, [num_blocks, num_kv_heads, block_size, 2 * head_size] per layer
LAYOUTS = ("vllm-split-nhd", "vllm-split-hnd", "vllm-joint-nhd", "vllm-cpu", "lmdeploy")


class Side:
    """The ranks of one side and the requests they hold.

    Transport endpoints outlive a case: rank i of the next case reuses endpoint i, because
    tearing down a Mooncake engine is slow (docs/measurements/design-evidence.md) and would dominate
    a run of many cases with 16 ranks a side. The KV buffers are registered anew per case.
    """

    def __init__(self) -> None:
        self.backends: dict[tuple[str, str | None], list[MigrationBackend]] = {}
        self.agents: list[KVAgent] = []
        self.buffers: list[np.ndarray] = []
        self.shares: list[dict[str, Share]] = []

    def setup(
        self,
        side: str,
        engine_id: str,
        spec: str,
        model: str,
        requests: list[dict[str, Any]],
        backend: str,
        protocol: str | None,
        layout: str,
        seed: int = 0,
    ) -> dict[str, Any]:
        """Start one agent per rank, place every request's blocks; prefill fills its shares."""
        self.close()
        self.side, self.config, self.model = side, ParallelConfig.parse(spec), get_preset(model)
        self.requests = {r["id"]: r for r in requests}
        place = HeadPlacement.of(self.model, self.config, side)
        rng = np.random.default_rng(seed + (side == "decode"))
        device = get_device("cpu")
        started = time.perf_counter()
        for rank in range(self.config.world_size):
            shares = self._shares(rank, place, rng)
            used = sum(len(s.block_ids) for s in shares.values())
            capacity = max(1, used + (3 if side == "decode" else 1))  # asymmetric capacity on purpose
            buf, kv = _allocate(device, self.model, place.per_rank, capacity, layout)
            endpoint = self._endpoint(backend, protocol, rank)
            self.agents.append(KVAgent(engine_id, rank, self.config, kv, buf, backend=endpoint))
            self.buffers.append(buf)
            self.shares.append(shares)
            if side == "prefill":
                fill(kv, buf, list(shares.values()))
        return {
            "infos": [a.info().encode().hex() for a in self.agents],
            "blocks": {str(r): {rid: list(s.block_ids) for rid, s in sh.items()} for r, sh in enumerate(self.shares)},
            "setup_s": time.perf_counter() - started,
            **_process_stats(),
        }

    def _endpoint(self, backend: str, protocol: str | None, rank: int) -> MigrationBackend:
        pool = self.backends.setdefault((backend, protocol), [])
        while len(pool) <= rank:
            pool.append(create_backend(backend, protocol=protocol))
        return pool[rank]

    def _shares(self, rank: int, place: HeadPlacement, rng: np.random.Generator) -> dict[str, Share]:
        """This rank's block ids of every request in its DP group; decode ids are shuffled in runs of 4."""
        c = self.config.coords(rank)
        out: dict[str, Share] = {}
        next_id = 0
        for rid, req in self.requests.items():
            if req[f"{self.side}_dp"] != c.dp:
                continue
            n_blocks = -(-req["tokens"] // self.model.block_size)
            count = self.config.blocks_on(c.cp, n_blocks)
            ids = np.arange(next_id, next_id + count)
            if self.side == "decode" and count:
                runs = np.array_split(ids, -(-count // 4))
                ids = np.concatenate([runs[i] for i in rng.permutation(len(runs))])
            next_id += count
            logical = [c.cp + i * self.config.cp for i in range(count)]
            out[rid] = Share(ids.tolist(), logical, list(place.heads(c.shard)), req["tokens"])
        return out

    def release_counts(self, decode: str) -> dict[str, dict[str, int]]:
        """Prefill side: per request, per rank of its DP group, the pulls the rank waits for."""
        d = ParallelConfig.parse(decode)
        out: dict[str, dict[str, int]] = {}
        for rid, req in self.requests.items():
            ranks = self.config.group(req["prefill_dp"])
            out[rid] = {str(r): self.agents[r].release_count(d, req["tokens"], req["decode_dp"]) for r in ranks}
        return out

    def pull(
        self, infos: list[str], blocks: dict[str, dict[str, list[int]]], verify: bool, timeout: float = 120.0
    ) -> dict[str, Any]:
        """Decode side: every rank pulls its share of every request at once, then (optionally) verifies."""
        remote = [RankInfo.decode(bytes.fromhex(h)) for h in infos]
        prefill = remote[0].parallel
        results: list[PullResult] = []
        handles = []
        started = time.perf_counter()
        for rid, req in self.requests.items():
            remote_blocks = {r: blocks[str(r)][rid] for r in prefill.group(req["prefill_dp"])}
            for rank in self.config.group(req["decode_dp"]):
                share = self.shares[rank][rid]
                handles.append(
                    self.agents[rank].pull(
                        rid,
                        remote,
                        remote_blocks,
                        share.block_ids,
                        req["tokens"],
                        prefill_dp=req["prefill_dp"],
                        on_done=results.append,
                    )
                )
        for h in handles:
            h.wait(timeout)
        seconds = time.perf_counter() - started
        errors = [str(r.error) for r in results if r.error is not None]
        received: dict[str, dict[str, int]] = {}
        for r in results:
            counts = received.setdefault(r.request_id, {})
            for _engine, prank in r.pulled:
                counts[str(prank)] = counts.get(str(prank), 0) + 1
            for _engine, prank in r.notify:
                counts.setdefault(str(prank), 0)
        bad = {}
        if verify:
            for rank, (agent, buf) in enumerate(zip(self.agents, self.buffers)):
                n, notes = mismatches(agent.layout, buf, list(self.shares[rank].values()))
                if n:
                    bad[str(rank)] = {"wrong_words": n, "first": notes}
        return {
            "seconds": seconds,
            "bytes": sum(r.nbytes for r in results),
            "descriptors": sum(r.descriptors for r in results),
            "pulls": sum(len(r.pulled) for r in results),
            "received": received,
            "errors": errors,
            "bad": bad,
            **_process_stats(),
        }

    def close(self) -> None:
        """Close the agents (unregistering their buffers); endpoints stay for the next case."""
        for agent in self.agents:
            agent.close()
        self.agents, self.buffers, self.shares = [], [], []

    def shutdown(self) -> None:
        self.close()
        for pool in self.backends.values():
            for backend in pool:
                backend.close()
        self.backends = {}


def _allocate(device: Any, model: ModelSpec, heads: int, num_blocks: int, layout: str) -> tuple[np.ndarray, KVLayout]:
    """One zeroed buffer holding every layer of a rank's cache, and its layout."""
    per_block = model.kv_tensors * heads * model.block_size * model.head_dim * model.dtype_bytes
    layer_bytes = num_blocks * per_block
    buf = device.allocate(model.layers * layer_bytes)
    base = buf.ctypes.data
    if layout == "lmdeploy":
        return buf, lmdeploy_layout(model, heads, base, num_blocks)
    _, kv, order = ("vllm", "per-head", "hnd") if layout == "vllm-cpu" else layout.split("-")
    addrs = [base + i * layer_bytes for i in range(model.layers)]
    return buf, vllm_layout(model, heads, addrs, num_blocks, kv=kv, order=order.upper())  # type: ignore[arg-type]


def _process_stats() -> dict[str, Any]:
    """Resident memory (MiB) and thread count of this process, from /proc."""
    stats: dict[str, Any] = {"pid": os.getpid()}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    stats["rss_mib"] = int(line.split()[1]) // 1024
                elif line.startswith("Threads:"):
                    stats["threads"] = int(line.split()[1])
    except OSError:
        pass
    return stats


def main() -> None:
    logging.basicConfig(level=os.environ.get("KVBRIDGE_LOG", "WARNING"), format="%(levelname)s %(name)s: %(message)s")
    side = Side()
    try:
        serve({"setup": side.setup, "release_counts": side.release_counts, "pull": side.pull, "close": side.close})
    finally:
        side.shutdown()


if __name__ == "__main__":
    main()
