"""`kvbridge bench --compare-transports A,B`: pair mode on several transports, side by side, in one run.

Each transport is measured contiguous and `--fragmented` against its own raw transfer (one descriptor
per request) in the same run, so the ratios compare what kvbridge adds on each transport.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

from kvbridge.base.errors import ConfigError
from kvbridge.cli.output import print_json, print_table
from kvbridge_tools.bench import pair


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--compare-transports",
        default=None,
        metavar="A,B",
        help="run the pair bench on each of these transports, contiguous and fragmented, and "
        "print them side by side (e.g. mooncake,nixl); each uses its default protocol",
    )


def transports(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if len(names) < 2 or len(set(n.lower() for n in names)) != len(names):
        raise ConfigError(f"--compare-transports needs two or more different transports, got {text!r}")
    return names


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    names = transports(args.compare_transports)
    if args.option or args.protocol:
        raise ConfigError(
            "--option and --protocol are transport-specific: run the transports one at a time with "
            "--migration-backend to use them"
        )
    for name in names:
        pair._check_backend(name, {})  # fail before the first measurement, not after it
    results = []
    for name in names:
        for fragmented in (False, True):
            one = copy.copy(args)
            one.migration_backend, one.fragmented = name, fragmented
            results.append(pair.measure(one))
    return results


def run(args: argparse.Namespace) -> int:
    results = measure(args)
    verified = all(r["verified"] for r in results)
    if args.json:
        print_json({"results": results, "verified": verified})
        return 0 if verified else 1
    c = results[0]["config"]
    rows = [
        (
            r["config"]["migration_backend"],
            "fragmented" if r["config"]["fragmented"] else "contiguous",
            f"{r['raw']['gbps']:.2f}",
            f"{r['kvbridge']['gbps']:.2f}",
            pair.ratio_cell(r),
            f"{r['kvbridge']['latency_ms']['median']:.1f}",
            "yes" if r["verified"] else "NO",
        )
        for r in results
    ]
    print_table(
        f"kvbridge bench: transports side by side, {c['model']} {c['tokens']} tokens x {c['requests']} requests "
        f"({c['bytes_per_request'] / 2**20:.1f} MiB per request, {c['repeat']} rounds each)",
        ["transport", "blocks", "raw GB/s", "kvbridge GB/s", "of raw (per-round range)", "median ms", "verified"],
        rows,
    )
    print(
        "verified: every byte on the decode side is correct"
        if verified
        else "VERIFICATION FAILED: " + "; ".join(p for r in results for p in r["problems"])
    )
    return 0 if verified else 1
