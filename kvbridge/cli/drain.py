"""`kvbridge drain SERVER --registry URL`: order a server in the registry to drain; `--list` shows the servers."""

from __future__ import annotations

import argparse
import logging
import time

from kvbridge.base.errors import ConfigError
from kvbridge.base.secret import HOW_TO_SET, load_secret
from kvbridge.cli.numbers import real
from kvbridge.cli.output import print_json, print_table
from kvbridge.control.discovery import ServerRecord, open_registry

log = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "drain",
        help="order a prefill or decode server in the registry to drain and leave",
        description="Order SERVER (an id or URL, as --list shows) to drain as on SIGTERM: it takes the order at its "
        "next renewal, marks itself draining, serves drain_grace_s, then shuts down once no lease it holds is left. "
        "The order is signed with KVBRIDGE_SECRET or KVBRIDGE_SECRET_FILE, as the records are (unsigned without: a "
        "trusted network only). Waits until SERVER says draining; exits 1 if not within --ttl. docs/elastic.md",
    )
    p.add_argument("server", nargs="?", help="the server's id or URL (see --list)")
    p.add_argument("--registry", required=True, help="redis://HOST:PORT or etcd://HOST:PORT, as the servers use")
    p.add_argument("--list", action="store_true", help="list the servers in the registry and their state; no order")
    p.add_argument(
        "--ttl",
        type=real(low=1, high=3600, zero=True),
        default=60.0,
        help="seconds the order holds (default 60): 1 to 3600",
    )
    p.add_argument("--no-wait", action="store_true", help="write the order and return, without waiting to see it taken")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=run)


def _show(title: str, records: list[ServerRecord], as_json: bool, state: dict[str, str] | None = None) -> None:
    """The records, with `state` (server id -> state: `left` when its record is gone) over theirs."""
    rows = [(r.server_id, r.role, r.url, (state or {}).get(r.server_id, r.state)) for r in records]
    if as_json:
        print_json([dict(zip(("server_id", "role", "url", "state"), row)) for row in rows])
        return
    print_table(title, ["server", "role", "url", "state"], rows)


def run(args: argparse.Namespace) -> int:
    secret = load_secret()
    registry = open_registry(args.registry, secret=secret)
    if registry is None:  # p2p: no registry, so no server to find or order
        raise ConfigError(
            f"--registry {args.registry}: name the servers' registry, redis://HOST:PORT or etcd://HOST:PORT"
        )
    if args.server is None and not args.list:
        raise ConfigError(f"say which server to drain (--list shows the servers in {registry.url})")
    with registry:
        records = registry.servers()
        if args.list:
            _show(f"servers in {registry.url}", records, args.json)
            return 0
        targets = [r for r in records if args.server in (r.server_id, r.url, r.url.rstrip("/"))]
        if not targets:
            known = ", ".join(f"{r.server_id} ({r.role}, {r.url})" for r in records) or "none"
            raise ConfigError(
                f"no server {args.server!r} in {registry.url} (records with a bad or missing MAC are ignored, and "
                f"logged); its servers: {known}"
            )
        if secret is None:
            if any(r.mac for r in targets):
                raise ConfigError(f"{args.server}'s record is signed: it ignores an unsigned order; {HOW_TO_SET}")
            log.warning("no KVBRIDGE_SECRET: the order is unsigned, which only a server without a secret takes")
        for r in targets:
            registry.order_drain(r.server_id, args.ttl, r.incarnation)  # this run of it: not a restarted one
        deadline = time.monotonic() + args.ttl
        state = {r.server_id: r.state for r in targets}
        while not args.no_wait and time.monotonic() < deadline:
            now = {r.server_id: r.state for r in registry.servers()}
            state = {k: now.get(k, "left") for k in state}  # drained and gone between two reads: left
            if "serving" not in state.values():
                break
            time.sleep(0.5)  # bounded by the order's life
        _show(f"drain ordered in {registry.url}", targets, args.json, state)
    if args.no_wait or "serving" not in state.values():
        return 0
    log.error("%s did not start draining within --ttl %g s: its log says why (another secret?)", args.server, args.ttl)
    return 1
