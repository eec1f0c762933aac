"""Value types shared by the contracts. Frozen attrs classes; the wire form lives in `wire`."""

from __future__ import annotations

import enum

import attrs


class MemoryKind(str, enum.Enum):
    """Where a region lives: what a transport must be able to reach."""

    DRAM = "dram"
    VRAM = "vram"  # CUDA device memory
    NPU = "npu"  # Ascend HBM
    MLU = "mlu"  # Cambricon device memory


INT64_MAX = (1 << 63) - 1


@attrs.frozen
class MemoryRegion:
    """A contiguous range of memory that a transport registers and peers address."""

    addr: int = attrs.field(converter=int)
    length: int = attrs.field(converter=int)
    kind: MemoryKind = attrs.field(default=MemoryKind.DRAM, converter=MemoryKind)
    device_id: int = attrs.field(default=-1, converter=int)

    @length.validator
    def _positive(self, _attr: attrs.Attribute, value: int) -> None:
        if value <= 0:
            raise ValueError(f"a memory region needs a positive length, got {value}")
        # Descriptors are int64: a region a peer describes past 2**63 would wrap around in the bounds checks.
        if not 0 <= self.addr <= INT64_MAX - value:
            raise ValueError(f"memory region [{self.addr:#x}, +{value}) does not fit in [0, 2**63)")

    @property
    def end(self) -> int:
        return self.addr + self.length


@attrs.frozen
class BackendCapabilities:
    """What a transport can do, declared at registration so hosts never guess."""

    protocols: tuple[str, ...] = attrs.field(converter=tuple)
    memory_kinds: frozenset[MemoryKind] = attrs.field(
        default=frozenset({MemoryKind.DRAM}), converter=lambda v: frozenset(MemoryKind(k) for k in v)
    )
    read: bool = True
    write: bool = True
    notifications: bool = False
    max_batch: int | None = None  # descriptors per submission; the backend splits larger batches
    max_descriptor_bytes: int | None = None  # longer descriptors are cut, so a transport's lanes run in parallel
    # A transfer that failed may still write into its destination later (Mooncake TCP re-sends slices
    # queued behind a dropped lane once the peer answers): pulls into a live cache land in a buffer first
    # (kvbridge.agent.landing), so a late write never reaches a block the engine gave back.
    late_writes: bool = False


@attrs.frozen
class BackendConfig:
    """How to initialize a transport. `options` carries transport-specific settings."""

    protocol: str | None = None
    hostname: str = "127.0.0.1"
    metadata_server: str | None = None
    device_name: str = ""
    options: dict[str, object] = attrs.field(factory=dict)


@attrs.frozen
class EndpointInfo:
    """What a peer needs to reach this transport: published, serialized, passed to `connect`."""

    backend: str
    protocol: str
    address: str  # transport-specific: a Mooncake session name, host:port, a loopback id
    regions: tuple[MemoryRegion, ...] = attrs.field(converter=tuple, factory=tuple)
    extra: dict[str, str] = attrs.field(factory=dict)


@attrs.frozen
class PluginInfo:
    """One row of `kvbridge plugins`."""

    kind: str  # "backend" or "device"
    name: str
    available: bool
    reason: str = ""
    hint: str = ""
    distribution: str = ""
    version: str = ""
    detail: dict[str, object] = attrs.field(factory=dict)
    hardware_here: bool | None = None  # whether the hardware it drives is on this machine; None: not asked
