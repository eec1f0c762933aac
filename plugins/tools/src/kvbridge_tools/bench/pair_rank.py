"""One side (prefill or decode) of `kvbridge bench` in pair mode, run as a child process.

The KV cache is one pool per side laid out as a vLLM KV cache layout (`kvbridge_tools.bench.pool_layout`),
registered once. Decode holds more blocks than prefill (asymmetric capacity) and pulls each request's
blocks into its own block ids; a request moves as its layout's runs (units), one or more per block.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np

import kvbridge
from kvbridge.base.errors import ConfigError
from kvbridge.base.memory import merge_runs
from kvbridge.plan.presets import get_preset
from kvbridge.transport import netguard, staging
from kvbridge.transport.staging import copy_ranges
from kvbridge_tools.bench.fingerprint import block_values
from kvbridge_tools.bench.pool_layout import PoolLayout
from kvbridge_tools.harness.proc import serve
from kvbridge_tools.strategy import copy_rate, transfer_cost

GATHER_IN_FLIGHT = 4  # chunks on the wire at once in a gathered pull (64 pieces of 1 MiB: far under admission)

log = logging.getLogger(__name__)


class Side:
    def __init__(
        self,
        *,
        backend: str,
        protocol: str | None,
        device: str,
        model: str,
        blocks: int,
        options: dict[str, Any],
        layout: str,
        stage: bool = False,
        hostname: str | None = None,
    ) -> None:
        self.spec = get_preset(model)
        self.device = kvbridge.get_device(device)
        self.layout = PoolLayout(layout, self.spec, blocks)
        self.tensors = self.layout.logical_shape[0]  # per layer, or per (K/V, layer) for separate K and V
        self.block_elems = math.prod(self.layout.logical_shape[2:])  # one block of one tensor, any layout
        self.unit_bytes = self.layout.unit_bytes  # one contiguous run of a block (the direct descriptor)
        self.blocks = blocks
        self.pool = self.device.allocate(self.layout.nbytes)
        # Staged where the transport cannot reach the device's memory (or when asked to, to measure it).
        self.backend = staging.attach(
            kvbridge.create_backend(backend, protocol=protocol, hostname=hostname, **options), self.device, force=stage
        )
        (region,) = self.backend.register_memory(self.pool)
        self.base = region.addr  # local descriptors use device addresses, staged or not
        self.published = self.backend.endpoint().regions[0].addr  # what the peer addresses: a host mirror if staged
        self.peer: kvbridge.Peer | None = None
        self.staging: np.ndarray | None = None  # gather strategy: prefill's staging, decode's landing (+ a flag)
        self.gathered = 0  # prefill: chunks gathered so far (the flag peers poll)
        self.staging_bytes = 0

    def can_gather(self) -> bool:
        """Whether the bench's gather strategy runs here: host memory the transport reaches directly."""
        return isinstance(self.pool, np.ndarray) and staging.transport(self.backend) is self.backend

    def rows(self, blocks: list[int]) -> np.ndarray:
        """Byte offsets in the pool of a request's runs (units), in request order."""
        return self.layout.unit_offsets(blocks)

    def fill(self, requests: list[list[int]]) -> None:
        host = np.zeros(self.layout.nbytes, dtype=np.uint8)
        view = self.layout.element_view(host)
        for r, blocks in enumerate(requests):
            for t in range(self.tensors):
                view[t, blocks] = block_values(
                    request=r,
                    tensor=t,
                    n_tensors=self.tensors,
                    blocks=len(blocks),
                    block_elems=self.block_elems,
                    nbytes=self.spec.dtype_bytes,
                ).reshape(len(blocks), *view.shape[2:])
        self.device.from_host(self.pool, host)
        self.backend.publish()  # waits for the device; staged, copies to the mirror the decode side reads

    def descriptors(self, src: dict[str, Any], src_blocks: list[int], dst_blocks: list[int]) -> np.ndarray:
        """Pull descriptors for one request: every run of every block pair, built with numpy broadcasting.

        The prefill pool has the same layout with its own block count (so its own outer strides)."""
        remote_layout = PoolLayout(self.layout.name, self.spec, src["blocks"])
        local = self.base + self.rows(dst_blocks)
        remote = src["base"] + remote_layout.unit_offsets(src_blocks)
        length = np.full_like(local, self.unit_bytes)
        return np.stack([local, remote, length], axis=-1)


def stage(nbytes: int) -> dict[str, Any]:
    """Allocate and register the gather strategy's region: a request's bytes and an 8-byte flag after them.

    On the prefill side this is the staging region a real deployment holds with the request's lease
    (kvbridge.control.ledger) and frees with it; here one is reused for every request of the run.
    """
    side = _get()
    if not side.can_gather():
        raise ConfigError(
            "--strategy gather is measured on host memory reached directly (here: the cpu device); on a GPU "
            "the gather is a device kernel into registered device memory, which cannot run here"
        )
    side.staging = np.zeros(nbytes + 8, dtype=np.uint8)
    side.staging_bytes = nbytes
    (region,) = side.backend.register_memory(side.staging)
    return {"addr": region.addr, "endpoint": side.backend.endpoint_info().hex()}  # peers connect after this


def gather(blocks: list[int], chunk_bytes: int) -> dict[str, float]:
    """Prefill: copy a request's rows into the staging region chunk by chunk, bumping the flag after each."""
    side = _get()
    assert side.staging is not None, "call stage first"
    start = time.monotonic()
    src = side.rows(blocks)
    per = max(1, chunk_bytes // side.unit_bytes)
    flag = side.staging[side.staging_bytes :].view(np.int64)
    lengths = np.full(len(src), side.unit_bytes, dtype=np.int64)
    for i in range(0, len(src), per):
        j = slice(i, i + per)
        copy_ranges(side.staging, side.pool, np.arange(i, min(i + per, len(src))) * side.unit_bytes, src[j], lengths[j])
        side.gathered += 1
        flag[0] = side.gathered  # after the chunk's bytes: a reader that sees it reads a whole chunk
    end = time.monotonic()
    return {"start": start, "end": end, "gather": end - start}


def migrate_gathered(
    src_addr: int, dst_blocks: list[int], chunk_bytes: int, ready_before: int, wait_s: float
) -> dict[str, Any]:
    """Decode: read prefill's staging region into the landing region, chunk by chunk as its flag says they are ready.

    Each landed chunk is scattered into the request's blocks while the next is on the wire.
    """
    side = _get()
    assert side.staging is not None and side.peer is not None, "call stage and connect first"
    start = time.monotonic()
    deadline = start + wait_s
    dst = side.rows(dst_blocks)
    per = max(1, chunk_bytes // side.unit_bytes)
    chunks = [(i, min(i + per, len(dst))) for i in range(0, len(dst), per)]
    base = side.staging.ctypes.data
    flag_at = side.staging_bytes
    flag = side.staging[flag_at:].view(np.int64)
    transport = staging.transport(side.backend)
    ready = submitted = done = sent = 0
    handles: dict[int, Any] = {}
    poll: Any = None  # the one flag read in flight: it queues behind the chunks on the peer, never stalls them
    spent = {"poll": 0.0, "wire_wait": 0.0, "scatter": 0.0}  # where the decode side's time went
    while done < len(chunks):
        if time.monotonic() > deadline:
            raise TimeoutError(f"gathered pull: chunk {done} of {len(chunks)} not ready within {wait_s}s")
        if poll is None and ready < len(chunks) and ready - submitted < GATHER_IN_FLIGHT:
            poll = transport.raw_transfer(side.peer, base + flag_at, src_addr + flag_at, 8)
        if poll is not None and (poll.done() or done == submitted):  # idle: nothing to do but wait for it
            t = time.monotonic()
            poll.wait(wait_s)
            poll, ready = None, int(flag[0]) - ready_before
            spent["poll"] += time.monotonic() - t
        while submitted < min(ready, done + GATHER_IN_FLIGHT):
            a, b = chunks[submitted]
            off, n = a * side.unit_bytes, (b - a) * side.unit_bytes
            handles[submitted] = side.backend.transfer(side.peer, [(base + off, src_addr + off, n)], "read")
            sent += handles[submitted].descriptors
            submitted += 1
        if done < submitted:
            t = time.monotonic()
            handles.pop(done).wait(wait_s)
            t2 = time.monotonic()
            a, b = chunks[done]
            lengths = np.full(b - a, side.unit_bytes, dtype=np.int64)
            copy_ranges(side.pool, side.staging, dst[a:b], np.arange(a, b) * side.unit_bytes, lengths)
            spent["wire_wait"] += t2 - t
            spent["scatter"] += time.monotonic() - t2
            done += 1
    if poll is not None:
        poll.wait(wait_s)
    end = time.monotonic()
    return {"start": start, "end": end, "seconds": end - start, "descriptors": sent, "chunks": len(chunks), **spent}


_side: Side | None = None


def _get() -> Side:
    assert _side is not None, "call init first"
    return _side


def init(**kwargs: Any) -> dict[str, Any]:
    global _side
    _side = Side(**kwargs)
    cost = transfer_cost(_side.backend.name, _side.backend.protocol)
    return {
        "endpoint": _side.backend.endpoint_info().hex(),
        "base": _side.published,
        "blocks": _side.blocks,
        "unit_bytes": _side.unit_bytes,
        "units_per_block": _side.layout.units_per_block,
        "cost": {k: getattr(cost, k) for k in ("bytes_per_s", "descriptor_s", "piece_bytes", "peer_admission")},
        "copy_bytes_per_s": copy_rate(_side.device.name),
        "can_gather": _side.can_gather(),
    }


def admit(host: str) -> None:
    """Let the peer on `host` reach this side's guarded transport listeners (bench --hosts).

    The workers learn each other's address from the bench, which holds the secret and started both: the
    pair bench has no side channel on which the peer could prove the secret itself.
    """
    netguard.admit(host, "the bench's other host")


def fill(requests: list[list[int]]) -> None:
    _get().fill(requests)


def connect(endpoint: str) -> None:
    side = _get()
    side.peer = side.backend.connect(bytes.fromhex(endpoint))


def zero() -> None:
    side = _get()
    side.device.from_host(side.pool, np.zeros(side.layout.nbytes, dtype=np.uint8))


def migrate(src: dict[str, Any], src_blocks: list[int], dst_blocks: list[int], wait_s: float) -> dict[str, Any]:
    """Pull one request; the time covers descriptor building, submission and completion."""
    side = _get()
    assert side.peer is not None
    start = time.perf_counter()
    desc = side.descriptors(src, src_blocks, dst_blocks)
    handle = side.backend.transfer(side.peer, desc, op="read")
    handle.wait(wait_s)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "bytes": handle.nbytes,
        "descriptors_in": len(desc),
        "runs": len(merge_runs(desc)),
        "descriptors": handle.descriptors,
    }


def raw(src_base: int, nbytes: int, wait_s: float) -> dict[str, Any]:
    """The transport's ceiling: one descriptor of the same number of bytes, straight to the transport."""
    side = _get()
    assert side.peer is not None
    start = time.perf_counter()
    # Staged or not, the ceiling is the transport alone: host mirror to host mirror when staged.
    transport = staging.transport(side.backend)
    peer = side.peer if transport is side.backend else side.peer.handle  # a bound backend's Peer wraps the transport's
    transport.raw_transfer(peer, side.published, src_base, nbytes, op="read").wait(wait_s)
    return {"seconds": time.perf_counter() - start, "bytes": nbytes}


def verify(requests: list[list[int]]) -> dict[str, Any]:
    """Every block of every request holds its fingerprint; every other block is still zero."""
    side = _get()  # a pull's handle completes after the device synchronized: nothing to wait for here
    view = side.layout.element_view(side.device.to_host(side.pool))
    n = len(view.shape)
    touched = np.zeros(side.blocks, dtype=bool)
    bad: list[str] = []
    for r, blocks in enumerate(requests):
        touched[blocks] = True
        for t in range(side.tensors):
            expect = block_values(
                request=r,
                tensor=t,
                n_tensors=side.tensors,
                blocks=len(blocks),
                block_elems=side.block_elems,
                nbytes=side.spec.dtype_bytes,
            )
            wrong = np.flatnonzero((view[t, blocks].reshape(len(blocks), -1) != expect).any(axis=1))
            if len(wrong):
                bad.append(
                    f"request {r} tensor {t}: {len(wrong)} blocks differ (first decode block {blocks[wrong[0]]})"
                )
    stray = np.flatnonzero(view[:, ~touched].any(axis=(0, *range(2, n))))
    if len(stray):
        bad.append(f"{len(stray)} blocks outside every request were written")
    return {"verified": not bad, "problems": bad[:10]}


def close() -> None:
    global _side
    if _side is not None:
        _side.backend.close()
        _side = None


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    serve(
        {
            "init": init,
            "admit": admit,
            "fill": fill,
            "connect": connect,
            "zero": zero,
            "migrate": migrate,
            "stage": stage,
            "gather": gather,
            "migrate_gathered": migrate_gathered,
            "raw": raw,
            "verify": verify,
            "close": close,
        }
    )


if __name__ == "__main__":
    main()
