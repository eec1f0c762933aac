"""`kvbridge bench --hosts`: prefill and decode on two network-namespace hosts, over a shaped link.

The hosts come from `kvbridge_tools.harness.hosts` (root only; test tooling, imported when asked for).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
from collections.abc import Iterator, Sequence
from typing import Any

import attrs

from kvbridge.base.errors import ConfigError
from kvbridge.base.secret import SECRET_ENV

SUBNET = "198.51.100.0/24"  # a documentation range: never a real network


@attrs.frozen
class Link:
    """What `--link` asks of the hosts: a rate in bits/s, a loss each way, every host's TCP congestion control.

    A rate of None keeps the veth's own; a congestion control of None, the machine's (namespaces inherit it).
    """

    rate_bits: int | None = None
    loss: float = 0.0
    congestion: str | None = None

    def describe(self) -> str:
        rate = f"{self.rate_bits / 1e9:g} Gbit/s" if self.rate_bits else "unshaped"
        loss = f", {self.loss:.2%} loss each way" if self.loss else ""
        return f"{rate}{loss}, TCP {self.tcp_congestion()}"

    def tcp_congestion(self) -> str:
        """The hosts' TCP congestion control: the one asked for, else the machine's."""
        from kvbridge_tools.harness.hosts import machine_congestion

        return self.congestion or machine_congestion()

    def to_json(self) -> dict[str, Any]:
        """The link as a bench result reports it."""
        return {
            "rate_bits": self.rate_bits,
            "loss": self.loss,
            "tcp_congestion": self.tcp_congestion(),
            "described": self.describe(),
        }


def parse_link(text: str) -> Link:
    """`rate=10gbit[,loss=0.1%][,cc=cubic]` (a loss without % is a fraction: loss=0.001)."""
    from kvbridge_tools.harness.hosts import congestion_problem, parse_rate

    fields: dict[str, Any] = {}
    seen: set[str] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        try:
            if not sep:
                raise ValueError("expected KEY=VALUE")
            if key in seen:
                raise ValueError(f"{key} is given twice")
            seen.add(key)
            if key == "rate":
                fields["rate_bits"] = parse_rate(value)
            elif key == "loss":
                share = float(value[:-1]) / 100 if value.endswith("%") else float(value)
                if not 0 <= share < 1:
                    raise ValueError("loss is a share of packets below 100 %")
                fields["loss"] = share
            elif key == "cc":
                problem = congestion_problem(value)
                if problem:
                    raise ValueError(problem)
                fields["congestion"] = value
            else:
                raise ValueError(f"unknown key {key!r}")
        except ValueError as e:
            raise argparse.ArgumentTypeError(
                f"--link {text!r}: {e}; write rate=10gbit,loss=0.1%,cc=NAME (keys: rate, loss, cc)"
            ) from None
    if not seen:
        raise argparse.ArgumentTypeError(f"--link {text!r} asks for nothing; write rate=10gbit,loss=0.1%,cc=NAME")
    return Link(**fields)


@attrs.frozen
class Placed:
    """Where each bench side runs: the command prefix, its address, and the environment both share."""

    prefix: dict[str, list[str]]
    address: dict[str, str]
    env: dict[str, str]
    hosts: Any = None  # the `kvbridge_tools.harness.hosts.Hosts` themselves, for a bench that starts servers there
    engine_cores: str = "shared"  # as run: `--engine-cores`, or what its default came to


ENGINE_CORES = ("split", "shared")


def split_cores(cpus: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The prefill host's CPUs and the decode host's, for `--engine-cores split`: each half of `cpus`."""
    ordered = sorted(cpus)
    if len(ordered) < 2:
        raise ConfigError(
            f"--engine-cores split gives the prefill and the decode host a core each; this process may run on "
            f"{len(ordered)} CPU only: use --engine-cores shared"
        )
    half = len(ordered) // 2
    return tuple(ordered[:half]), tuple(ordered[half:])


@contextlib.contextmanager
def placed(link: Link, also: Sequence[str] = (), engine_cores: str | None = None) -> Iterator[Placed]:
    """Two hosts, prefill and decode, with `link` between them; removed (processes too) on exit.

    The hosts named in `also` are on the same bridge, unshaped. `engine_cores`: "split", the prefill host gets the
    first half of this process's CPUs as its own (`Host.cpus`) and the decode host the rest, as two machines would;
    "shared", every host runs on every CPU and sees the machine's NUMA nodes (an engine that pins itself to a node's
    last core pins prefill and decode to the same one); None, split where this process has two CPUs or more. The
    hosts in `also` keep every CPU.
    """
    from kvbridge_tools.harness.hosts import Hosts, hosts_unavailable

    reason = hosts_unavailable()
    if reason:
        raise ConfigError(f"--hosts runs prefill and decode in network namespaces: {reason}")
    cpus = sorted(os.sched_getaffinity(0))
    if engine_cores is None:  # prefill and decode are two machines; one CPU cannot be two
        engine_cores = "split" if len(cpus) >= 2 else "shared"
    if engine_cores not in ENGINE_CORES:
        raise ConfigError(f"--engine-cores {engine_cores!r}: choose one of {', '.join(ENGINE_CORES)}")
    with Hosts(["prefill", "decode", *also], subnet=SUBNET) as hosts:
        if engine_cores == "split":
            hosts["prefill"].cpus, hosts["decode"].cpus = split_cores(cpus)
        if link.rate_bits:
            hosts.shape("prefill", link.rate_bits)  # one shaped link is the path's bottleneck
        if link.loss:
            hosts.loss("prefill", "decode", link.loss)
            hosts.loss("decode", "prefill", link.loss)
        if link.congestion:
            for host in hosts:
                hosts.congestion(host.name, link.congestion)
        # The workers talk across a routable address, so the side channel and tcp need a secret: a
        # fresh one per run, in the environment only (never on a command line).
        env = {SECRET_ENV: secrets.token_hex(32)} if SECRET_ENV not in os.environ else {}
        yield Placed(
            prefix={h.name: h.command([]) for h in hosts},
            address={h.name: h.address for h in hosts},
            env=env,
            hosts=hosts,
            engine_cores=engine_cores,
        )


def report(link: Link, address: dict[str, str], kv_gbps: float, raw_gbps: float) -> dict[str, Any]:
    """The `hosts` part of a bench result: where each side ran, the link, and each path's share of it."""
    share = (lambda gbps: gbps * 8e9 / link.rate_bits) if link.rate_bits else (lambda gbps: None)
    return {
        "prefill": address["prefill"],
        "decode": address["decode"],
        "link": link.to_json(),
        "kvbridge_share_of_link": share(kv_gbps),
        "raw_share_of_link": share(raw_gbps),
    }
