"""Who pulls what: parallel configurations of both sides and the pull plan between them. See docs/internals.md."""

from __future__ import annotations

import functools
import math
import re

import attrs
import numpy as np

from kvbridge.base.errors import TopologyError
from kvbridge.plan.presets import ModelSpec

MAX_PARALLEL_SIZE = 4096  # one parallel size (tp, pcp, dcp, dp, pp): far above any deployment, and plans stay small


def _positive(_inst: object, attr: attrs.Attribute, value: int) -> None:
    if not 1 <= value <= MAX_PARALLEL_SIZE:
        raise TopologyError(f"{attr.name} must be an integer from 1 to {MAX_PARALLEL_SIZE}, got {value}")


@attrs.frozen
class ParallelConfig:
    """One side's parallelism: tensor, prefill-context, decode-context and data parallel sizes."""

    tp: int = attrs.field(default=1, validator=_positive)
    pcp: int = attrs.field(default=1, validator=_positive)
    dcp: int = attrs.field(default=1, validator=_positive)
    dp: int = attrs.field(default=1, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.tp % self.dcp:
            raise TopologyError(
                f"dcp ({self.dcp}) must divide tp ({self.tp}): decode context parallelism splits the tensor "
                "parallel ranks into groups that hold the same heads"
            )

    @classmethod
    def parse(cls, spec: str) -> ParallelConfig:
        """Parse `"tp8,pcp2,dcp8"` (also `"TP8/PCP2/DCP8"`); sizes not named are 1."""
        sizes: dict[str, int] = {}
        for part in filter(None, re.split(r"[,/\s]+", spec.strip().lower())):
            m = re.fullmatch(r"(tp|pcp|dcp|dp|pp)=?(\d+)", part)
            if not m:
                raise TopologyError(
                    f"cannot parse {part!r} in parallel spec {spec!r}; write sizes like 'tp8,pcp2,dcp8,dp2'"
                )
            if m.group(1) == "pp":  # (both engines run the same --pipeline-parallel-size)
                raise TopologyError(f"{part!r}: plan one pipeline stage (each pulls from its own stage); drop it")
            if m.group(1) in sizes:
                raise TopologyError(f"{m.group(1)} given twice in parallel spec {spec!r}")
            sizes[m.group(1)] = int(m.group(2))
        if not sizes:
            raise TopologyError(f"empty parallel spec {spec!r}; write sizes like 'tp8,pcp2,dcp8,dp2'")
        return cls(**sizes)

    def __str__(self) -> str:
        return ",".join(f"{k}{v}" for k, v in attrs.asdict(self).items() if v != 1 or k == "tp")

    @property
    def group_size(self) -> int:
        """Ranks in one DP group."""
        return self.pcp * self.tp

    @property
    def world_size(self) -> int:
        return self.dp * self.group_size

    @property
    def cp(self) -> int:
        """Context-parallel ranks a request's blocks are interleaved over."""
        return self.pcp * self.dcp

    @property
    def shards(self) -> int:
        """Head shards: TP ranks that hold different KV heads."""
        return self.tp // self.dcp

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} is outside {self} (world size {self.world_size})")
        dp_rank, rest = divmod(rank, self.group_size)
        pcp_rank, tp_rank = divmod(rest, self.tp)
        shard, dcp_rank = divmod(tp_rank, self.dcp)
        return RankCoords(rank, dp_rank, pcp_rank, tp_rank, dcp_rank, shard, pcp_rank * self.dcp + dcp_rank)

    def rank_of(self, dp_rank: int, cp_rank: int, shard: int) -> int:
        pcp_rank, dcp_rank = divmod(cp_rank, self.dcp)
        return dp_rank * self.group_size + pcp_rank * self.tp + shard * self.dcp + dcp_rank

    def group(self, dp_rank: int) -> range:
        """The ranks of one DP group."""
        if not 0 <= dp_rank < self.dp:
            raise TopologyError(f"dp rank {dp_rank} is outside {self}: its DP ranks are 0 to {self.dp - 1}")
        return range(dp_rank * self.group_size, (dp_rank + 1) * self.group_size)

    def blocks_on(self, cp_rank: int, num_blocks: int) -> int:
        """How many of a request's `num_blocks` logical blocks cp rank `cp_rank` holds."""
        return max(0, -(-(num_blocks - cp_rank) // self.cp))


@attrs.frozen
class RankCoords:
    """Where a rank sits in its side's parallel grid."""

    rank: int
    dp: int
    pcp: int
    tp: int
    dcp: int
    shard: int
    cp: int


@attrs.frozen
class HeadPlacement:
    """How a model's KV heads spread over one side's head shards."""

    kv_heads: int
    shards: int

    @classmethod
    def of(cls, model: ModelSpec, config: ParallelConfig, side: str) -> HeadPlacement:
        kv_heads = 1 if model.attention == "mla" else model.kv_heads
        shards = config.shards
        if kv_heads % shards and shards % kv_heads:
            raise TopologyError(
                f"{side} {config}: {kv_heads} KV heads of {model.name} cannot be spread over {shards} head shards "
                f"(tp {config.tp} / dcp {config.dcp}); one must divide the other. Pick a tp/dcp that does"
            )
        return cls(kv_heads, shards)

    @property
    def per_rank(self) -> int:
        return max(1, self.kv_heads // self.shards)

    @property
    def replicas(self) -> int:
        return max(1, self.shards // self.kv_heads)

    def heads(self, shard: int) -> range:
        """Global heads held by a shard."""
        first = shard * self.per_rank if self.replicas == 1 else shard // self.replicas
        return range(first, first + self.per_rank)

    def source(self, head: int, reader: int) -> tuple[int, int]:
        """(shard, local head index) reader number `reader` reads a global head from."""
        if self.replicas == 1:
            return divmod(head, self.per_rank)
        return head * self.replicas + reader % self.replicas, 0


@attrs.frozen
class Pull:
    """One decode rank reading one prefill rank's share of a request (docs/planning.md). See docs/internals.md."""

    decode_rank: int
    prefill_rank: int
    src_heads: tuple[int, int]
    dst_heads: tuple[int, int]
    first_block: int
    block_step: int
    num_blocks: int
    src_first: int
    src_step: int
    dst_first: int
    dst_step: int

    def logical_blocks(self) -> np.ndarray:
        return self.first_block + self.block_step * np.arange(self.num_blocks, dtype=np.int64)

    def src_positions(self) -> np.ndarray:
        return self.src_first + self.src_step * np.arange(self.num_blocks, dtype=np.int64)

    def dst_positions(self) -> np.ndarray:
        return self.dst_first + self.dst_step * np.arange(self.num_blocks, dtype=np.int64)


@attrs.frozen
class Plan:
    """Every pull of one request, and what each prefill rank of its DP group must expect."""

    prefill: ParallelConfig
    decode: ParallelConfig
    model: ModelSpec
    tokens: int
    prefill_dp: int
    decode_dp: int
    pulls: tuple[Pull, ...]
    release_counts: tuple[int, ...]  # indexed by prefill rank - first rank of prefill_dp's group

    @property
    def num_blocks(self) -> int:
        return -(-self.tokens // self.model.block_size)

    @property
    def last_block_tokens(self) -> int:
        return self.tokens - (self.num_blocks - 1) * self.model.block_size

    @property
    def prefill_ranks(self) -> range:
        return self.prefill.group(self.prefill_dp)

    @property
    def decode_ranks(self) -> range:
        return self.decode.group(self.decode_dp)

    def release_count(self, prefill_rank: int) -> int:
        """Pulls a prefill rank waits for before freeing the request's blocks."""
        if prefill_rank not in self.prefill_ranks:
            raise TopologyError(
                f"prefill rank {prefill_rank} is not in DP group {self.prefill_dp} ({self.prefill_ranks}); "
                "it holds nothing of this request"
            )
        return self.release_counts[prefill_rank - self.prefill_ranks.start]

    @property
    def unpulled(self) -> tuple[int, ...]:
        """Prefill ranks nobody reads: they must be told at once to free their blocks."""
        start = self.prefill_ranks.start
        return tuple(start + i for i, n in enumerate(self.release_counts) if n == 0)

    @property
    def notifier(self) -> int:
        """The decode rank that tells the unpulled prefill ranks (the first of the decode group)."""
        return self.decode_ranks.start

    def pulls_for(self, decode_rank: int) -> tuple[Pull, ...]:
        return tuple(p for p in self.pulls if p.decode_rank == decode_rank)

    def blocks_on(self, side: str, rank: int) -> int:
        """How many of the request's blocks a rank of `side` ("prefill"/"decode") holds."""
        config = self.prefill if side == "prefill" else self.decode
        return config.blocks_on(config.coords(rank).cp, self.num_blocks)


def heads_per_rank(model: ModelSpec, config: ParallelConfig) -> int:
    """KV heads (MLA: 1 latent) each rank of a side holds; raises TopologyError when not placeable."""
    return HeadPlacement.of(model, config, "side").per_rank


def plan(
    prefill: ParallelConfig,
    decode: ParallelConfig,
    model: ModelSpec,
    tokens: int,
    *,
    prefill_dp: int = 0,
    decode_dp: int = 0,
) -> Plan:
    """Plan one request of `tokens` tokens living in `prefill_dp` and `decode_dp`. See docs/internals.md."""
    if tokens < 1:
        raise TopologyError(f"a request needs at least one token, got {tokens}")
    prefill.group(prefill_dp)
    decode.group(decode_dp)
    return _plan(prefill, decode, model, tokens, prefill_dp, decode_dp)


def forget_plans() -> None:
    """Drop the plans cached so far (a measurement of planning plans every request afresh)."""
    _plan.cache_clear()


@functools.lru_cache(maxsize=256)
def _plan(
    prefill: ParallelConfig, decode: ParallelConfig, model: ModelSpec, tokens: int, prefill_dp: int, decode_dp: int
) -> Plan:
    src = HeadPlacement.of(model, prefill, "prefill")
    dst = HeadPlacement.of(model, decode, "decode")
    num_blocks = -(-tokens // model.block_size)
    step = math.lcm(prefill.cp, decode.cp)
    pulls: list[Pull] = []
    counts = [0] * prefill.group_size
    for decode_rank in decode.group(decode_dp):
        d = decode.coords(decode_rank)
        # replicas are spread over the decode ranks: rank (cp, shard) reads replica (cp * shards + shard) % replicas
        head_runs = _head_runs(src, dst, d.shard, d.cp * decode.shards + d.shard)
        for p_cp in range(prefill.cp):
            # the logical blocks both this decode cp rank and prefill cp rank p_cp hold
            first = next((g for g in range(step) if g % decode.cp == d.cp and g % prefill.cp == p_cp), None)
            if first is None or first >= num_blocks:
                continue
            count = -(-(num_blocks - first) // step)
            for p_shard, src_heads, dst_heads in head_runs:
                p_rank = prefill.rank_of(prefill_dp, p_cp, p_shard)
                counts[p_rank - prefill.group(prefill_dp).start] += 1
                pulls.append(
                    Pull(
                        decode_rank=decode_rank,
                        prefill_rank=p_rank,
                        src_heads=src_heads,
                        dst_heads=dst_heads,
                        first_block=first,
                        block_step=step,
                        num_blocks=count,
                        src_first=first // prefill.cp,
                        src_step=step // prefill.cp,
                        dst_first=first // decode.cp,
                        dst_step=step // decode.cp,
                    )
                )
    return Plan(prefill, decode, model, tokens, prefill_dp, decode_dp, tuple(pulls), tuple(counts))


def _head_runs(
    src: HeadPlacement, dst: HeadPlacement, decode_shard: int, reader: int
) -> list[tuple[int, tuple[int, int], tuple[int, int]]]:
    """(prefill shard, src head range, dst head range) covering a decode shard's heads."""
    runs: list[tuple[int, tuple[int, int], tuple[int, int]]] = []
    for dst_index, head in enumerate(dst.heads(decode_shard)):
        shard, src_index = src.source(head, reader)
        if runs and runs[-1][0] == shard and runs[-1][1][1] == src_index:
            prev = runs[-1]
            runs[-1] = (shard, (prev[1][0], src_index + 1), (prev[2][0], dst_index + 1))
        else:
            runs.append((shard, (src_index, src_index + 1), (dst_index, dst_index + 1)))
    return runs
