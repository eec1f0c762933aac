"""`kvbridge plugins`: what is installed, what is available here, and why not."""

from __future__ import annotations

import argparse

from kvbridge import wire
from kvbridge.cli.output import print_json, print_table
from kvbridge.plugins import list_backends, list_devices, refused_plugins


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plugins",
        help="list installed transports and devices",
        description="List every transport (migration backend) and device plugin, whether it can run on this "
        "machine, and if not, why and how to fix it.",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    infos = list_backends() + list_devices() + refused_plugins()
    if args.json:
        print_json([wire.to_dict(i) for i in infos])
        return 0
    rows = [
        (i.kind, i.name, "yes" if i.available else "no", i.reason + (f"\nfix: {i.hint}" if i.hint else ""),
         i.version, i.distribution)
        for i in infos
    ]
    print_table("kvbridge plugins", ["kind", "name", "available", "reason", "version", "distribution"], rows)
    return 0
