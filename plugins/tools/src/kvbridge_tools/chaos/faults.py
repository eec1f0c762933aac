"""The faults `kvbridge chaos` can inject, and which request gets which."""

from __future__ import annotations

import random

from kvbridge.base.errors import ConfigError

FAULTS = {
    "kill-decode": "SIGKILL a decode server while one of its streams runs, then restart it",
    "kill-prefill": "SIGKILL a prefill server while a request waits on it, then restart it",
    "disconnect": "the client drops a stream after its first tokens",
    "abort": "the client gives up on a request before its first token",
    "transfer-error": "a fraction of the decode servers' transfers fail inside the transport",
    "slow-peer": "a fraction of transfers are held past the transfer deadline before they run",
    "idle-gap": "pauses between requests (5-90 s by default), the gap after which Mooncake TCP lanes went stale",
    # elastic faults: every server announces itself in a redis registry the proxy follows (docs/elastic.md)
    "scale-out": "a new server (decode, then prefill, alternating) starts mid-run, joins through the registry, "
    "takes traffic",
    "scale-in": "a server (a scaled-out one, once it took traffic) is drained for good: SIGTERM, it finishes what "
    "it runs, exits",
    "drain-decode": "drain the decode serving a long stream at its first token at the proxy, then SIGTERM it "
    "(rolling upgrade); a new decode joins",
    "drain-prefill": "SIGTERM a prefill server 50 ms after a request is sent; a new prefill joins",
    # network faults (--hosts): between the hosts, one at a time, each for --net-fault-s
    "partition": "cut a prefill<->decode link (mid-pull) or a decode<->proxy link, then heal it",
    "flap": "a prefill<->decode link goes down and up three times",
    "loss": "drop 1-5 % of the packets on every prefill<->decode and decode<->proxy link, each way, all run",
    "bandwidth-drop": "a decode host's link drops to 100 Mbit/s",
}
NETWORK = ("partition", "flap", "loss", "bandwidth-drop")
ELASTIC = ("scale-out", "scale-in", "drain-decode", "drain-prefill")
# Faults a request is picked for; the others act on servers (transfer-error, slow-peer) or between requests.
PER_REQUEST = ("kill-decode", "kill-prefill", "drain-decode", "drain-prefill", "disconnect", "abort")
# Faults on for the whole run, at random moments: a request's own fault never names them
ALL_RUN = ("transfer-error", "slow-peer", "loss")
IN_SERVERS = ("transfer-error", "slow-peer")  # rates inside the servers' transports: not counted as injected
# how many per 100 requests (at least one each when asked): kills and drains restart or start a server
PER_100 = {"kill-decode": 2, "kill-prefill": 2, "drain-decode": 1, "drain-prefill": 1, "disconnect": 8, "abort": 8}
# requests per scale-out and per scale-in (at least one each when asked): each starts or ends a server for good
REQUESTS_PER_SCALE = 150


def parse_faults(text: str) -> list[str]:
    names = [f.strip() for f in text.split(",") if f.strip()]
    unknown = [f for f in names if f not in FAULTS]
    if unknown:
        raise ConfigError(f"unknown fault(s) {unknown}; choose from {sorted(FAULTS)} (comma-separated)")
    twice = sorted({f for f in names if names.count(f) > 1})
    if twice:  # it doubled a per-request fault's share, which no option says
        raise ConfigError(f"fault(s) {twice} given more than once; name each once")
    return names


def schedule(faults: list[str], requests: int, *, seed: int) -> dict[int, str]:
    """Request index -> the per-request fault it carries.

    Kills and drains are rare (each starts a server), at least one each when asked; client-side faults are more
    frequent (`PER_100`). The first few requests run clean.
    """
    rng = random.Random(seed)
    out: dict[int, str] = {}
    pool = list(range(min(3, requests), requests))
    rng.shuffle(pool)
    for fault in [f for f in faults if f in PER_REQUEST]:
        for _ in range(max(1, requests * PER_100[fault] // 100)):
            if pool:
                out[pool.pop()] = fault
    return out


def scaling(faults: list[str], requests: int) -> dict[int, str]:
    """Request index -> the scale-out, scale-in or "join" (wait for servers still starting) played before it.

    Scale-outs and scale-ins alternate, a scale-out first, spread evenly over the run; a scale-out is followed by
    a "join" (or a scale-in, which waits the same way) so that the new server is routed to while requests remain.
    """
    n = max(1, requests // REQUESTS_PER_SCALE)
    events = [f for _ in range(n) for f in ("scale-out", "scale-in") if f in faults]
    if "scale-out" in faults and "scale-in" not in faults:
        events = [e for _ in range(n) for e in ("scale-out", "join")]
    out: dict[int, str] = {}
    for j, event in enumerate(events):
        at = max(min(3, requests - 1), requests * (j + 1) // (len(events) + 1))
        while at in out and at < requests - 1:
            at += 1
        out.setdefault(at, event)
    return out


def not_injected(asked: list[str], injected: dict[str, int]) -> list[str]:
    """The faults asked for that a run never injected.

    A kill or a drain whose moment found no other server of its role serving is skipped (its request waits for one
    first, `runner.SPARE_WAIT_S`, but another fault may take it meanwhile). The transports' faults
    (`IN_SERVERS`) are not counted as injected: they show as retries and failed pulls."""
    return [f for f in asked if not injected.get(f) and f not in IN_SERVERS]
