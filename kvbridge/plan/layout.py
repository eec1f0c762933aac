"""KV cache layouts: where a rank's blocks live, and whether two ranks can exchange them. See docs/internals.md."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Literal

import attrs

from kvbridge.base.errors import ConfigError, LayoutMismatch
from kvbridge.plan.presets import ModelSpec
from kvbridge.plugin.placement import regions_of

Order = Literal["NHD", "HND"]
KINDS = ("k", "v", "kv", "latent", "index")


@attrs.frozen
class KVRegion:
    """The blocks of one (layer, kind) of a rank's KV cache."""

    layer: int
    kind: str = attrs.field(validator=attrs.validators.in_(KINDS))
    addr: int
    num_blocks: int
    block_stride: int
    block_bytes: int
    heads: int = 0  # heads that can be sliced out of a block; 0: the block is opaque
    head_bytes: int = 0
    chunks: int = 1
    chunk_stride: int = 0

    def __attrs_post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_bytes < 1:
            raise ConfigError(f"region layer {self.layer} {self.kind}: needs blocks and bytes, got {self}")
        if self.num_blocks > 1 and self.block_stride < self.block_bytes:
            raise ConfigError(
                f"region layer {self.layer} {self.kind}: block stride {self.block_stride} is smaller than the "
                f"{self.block_bytes}-byte block, so blocks overlap"
            )
        if self.heads and self.heads * self.head_bytes > (self.chunk_stride if self.chunks > 1 else self.block_bytes):
            raise ConfigError(f"region layer {self.layer} {self.kind}: {self.heads} heads do not fit in a chunk")
        if self.heads and (self.chunks - 1) * self.chunk_stride + self.heads * self.head_bytes > self.block_bytes:
            raise ConfigError(f"region layer {self.layer} {self.kind}: head chunks reach past the block")

    @property
    def order(self) -> str:
        """How heads sit in a block: "HND", "NHD", or "opaque" (no head slicing)."""
        return "opaque" if not self.heads else ("NHD" if self.chunks > 1 else "HND")

    @property
    def span(self) -> tuple[int, int]:
        """[first byte, last byte + 1) the region's blocks occupy."""
        return self.addr, self.addr + (self.num_blocks - 1) * self.block_stride + self.block_bytes


@attrs.frozen
class PagedPlane:
    """One plane of a paged cache: per layer, a `[block, head, token, content]` grid of bytes. See docs/internals.md."""

    kind: str = attrs.field(validator=attrs.validators.in_(KINDS))
    content: int  # bytes of one (head, token) cell in this plane
    layer_addrs: tuple[int, ...] = attrs.field(converter=tuple)
    block_stride: int
    head_stride: int
    token_stride: int


@attrs.frozen
class PagedGeometry:
    """Where every (layer, block, head, token, content byte) of a rank's paged cache lives. See docs/internals.md."""

    name: str
    order: tuple[int, ...] = attrs.field(converter=tuple)
    num_blocks: int
    heads: int
    block_size: int
    planes: tuple[PagedPlane, ...] = attrs.field(converter=tuple)

    @property
    def content(self) -> int:
        """Bytes of one (head, token) cell over all planes."""
        return sum(p.content for p in self.planes)

    def same_arrangement(self, other: PagedGeometry) -> bool:
        """Blocks of both can be copied byte for byte (only addresses and capacity differ)."""
        return _arrangement(self) == _arrangement(other)


def _arrangement(g: PagedGeometry) -> tuple[Any, ...]:
    planes = tuple((p.kind, p.content, p.head_stride, p.token_stride) for p in g.planes)
    return g.name, g.order, g.heads, g.block_size, planes


@attrs.frozen(cache_hash=True)  # a key of the planner's caches: hashed on every pull
class KVLayout:
    """A rank's KV cache: model facts, KV heads on this rank, its regions (and a paged cache's geometry)."""

    model: ModelSpec
    heads: int
    regions: tuple[KVRegion, ...] = attrs.field(converter=tuple)
    paged: PagedGeometry | None = None

    @property
    def num_blocks(self) -> int:
        """Blocks every region can hold (the rank's capacity)."""
        return _capacity(self)


@functools.lru_cache(maxsize=256)
def _capacity(layout: KVLayout) -> int:
    # asked twice per pull; a model of 64 layers has 128 regions to scan
    return min(r.num_blocks for r in layout.regions)


def check_compatible(local: KVLayout, remote: KVLayout) -> None:
    """Raise LayoutMismatch naming the first field that keeps the two ranks from exchanging blocks.

    Block counts and heads per rank may differ, as long as a head has the same bytes on both sides."""
    for name in ("attention", "layers", "head_dim", "dtype", "block_size"):
        a, b = getattr(local.model, name), getattr(remote.model, name)
        if a != b:
            raise LayoutMismatch(f"model.{name}", a, b)
    if len(local.regions) != len(remote.regions):
        raise LayoutMismatch(
            "regions",
            len(local.regions),
            len(remote.regions),
            "Both sides must register the same layers and cache kinds (K/V, latent, index)",
        )
    for i, (a, b) in enumerate(zip(local.regions, remote.regions)):
        for name in ("layer", "kind"):
            if getattr(a, name) != getattr(b, name):
                raise LayoutMismatch(f"regions[{i}].{name}", getattr(a, name), getattr(b, name))
        if a.order != b.order:
            raise LayoutMismatch(
                f"regions[{i}].order", a.order, b.order, "Use the same cache layout (NHD/HND) on both sides"
            )
        if a.heads and a.head_bytes != b.head_bytes:
            raise LayoutMismatch(f"regions[{i}].head_bytes", a.head_bytes, b.head_bytes)
        if local.heads == remote.heads and a.block_bytes != b.block_bytes:
            raise LayoutMismatch(f"regions[{i}].block_bytes", a.block_bytes, b.block_bytes)


def address(x: Any) -> int:
    """The first byte of a tensor or numpy array (through its device plugin), or an int as is."""
    if isinstance(x, int):
        return x
    regions = regions_of(x)
    if len(regions) != 1:
        raise ConfigError(f"expected one tensor or address, got {len(regions)} regions")
    return regions[0].addr


def _kind_geometry(model: ModelSpec, heads: int, kind: str, order: Order) -> dict[str, int]:
    """block_bytes and head slicing of one block of a K, V or latent cache."""
    row = model.head_dim * model.dtype_bytes  # one token of one head
    block_bytes = heads * model.block_size * row
    if order == "HND":
        return dict(block_bytes=block_bytes, heads=heads, head_bytes=model.block_size * row)
    if order == "NHD":
        return dict(
            block_bytes=block_bytes, heads=heads, head_bytes=row, chunks=model.block_size, chunk_stride=heads * row
        )
    raise ConfigError(f"order must be 'NHD' or 'HND', got {order!r}")


def _kinds(model: ModelSpec) -> tuple[str, ...]:
    return ("latent",) if model.attention == "mla" else ("k", "v")


def vllm_layout(
    model: ModelSpec,
    heads: int,
    layers: Sequence[Any],
    num_blocks: int,
    *,
    kv: Literal["split", "joint", "per-head"] = "split",
    order: Order = "NHD",
) -> KVLayout:
    """A vLLM-style cache: one entry per layer, each a tensor (or address), or a (K, V) pair. See docs/internals.md."""
    if len(layers) != model.layers:
        raise ConfigError(f"{model.name} has {model.layers} layers, got {len(layers)} cache entries")
    if kv == "per-head":
        if model.attention == "mla" or order != "HND":
            raise ConfigError("kv='per-head' is a GQA layout with heads outermost in a block: use order='HND'")
        slab = model.block_size * model.head_dim * model.dtype_bytes  # one head's K (or V) in a block
        block_bytes = heads * 2 * slab
        joint = [
            KVRegion(
                layer, "kv", address(entry), num_blocks, block_bytes, block_bytes, heads=heads, head_bytes=2 * slab
            )
            for layer, entry in enumerate(layers)
        ]
        return KVLayout(model, heads, joint)
    regions = []
    for layer, entry in enumerate(layers):
        for i, kind in enumerate(_kinds(model)):
            geo = _kind_geometry(model, heads, kind, order)
            bb = geo["block_bytes"]
            if isinstance(entry, tuple):
                if len(entry) != len(_kinds(model)):
                    raise ConfigError(f"layer {layer}: expected {len(_kinds(model))} tensors, got {len(entry)}")
                base, stride = address(entry[i]), bb
            elif kv == "split":
                base, stride = address(entry) + i * num_blocks * bb, bb
            elif kv == "joint":
                base, stride = address(entry) + i * bb, len(_kinds(model)) * bb
            else:
                raise ConfigError(f"kv must be 'split' or 'joint', got {kv!r}")
            regions.append(KVRegion(layer, kind, base, num_blocks, stride, **geo))
    return KVLayout(model, heads, regions)


def paged_layout(model: ModelSpec, geometry: PagedGeometry) -> KVLayout:
    """Regions of a paged cache for byte-for-byte pulls. See docs/internals.md."""
    g = geometry
    regions = []
    for plane in g.planes:
        c, n, h = plane.content, g.block_size, g.heads
        page = h * n * c
        for layer, addr in enumerate(plane.layer_addrs):
            region = functools.partial(KVRegion, layer, plane.kind, addr, g.num_blocks, plane.block_stride)
            if (plane.head_stride, plane.token_stride) == (n * c, c) or h == 1 and plane.token_stride == c:
                regions.append(region(page, heads=h, head_bytes=n * c))
            elif (plane.head_stride, plane.token_stride) == (c, h * c):
                regions.append(region(page, heads=h, head_bytes=c, chunks=n, chunk_stride=h * c))
            elif plane.token_stride == c:
                regions.extend(
                    KVRegion(layer, plane.kind, addr + i * plane.head_stride, g.num_blocks, plane.block_stride, n * c)
                    for i in range(h)
                )
            else:
                raise ConfigError(
                    f"{g.name} cache: tokens of a head are not contiguous (token stride "
                    f"{plane.token_stride}, {c} bytes each); kvbridge cannot address its blocks"
                )
    return KVLayout(model, g.heads, regions, paged=g)


def lmdeploy_layout(model: ModelSpec, heads: int, pool: Any, num_blocks: int, *, order: Order = "NHD") -> KVLayout:
    """An LMDeploy-style packed pool of shape (layers, num_blocks, entry): each entry is K then V."""
    kinds = _kinds(model)
    base = address(pool)
    geo = _kind_geometry(model, heads, kinds[0], order)
    entry = len(kinds) * geo["block_bytes"]
    regions = [
        KVRegion(layer, kind, base + layer * num_blocks * entry + i * geo["block_bytes"], num_blocks, entry, **geo)
        for layer in range(model.layers)
        for i, kind in enumerate(kinds)
    ]
    return KVLayout(model, heads, regions)


@attrs.frozen
class BufferDesc:
    """One registered buffer of shape (num_layers, num_blocks, size_per_block), as MLU engines describe them."""

    kind: str = attrs.field(validator=attrs.validators.in_(KINDS))
    addr: int
    num_blocks: int
    size_per_block: int
    num_layers: int


def buffer_layout(model: ModelSpec, heads: int, buffers: Sequence[BufferDesc]) -> KVLayout:
    """Opaque blocks from buffer descriptors (key, value, index...): whole blocks only, no head slicing."""
    for b in buffers:
        if b.num_layers != model.layers:
            raise ConfigError(f"{b.kind} buffer has {b.num_layers} layers, {model.name} has {model.layers}")
    regions = []
    for layer in range(model.layers):
        for b in buffers:
            size = b.size_per_block  # blocks back to back: the stride is the block
            regions.append(KVRegion(layer, b.kind, b.addr + layer * b.num_blocks * size, b.num_blocks, size, size))
    return KVLayout(model, heads, regions)
