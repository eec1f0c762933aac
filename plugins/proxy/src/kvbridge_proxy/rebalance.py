"""Rebalancing (`kvbridge proxy --rebalance`): move streams off a decode under KV pressure to an idle one.

Each health round the proxy reads every serving decode's `/metrics` (vLLM's `vllm:kv_cache_usage_perc`, the
fraction of its KV cache blocks in use). When the fullest is at or above `above` and the emptiest at or below
`below`, a quarter of the fullest one's movable streams (at least one; the longest first, as they hold the most
blocks) move to the emptiest, by the same cut and pull as a drain (moving_stream.py). A quarter a round lets the next
round see what the moves did before moving more. Off unless asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import attrs
from prometheus_client.parser import text_string_to_metric_families

from kvbridge.base.errors import ConfigError

if TYPE_CHECKING:
    from kvbridge_proxy.moving_stream import MovingStream
    from kvbridge_proxy.upstreams import Instance

log = logging.getLogger(__name__)

KV_USAGE = "vllm:kv_cache_usage_perc"


def kv_usage(metrics_text: str) -> float | None:
    """The KV cache usage (0 to 1) a vLLM server's `/metrics` reports: the largest over its engines, or None."""
    values = [
        sample.value
        for family in text_string_to_metric_families(metrics_text)
        if family.name == KV_USAGE
        for sample in family.samples
    ]
    return max(values) if values else None


@attrs.frozen
class Policy:
    """When to move, and what."""

    above: float = 0.8  # a decode this full sheds streams
    below: float = 0.4  # to one at most this full

    def __attrs_post_init__(self) -> None:
        if not 0.0 <= self.below < self.above <= 1.0:  # NaN fails too
            raise ConfigError(
                f"--rebalance-below ({self.below}) must be below --rebalance-above ({self.above}), both from 0 to 1"
            )

    def plan(self, usage: Mapping[Instance, float]) -> tuple[list[MovingStream], Instance | None]:
        """The streams to move this round and where to; none when no decode is over `above` while one is idle."""
        if len(usage) < 2:
            return [], None
        hot = max(usage, key=lambda i: usage[i])
        others = [i for i in usage if i is not hot]
        # a decode without prefix caching computes a moved stream whole: a target only where every other one is such
        cold = min([i for i in others if i.prefix_cache is not False] or others, key=lambda i: usage[i])
        if usage[hot] < self.above or usage[cold] > self.below:
            return [], None
        movable = [s for s in hot.streams if s.movable and s.prompt is not None and not s.cut_requested]
        movable.sort(key=lambda s: len(s.prompt or ()) + len(s.generated), reverse=True)
        chosen = movable[: max(1, len(movable) // 4)]
        if chosen:
            log.warning(
                "decode %s uses %.0f%% of its KV cache, %s %.0f%%: moving %d of its %d movable streams there",
                hot.url,
                usage[hot] * 100,
                cold.url,
                usage[cold] * 100,
                len(chosen),
                len(movable),
            )
        return chosen, cold
