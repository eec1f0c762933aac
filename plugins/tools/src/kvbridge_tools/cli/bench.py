"""`kvbridge bench`: a verified prefill->decode migration, measured against the raw transport.

Modes live in `kvbridge_tools.bench.*`; this module owns the options they share and picks the mode.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from kvbridge.base.errors import ConfigError
from kvbridge.cli.numbers import whole
from kvbridge.plan.presets import PRESETS
from kvbridge_tools.bench.link import ENGINE_CORES
from kvbridge_tools.cli import set_options

# mode name -> module in kvbridge_tools.bench; each has add_arguments(group) and run(args) -> int
MODES = {
    "pair": "kvbridge_tools.bench.pair",
    "parallel": "kvbridge_tools.bench.parallel",
    "lmdeploy": "kvbridge_tools.bench.lmdeploy",
    "vllm": "kvbridge_tools.bench.vllm",
    "vllm-load": "kvbridge_tools.bench.vllm_load",
    "vllm-idle": "kvbridge_tools.bench.vllm_idle",
    "vllm-connector": "kvbridge_tools.bench.connector",
    "compare": "kvbridge_tools.bench.compare",
    "scale": "kvbridge_tools.bench.scale",
    "vllm-moves": "kvbridge_tools.bench.vllm_moves",
}

# Options that some modes alone read (the modes, how they are asked for, the options): given to another, they would be
# ignored, so they are refused.
VLLM_MODES = ("vllm", "vllm-load", "vllm-idle", "vllm-moves")
ONLY_IN: list[tuple[tuple[str, ...], str, tuple[str, ...]]] = [
    (
        ("vllm-load",),
        "--engine vllm --load",
        ("rates", "concurrency", "slices", "alternate", "slo_factor", "slo", "input_min", "input_max", "output_len")
        + ("router", "systems", "prefix_caching", "start_ahead", "idle_s", "noise"),
    ),
    (("vllm-moves",), "--engine vllm --live-moves --hosts", ("moves", "precopy_tail", "engine_nice")),
    (("vllm-idle",), "--engine vllm --idle", ("gaps", "idle_systems")),
    (("vllm-load", "vllm-idle"), "--engine vllm --load or --idle", ("nixl_busy_poll",)),
    (("scale",), "--scale", ("sizes", "spread", "ranks_per_process", "records", "registry_kind")),
    (VLLM_MODES, "--engine vllm", ("model_dir", "keep_logs", "executor")),
    (("vllm", "vllm-idle", "vllm-moves"), "--engine vllm without --load", ("lengths",)),  # --load: --input-min/-max
]
_DEFAULTS: dict[str, Any] = {}  # those options' defaults (`add_parser`)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="run a verified prefill->decode KV migration and report its speed",
        description=(
            "Start a prefill and a decode process, fill the prefill KV cache with fingerprinted values, migrate "
            "the requests, verify every byte on the decode side, and report GB/s and latency beside the raw "
            "transport measured in the same run. Exit status 1 when verification fails."
        ),
        epilog="example: kvbridge bench --migration-backend mooncake --model llama3-8b --tokens 4096",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--migration-backend",
        default="mooncake",
        metavar="NAME",
        help="transport to use, by name (see `kvbridge plugins`); default: mooncake",
    )
    p.add_argument("--protocol", default=None, help="transport protocol (default: the transport's first, e.g. tcp)")
    p.add_argument("--model", default=None, choices=sorted(PRESETS), help="KV cache shape preset")
    p.add_argument("--tokens", type=whole(), default=None, help="prompt tokens per request")
    p.add_argument("--requests", type=whole(), default=None, help="number of requests to migrate")
    p.add_argument("--repeat", type=whole(), help="measured rounds, medians reported (default 3; --live-moves: 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument(
        "--sweep-tokens",
        type=_token_list,
        default=None,
        metavar="N,N,...",
        help="run once per prompt length (e.g. 256,1024,4096,16384) and report each",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="FILE",
        help="draw GB/s against request size (raw and kvbridge) into FILE (.svg; .png with matplotlib)",
    )
    p.add_argument(
        "--engine",
        choices=["lmdeploy", "vllm", "vllm-connector"],
        default=None,
        help="drive the migration through an engine's adapter (lmdeploy: kvbridge's LMDeploy backend "
        "vs LMDeploy's per-(layer, block) strategy; vllm: real vLLM servers, KVBridgeConnector "
        "vs vLLM's MooncakeConnector; vllm-connector: one process per rank driving KVBridgeConnector "
        "through vLLM's connector API, any KV cache layouts, block sizes and TP on each side)",
    )
    p.add_argument(
        "--hosts",
        action="store_true",
        help="run prefill and decode on two hosts: network namespaces at 198.51.100.1 and 198.51.100.2 joined by a "
        "bridge, with a fresh shared secret (needs root, ip, tc and nft; pair mode, or --engine vllm with the "
        "proxy and the client on two more hosts; docs/hosts.md)",
    )
    p.add_argument(
        "--link",
        type=_link,
        default=None,
        metavar="rate=10gbit[,loss=0.1%][,cc=cubic]",
        help="with --hosts: shape the prefill<->decode link to a rate (both ways), drop a share of packets each way, "
        "and give every host's TCP a congestion control (default: this machine's, which the report names; BBR "
        "paces Mooncake TCP's idle lanes into 80-165 ms stalls under load: docs/measurements/vllm-load.md); the "
        "report gives each path's share of the rate",
    )
    p.add_argument(
        "--engine-cores",
        choices=ENGINE_CORES,
        default=None,
        help="with --hosts: which CPUs each engine host has. split (the default where there are two CPUs or more; "
        "not with --live-moves, whose three engines share them): the prefill host has the first half of the CPUs "
        "as its own, seen as its one NUMA node, and the decode host the rest, as two machines would (the proxy, "
        "the client and --noise run on every CPU); shared: every host sees and runs on the machine's CPUs, so "
        "engines that pin their model thread to a NUMA node's last core (vLLM's NixlConnector on a CPU platform, "
        "KVBridgeConnector's cpu_affinity: reserved) pin prefill and decode to the same one",
    )
    for name, module in MODES.items():
        importlib.import_module(module).add_arguments(p.add_argument_group(f"{name} mode"))
    _DEFAULTS.update({dest: p.get_default(dest) for _, _, dests in ONLY_IN for dest in dests})
    p.set_defaults(run=run)


def _token_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive token counts, got {text!r}")
    return values


def _link(text: str) -> Any:
    from kvbridge_tools.bench.link import parse_link

    return parse_link(text)


def pick_mode(args: argparse.Namespace) -> str:
    if getattr(args, "scale", False):
        return "scale"
    if getattr(args, "engine", None) == "lmdeploy":
        return "lmdeploy"
    if getattr(args, "load", False):
        if getattr(args, "engine", None) != "vllm":
            raise ConfigError("--load runs vLLM's serve benchmark against vLLM servers; add --engine vllm")
        return "vllm-load"
    if getattr(args, "live_moves", False):
        if getattr(args, "engine", None) != "vllm":
            raise ConfigError("--live-moves moves streams between vLLM decode servers; add --engine vllm --hosts")
        return "vllm-moves"
    if getattr(args, "idle", False):
        if getattr(args, "engine", None) != "vllm":
            raise ConfigError("--idle measures vLLM servers after idle spells; add --engine vllm")
        return "vllm-idle"
    if getattr(args, "engine", None) in ("vllm", "vllm-connector"):
        return str(args.engine)
    if getattr(args, "prefill", None) or getattr(args, "decode", None):
        return "parallel"
    if getattr(args, "compare_transports", None):
        return "compare"
    return "pair"


def check_read(args: argparse.Namespace, mode: str) -> None:
    """Refuse an option that `mode` would not read (`ONLY_IN`): who set it expects what it says."""
    for modes, how, dests in ONLY_IN:
        if mode not in modes and (flags := set_options(args, {d: _DEFAULTS.get(d) for d in dests})):
            flag = flags[0]
            raise ConfigError(
                f"{flag} is read by `kvbridge bench {how}` alone, not by the {mode} bench: add {how}, or drop {flag}"
            )


def run(args: argparse.Namespace) -> int:
    mode = pick_mode(args)
    if args.repeat is None:  # a round of live moves is 8 streams at every context and way: minutes, not seconds
        args.repeat = 1 if mode == "vllm-moves" else 3
    check_read(args, mode)
    if getattr(args, "link", None) and not getattr(args, "hosts", False):
        raise ConfigError("--link shapes the link between --hosts; add --hosts")
    if getattr(args, "hosts", False) and mode not in ("pair", "vllm", "vllm-load", "vllm-moves"):
        raise ConfigError(
            f"--hosts runs the pair bench, --engine vllm or --engine vllm --load (no other --engine, "
            f"--prefill/--decode or --compare-transports); not {mode}"
        )
    # across hosts, the vLLM bench is its own module (its arguments are --engine vllm's)
    module = "kvbridge_tools.bench.vllm_hosts" if mode == "vllm" and getattr(args, "hosts", False) else MODES[mode]
    return int(importlib.import_module(module).run(args))
