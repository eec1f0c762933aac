"""The proxy's settings: what `kvbridge proxy`'s options, `create_app`'s keywords and `Proxy` share."""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from kvbridge.base.errors import ConfigError
from kvbridge.control.discovery import url_problem
from kvbridge_proxy.limits import Limits
from kvbridge_proxy.moving_stream import MoveSettings
from kvbridge_proxy.rebalance import Policy
from kvbridge_proxy.upstreams import CONNECT_TIMEOUT_S


def _urls(urls: Sequence[str]) -> tuple[str, ...]:
    for url in urls:
        if problem := url_problem(url):
            raise ConfigError(problem)
    return tuple(urls)


def _limits(limits: Limits | None) -> Limits:
    return Limits() if limits is None else limits


def _moves(moves: MoveSettings | None) -> MoveSettings:
    return MoveSettings() if moves is None else moves


@attrs.frozen
class ProxySettings:
    """One proxy's settings; the defaults are `create_app`'s (the CLI's are in cli.py's help).

    `warm_up`: send one request through each prefill/decode pair once both are up (app.py's module doc).
    `transfer="layerwise"`: prefill and decode get each request at once (docs/vllm.md).
    `expose_internals`: answers name the servers by URL (app.py's module doc).
    `registry`: follow the servers announced there too (app.py's module doc).
    `live_moves`: move a draining decode's streams to another decode (moving_stream.py, docs/elastic.md).
    `rebalance`: also move streams off a decode under KV pressure by this policy (rebalance.py; implies `live_moves`).
    `moves`: how a stream moves (pre-copy, by default; moving_stream.MoveSettings).
    `limits`: the bounds on one request and on the clients (limits.py); serve the app with `limits.server` for the
    deadlines on request heads."""

    prefill: tuple[str, ...] = attrs.field(converter=_urls)
    decode: tuple[str, ...] = attrs.field(converter=_urls)
    health_interval: float = 2.0
    timeout: float = 600.0
    warm_up: bool = True
    transfer: str = "pull"
    connect_timeout: float = CONNECT_TIMEOUT_S
    expose_internals: bool = False
    registry: str | None = None
    live_moves: bool = False
    rebalance: Policy | None = None
    limits: Limits = attrs.field(factory=Limits, converter=_limits)  # None: the defaults
    moves: MoveSettings = attrs.field(factory=MoveSettings, converter=_moves)  # None: the defaults

    def __attrs_post_init__(self) -> None:
        if self.transfer not in ("pull", "layerwise"):
            raise ConfigError(f"--transfer must be pull or layerwise, got {self.transfer!r}")
        for name in ("health_interval", "timeout", "connect_timeout"):
            seconds = getattr(self, name)
            if not (math.isfinite(seconds) and seconds > 0):
                raise ConfigError(f"--{name.replace('_', '-')} takes a number of seconds > 0, not {seconds}")

    @property
    def moving(self) -> bool:
        """Whether streams move off a draining decode (`live_moves`, or implied by `rebalance`)."""
        return self.live_moves or self.rebalance is not None
