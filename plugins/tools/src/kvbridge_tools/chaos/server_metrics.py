"""What a vLLM server (or the proxy) of a chaos run holds and counts, read from its own /metrics."""

from __future__ import annotations

import logging
import re

from kvbridge_tools.harness.vllm_server import Server, parse_metrics

log = logging.getLogger(__name__)

_BLOCKS = re.compile(r'num_gpu_blocks="(\d+)"')


def _metrics(server: Server) -> str | None:
    """The server's /metrics text; None (logged) when it cannot be read."""
    import httpx

    try:
        return httpx.get(f"{server.url}/metrics", timeout=10, trust_env=False).text
    except httpx.HTTPError as exc:
        log.error("chaos: cannot read %s/metrics: %s", server.url, exc)
        return None


def counts_by(server: Server, name: str, label: str) -> dict[str, float] | None:
    """A counter's values by one of its labels, summed over the others; None when unreadable or not exported."""
    text = _metrics(server)
    if text is None:
        return None
    found = re.compile(rf'^{re.escape(name)}\{{.*?\b{re.escape(label)}="([^"]*)".*\}} (\S+)$', re.M).findall(text)
    counts: dict[str, float] = {}
    for value, number in found:
        counts[value] = counts.get(value, 0.0) + float(number)
    return counts or None


def blocks_in_use(server: Server) -> float:
    """KV blocks the server holds now (usage x its block count); -1 when unreadable (nothing proves it holds none)."""
    text = _metrics(server)
    if text is None:
        return -1.0
    usage = sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:kv_cache_usage_perc")
    )
    m = _BLOCKS.search(text)
    return round(usage * int(m.group(1)), 1) if m else usage


def kvbridge_counters(server: Server) -> dict[str, float]:
    """The server's kvbridge_* series, summed over labels ({} when unreadable)."""
    text = _metrics(server)
    return {} if text is None else {k: v for k, v in parse_metrics(text).items() if k.startswith("kvbridge_")}


def holding(server: Server) -> str:
    """What a server that still holds KV blocks has running, waiting and leased."""
    text = _metrics(server)
    if text is None:
        return "unreadable"
    got = parse_metrics(text)
    keys = ["num_requests_running", "num_requests_waiting", "kvbridge_leases_held", "kvbridge_blocks_held"]
    return ", ".join(f"{k} {got.get(k if k.startswith('kvbridge') else f'vllm:{k}', float('nan')):g}" for k in keys)
