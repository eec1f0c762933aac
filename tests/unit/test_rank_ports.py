"""Rank wiring: every (DP, PP, TP) rank of an engine gets its own side-channel port; readers find them."""

from __future__ import annotations

import itertools

import pytest

from kvbridge.base.errors import ConfigError
from kvbridge.plan.rank_ports import group_port, side_channel_port, stage_port


def test_every_rank_has_its_own_port() -> None:
    dp, pp, tp = 2, 3, 4
    ports = [
        side_channel_port(5800, tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp, dp_index=d)
        for d, p, t in itertools.product(range(dp), range(pp), range(tp))
    ]
    assert len(set(ports)) == dp * pp * tp and min(ports) == 5800 and max(ports) == 5800 + dp * pp * tp - 1


@pytest.mark.parametrize(("dp", "pp", "tp"), [(1, 1, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2), (3, 4, 2), (2, 3, 1)])
def test_reader_finds_the_rank_of_its_stage(dp: int, pp: int, tp: int) -> None:
    from kvbridge.plan.topology import ParallelConfig

    published = group_port(7000, tp_size=tp, pp_size=pp)  # every DP rank publishes the engine's base
    for d, p, t in itertools.product(range(dp), range(pp), range(tp)):
        rank = ParallelConfig(tp=tp, dp=dp).group(d)[t]  # the global index the reader resolves
        found = stage_port(published, remote_tp_size=tp, pp_rank=p, pp_size=pp, dp_rank=d) + rank
        assert found == side_channel_port(7000, tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp, dp_index=d)


def test_bad_ranks_are_refused() -> None:
    with pytest.raises(ConfigError, match="tp rank 2"):
        side_channel_port(5800, tp_rank=2, tp_size=2)
    with pytest.raises(ConfigError, match="out of range"):
        side_channel_port(65530, tp_rank=7, tp_size=8)
