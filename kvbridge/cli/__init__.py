"""`kvbridge` command line: one module per subcommand, each with `add_parser` and `run`. See docs/internals.md."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import logging
import os
import signal
import sys
from types import FrameType

from kvbridge import __version__
from kvbridge.base.errors import KVBridgeError, described
from kvbridge.base.nativelog import quiet_native_logs
from kvbridge.plugin.registry import PluginRegistry, registry

log = logging.getLogger(__name__)

# Each module defines add_parser(subparsers) and run(args) -> int.
SUBCOMMANDS = ["plugins", "doctor", "drain"]
# What other distributions of this repository add, and which: named here so that, without it, they say what
# to install.
ELSEWHERE = {
    "proxy": ("serve an OpenAI-compatible proxy in front of prefill and decode servers", "kvbridge-proxy"),
    "bench": ("verified prefill->decode migration benchmark", "kvbridge-tools"),
    "chaos": ("faults against a real prefill/decode deployment", "kvbridge-tools"),
    "trace": ("send requests through kvbridge proxy and show where each spent its time", "kvbridge-tools"),
    "plan": ("which decode rank pulls which heads and blocks from which prefill rank", "kvbridge-tools"),
}

EPILOG = """\
Start with `kvbridge plugins` to see which transports and devices are installed, then
`kvbridge bench --migration-backend mooncake` for a verified prefill->decode migration.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbridge",
        description="Move LLM KV caches between prefill and decode engines over pluggable transports.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    parser.add_argument(
        "--version",
        action="version",
        version=f"kvbridge {__version__} (`kvbridge plugins` lists each plugin's)",
        help="print kvbridge's version and exit",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"kvbridge.cli.{name}").add_parser(sub)
    added = set(SUBCOMMANDS)
    broken: dict[str, str] = {}
    # what plugins add through the kvbridge_commands hook; their loading is quiet on stdout (main loads them first)
    for command in sorted(_load_plugins_off_stdout(probe=False).commands.values(), key=lambda c: c.name):
        if command.name in added:
            log.warning("kvbridge_commands: a second %r subcommand (%s) is ignored", command.name, command.module)
            continue
        try:
            module = importlib.import_module(command.module)
        except Exception as exc:  # a broken tools install must not take `kvbridge plugins` with it
            broken[command.name] = (
                f"`kvbridge {command.name}` ({command.module}) does not load: {described(exc)}; "
                f"reinstall it: pip install --force-reinstall {command.distribution}"
            )
            continue
        module.add_parser(sub)
        added.add(command.name)
    for name in sorted(broken):
        _unavailable(sub, name, ELSEWHERE.get(name, ("a plugin's subcommand",))[0], broken[name])
    for name, (summary, dist) in ELSEWHERE.items():
        if name not in added and name not in broken:
            why = (
                f"`kvbridge {name}` comes with {dist}, which is not installed: pip install {dist} (scripts/setup does)"
            )
            _unavailable(sub, name, f"{summary} (needs {dist})", why)
    return parser


def _unavailable(sub: argparse._SubParsersAction, name: str, summary: str, why: str) -> None:
    """A subcommand that cannot run here: it takes any arguments and exits 2 with `why` (the fix)."""
    p = sub.add_parser(name, help=summary, add_help=False)

    def run(_args: argparse.Namespace) -> int:
        print(f"kvbridge: error: {why}", file=sys.stderr)
        return 2

    p.set_defaults(run=run, any_arguments=True)  # its own arguments are unknown here: --help included


def _exit_on_sigterm(signum: int, _frame: FrameType | None) -> None:
    # SIGTERM would end Python without running `finally`, leaving the processes a bench or test
    # started (prefill and decode ranks, vLLM servers) running; as an exit, they are stopped.
    raise SystemExit(128 + signum)


def _load_plugins_off_stdout(probe: bool) -> PluginRegistry:
    """Load the plugins (and `probe` their availability) with stdout on stderr, file descriptor included.

    What a plugin or its native library prints as it loads (a banner) must not land in a table or in `--json` output."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            reg = registry()
            if probe:  # probed once, so the listing later prints what they found, not what they print
                for entry in (*reg.backends.values(), *reg.devices.values()):
                    entry.unavailable_reason()
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    return reg


def _verbosity(argv: list[str]) -> int:
    """How many -v the options before the subcommand give (the parser needs the plugins, loaded with logging set)."""
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("-v", "--verbose", action="count", default=0)
    before = list(itertools.takewhile(lambda a: a.startswith("-") and a != "--", argv))
    return early.parse_known_args(before)[0].verbose


def main(argv: list[str] | None = None) -> int:
    level = {0: logging.WARNING, 1: logging.INFO}.get(_verbosity(sys.argv[1:] if argv is None else argv), logging.DEBUG)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_native_logs(level)  # before any transport library loads, here or in a child
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        _load_plugins_off_stdout(probe=bool(getattr(args, "json", False)))
        return int(args.run(args) or 0)
    except KVBridgeError as exc:
        # Expected failures get one clear line and the fix, not a traceback.
        print(f"kvbridge: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
