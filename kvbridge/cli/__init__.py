"""`kvbridge` command line: one module per subcommand, each with `add_parser` and `run`."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import sys
from types import FrameType

from kvbridge.errors import KVBridgeError
from kvbridge.nativelog import quiet_native_logs

# Each module defines add_parser(subparsers) and run(args) -> int.
SUBCOMMANDS = [
    "plugins",
    "doctor",
    "bench",
    "plan",
    "proxy",
    "trace",
    "chaos",
]

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
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"kvbridge.cli.{name}").add_parser(sub)
    return parser


def _exit_on_sigterm(signum: int, _frame: FrameType | None) -> None:
    # SIGTERM would end Python without running `finally`, leaving the processes a bench or test
    # started (prefill and decode ranks, vLLM servers) running; as an exit, they are stopped.
    raise SystemExit(128 + signum)


def _load_plugins_off_stdout(probe: bool) -> None:
    """Load the plugins (and `probe` their availability) with stdout on stderr, file descriptor included.

    What a plugin or its native library prints as it loads (a banner) must not land in a table or in `--json` output."""
    from kvbridge.plugins import registry

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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    quiet_native_logs(level)  # before any transport library loads, here or in a child
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
