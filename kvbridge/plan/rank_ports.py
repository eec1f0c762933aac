"""Rank wiring: which port each rank's side channel listens on, and which ones peers read. See docs/internals.md."""

from __future__ import annotations

from kvbridge.base.errors import ConfigError


def side_channel_port(
    base: int, *, tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1, dp_index: int = 0
) -> int:
    """The port rank (dp_index, pp_rank, tp_rank) of an engine listens on."""
    for name, rank, size in (("tp", tp_rank, tp_size), ("pp", pp_rank, pp_size)):
        if not 0 <= rank < size:
            raise ConfigError(f"{name} rank {rank} is outside {name} size {size}")
    port = base + (dp_index * pp_size + pp_rank) * tp_size + tp_rank
    if not 0 < port < 65536:
        raise ConfigError(f"side channel port {port} (base {base}) is out of range; pick a lower side_channel_port")
    return port


def group_port(base: int, *, tp_size: int = 1, pp_size: int = 1, dp_index: int = 0) -> int:
    """The base port of DP rank `dp_index`'s group (its first stage's TP rank 0), as peers are told."""
    return side_channel_port(base, tp_size=tp_size, pp_size=pp_size, dp_index=dp_index)


def stage_port(remote_port: int, *, remote_tp_size: int, pp_rank: int, pp_size: int, dp_rank: int) -> int:
    """The base to which a reader adds a rank's global index to reach that rank of stage `pp_rank`.

    The global index is `dp_rank * remote_tp_size + tp_rank`; the engine published `remote_port` (its base)."""
    return remote_port + (dp_rank * (pp_size - 1) + pp_rank) * remote_tp_size
