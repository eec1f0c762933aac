"""Topology: parallel configs and the pull plan (who reads which heads and blocks from whom)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.base.errors import TopologyError
from kvbridge.plan.presets import PRESETS, ModelSpec
from kvbridge.plan.topology import HeadPlacement, ParallelConfig, Plan, plan
from kvbridge_tools.bench.parallel import CONTEXT_PAIRS


def test_parse_and_str_round_trip() -> None:
    c = ParallelConfig.parse("tp8,pcp2,dcp8")
    assert c == ParallelConfig(tp=8, pcp=2, dcp=8)
    assert ParallelConfig.parse("TP8/DCP4/DP2") == ParallelConfig(tp=8, dcp=4, dp=2)
    assert ParallelConfig.parse(str(c)) == c
    assert (c.world_size, c.cp, c.shards) == (16, 16, 1)


@pytest.mark.parametrize("spec", ["", "tp", "tp8,xx2", "tp8,tp4", "tp0", "tp4,dcp3"])
def test_parse_refuses_bad_specs(spec: str) -> None:
    with pytest.raises(TopologyError):
        ParallelConfig.parse(spec)


def test_a_pipeline_size_is_refused_with_why_a_plan_has_none() -> None:
    with pytest.raises(TopologyError, match="'pp2': plan one pipeline stage"):
        ParallelConfig.parse("tp4,pp2")


def test_rank_coordinates_round_trip() -> None:
    c = ParallelConfig(tp=8, pcp=2, dcp=4, dp=2)
    seen = set()
    for rank in range(c.world_size):
        x = c.coords(rank)
        assert c.rank_of(x.dp, x.cp, x.shard) == rank
        assert x.cp == x.pcp * c.dcp + x.dcp
        seen.add((x.dp, x.cp, x.shard))
    assert len(seen) == c.world_size
    with pytest.raises(TopologyError):
        c.coords(c.world_size)


def test_heads_that_cannot_be_spread_are_refused_before_planning() -> None:
    model = ModelSpec("six", layers=1, kv_heads=6, head_dim=8)
    with pytest.raises(TopologyError, match="6 KV heads"):
        plan(ParallelConfig(tp=4), ParallelConfig(tp=2), model, 100)
    with pytest.raises(TopologyError, match="dp rank 2 is outside tp2,dp2: its DP ranks are 0 to 1"):
        plan(ParallelConfig(tp=2), ParallelConfig(tp=2, dp=2), PRESETS["tiny-gqa"], 100, decode_dp=2)
    with pytest.raises(TopologyError, match="at least one token"):
        plan(ParallelConfig(tp=2), ParallelConfig(tp=2), PRESETS["tiny-gqa"], 0)


def test_mla_latent_is_read_once_per_decode_rank() -> None:
    p = plan(ParallelConfig.parse("tp8"), ParallelConfig.parse("tp4,dcp2"), PRESETS["tiny-mla"], 100)
    # 4 decode ranks, each reads its cp half of the blocks from its own prefill replica
    assert len(p.pulls) == 4
    assert {len(p.pulls_for(r)) for r in p.decode_ranks} == {1}
    assert p.release_counts == (1, 1, 1, 1, 0, 0, 0, 0)
    assert p.unpulled == (4, 5, 6, 7)  # the other four replicas are released at once
    assert p.notifier == 0


def test_pcp_dcp_prefill_rank_is_pulled_by_every_decode_rank() -> None:
    # the context PR's example: a prefill rank pulled by several decode ranks frees after the last pull
    p = plan(ParallelConfig.parse("tp8,pcp2,dcp8"), ParallelConfig.parse("tp8,dp2"), PRESETS["tiny-mla"], 2500)
    assert p.release_counts == (8,) * 16
    assert p.unpulled == ()


def test_short_prompt_leaves_cp_ranks_without_blocks_unpulled() -> None:
    # 2 blocks over 16 cp ranks: only cp ranks 0 and 1 hold anything
    p = plan(ParallelConfig.parse("tp8,pcp2,dcp8"), ParallelConfig.parse("tp8"), PRESETS["tiny-mla"], 20)
    assert p.num_blocks == 2 and p.last_block_tokens == 4
    pulled = {pl.prefill_rank for pl in p.pulls}
    assert pulled == {0, 1}
    assert set(p.unpulled) == set(range(16)) - pulled


def test_prefill_tp_larger_reads_head_subranges_from_several_ranks() -> None:
    p = plan(
        ParallelConfig.parse("tp16,dcp2"), ParallelConfig.parse("tp8,dcp2,dp2"), PRESETS["tiny-gqa"], 64, decode_dp=1
    )
    rank = p.decode_ranks.start  # decode dp 1, shard 0, dcp 0: heads 0-3 from prefill shards 0 and 1
    pulls = p.pulls_for(rank)
    assert [(x.prefill_rank, x.src_heads, x.dst_heads) for x in pulls] == [(0, (0, 2), (0, 2)), (2, (0, 2), (2, 4))]
    assert [x.logical_blocks().tolist() for x in pulls] == [[0, 2], [0, 2]]


@pytest.mark.parametrize(("model", "prefill", "decode"), CONTEXT_PAIRS)
def test_context_pairs_plan(model: str, prefill: str, decode: str) -> None:
    p, d = ParallelConfig.parse(prefill), ParallelConfig.parse(decode)
    for dp_p in range(p.dp):
        for dp_d in range(d.dp):
            _check_plan(plan(p, d, PRESETS[model], 2500, prefill_dp=dp_p, decode_dp=dp_d))


def _check_plan(p: Plan) -> None:
    """Every (block, head) of every decode rank's share has exactly one source, which holds it."""
    src_place = HeadPlacement.of(p.model, p.prefill, "prefill")
    dst_place = HeadPlacement.of(p.model, p.decode, "decode")
    for rank in p.decode_ranks:
        d = p.decode.coords(rank)
        cover = np.zeros((p.blocks_on("decode", rank), dst_place.per_rank), dtype=np.int64)
        for pull in p.pulls_for(rank):
            assert pull.num_blocks > 0
            s = p.prefill.coords(pull.prefill_rank)
            assert pull.prefill_rank in p.prefill_ranks
            g = pull.logical_blocks()
            assert (g < p.num_blocks).all()
            assert (g % p.prefill.cp == s.cp).all() and (g % p.decode.cp == d.cp).all()
            assert (pull.src_positions() == g // p.prefill.cp).all()
            assert (pull.src_positions() < p.blocks_on("prefill", pull.prefill_rank)).all()
            assert (pull.dst_positions() == g // p.decode.cp).all()
            src_heads = list(src_place.heads(s.shard))[slice(*pull.src_heads)]
            dst_heads = list(dst_place.heads(d.shard))[slice(*pull.dst_heads)]
            assert src_heads == dst_heads and src_heads
            cover[np.ix_(pull.dst_positions(), np.arange(*pull.dst_heads))] += 1
        assert (cover == 1).all(), f"decode rank {rank}: coverage {cover.tolist()}"
    counts = {r: 0 for r in p.prefill_ranks}
    for pull in p.pulls:
        counts[pull.prefill_rank] += 1
    assert tuple(counts.values()) == p.release_counts
    assert set(p.unpulled) == {r for r, n in counts.items() if n == 0}


POW2 = st.sampled_from([1, 2, 4, 8, 16])


@st.composite
def configs(draw: st.DrawFn) -> ParallelConfig:
    tp = draw(POW2)
    dcp = draw(st.sampled_from([x for x in (1, 2, 4, 8, 16) if tp % x == 0]))
    return ParallelConfig(tp=tp, pcp=draw(st.sampled_from([1, 2, 3])), dcp=dcp, dp=draw(st.sampled_from([1, 2, 3])))


@st.composite
def models(draw: st.DrawFn) -> ModelSpec:
    block = draw(st.sampled_from([1, 4, 16]))
    if draw(st.booleans()):
        return ModelSpec("m", layers=1, kv_heads=1, head_dim=8, block_size=block, attention="mla")
    return ModelSpec("g", layers=1, kv_heads=draw(POW2), head_dim=8, block_size=block)


@settings(max_examples=300, deadline=None)
@given(configs(), configs(), models(), st.integers(1, 700), st.data())
def test_plan_properties(
    prefill: ParallelConfig, decode: ParallelConfig, model: ModelSpec, tokens: int, data: st.DataObject
) -> None:
    dp_p = data.draw(st.integers(0, prefill.dp - 1))
    dp_d = data.draw(st.integers(0, decode.dp - 1))
    _check_plan(plan(prefill, decode, model, tokens, prefill_dp=dp_p, decode_dp=dp_d))
