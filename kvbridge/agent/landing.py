"""Pulls between caches arranged differently: land the peer's blocks as-is, rearrange them. See docs/internals.md."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from kvbridge.base.block_ids import block_array
from kvbridge.base.errors import ConfigError, LayoutMismatch, LoadError
from kvbridge.base.memory import Descriptors, merge_runs
from kvbridge.device.contract import Device
from kvbridge.plan.layout import KVLayout, PagedGeometry
from kvbridge.plan.topology import Pull
from kvbridge.plugin.registry import get_device

log = logging.getLogger(__name__)

MIN_LANDING_BYTES = 1 << 20
MAX_IDLE_BYTES = 256 << 20  # idle landing buffers kept registered for reuse, at most
# Retired landing buffers (kept allocated for late writes, never reused) a rank holds, at most, before it
# refuses pulls that would land: plus what pulls in flight hold, each admitted under the bound.
MAX_RETIRED_BYTES = 1 << 30


def direct(local: KVLayout, remote: KVLayout) -> bool:
    """Whether blocks can be read byte for byte into place (the planner's path)."""
    a, b = local.paged, remote.paged
    if a is None or b is None:
        return True
    if (a.name, a.order, a.block_size) != (b.name, b.order, b.block_size) or [
        (p.kind, p.content) for p in a.planes
    ] != [(p.kind, p.content) for p in b.planes]:
        return False
    if a.heads == b.heads:
        return a.same_arrangement(b)
    return all(r.order == "HND" for r in (*local.regions, *remote.regions))


def _compact_strides(order: Sequence[int], sizes: Sequence[int]) -> list[int]:
    """Byte strides of a dense array of logical `sizes` laid out in physical `order`."""
    strides, cur = [0] * len(sizes), 1
    for d in reversed(order):
        strides[d] = cur
        cur *= sizes[d]
    return strides


def landing_descriptors(g: PagedGeometry, blocks: np.ndarray) -> tuple[Descriptors, list[tuple[int, list[int]]], int]:
    """How to copy `blocks` of `g` into a compact buffer in `g`'s own physical order. See docs/internals.md."""
    n, layers = len(blocks), len(g.planes[0].layer_addrs)
    order = g.order
    heads_outer = order.index(2) < max(order.index(0), order.index(1))  # LHBNC, BHLNC: a head is its own run
    parts, planes, off = [], [], 0
    for p in g.planes:
        sizes = (layers, n, g.heads, g.block_size, p.content)
        st = _compact_strides(order, sizes)
        hs = np.arange(g.heads, dtype=np.int64)[None, None, :] if heads_outer else np.zeros((1, 1, 1), np.int64)
        remote = (
            np.asarray(p.layer_addrs, dtype=np.int64)[:, None, None]
            + blocks[None, :, None] * p.block_stride
            + hs * p.head_stride
        )
        local = (
            off
            + np.arange(layers, dtype=np.int64)[:, None, None] * st[0]
            + np.arange(n, dtype=np.int64)[None, :, None] * st[1]
            + hs * st[2]
        )
        length = (1 if heads_outer else g.heads) * g.block_size * p.content
        parts.append(np.stack([local.ravel(), remote.ravel(), np.full(local.size, length, np.int64)], axis=1))
        planes.append((off, st))
        off += layers * n * g.heads * g.block_size * p.content
    desc = np.concatenate(parts)
    return merge_runs(desc[np.argsort(desc[:, 0], kind="stable")]), planes, off


def write_planes(views: Sequence[Sequence[Any]], blocks: Any, heads: tuple[int, int], planes: Sequence[Any]) -> None:
    """Write each plane's `[L, n, h, N, c]` bytes into blocks `blocks` and heads [h0, h1) of a cache.

    The cache is given as per-plane, per-layer uint8 views `[B, H, N, c]`."""
    host = _host_index(blocks)
    for plane, data in zip(views, planes):
        for layer, view in enumerate(plane):
            dst, rows = view[:, heads[0] : heads[1]], data[layer]
            if host is not None and _in_host_bytes(dst, rows):
                dst.numpy()[host] = rows.numpy()
            else:
                dst[blocks] = rows


# Host block scatters go through numpy: torch's CPU `index_put_` copies uint8 element by element, numpy each block's
# bytes at once (docs/measurements/README.md). A device tensor keeps torch's kernel.
def _host_index(blocks: Any) -> np.ndarray | None:
    if isinstance(blocks, np.ndarray):
        return blocks
    device = getattr(blocks, "device", None)
    return blocks.numpy() if device is not None and device.type == "cpu" else None


def _in_host_bytes(*tensors: Any) -> bool:
    import torch

    return all(t.device.type == "cpu" and t.dtype == torch.uint8 for t in tensors)


def write_logical(
    views: Sequence[Sequence[Any]], contents: Sequence[int], blocks: Any, heads: tuple[int, int], data: Any
) -> None:
    """Write `data` `[L, n, h, N, C]` (bytes) into blocks `blocks` and heads [h0, h1) of a cache.

    The cache is given as per-plane, per-layer uint8 views `[B, H, N, c]`; planes split C in order."""
    bounds = np.cumsum([0, *contents]).tolist()
    write_planes(views, blocks, heads, [data[..., a:b] for a, b in zip(bounds[:-1], bounds[1:])])


def read_logical(views: Sequence[Sequence[Any]], blocks: Any) -> Any:
    """`[L, n, H, N, C]` bytes of blocks `blocks` of a cache given as per-plane, per-layer uint8 views."""
    import torch

    return torch.cat([torch.stack([view[blocks] for view in plane]) for plane in views], dim=-1)


class Landed:
    """One pull's landing: its descriptors, then `finish(ok)` rearranges into the cache (or only frees)."""

    def __init__(self, buffers: LandingBuffers, buf: Any, descriptors: Descriptors, action: Any) -> None:
        self._buffers, self._buf, self.descriptors, self._action = buffers, buf, descriptors, action

    def finish(self, ok: bool, *, moved: bool = True) -> None:
        """Rearrange into the cache when the transfer succeeded; give the buffer back. See docs/internals.md."""
        try:
            if ok:
                self._action(self._buf)
        finally:
            if ok or not moved:
                self._buffers.release(self._buf)
            else:
                self._buffers.retire(self._buf)


class LandingBuffers:
    """A decode rank's landing buffers (registered once, reused) and the rearrangement after. See docs/internals.md."""

    def __init__(
        self,
        backend: Any,
        layout: KVLayout,
        views: Sequence[Sequence[Any]],
        device: Device | None = None,
        *,
        max_idle_bytes: int = MAX_IDLE_BYTES,
        max_retired_bytes: int = MAX_RETIRED_BYTES,
    ) -> None:
        if layout.paged is None:
            raise ConfigError("landing buffers need a paged layout (PagedGeometry)")
        self.backend = backend
        self.layout = layout
        self.geometry = layout.paged
        self.views = [list(v) for v in views]
        self.device = device if device is not None else get_device("cpu")
        self.device_id = max(self.device.device_id(self.views[0][0]), 0)
        self.max_idle_bytes = max_idle_bytes
        self.max_retired_bytes = max_retired_bytes
        self._free: list[Any] = []
        self._all: list[Any] = []
        self._retired_bytes = 0
        self._lock = threading.Lock()

    def direct(self, remote: KVLayout) -> bool:
        return direct(self.layout, remote)

    def lands(self, remote: KVLayout, pull: Pull) -> bool:
        """Whether `pull` goes through a landing buffer: the layouts differ, or the transport may write late."""
        if not self.direct(remote):
            return True
        return remote.paged is not None and pull.num_blocks > 0 and self.backend.capabilities.late_writes

    def prepare(
        self,
        request_id: str,
        pull: Pull,
        remote: KVLayout,
        remote_blocks: Sequence[int],
        local_blocks: Sequence[int],
        tokens: int,
        *,
        layers: Sequence[int] | None = None,
    ) -> Landed:
        """Descriptors that land the peer's blocks of the request, and the rearrangement after them.

        `layers`: of those layers only (a layer-wise read, `kvbridge.adapters.vllm.layerwise`)."""
        g = self._remote_geometry(request_id, remote)
        src, dst, n_src, n_dst = self._blocks(request_id, pull, remote, remote_blocks, local_blocks, tokens)
        views = self.views
        if layers is not None:
            keep = list(layers)
            planes_kept = [attrs.evolve(p, layer_addrs=[p.layer_addrs[i] for i in keep]) for p in g.planes]
            g = attrs.evolve(g, planes=planes_kept)
            views = [[plane[i] for i in keep] for plane in views]
        desc, planes, nbytes = landing_descriptors(g, src)
        buf = self.acquire(nbytes, request_id)
        desc = desc.copy()
        desc[:, 0] += buf.data_ptr()
        rearrange = self._rearrangement(g, planes, views, pull, dst, (n_src, n_dst), tokens)
        return Landed(self, buf, desc, rearrange)

    def _remote_geometry(self, request_id: str, remote: KVLayout) -> PagedGeometry:
        """The prefill rank's cache geometry, checked to hold the same model as this rank's."""
        g, mine = remote.paged, self.geometry
        if g is None:
            raise ConfigError(f"request {request_id}: the prefill rank sent no cache geometry; update kvbridge there")
        for name, a, b in (
            ("layers", len(mine.planes[0].layer_addrs), len(g.planes[0].layer_addrs)),
            ("content bytes", mine.content, g.content),
            ("attention", self.layout.model.attention, remote.model.attention),
            ("dtype", self.layout.model.dtype, remote.model.dtype),
        ):
            if a != b:
                raise LayoutMismatch(name, a, b, f"prefill ({g.name}) and decode ({mine.name}) hold different models")
        return g

    def _blocks(
        self,
        request_id: str,
        pull: Pull,
        remote: KVLayout,
        remote_blocks: Sequence[int],
        local_blocks: Sequence[int],
        tokens: int,
    ) -> tuple[np.ndarray, np.ndarray, int, int]:
        """The prefill and decode block ids the pull lands, and how many blocks it reads and writes."""
        g, mine = remote.paged, self.geometry
        assert g is not None  # checked by _remote_geometry
        if self.direct(remote):
            # Like layouts land whole blocks, each at the position the pull names on either side: the
            # request's first blocks, every `block_step`-th of a context-parallel rank, or the range a
            # layer-wise read covers.
            src_at, dst_at = pull.src_positions(), pull.dst_positions()
            if len(src_at) and (len(remote_blocks) <= src_at.max() or len(local_blocks) <= dst_at.max()):
                raise ConfigError(
                    f"request {request_id}: the pull reads block positions up to {src_at.max()} of prefill "
                    f"and {dst_at.max()} of decode, got {len(remote_blocks)} and {len(local_blocks)} block ids"
                )
            n_src = n_dst = pull.num_blocks
            src = block_array(remote_blocks)[src_at]
            dst = block_array(local_blocks)[dst_at]
        elif pull.src_step != 1 or pull.dst_step != 1 or pull.first_block:
            # re-blocking or rearranging a context-parallel rank's blocks would have to interleave ranks
            raise ConfigError(
                f"request {request_id}: {g.name} -> {mine.name} with context parallelism needs the "
                "same layout and block size on both sides"
            )
        else:
            n_src, n_dst = -(-tokens // g.block_size), -(-tokens // mine.block_size)
            if len(remote_blocks) < n_src or len(local_blocks) < n_dst:
                raise ConfigError(
                    f"request {request_id}: {tokens} tokens need {n_src} prefill and {n_dst} decode blocks, "
                    f"got {len(remote_blocks)} and {len(local_blocks)}"
                )
            src = block_array(remote_blocks)[:n_src]
            dst = block_array(local_blocks)[:n_dst]
        if not len(src):
            raise ConfigError(f"request {request_id}: the pull names no block to land")
        if src.min() < 0 or src.max() >= g.num_blocks or dst.min() < 0 or dst.max() >= mine.num_blocks:
            raise ConfigError(f"request {request_id}: block ids out of range")
        return src, dst, n_src, n_dst

    def _rearrangement(
        self,
        g: PagedGeometry,
        planes: list[tuple[int, list[int]]],
        views: Sequence[Sequence[Any]],
        pull: Pull,
        dst: np.ndarray,
        counts: tuple[int, int],
        tokens: int,
    ) -> Callable[[Any], None]:
        """What writes a landing buffer of `g`'s blocks into this rank's cache (blocks `dst`, the pull's heads).

        `counts`: the prefill and decode blocks of the landing."""
        mine = self.geometry
        n_src, n_dst = counts

        def rearrange(landing: Any) -> None:
            import torch

            n_layers = len(g.planes[0].layer_addrs)
            base = landing.storage_offset()  # a device plugin may hand out a view (NPU: 2 MiB-aligned)
            h0, h1 = pull.src_heads
            parts = [
                torch.as_strided(landing, (n_layers, n_src, g.heads, g.block_size, p.content), st, base + off)
                for p, (off, st) in zip(g.planes, planes)
            ]
            parts = [part[:, :, h0:h1] for part in parts]
            index = views[0][0].new_tensor(dst, dtype=torch.int64)  # on the cache's own device
            contents = [p.content for p in mine.planes]
            if g.block_size == mine.block_size and [p.content for p in g.planes] == contents:
                # whole blocks, as a direct read would: a backend may pack a block's interior (vLLM's CPU
                # attention tiles K by ISA), so its token slots are not cut or padded here; planes split
                # alike go plane by plane, without a concatenated copy
                write_planes(views, index, pull.dst_heads, parts)
            else:
                x = torch.cat(parts, dim=-1)
                if g.block_size == mine.block_size:
                    y = x
                else:  # re-blocking reads token slots literally, as vLLM's GPU backends store them
                    h = x.shape[2]
                    z = x.permute(0, 2, 1, 3, 4).reshape(n_layers, h, n_src * g.block_size, -1)[:, :, :tokens]
                    pad = n_dst * mine.block_size - tokens
                    if pad:
                        z = torch.nn.functional.pad(z, (0, 0, 0, pad))
                    y = z.reshape(n_layers, h, n_dst, mine.block_size, -1).permute(0, 2, 1, 3, 4)
                write_logical(views, contents, index, pull.dst_heads, y)
            if self.device.synchronizes:  # the rearrangement ran on the device: done before vLLM reads
                self.device.after_transfer(self.device_id)

        return rearrange

    def acquire(self, nbytes: int, request_id: str = "") -> Any:
        """A registered landing buffer of at least `nbytes` (a free one, or a new one). See docs/internals.md."""
        import torch

        size = max(MIN_LANDING_BYTES, 1 << (max(nbytes, 1) - 1).bit_length())
        with self._lock:
            fits = [b for b in self._free if b.numel() >= nbytes]
            buf = min(fits, key=lambda b: b.numel()) if fits else None
            lent = size if buf is None else buf.numel()
            if self._retired_bytes + lent > self.max_retired_bytes:
                raise LoadError(
                    f"request {request_id}: this decode rank holds {self._retired_bytes} bytes of landing buffers "
                    f"retired after failed transfers (a late write may still land in them, so they are never "
                    f"freed), and another {lent} would pass the bound of {self.max_retired_bytes}; the request is "
                    "recomputed. Find why pulls fail (the peer's health, the transfer deadline); a restart of this "
                    "engine frees them",
                    request=request_id,
                    cause="retired landing buffers at their bound",
                )
            if buf is not None:
                self._free = [b for b in self._free if b is not buf]  # by identity: == compares tensors
                return buf
        buf = self.device.allocate(size, self.device_id)
        if not isinstance(buf, torch.Tensor):  # a host device's numpy buffer: torch views it in place
            buf = torch.from_numpy(buf)
        self.backend.register_memory(buf)
        log.debug("landing buffer of %d bytes registered on %s:%d", size, self.device.name, self.device_id)
        with self._lock:
            self._all.append(buf)
        return buf

    def release(self, buf: Any) -> None:
        """Keep `buf` for reuse while the idle buffers stay within `max_idle_bytes`; else free it."""
        with self._lock:
            idle = sum(b.numel() for b in self._free)
            keep = idle + buf.numel() <= self.max_idle_bytes
            if keep:
                self._free.append(buf)
            else:
                self._all = [b for b in self._all if b is not buf]
        if not keep:
            self.backend.unregister_memory(buf)
            log.debug("landing buffer of %d bytes freed (idle buffers at the bound)", buf.numel())

    def retire(self, buf: Any) -> None:
        """Keep `buf` allocated and registered but never reuse it: a late write may still land in it."""
        with self._lock:
            self._retired_bytes += buf.numel()
            retired = self._retired_bytes
        log.warning(
            "landing buffer of %d bytes retired after a failed transfer (a late write may still land in it); "
            "%d bytes retired on this rank",
            buf.numel(),
            retired,
        )

    @property
    def retired_bytes(self) -> int:
        with self._lock:
            return self._retired_bytes

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._free)

    def close(self) -> None:
        with self._lock:
            bufs, self._all, self._free = self._all, [], []
        for buf in bufs:
            try:
                self.backend.unregister_memory(buf)
            except Exception as exc:  # the backend may already be closed with everything it registered
                log.debug("landing buffer unregister: %s", exc)
