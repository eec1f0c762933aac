"""Many engine ranks in one process, for `kvbridge bench --scale` (`python -m kvbridge_tools.bench.scale_rank`).

Each rank is what an engine rank runs, minus the engine: a `KVAgent` over a small host cache on a real transport, a
side channel (`ControlServer`) with a lease ledger on a prefill rank, `PullControl` on a decode rank, and a record
in the registry. Packing ranks lets hundreds of them fit on a small machine; a rank shares nothing with another
rank of its process but the process-wide ZeroMQ context its clients use, as ranks of one engine do.
"""

from __future__ import annotations

import collections
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import numpy as np

from kvbridge.agent.kv_agent import KVAgent
from kvbridge.base.errors import described
from kvbridge.control import ControlServer, KVTransferParams, LeaseState, Ledger, open_registry
from kvbridge.plan.layout import vllm_layout
from kvbridge.plan.presets import PRESETS
from kvbridge.plan.topology import ParallelConfig
from kvbridge.session.machine import PullMachine
from kvbridge.session.pull_control import PullControl
from kvbridge_tools.harness.proc import serve

MODEL = attrs.evolve(PRESETS["tiny-gqa"], kv_heads=2)  # a few KiB per block: the bench measures control, not bytes
BLOCKS = 8  # per rank; a pull reads one block, a decode rank's pulls at once land in blocks of their own


@attrs.define
class Rank:
    engine_id: str
    buf: np.ndarray
    agent: KVAgent
    server: ControlServer
    ledger: Ledger | None
    control: PullControl | None


RANKS: list[Rank] = []
RELEASED: list[str] = []
_LOCK = threading.Lock()


def _released(lease: Any, why: LeaseState) -> None:
    with _LOCK:
        RELEASED.append(f"{lease.request_id}:{why.value}")


def setup(
    role: str, first: int, count: int, backend: str, secret: str | None, registry: str | None, host: str
) -> list[list[Any]]:
    """Start `count` ranks of `role`, engines `<role><first>`...; returns each one's side-channel address."""
    reg = open_registry(registry, secret=secret) if registry else None
    layer_bytes = 2 * BLOCKS * MODEL.kv_heads * MODEL.block_size * MODEL.head_dim * MODEL.dtype_bytes
    for i in range(first, first + count):
        engine_id = f"{role}{i}"
        buf = np.zeros(MODEL.layers * layer_bytes, dtype=np.uint8)
        if role == "prefill":
            buf[:] = i % 251 + 1  # the decode checks it read this engine's bytes
        layout = vllm_layout(
            MODEL, MODEL.kv_heads, [buf.ctypes.data + j * layer_bytes for j in range(MODEL.layers)], BLOCKS
        )
        agent = KVAgent(engine_id, 0, ParallelConfig(), layout, buf, backend=backend, hostname=host)
        ledger = Ledger(_released, timeout_s=120.0) if role == "prefill" else None
        server = ControlServer(engine_id, 0, ledger=ledger, host=host, secret=secret, registry=reg)
        server.register(agent.info())
        control = PullControl(agent, server, secret=secret, registry=reg) if role == "decode" else None
        RANKS.append(Rank(engine_id, buf, agent, server, ledger, control))
    return [[r.engine_id, *r.server.address] for r in RANKS[-count:]]


def offer(requests: list[list[Any]]) -> int:
    """Hold block 0 of each (rank index, request id) under a lease, for one pull."""
    for index, rid in requests:
        ledger = RANKS[index].ledger
        assert ledger is not None, "offers go to prefill ranks"
        ledger.offer(rid, [0], 1)
    return len(requests)


def pull(jobs: list[list[Any]], concurrency: int) -> list[dict[str, Any]]:
    """Each (rank index, local block, params) job pulled through `PullControl`, `concurrency` at a time.

    Returns, per job, its control time (resolving + first contact + BeginPull: `at_reading_ms`), its whole time,
    and its error, if any."""

    def one(index: int, block: int, params: dict[str, Any]) -> dict[str, Any]:
        rank = RANKS[index]
        assert rank.control is not None, "pulls run on decode ranks"
        p = KVTransferParams.from_dict(params)
        region = rank.agent.layout.regions[0]
        at = region.addr - rank.buf.ctypes.data + block * region.block_stride  # the first byte the pull lands
        rank.buf[at] = 0
        machine = PullMachine(str(p.remote_request_id), "pull")
        errors: list[BaseException | None] = []
        began = time.perf_counter()
        try:
            handle = rank.control.start(
                str(p.remote_request_id), p, [block], on_finished=lambda _r, e: errors.append(e), machine=machine
            )
            handle.wait(60)
        except Exception as exc:  # noqa: BLE001  # reported per job: the bench counts failures
            errors.append(exc)
        took = (time.perf_counter() - began) * 1e3
        marks = machine.marks()
        error = next((e for e in errors if e is not None), None)
        expected = int(str(p.remote_engine_id).removeprefix("prefill")) % 251 + 1
        if error is None and int(rank.buf[at]) != expected:
            error = AssertionError(f"{rank.engine_id} read byte {int(rank.buf[at])}, not {p.remote_engine_id}'s")
        return {
            "control_ms": marks.get("at_reading_ms", took),
            "total_ms": took,
            "error": None if error is None else described(error),
        }

    with ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="scale-pull") as pool:
        return list(pool.map(lambda job: one(*job), jobs))


def stats() -> dict[str, Any]:
    """This process's resident memory (KiB), open file descriptors and threads (native ones included)."""
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    kinds = collections.Counter(re.sub(r"[-_]?[\d.:/]+.*$", "", t.name) for t in threading.enumerate())
    return {
        "rss_kib": rss,
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
        "python_threads": dict(kinds),  # by name, numbers dropped: what the threads are
        "released": len(RELEASED),
    }


def close() -> None:
    for r in RANKS:
        if r.control is not None:
            r.control.close()
        r.server.close()
        r.agent.close()
    RANKS.clear()


def main() -> None:
    serve({"setup": setup, "offer": offer, "pull": pull, "stats": stats, "close": close})
    close()


if __name__ == "__main__":
    main()
