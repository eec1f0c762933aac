"""Network faults for `kvbridge chaos --hosts`: partitions, flaps, loss and a rate drop between hosts.

Loss is set once for the whole run (a share drawn from 1-5 % per link and direction). The other
faults take turns, one at a time, each for `fault_s` seconds, every `every_s` seconds, while the
requests are played, so pulls are in flight when a link goes. Every fault is healed when it ends
and at `stop()`; what was injected, and for how long, is kept for the report and the bound.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from typing import TYPE_CHECKING, Any

import attrs

from kvbridge_tools.chaos.faults import NETWORK

if TYPE_CHECKING:
    from kvbridge_tools.harness.hosts import Hosts

log = logging.getLogger(__name__)

DROPPED_RATE = "100mbit"
LOSS_RANGE = (0.01, 0.05)


@attrs.define
class Injected:
    fault: str
    between: str
    seconds: float
    at: float = 0.0  # time.monotonic() once it was in place (loss: the whole run)


@attrs.define
class NetworkFaults:
    """Inject `faults` (from NETWORK) between the deployment's hosts in a background thread."""

    hosts: Hosts
    prefill: list[str]
    decode: list[str]
    proxy: str
    faults: list[str] = attrs.field(converter=lambda fs: [f for f in fs if f in NETWORK])
    fault_s: float = 3.0
    every_s: float = 8.0
    seed: int = 0
    injected: list[Injected] = attrs.field(factory=list)
    tcp: dict[str, dict[str, int]] = attrs.field(factory=dict)  # each host's TCP retransmissions, read at stop()
    _stop: threading.Event = attrs.field(factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        rng = random.Random(self.seed)
        if "loss" in self.faults:
            for a, b in self._links():
                for src, dst in ((a, b), (b, a)):
                    share = round(rng.uniform(*LOSS_RANGE), 3)
                    self.hosts.loss(src, dst, share)
                    self.injected.append(Injected("loss", f"{src}->{dst} {share:.1%}", 0.0))
        turns = [f for f in self.faults if f != "loss"]
        if turns:
            self._thread = threading.Thread(target=self._run, args=(turns, rng), name="chaos-network", daemon=True)
            self._thread.start()

    def _links(self) -> list[tuple[str, str]]:
        return [*itertools.product(self.prefill, self.decode), *((d, self.proxy) for d in self.decode)]

    def _run(self, turns: list[str], rng: random.Random) -> None:
        kinds = itertools.cycle(turns)
        partitions = itertools.cycle(["prefill-decode", "decode-proxy"])
        while not self._stop.wait(self.every_s):
            fault = next(kinds)
            try:
                self._one(fault, rng, next(partitions) if fault == "partition" else "")
            except Exception:  # a fault that cannot be set is a broken harness: say so, keep healing
                log.exception("chaos: network fault %s failed", fault)

    def _one(self, fault: str, rng: random.Random, which: str) -> None:
        d = rng.choice(self.decode)
        a = self.proxy if which == "decode-proxy" else rng.choice(self.prefill)
        # Timed from the fault in place to its heal done: on a loaded machine each nft or tc call can take
        # seconds, and the time before the fault lands stalls nothing.
        if fault == "partition":
            log.warning("chaos: partition %s <-> %s for %.1fs", a, d, self.fault_s)
            self.hosts.partition(a, d)
            t0 = time.monotonic()
            self._stop.wait(self.fault_s)
            self.hosts.heal(a, d)
        elif fault == "flap":
            log.warning("chaos: flap %s <-> %s for %.1fs", a, d, self.fault_s)
            down = self.fault_s / 6
            t0 = time.monotonic()
            self.hosts.flap(a, d, down_s=down, up_s=down, times=3).join()
        elif fault == "bandwidth-drop":
            rate = self.hosts.rate(d)
            log.warning("chaos: %s's link down to %s for %.1fs", d, DROPPED_RATE, self.fault_s)
            self.hosts.shape(d, DROPPED_RATE)
            t0 = time.monotonic()
            self._stop.wait(self.fault_s)
            self.hosts.shape(d, rate)
        else:
            raise ValueError(f"not a network fault that takes turns: {fault!r}")
        self.injected.append(Injected(fault, f"{a}<->{d}", time.monotonic() - t0, t0))

    def stop(self) -> None:
        """End the faults, heal every link (loss removed too), then read each host's TCP retransmissions."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        for a, b in self._links():
            self.hosts.heal(a, b)
            self.hosts.loss(a, b, 0)
            self.hosts.loss(b, a, 0)
        # after the heal: the counters are totals, and a host whose counters cannot be read must not stay partitioned
        self.tcp = {h.name: self.hosts.tcp_counters(h.name) for h in self.hosts}

    def longest_s(self) -> float:
        """The longest a fault that stops a link lasted (loss, which only slows one, counts 0)."""
        return max((i.seconds for i in self.injected), default=0.0)

    def during(self, start: float, end: float) -> list[str]:
        """The faults that took turns and were in place some time between `start` and `end` (time.monotonic()).

        Each as `partition a<->b at +0.2 s for 3.0 s`, from `start`. TCP backs off its retransmissions while a link is
        down, so a request held by a fault may go on up to a few seconds after the heal."""
        return [
            f"{i.fault} {i.between} at {i.at - start:+.1f} s for {i.seconds:.1f} s"
            for i in self.injected
            if i.fault != "loss" and i.at < end and i.at + i.seconds > start
        ]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for i in self.injected:
            out[i.fault] = out.get(i.fault, 0) + 1
        return out

    def as_dict(self) -> dict[str, Any]:
        # what loss and partitions cost in the kernel's retransmissions, host by host (a lost SYN: 1 s of a connect)
        tcp = {name: c for name, c in self.tcp.items() if any(c.values())}
        return {"injected": self.counts(), "longest_fault_s": round(self.longest_s(), 2), "tcp_retransmits": tcp}
