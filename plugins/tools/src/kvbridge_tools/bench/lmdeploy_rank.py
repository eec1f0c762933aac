"""One LMDeploy worker's migration side, in its own process (`python -m kvbridge_tools.bench.lmdeploy_rank`).

It does what LMDeploy's CacheEngine does around its migration backend, with LMDeploy's own
classes: one packed uint8 pool (layers, blocks, bytes) described by `describe_cache_pools`,
the backend built by `MIGRATION_BACKENDS.module_dict[name]()`, pydantic messages, and
assignments from `build_cache_pool_assignments`. It also runs LMDeploy 0.18's Mooncake
strategy (one synchronous `transfer_sync_read` per instruct on a raw TCP TransferEngine) as
the bench's baseline. Driven by `kvbridge_tools.harness.proc.Child`; the bench and the tests share it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import numpy as np
import torch
from lmdeploy.pytorch.disagg.backend.backend import MIGRATION_BACKENDS
from lmdeploy.pytorch.disagg.config import DistServeEngineConfig
from lmdeploy.pytorch.disagg.conn.protocol import (
    DistServeInitRequest,
    DistServeKVTransferEndpointInfo,
    MigrationProtocol,
)
from lmdeploy.pytorch.disagg.messages import DistServeRegisterMRMessage, MigrationAssignment
from lmdeploy.pytorch.engine.cache_engine.layout import CachePool
from lmdeploy.pytorch.engine.cache_engine.migration import (
    build_cache_pool_assignments,
    describe_cache_pools,
    validate_cache_pool_layouts,
)

from kvbridge.base.errors import ConfigError, TransferFailed
from kvbridge_tools.harness.proc import serve


def engine_config(num_blocks: int, block_size: int) -> DistServeEngineConfig:
    """A single-rank engine config, as a worker's p2p_initialize receives it."""
    return DistServeEngineConfig(
        tp_size=1,
        ep_size=1,
        dp_size=1,
        pp_size=None,
        dp_rank=0,
        block_size=block_size,
        num_cpu_blocks=0,
        num_gpu_blocks=num_blocks,
    )


def fingerprint(layers: np.ndarray, blocks: np.ndarray, words: int) -> np.ndarray:
    """(len(layers), len(blocks), words) int64 where each 8-byte word encodes (layer, block, word)."""
    return (layers[:, None, None] << 40) | (blocks[None, :, None] << 20) | np.arange(words)[None, None, :]


class Rank:
    def __init__(self) -> None:
        self.pool: torch.Tensor | None = None
        self.backend: Any = None
        self.engine_id = ""
        self.remote_pools: dict[str, tuple] = {}
        self.raw: Any = None
        self.raw_peer: tuple[str, int] | None = None

    # -- LMDeploy's CacheEngine steps --------------------------------------------------------

    def setup(
        self, engine_id: str, layers: int, blocks: int, block_bytes: int, fill: bool, backend: str = "Mooncake"
    ) -> dict[str, Any]:
        if block_bytes % 8:
            raise ConfigError(f"block_bytes must be a multiple of 8, got {block_bytes}")
        self.engine_id = engine_id
        self.pool = torch.zeros((layers, blocks, block_bytes), dtype=torch.uint8)
        if fill:
            words = self.pool.numpy().view(np.int64)
            words[:] = fingerprint(np.arange(layers), np.arange(blocks), block_bytes // 8)
        self.cache_pools = (CachePool(tensor=self.pool, entry_axis=1),)
        self.pool_infos = describe_cache_pools(self.cache_pools, blocks)
        cls = MIGRATION_BACKENDS.module_dict[backend]
        self.backend = cls()
        return {"backend": f"{cls.__module__}.{cls.__qualname__}"}

    def initialize(self, remote_engine_id: str, remote_blocks: int, block_size: int = 16, protocol: str = "TCP") -> str:
        assert self.pool is not None
        req = DistServeInitRequest(
            local_engine_id=self.engine_id,
            local_engine_config=engine_config(self.pool.shape[1], block_size),
            remote_engine_id=remote_engine_id,
            remote_engine_config=engine_config(remote_blocks, block_size),
            protocol=MigrationProtocol[protocol],
            rank=0,
        )
        self.backend.p2p_initialize(req)
        for mr_key, pool in enumerate(self.cache_pools):
            t = pool.tensor
            self.backend.register_memory_region(
                DistServeRegisterMRMessage(
                    protocol=req.protocol,
                    remote_engine_id=remote_engine_id,
                    mr_key=mr_key,
                    addr=t.data_ptr(),
                    offset=t.storage_offset(),
                    length=t.numel() * t.itemsize,
                )
            )
        info = DistServeKVTransferEndpointInfo(
            protocol=req.protocol,
            endpoint_info=json.dumps(self.backend.endpoint_info(remote_engine_id, req.protocol)),
            cache_pools=self.pool_infos,
        )
        return info.model_dump_json()

    def connect(self, remote_engine_id: str, endpoint: str) -> None:
        conn = DistServeKVTransferEndpointInfo.model_validate_json(endpoint)
        remote_blocks = self.backend.links[remote_engine_id].remote_engine_config.num_gpu_blocks
        assert self.pool is not None
        validate_cache_pool_layouts(self.pool_infos, conn.cache_pools, self.pool.shape[1], remote_blocks)
        self.remote_pools[remote_engine_id] = tuple(conn.cache_pools)
        self.backend.p2p_connect(remote_engine_id, conn)

    def assignment(self, remote_engine_id: str, pairs: list[list[int]], protocol: str = "TCP") -> MigrationAssignment:
        """pairs: [(remote block, local block)], as LMDeploy's migrate passes them."""
        batch = build_cache_pool_assignments(
            self.pool_infos, self.remote_pools[remote_engine_id], [tuple(p) for p in pairs]
        )
        return MigrationAssignment(protocol=MigrationProtocol[protocol], remote_engine_id=remote_engine_id, batch=batch)

    def migrate(
        self,
        remote_engine_id: str,
        pairs: list[list[int]],
        async_op: bool = False,
        protocol: str = "TCP",
        ticker: bool = True,
    ) -> dict[str, Any]:
        """Run p2p_migrate on an event loop; report seconds, and how often a ticker task ran during the await.

        The ticker proves the loop runs during an async migration; it spins, so the bench turns it off.
        """
        assignment = self.assignment(remote_engine_id, pairs, protocol)

        async def main() -> tuple[float, int]:
            ticks = 0
            running = True

            async def tick() -> None:
                nonlocal ticks
                while running:
                    ticks += 1
                    await asyncio.sleep(0)

            task = asyncio.create_task(tick() if ticker else asyncio.sleep(0))
            await asyncio.sleep(0)  # let the ticker start
            start_ticks, start = ticks, time.perf_counter()
            try:
                await self.backend.p2p_migrate(assignment, async_op=async_op)
            finally:
                elapsed = time.perf_counter() - start
                running = False
                await task
            return elapsed, ticks - start_ticks

        seconds, ticks = asyncio.run(main())
        return {
            "seconds": seconds,
            "ticks": ticks,
            "instructs": len(assignment.batch),
            "bytes": sum(i.length for i in assignment.batch),
            "descriptors": self._descriptors(assignment),
        }

    def _descriptors(self, assignment: MigrationAssignment) -> int | None:
        """How many descriptors kvbridge's planner makes of this assignment (None for another backend)."""
        link = self.backend.links[assignment.remote_engine_id]
        if not hasattr(link, "local_regions"):
            return None
        from kvbridge.adapters.lmdeploy.plan import instruct_array, plan

        p = plan(
            instruct_array(assignment.batch),
            link.local_regions,
            link.remote_regions,
            engine=assignment.remote_engine_id,
        )
        return len(p.descriptors)

    def store(self, remote_engine_id: str, pairs: list[list[int]]) -> None:
        self.backend.store(self.assignment(remote_engine_id, pairs))

    def load(self, remote_engine_id: str, pairs: list[list[int]]) -> None:
        self.backend.load(self.assignment(remote_engine_id, pairs))

    def migrate_raw(self, remote_engine_id: str, instructs: list[list[int]]) -> None:
        """p2p_migrate with a hand-made batch of (mr_key, source_offset, target_offset, length)."""
        from lmdeploy.pytorch.disagg.messages import AssignmentInstruct

        batch = [AssignmentInstruct(mr_key=m, source_offset=s, target_offset=t, length=n) for m, s, t, n in instructs]
        asyncio.run(
            self.backend.p2p_migrate(
                MigrationAssignment(protocol=MigrationProtocol.TCP, remote_engine_id=remote_engine_id, batch=batch)
            )
        )

    def verify(self, pairs: list[list[int]]) -> dict[str, int]:
        """Check that local block d holds remote block p's fingerprint for every (p, d), and the rest is zero."""
        assert self.pool is not None
        words = self.pool.numpy().view(np.int64)
        arr = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        want = fingerprint(np.arange(words.shape[0]), arr[:, 0], words.shape[2])
        wrong_blocks = int((words[:, arr[:, 1], :] != want).any(axis=(0, 2)).sum())
        untouched = np.ones(words.shape[1], dtype=bool)
        untouched[arr[:, 1]] = False
        stray = int(words[:, untouched, :].any(axis=(0, 2)).sum())
        return {"wrong_blocks": wrong_blocks, "stray_blocks": stray, "checked": len(arr)}

    def reset(self) -> None:
        assert self.pool is not None
        self.pool.zero_()

    def drop(self, remote_engine_id: str) -> dict[str, Any]:
        self.backend.p2p_drop_connect(remote_engine_id)
        return {
            "links": sorted(self.backend.links),
            "registered": sum(len(t.registered) for t in self.backend.transports.values()),
        }

    def close(self) -> None:
        if self.backend is not None and hasattr(self.backend, "close"):
            self.backend.close()

    # -- LMDeploy 0.18's Mooncake strategy, on a raw TCP TransferEngine (the bench baseline) -----

    def raw_setup(self) -> dict[str, Any]:
        from mooncake.engine import TransferEngine

        assert self.pool is not None
        self.raw = TransferEngine()
        rc = self.raw.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise ConfigError(f"raw Mooncake TransferEngine.initialize failed with {rc}")
        rc = self.raw.register_memory(self.pool.data_ptr(), self.pool.numel())
        if rc != 0:
            raise ConfigError(f"raw Mooncake register_memory failed with {rc}")
        return {"session": f"127.0.0.1:{self.raw.get_rpc_port()}", "addr": self.pool.data_ptr()}

    def raw_connect(self, session: str, addr: int) -> None:
        self.raw_peer = (session, addr)

    def raw_migrate(self, remote_engine_id: str, pairs: list[list[int]]) -> dict[str, Any]:
        """One synchronous transfer_sync_read per instruct, in order, as lmdeploy 0.18's MooncakeBackend."""
        assert self.pool is not None and self.raw_peer is not None
        session, remote_base = self.raw_peer
        batch = self.assignment(remote_engine_id, pairs).batch
        local_base = self.pool.data_ptr()
        start = time.perf_counter()
        for i, task in enumerate(batch):
            rc = self.raw.transfer_sync_read(
                session, local_base + task.source_offset, remote_base + task.target_offset, task.length
            )
            if rc != 0:
                raise TransferFailed(f"raw transfer_sync_read of instruct {i} failed with {rc}", peer=session)
        return {"seconds": time.perf_counter() - start, "instructs": len(batch), "bytes": sum(i.length for i in batch)}


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    rank = Rank()
    handlers = {
        name: getattr(rank, name)
        for name in (
            "setup",
            "initialize",
            "connect",
            "migrate",
            "migrate_raw",
            "store",
            "load",
            "verify",
            "reset",
            "drop",
            "close",
            "raw_setup",
            "raw_connect",
            "raw_migrate",
        )
    }
    try:
        serve(handlers)
    finally:
        rank.close()


if __name__ == "__main__":
    main()
