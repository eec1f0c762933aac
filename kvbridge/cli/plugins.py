"""`kvbridge plugins [NAME]`: what is installed, what is available here, and why not; one plugin's options."""

from __future__ import annotations

import argparse

from kvbridge.base import wire
from kvbridge.base.types import PluginInfo
from kvbridge.cli.output import print_json, print_table
from kvbridge.plugin.registry import list_backends, list_devices, plugin_options, refused_plugins


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plugins",
        help="list installed transports and devices",
        description="List every transport (migration backend) and device plugin, whether it can run on this "
        "machine, and if not, why and how to fix it. A plugin that failed to load is listed as BROKEN, with "
        "its distribution and the error; the others still load. With NAME: that plugin's options, their "
        "defaults and what they do.",
    )
    p.add_argument("name", nargs="?", help="a transport or device name: list its options")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=run)


def _broken(info: PluginInfo) -> bool:
    return info.kind == "plugin"  # a distribution refused at load, not a transport or device


def run(args: argparse.Namespace) -> int:
    if args.name:
        return _show(args.name, as_json=args.json)
    infos = list_backends() + list_devices() + refused_plugins()
    if args.json:
        print_json([{**wire.to_dict(i), "broken": _broken(i)} for i in infos])
        return 0
    rows = [
        (
            i.kind,
            i.name,
            "BROKEN" if _broken(i) else "yes" if i.available else "no",
            i.reason + (f"\nfix: {i.hint}" if i.hint else ""),
            i.version,
            i.distribution,
        )
        for i in infos
    ]
    print_table("kvbridge plugins", ["kind", "name", "available", "reason", "version", "distribution"], rows)
    return 0


def _show(name: str, *, as_json: bool) -> int:
    found = plugin_options(name)
    if as_json:
        print_json([{**wire.to_dict(info), "options": [wire.to_dict(o) for o in options]} for info, options in found])
        return 0
    for info, options in found:
        title = f"{info.kind} {info.name} ({info.distribution} {info.version}): options"
        if info.kind == "backend":
            title += "; also protocol, hostname, metadata_server, device_name (create_backend's own)"
        rows = [(o.name, o.type, repr(o.default), o.doc) for o in options]
        print_table(title, ["option", "type", "default", "what it does"], rows or [("(none)", "", "", "")])
    return 0
