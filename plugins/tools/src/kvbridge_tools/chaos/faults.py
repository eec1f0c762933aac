"""The faults `kvbridge chaos` can inject, and which request gets which."""

from __future__ import annotations

import random

from kvbridge.errors import ConfigError

FAULTS = {
    "kill-decode": "SIGKILL a decode server while one of its streams runs, then restart it",
    "kill-prefill": "SIGKILL a prefill server while a request waits on it, then restart it",
    "disconnect": "the client drops a stream after its first tokens",
    "abort": "the client gives up on a request before its first token",
    "transfer-error": "a fraction of the decode servers' transfers fail inside the transport",
    "slow-peer": "a fraction of transfers are held past the transfer deadline before they run",
    "idle-gap": "pauses between requests (5-90 s by default), the gap after which Mooncake TCP lanes went stale",
    # network faults (--hosts): between the hosts, one at a time, each for --net-fault-s
    "partition": "cut a prefill<->decode link (mid-pull) or a decode<->proxy link, then heal it",
    "flap": "a prefill<->decode link goes down and up three times",
    "loss": "drop 1-5 % of the packets on every prefill<->decode and decode<->proxy link, each way, all run",
    "bandwidth-drop": "a decode host's link drops to 100 Mbit/s",
}
NETWORK = ("partition", "flap", "loss", "bandwidth-drop")
# Faults a request is picked for; the others act on servers (transfer-error, slow-peer) or between requests.
PER_REQUEST = ("kill-decode", "kill-prefill", "disconnect", "abort")


def parse_faults(text: str) -> list[str]:
    names = [f.strip() for f in text.split(",") if f.strip()]
    unknown = [f for f in names if f not in FAULTS]
    if unknown:
        raise ConfigError(f"unknown fault(s) {unknown}; choose from {sorted(FAULTS)} (comma-separated)")
    return names


def schedule(
    faults: list[str], requests: int, *, seed: int, kills_per_100: int = 2, client_faults_per_100: int = 8
) -> dict[int, str]:
    """Request index -> the per-request fault it carries.

    Kills are rare (each restarts a server), at least one each when asked; client-side faults are more frequent.
    The first few requests run clean.
    """
    rng = random.Random(seed)
    out: dict[int, str] = {}
    pool = list(range(min(3, requests), requests))
    rng.shuffle(pool)
    for fault in [f for f in faults if f in PER_REQUEST]:
        per_100 = kills_per_100 if fault.startswith("kill") else client_faults_per_100
        for _ in range(max(1, requests * per_100 // 100)):
            if pool:
                out[pool.pop()] = fault
    return out
