"""The `kvbridge` plugin of kvbridge-tools: it adds `kvbridge bench`, `chaos`, `plan` and `trace`, nothing else."""

from __future__ import annotations

import kvbridge

KVBRIDGE_PLUGIN_API = 3


@kvbridge.hookimpl
def kvbridge_commands() -> dict[str, str]:
    # each module has add_parser(subparsers) and run(args) -> int
    return {name: f"kvbridge_tools.cli.{name}" for name in ("bench", "chaos", "plan", "trace")}
