"""`kvbridge chaos`: a real PD deployment on this machine, played with faults, checked for lost work."""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kvbridge.cli.numbers import real, seconds, whole
from kvbridge_tools.chaos.faults import ELASTIC, FAULTS, NETWORK, parse_faults
from kvbridge_tools.cli import set_options
from kvbridge_tools.harness.vllm_server import add_executor_argument

log = logging.getLogger(__name__)

EPILOG = (
    """\
faults:
"""
    + "\n".join(f"  {name:<15} {what}" for name, what in FAULTS.items())
    + """

what is checked (exit status 1 when any of these is not 0):
  completed_different      a request that completed with output other than the colocated server's
  hung                     a request with no answer within --hang-timeout
  failed_unclear           an error answer without a status and a reason
  blocks_held_after_drain  KV blocks any server still holds once the run has drained (read from its metrics)
  drains_unclean           (elastic faults) servers drained for good that did not exit with status 0 by
                           themselves within --shutdown-timeout + 60 s, or whose ranks did not log closing
                           with 0 leases held (their blocks_at_close also go into blocks_held_after_drain)
  handovers_over_bound     requests whose handover (control + transfer + DONE phases of x-kvbridge-timing,
                           measured on every other fault-free request, answered whole) took longer than
                           the bound: 2 side-channel waits + the transfer deadline's attempts + the longest
                           injected fault (kvbridge_tools.chaos.bound); printed beside the measured maximum

examples:
  kvbridge chaos --requests 30 --concurrency 4 --faults disconnect,abort,transfer-error
  kvbridge chaos --requests 300 --concurrency 8 \\
      --faults kill-decode,kill-prefill,disconnect,abort,transfer-error,idle-gap --json
  kvbridge chaos --hosts --requests 300 --faults partition,loss,bandwidth-drop,kill-decode,disconnect --json
  kvbridge chaos --requests 300 --faults scale-in,scale-out,drain-decode,kill-decode --json

With an elastic fault (scale-out, scale-in, drain-decode, drain-prefill) the run starts a redis-server: every
prefill and decode server announces itself there (signed with the run's secret) and runs with
--shutdown-timeout above drain_grace_s + lease_s, and the proxy routes to what is announced (--registry); with
drain-decode or scale-in it runs with --live-moves, moving a draining decode's streams to another decode.
Before a scale-in, and after a scale-out when no scale-in follows, no new request is sent until the servers
being started are routed to (requests in flight go on).

It starts 5 vLLM servers (2 prefill, 2 decode, 1 colocated reference) on the tiny model, and more with
scale-out and the drains; on a small machine serialize it with other heavy jobs
(flock /tmp/kvbridge-heavy.lock kvbridge chaos ...).
"""
)

# Options that some faults alone read: given without one of them, they would be ignored, so they are refused.
TIMED = ("partition", "flap", "bandwidth-drop")
FAULT_OPTIONS = {
    "transfer_error_rate": ("transfer-error",),
    "slow_rate": ("slow-peer",),
    "slow_s": ("slow-peer",),
    "idle_gaps": ("idle-gap",),
    "gap_range": ("idle-gap",),
    "net_fault_s": TIMED,
    "net_every_s": TIMED,
}
_DEFAULTS: dict[str, Any] = {}  # their defaults (`add_parser`)


def _faults(text: str) -> list[str]:
    try:
        return parse_faults(text)
    except ValueError as exc:  # argparse shows an ArgumentTypeError's own words
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chaos",
        help="run a real prefill/decode deployment under injected faults and check nothing is lost",
        description=(
            "Start 2 prefill and 2 decode vLLM servers (the tiny test model, KVBridgeConnector over "
            "--migration-backend, Mooncake TCP by default) "
            "behind `kvbridge proxy`, plus a colocated server for the reference output; play --requests prompts "
            "from a few tokens to near max_model_len at --concurrency while injecting --faults; then drain and "
            "report how each request ended, what every server still holds, leases expired, retries and TTFT."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--requests", type=whole(), default=30, help="requests to play (default 30)")
    p.add_argument("--concurrency", type=whole(1, 4096), default=4, help="requests in flight at once (default 4)")
    _add_fault_arguments(p.add_argument_group("injecting faults"))
    p.add_argument(
        "--migration-backend",
        default="mooncake",
        metavar="NAME",
        help="the servers' transport, by name (see `kvbridge plugins`; mooncake runs over TCP); default: mooncake",
    )
    p.add_argument(
        "--transfer",
        choices=["pull", "layerwise"],
        default="pull",
        help="pull: prefill, then decode with its params; layerwise: the servers and the proxy in layer-wise mode, "
        "decode reading each layer while prefill computes, a failed prefill sent again the pull way (default pull)",
    )
    p.add_argument("--max-tokens", type=whole(), default=16, help="tokens generated per request (default 16)")
    p.add_argument("--max-model-len", type=whole(), default=1024, help="the servers' max_model_len (default 1024)")
    add_executor_argument(p)
    p.add_argument(
        "--lease-s",
        type=seconds,
        default=30.0,
        metavar="S",
        help="prefill lease: how long blocks wait for a decode that never says DONE (default 30)",
    )
    p.add_argument(
        "--hang-timeout",
        type=seconds,
        default=180.0,
        metavar="S",
        help="a request with no answer within this is counted as hung (default 180)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for prompts, lengths and fault placement (default 0)")
    p.add_argument(
        "--logs",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep the servers' logs here (default: a temporary folder, removed after a run that passes unstalled)",
    )
    _add_host_arguments(p.add_argument_group("across hosts"))
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    _DEFAULTS.update({dest: p.get_default(dest) for dest in FAULT_OPTIONS})
    p.set_defaults(run=run)


def _add_fault_arguments(group: argparse._ArgumentGroup) -> None:
    """What to inject, and how often or how long."""
    group.add_argument(
        "--faults",
        type=_faults,
        default=[],
        metavar="F1,F2",
        help=f"comma-separated faults to inject, from: {', '.join(FAULTS)} (default: none)",
    )
    group.add_argument(
        "--transfer-error-rate",
        type=real("a share", 0, 1, zero=True),
        default=0.1,
        metavar="P",
        help="with transfer-error: fraction of decode transfers that fail in the transport (default 0.1)",
    )
    group.add_argument(
        "--slow-rate",
        type=real("a share", 0, 1, zero=True),
        default=0.05,
        metavar="P",
        help="with slow-peer: fraction of transfers held past the deadline (default 0.05)",
    )
    group.add_argument(
        "--slow-s",
        type=seconds,
        default=4.0,
        metavar="S",
        help="with slow-peer: seconds a held transfer waits (default 4, past the 2 s deadline and its 1 s grace)",
    )
    group.add_argument(
        "--idle-gaps", type=whole(), default=3, metavar="N", help="with idle-gap: how many pauses (default 3)"
    )
    group.add_argument(
        "--gap-range",
        type=real(zero=True),
        nargs=2,
        default=(5.0, 90.0),
        metavar=("MIN", "MAX"),
        help="with idle-gap: each pause's length is drawn from this range in seconds (default 5 90)",
    )


def _add_host_arguments(group: argparse._ArgumentGroup) -> None:
    """--hosts, and the network faults' timing there."""
    group.add_argument(
        "--hosts",
        action="store_true",
        help="put every prefill and decode server on a host of its own, the proxy, the colocated server and the "
        "client on another (network namespaces on 198.51.100.0/24; needs root, ip, tc, nft); network faults need it",
    )
    group.add_argument(
        "--net-fault-s",
        type=seconds,
        default=3.0,
        metavar="S",
        help="with --hosts: how long each partition, flap and bandwidth drop lasts (default 3)",
    )
    group.add_argument(
        "--net-every-s",
        type=seconds,
        default=8.0,
        metavar="S",
        help="with --hosts: seconds between the start of one network fault and the next (default 8)",
    )


def check(args: argparse.Namespace) -> None:
    """Refuse, before anything starts, options that cannot mean what they say together."""
    from kvbridge.base.errors import ConfigError

    network_faults = [f for f in args.faults if f in NETWORK]
    if network_faults and not args.hosts:
        raise ConfigError(f"network faults ({', '.join(network_faults)}) act between hosts: add --hosts")
    for dest, faults in FAULT_OPTIONS.items():
        if not set(faults) & set(args.faults) and (flags := set_options(args, {dest: _DEFAULTS.get(dest)})):
            flag = flags[0]
            raise ConfigError(
                f"{flag} is read with the {' or '.join(faults)} fault: add it to --faults, or drop {flag}"
            )
    if args.net_every_s <= args.net_fault_s:
        raise ConfigError("--net-fault-s must be shorter than --net-every-s")
    if args.max_tokens + 3 > args.max_model_len:  # a prompt of at least 1 token, and room to spare
        raise ConfigError(
            f"--max-tokens {args.max_tokens} leaves no room for a prompt within --max-model-len {args.max_model_len}: "
            f"raise --max-model-len above {args.max_tokens + 2}"
        )
    if args.gap_range[0] > args.gap_range[1]:
        raise ConfigError(f"--gap-range MIN MAX: MIN {args.gap_range[0]:g} is above MAX {args.gap_range[1]:g}")


def run(args: argparse.Namespace) -> int:
    from kvbridge_tools.chaos.bound import transport_bound
    from kvbridge_tools.chaos.deployment import Deployment
    from kvbridge_tools.chaos.runner import Workload
    from kvbridge_tools.harness.tiny_model import TinyLlamaSpec, build_tiny_llama

    check(args)
    elastic = [f for f in args.faults if f in ELASTIC]
    _check_backend(args.migration_backend)
    # the model always goes; the servers' logs stay where --logs says, else only after a run that failed or stalled
    model_dir = tempfile.TemporaryDirectory(prefix="kvbridge-chaos-model-")
    logs = args.logs or Path(tempfile.mkdtemp(prefix="kvbridge-chaos-logs-"))
    injection = {}
    if "transfer-error" in args.faults:
        injection["transfer_error"] = args.transfer_error_rate
    if "slow-peer" in args.faults:
        injection.update(slow_peer=args.slow_rate, slow_s=args.slow_s)
    if injection:
        injection["seed"] = args.seed
    dep = Deployment(
        # the model holds as many positions as the servers are given (its default is 2048)
        build_tiny_llama(Path(model_dir.name) / "model", TinyLlamaSpec(max_positions=max(2048, args.max_model_len))),
        logs,
        max_model_len=args.max_model_len,
        executor=args.executor,
        lease_s=args.lease_s,
        fault_injection=injection or None,
        backend=args.migration_backend,
        transfer=args.transfer,
    )
    workload = Workload(
        args.requests,
        args.concurrency,
        args.faults,
        max_tokens=args.max_tokens,
        hang_s=args.hang_timeout,
        idle_gaps=args.idle_gaps,
        gap_range=tuple(args.gap_range),
        seed=args.seed,
    )
    network = None
    if elastic:  # on hosts: the registry gets one, and each server that joins one kept for it
        dep.elastic = True
        dep.spares = _joins(args.faults, args.requests, args.seed)
    try:
        with contextlib.ExitStack() as stack:
            if args.hosts:
                network = _on_hosts(args, dep, stack)
            if elastic:
                from kvbridge_tools.harness.redis import redis_server

                where = dep.hosts["registry"] if dep.hosts is not None else None
                dep.registry = stack.enter_context(redis_server(logs, host=where))  # it saves nothing there
                if {"drain-decode", "scale-in"} & set(elastic):  # a drained decode's streams move (docs/elastic.md)
                    dep.live_moves = True
            report = _play(args, dep, workload, network, logs)
    except BaseException:  # (a Ctrl-C or SIGTERM too) the logs are what says why it stopped
        if args.logs is None:
            log.warning("chaos stopped before its report; the servers' logs are kept in %s", logs)
        raise
    finally:
        model_dir.cleanup()
    slow_s = args.slow_s if "slow-peer" in args.faults else 0.0
    longest = max(slow_s, network.longest_s() if network else 0.0)
    report.handover_bound = transport_bound(dep.backend, {}, longest, dep.pull_timeout_s)
    return _finish(args, report, logs)


def _check_backend(name: str) -> None:
    """Refuse a transport that is not installed or cannot run here before any server starts (the error says why)."""
    from kvbridge.base.errors import PluginUnavailable
    from kvbridge.plugin.registry import registry

    entry = registry().backend_entry(name)  # an unknown name: PluginNotFound names the known ones
    reason = entry.unavailable_reason()
    if reason:
        raise PluginUnavailable("backend", entry.name, reason, entry.install_hint)


def _joins(faults: list[str], requests: int, seed: int) -> int:
    """How many servers join in a run: each scale-out, and the replacement of each drained server."""
    from kvbridge_tools.chaos.faults import scaling, schedule

    drains = sum(f.startswith("drain") for f in schedule(faults, requests, seed=seed).values())
    return drains + sum(e == "scale-out" for e in scaling(faults, requests).values())


def _on_hosts(args: argparse.Namespace, dep: Any, stack: contextlib.ExitStack) -> Any:
    """Put `dep` on namespace hosts for as long as `stack` lasts; this thread becomes the proxy host's client."""
    from kvbridge.base.errors import ConfigError
    from kvbridge_tools.chaos.network import NetworkFaults
    from kvbridge_tools.harness.hosts import Hosts, hosts_unavailable

    reason = hosts_unavailable()
    if reason:
        raise ConfigError(f"--hosts puts the servers in network namespaces: {reason}")
    names = dep.host_names()
    dep.hosts = stack.enter_context(Hosts([n for group in names.values() for n in group]))
    # The client talks to the proxy (and reads every server's metrics) from the proxy's host; the
    # threads it starts are born there.
    stack.enter_context(dep.hosts["proxy"].entered())
    return NetworkFaults(
        dep.hosts,
        names["prefill"],
        names["decode"],
        "proxy",
        args.faults,
        fault_s=args.net_fault_s,
        every_s=args.net_every_s,
        seed=args.seed,
    )


def _play(args: argparse.Namespace, dep: Any, workload: Any, network: Any, logs: Path) -> Any:
    from kvbridge.cli.output import err_console
    from kvbridge_tools.chaos.runner import Runner

    show = err_console.is_terminal and not args.json
    try:
        if show:
            where = " on 6 hosts" if args.hosts else ""
            err_console.print(f"starting 5 vLLM servers and the proxy{where} (logs in {logs}) ...")
        dep.start()
        with contextlib.ExitStack() as stack:
            runner = Runner(dep, workload, network=network)
            if show:
                from rich.progress import Progress

                progress = stack.enter_context(Progress(console=err_console, transient=True))
                task = progress.add_task("requests", total=args.requests)
                runner.progress = functools.partial(progress.advance, task)
            return runner.run()
    finally:
        dep.stop()


def _finish(args: argparse.Namespace, report: Any, logs: Path) -> int:
    from kvbridge.cli.output import print_json, print_table

    out = report.as_dict()
    if args.logs is None and report.ok and not report.stalls:  # a stall dump keeps the logs it is read beside
        shutil.rmtree(logs, ignore_errors=True)
        out["logs"] = None
    else:
        out["logs"] = str(logs)
    if args.json:
        print_json(out)
    else:
        rows = [(k, v) for k, v in out.items() if v is not None and not isinstance(v, dict)]
        rows += [(f"{k}: {kk}", vv) for k, v in out.items() if isinstance(v, dict) for kk, vv in v.items()]
        print_table(f"kvbridge chaos: {'OK' if report.ok else 'FAILED'}", ["figure", "value"], rows)
    return 0 if report.ok else 1
