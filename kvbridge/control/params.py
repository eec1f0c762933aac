"""`KVTransferParams`: the request metadata a PD proxy carries between prefill and decode. See docs/internals.md."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np

from kvbridge.base import wire
from kvbridge.base.block_ids import BlockIds
from kvbridge.base.errors import ConfigError
from kvbridge.plan.topology import MAX_PARALLEL_SIZE


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


def _optional_tuple(kind: type) -> Callable[[Any], tuple[Any, ...] | None]:
    """A converter: None stays None, anything else becomes a tuple of `kind`."""
    return lambda value: None if value is None else tuple(kind(v) for v in value)


TRANSFER_MODES = ("pull", "layerwise")


def _check(ok: Callable[[Any], bool], expected: str, *, optional: bool = False) -> Any:
    """A validator that refuses what `ok` does not accept, naming the key and what it takes.

    A bad value from a proxy fails here, not later as a timeout or a socket error far from its cause."""

    def check(_inst: object, attr: attrs.Attribute, value: Any) -> None:
        if optional and value is None:
            return
        if not ok(value):
            raise ConfigError(f"kv_transfer_params[{attr.name!r}] must be {expected}, got {value!r:.80}")

    return check


def _int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _host(value: Any) -> bool:
    """A name or address the side channel can connect to: no spaces or URL parts, IPv6 in brackets."""
    if not isinstance(value, str) or not value or any(c.isspace() or c in "/@*" for c in value):
        return False
    if ":" in value:
        return value.startswith("[") and value.endswith("]")
    return True


def _dp_rank(inst: KVTransferParams, attr: attrs.Attribute, value: Any) -> None:
    _check(lambda v: _int(v) and v >= 0, "an integer >= 0")(inst, attr, value)
    if _int(inst.dp_size) and value >= inst.dp_size:
        raise ConfigError(
            f"kv_transfer_params['dp_rank'] must be below dp_size ({inst.dp_size}), got {value}: the proxy must "
            "pass the prefill engine's own DP rank and size"
        )


_STR = _check(lambda v: isinstance(v, str), "a string", optional=True)
_BOOL = _check(lambda v: isinstance(v, bool), "true or false", optional=True)
_SIZE = _check(lambda v: _int(v) and 1 <= v <= MAX_PARALLEL_SIZE, f"an integer from 1 to {MAX_PARALLEL_SIZE}")


@attrs.frozen
class KVTransferParams:
    """What one side tells the other about a request's KV, through the proxy. See docs/internals.md."""

    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    remote_engine_id: str | None = attrs.field(default=None, validator=_STR)
    remote_request_id: str | None = attrs.field(default=None, validator=_STR)
    remote_block_ids: tuple[BlockIds, ...] = attrs.field(default=(), converter=_groups)
    remote_host: str | None = attrs.field(
        default=None, validator=_check(_host, "a host name or address (IPv6 in brackets)", optional=True)
    )
    # rank r serves on remote_port + r: checked again with the rank (side_channel)
    remote_port: int | None = attrs.field(
        default=None, validator=_check(lambda v: _int(v) and 1 <= v <= 65535, "a port in [1, 65535]", optional=True)
    )
    # the remote engine's parallel config
    tp_size: int = attrs.field(default=1, validator=_SIZE)
    pcp_size: int = attrs.field(default=1, validator=_SIZE)
    dcp_size: int = attrs.field(default=1, validator=_SIZE)
    pp_size: int = attrs.field(default=1, validator=_SIZE)
    dp_size: int = attrs.field(default=1, validator=_SIZE)
    dp_rank: int = attrs.field(default=0, validator=_dp_rank)
    # prompt tokens whose KV the remote side holds
    remote_num_tokens: int | None = attrs.field(
        default=None, validator=_check(lambda v: _int(v) and v >= 0, "an integer >= 0", optional=True)
    )
    remote_blocks_expiry_time: float | None = attrs.field(
        default=None,
        validator=_check(
            lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v),
            "a finite number (seconds)",
            optional=True,
        ),
    )
    # or "layerwise": decode reads layer by layer while prefill computes
    transfer_mode: str = attrs.field(
        default="pull", validator=_check(TRANSFER_MODES.__contains__, f"one of {TRANSFER_MODES}")
    )
    # layerwise: the id the proxy gave both sides (prefill's lease is keyed by it)
    transfer_id: str | None = attrs.field(default=None, validator=_STR)
    # a live move (docs/elastic.md): a draining decode offers the request's blocks under this lease id
    # when its stream is cut; the decode resuming it pulls that lease, its block ids taken from the lease
    kvbridge_move_id: str | None = attrs.field(default=None, validator=_STR)
    prefix_prompt_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_optional_tuple(int))
    cache_keys: tuple[str, ...] | None = attrs.field(default=None, converter=_optional_tuple(str))
    # what the engine that answered measured of this request, in ms (prefill_ms; queue_ms, control_ms,
    # transfer_ms, done_ms from decode): `kvbridge proxy` assembles its timeline from it
    kvbridge_timing: dict[str, float] | None = None
    # a decode's answer to a pulled request: whether its prefix cache keeps what it pulled for a later request, as a
    # live move's continuation needs (vLLM's prefix caching); None: not said
    kvbridge_prefix_cache: bool | None = attrs.field(default=None, validator=_BOOL)
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
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(
                f"kv_transfer_params['remote_block_ids'] must be a list of block ids or of lists of them, "
                f"got {blocks!r:.200}"
            ) from None
        try:
            params = wire.from_dict(known, cls, passthrough=(ConfigError,))  # a validator's names the key
        except ConfigError:
            raise
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

    @property
    def resumes_move(self) -> bool:
        """A live move's continuation, or one of its pre-copy stages: pulled from the moved stream's lease.

        A layer-wise request's move id only marks it as one the proxy may move later: its KV comes by its stream."""
        return self.kvbridge_move_id is not None and self.transfer_mode == "pull"

    @property
    def lease_blocks(self) -> bool:
        """Decode takes the block ids from the lease's answer (a live move names none)."""
        return self.resumes_move and not self.remote_block_ids

    def move_resolved(self) -> KVTransferParams:
        """These params with a live move's lease named (its move id); others unchanged. See docs/internals.md."""
        if not self.resumes_move:
            return self
        if self.remote_num_tokens is None:
            raise ConfigError(
                "kv_transfer_params with kvbridge_move_id lack remote_num_tokens: the proxy sets it to the "
                "resumed prompt's length less one"
            )
        if self.remote_request_id is not None:
            return self
        return attrs.evolve(self, remote_request_id=self.kvbridge_move_id)

    @property
    def server(self) -> str:
        """`host:port` of the prefill server these params name (its rank 0's side channel): a peer's name in metrics."""
        return f"{self.remote_host}:{self.remote_port}"

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
        port = int(self.remote_port) + rank  # type: ignore[arg-type]
        if port > 65535:
            raise ConfigError(
                f"remote rank {rank}'s side channel would be on port {port} (kv_transfer_params['remote_port'] "
                f"{self.remote_port} + rank): lower the prefill engine's side-channel port"
            )
        return (str(self.remote_host), port)
