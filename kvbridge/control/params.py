"""`KVTransferParams`: the request-level metadata a PD proxy carries between prefill and decode.

Its dict form uses the keys vLLM's NIXL-style connectors and proxies already pass
(`do_remote_prefill`, `do_remote_decode`, `remote_engine_id`, `remote_request_id`,
`remote_block_ids`, `remote_host`, `remote_port`, `tp_size`, `dcp_size`, `pp_size`,
`remote_num_tokens`, `remote_blocks_expiry_time`, `transfer_mode`, `transfer_id`), plus kvbridge's own
(`pcp_size`, `dp_size`, `dp_rank`, `prefix_prompt_ids`, `cache_keys`, `kvbridge_timing`). Keys it does not know
are kept in `extra` and written back, so a proxy's additions survive a round trip.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from kvbridge import wire
from kvbridge.block_ids import BlockIds
from kvbridge.errors import ConfigError


def _groups(value: Any) -> tuple[BlockIds, ...]:
    """Block ids as groups (vLLM >= 0.10 sends one list per KV-cache group); a flat list is one group."""
    if value is None:
        return ()
    if isinstance(value, (BlockIds, np.ndarray)):
        return (BlockIds(value),)
    value = list(value)
    if value and not isinstance(value[0], (list, tuple, BlockIds, np.ndarray)):
        return (BlockIds(value),)
    return tuple(BlockIds(g) for g in value)


def _opt_ints(value: Any) -> tuple[int, ...] | None:
    return None if value is None else tuple(int(v) for v in value)


def _opt_strs(value: Any) -> tuple[str, ...] | None:
    return None if value is None else tuple(str(v) for v in value)


@attrs.frozen
class KVTransferParams:
    """What one side tells the other about a request's KV, through the proxy.

    On the prefill request the proxy sets `do_remote_decode=True`; the prefill engine answers
    with `do_remote_prefill=True` and where its KV is (`remote_*`), which the proxy hands to
    the decode request. Rank r of the remote engine serves its side channel on
    `remote_port + r` unless a registry is used (see `kvbridge.control.discovery`).
    """

    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_block_ids: tuple[BlockIds, ...] = attrs.field(default=(), converter=_groups)
    remote_host: str | None = None
    remote_port: int | None = None
    # the remote engine's parallel config
    tp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    dp_rank: int = 0
    remote_num_tokens: int | None = None  # prompt tokens whose KV the remote side holds
    remote_blocks_expiry_time: float | None = None
    transfer_mode: str = "pull"  # or "layerwise": decode reads layer by layer while prefill computes
    transfer_id: str | None = None  # layerwise: the id the proxy gave both sides (prefill's lease is keyed by it)
    prefix_prompt_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_opt_ints)
    cache_keys: tuple[str, ...] | None = attrs.field(default=None, converter=_opt_strs)
    # what the engine that answered measured of this request, in ms (prefill_ms; queue_ms, control_ms,
    # transfer_ms, done_ms from decode): `kvbridge proxy` assembles its timeline from it
    kvbridge_timing: dict[str, float] | None = None
    extra: dict[str, Any] = attrs.field(factory=dict)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> KVTransferParams:
        """Build from a request's `kv_transfer_params` dict (None gives the defaults)."""
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise ConfigError(f"kv_transfer_params must be a dict, got {type(data).__name__}")
        names = {a.name for a in attrs.fields(cls)} - {"extra"}
        known = {k: v for k, v in data.items() if k in names}
        extra = {k: v for k, v in data.items() if k not in names}
        blocks = known.pop("remote_block_ids", None)
        try:
            groups = _groups(blocks)  # JSON lists, converted once (the side channel's form is bytes)
        except (TypeError, ValueError):
            raise ConfigError(
                f"kv_transfer_params['remote_block_ids'] must be a list of block ids or of lists of them, "
                f"got {blocks!r:.200}"
            ) from None
        try:
            params = wire.from_dict(known, cls)
        except Exception as exc:  # ProtocolError from wire, or a converter's ValueError
            raise ConfigError(f"bad kv_transfer_params: {exc}") from None
        return attrs.evolve(params, remote_block_ids=groups, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        """The dict form, with vLLM's key names; block ids as a list of groups, unset optionals omitted."""
        out: dict[str, Any] = dict(self.extra)
        for a in attrs.fields(type(self)):
            if a.name == "extra":
                continue
            value = getattr(self, a.name)
            if value is None:
                continue
            if a.name == "remote_block_ids":
                value = [g.tolist() for g in value]
            elif isinstance(value, tuple):
                value = list(value)
            out[a.name] = value
        return out

    @property
    def block_ids(self) -> BlockIds:
        """The block ids of the first (usually only) KV-cache group."""
        return self.remote_block_ids[0] if self.remote_block_ids else BlockIds()

    def require_remote(self) -> None:
        """Raise ConfigError naming the missing keys a decode side needs to pull."""
        missing = [
            k
            for k in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
            if getattr(self, k) is None
        ]
        if missing:
            raise ConfigError(
                f"kv_transfer_params lack {', '.join(missing)}: the proxy must copy the prefill response's "
                "kv_transfer_params into the decode request"
            )

    def side_channel(self, rank: int) -> tuple[str, int]:
        """Peer-to-peer address of remote rank `rank`'s side channel (`remote_port + rank`)."""
        self.require_remote()
        return (str(self.remote_host), int(self.remote_port) + rank)  # type: ignore[arg-type]
