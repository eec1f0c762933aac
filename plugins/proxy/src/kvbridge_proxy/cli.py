"""`kvbridge proxy`: an XpYd OpenAI-compatible proxy in front of vLLM prefill and decode servers."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from kvbridge.base.errors import ConfigError
from kvbridge.base.secret import HOW_TO_SET, admin_token, load_secret
from kvbridge.cli.numbers import real, seconds, whole
from kvbridge_proxy.moving_stream import MOVES, MoveSettings

if TYPE_CHECKING:
    from kvbridge_proxy.settings import ProxySettings

MAX_BYTES = 1 << 40  # a bound far above any use


def _port(text: str) -> int:
    # out of range, uvicorn never listens and never exits
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is from 0 to 65535, got {port}")
    return port


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "proxy",
        help="serve an OpenAI-compatible proxy in front of prefill and decode servers",
        description="Send each request to a prefill server (max_tokens 1, kv_transfer_params do_remote_decode), "
        "then to a decode server with the prefill's kv_transfer_params, and pass the answer through. "
        "Round-robin over healthy instances; /health and /instances report their state.",
        epilog="example: kvbridge proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000",
    )
    _add_servers(p)
    _add_routing(p)
    _add_moves(p)
    p.add_argument(
        "--admin-token",
        action="store_true",
        help="print the bearer token of the proxy's /admin calls, derived from KVBRIDGE_SECRET (or "
        "KVBRIDGE_SECRET_FILE; the secret itself is never a token), and exit (docs/security.md)",
    )
    _add_limits(p)
    p.set_defaults(run=run)


def _add_servers(p: argparse.ArgumentParser) -> None:
    """Which servers the proxy routes to, and where it listens."""
    p.add_argument(
        "--prefill",
        nargs="+",
        action="extend",
        default=[],
        metavar="URL",
        help="prefill servers as http://HOST:PORT, no /v1 (repeat or list several; with --registry, none is needed)",
    )
    p.add_argument(
        "--decode",
        nargs="+",
        action="extend",
        default=[],
        metavar="URL",
        help="decode servers as http://HOST:PORT, no /v1 (repeat or list several; with --registry, none is needed)",
    )
    p.add_argument(
        "--registry",
        metavar="URL",
        help="also route to the servers announced in this registry, joins and leaves followed while the proxy "
        "runs, draining ones sent nothing new: redis://HOST:PORT, etcd://HOST:PORT, or a JSON file of "
        "{role, url[, state]} objects; records are checked with KVBRIDGE_SECRET (docs/elastic.md)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="port to listen on (default 8000; 0 picks a free one)")


def _add_routing(p: argparse.ArgumentParser) -> None:
    """How the proxy talks to the servers."""
    p.add_argument(
        "--health-interval",
        type=seconds,
        default=2.0,
        metavar="S",
        help="seconds between health checks of every instance (default 2)",
    )
    p.add_argument("--timeout", type=seconds, default=600.0, metavar="S", help="upstream request timeout (default 600)")
    p.add_argument(
        "--connect-timeout",
        type=seconds,
        default=5.0,
        metavar="S",
        help="seconds to open a connection to an upstream; one that does not accept in time never saw the "
        "request, stays in the pool, and the request goes to the next (or the same) server (default 5)",
    )
    p.add_argument(
        "--transfer",
        choices=["pull", "layerwise"],
        default="pull",
        help="pull: prefill, then decode with its params; layerwise: both at once with one transfer id, decode "
        'reads each layer while prefill computes (servers with "transfer": "layerwise"; the first request '
        "through each prefill server, the warm-up's or a client's, goes the pull way, which tells the proxy its "
        "side channel) (default pull)",
    )
    p.add_argument(
        "--no-warm-up",
        dest="warm_up",
        action="store_false",
        help="do not send one request through each prefill/decode pair when both come up (first contact is "
        "then paid by the first client request of the pair)",
    )
    p.add_argument(
        "--expose-internals",
        action="store_true",
        help="name the prefill and decode servers by URL to clients: the x-kvbridge-prefill and x-kvbridge-decode "
        "headers, /instances, error answers and /metrics labels (`kvbridge trace` and `kvbridge chaos` read them); "
        "without it they are named by role and place, e.g. decode-1",
    )


def _add_moves(p: argparse.ArgumentParser) -> None:
    """Moving running streams between decodes (docs/elastic.md)."""
    p.add_argument(
        "--live-moves",
        action="store_true",
        help="move each streamed request off a decode that drains to another decode, which pulls its KV (prompt and "
        "tokens so far) from the draining one and continues the stream; requests whose parameters cannot be carried "
        "(seed, stop strings, bad words, frequency/presence penalties, n > 1, tools, media; docs/elastic.md) finish "
        "where they are. A stream whose decode dies is continued by another decode that computes it (default off)",
    )
    p.add_argument(
        "--move",
        choices=MOVES,
        default="precopy",
        help="how a stream moves (docs/elastic.md): precopy (the next decode pulls the blocks the stream filled while "
        "it keeps running, then the rest after the cut), stop-and-copy (all of it after the cut), recompute (the next "
        "decode computes it); default precopy",
    )
    p.add_argument(
        "--precopy-stages",
        type=whole(),
        default=3,
        metavar="N",
        help="pre-copy stages at most before the cut (default 3)",
    )
    p.add_argument(
        "--precopy-tail",
        type=whole(0),
        default=16,
        metavar="TOKENS",
        help="cut once at most this many tokens of the stream were not pre-copied (default 16; the next decode then "
        "computes them and the part of a block its cache lacks)",
    )
    p.add_argument(
        "--precopy-tail-by",
        choices=("compute", "pull"),
        default="compute",
        help="after a pre-copy, the next decode computes the stream's last tokens (the cut then needs nothing of the "
        "decode it leaves) or pulls them (default compute; docs/elastic.md)",
    )
    p.add_argument(
        "--precopy-cut-together",
        type=real(zero=True),
        default=2.0,
        metavar="S",
        help="a stream whose pre-copy ended waits, still running where it is, up to S seconds for the pre-copies of "
        "the other streams leaving its decode, and they are cut together: no continuation then waits on the next "
        "decode behind another's pre-copy (0: each is cut when its own pre-copy ends; default 2)",
    )
    p.add_argument(
        "--precopy-cuts-at-once",
        type=whole(),
        default=1,
        metavar="N",
        help="pre-copied streams cut to one decode at a time; the next is cut once the last one's first event came "
        "from there (the others run on meanwhile), so that no continuation waits behind another's (default 1)",
    )
    p.add_argument(
        "--rebalance",
        action="store_true",
        help="as --live-moves does, move streams off a decode whose KV cache is at least --rebalance-above full "
        "to one at most --rebalance-below full, read from each decode's /metrics every health round (default off)",
    )
    fraction = real("a fraction of the KV cache", 0.0, 1.0, zero=True)
    p.add_argument("--rebalance-above", type=fraction, default=0.8, metavar="F", help="default 0.8")
    p.add_argument("--rebalance-below", type=fraction, default=0.4, metavar="F", help="default 0.4")


def _add_limits(p: argparse.ArgumentParser) -> None:
    """What one client can make the proxy do (kvbridge_proxy.limits; docs/vllm.md, "The proxy's limits")."""
    from kvbridge_proxy import limits

    g = p.add_argument_group("limits", "what one client can make the proxy do; past them it answers 4xx or 503")
    g.add_argument(
        "--max-parts",
        type=whole(),
        default=limits.MAX_PARTS,
        metavar="N",
        help=f"P/D requests one batched or n > 1 request may become; more is a 400 (default {limits.MAX_PARTS})",
    )
    g.add_argument(
        "--max-upstream-bytes",
        type=whole(1, MAX_BYTES),
        default=limits.MAX_UPSTREAM_BYTES,
        metavar="B",
        help="bytes one client request may send to the servers, every prefill and decode body of every part and "
        f"retry together; more is a 413 (default {limits.MAX_UPSTREAM_BYTES}, four times the 32 MiB body limit)",
    )
    g.add_argument(
        "--header-timeout",
        type=seconds,
        default=limits.HEADER_TIMEOUT_S,
        metavar="S",
        help="seconds a connection has to send its request head, from when it opens or got its last answer; then "
        f"it is closed (default {limits.HEADER_TIMEOUT_S:g})",
    )
    g.add_argument(
        "--body-timeout",
        type=seconds,
        default=limits.BODY_TIMEOUT_S,
        metavar="S",
        help=f"seconds a request has to send its body after its head; then a 408 (default {limits.BODY_TIMEOUT_S:g})",
    )
    g.add_argument(
        "--keep-alive",
        type=seconds,
        default=limits.KEEP_ALIVE_S,
        metavar="S",
        help=f"seconds an idle connection stays open between requests (default {limits.KEEP_ALIVE_S:g})",
    )
    g.add_argument(
        "--max-connections",
        type=whole(),
        default=limits.MAX_CONNECTIONS,
        metavar="N",
        help="requests in progress at once (a stream counts until it ends), and as many connections waiting to send "
        f"a request; past either a 503. /health is always answered (default {limits.MAX_CONNECTIONS})",
    )
    g.add_argument(
        "--max-connections-per-client",
        type=whole(),
        default=limits.MAX_CONNECTIONS_PER_CLIENT,
        metavar="N",
        help="the same, per client address (clients behind one NAT or load balancer share one: raise it there) "
        f"(default {limits.MAX_CONNECTIONS_PER_CLIENT})",
    )


def settings(args: argparse.Namespace) -> ProxySettings:
    """The proxy's settings from its options."""
    from kvbridge_proxy.limits import Limits
    from kvbridge_proxy.rebalance import Policy
    from kvbridge_proxy.settings import ProxySettings

    policy = Policy(args.rebalance_above, args.rebalance_below)
    moves = MoveSettings(
        args.move,
        tail=args.precopy_tail_by,
        stages=args.precopy_stages,
        tail_tokens=args.precopy_tail,
        cut_together_s=args.precopy_cut_together,
        cuts_at_once=args.precopy_cuts_at_once,
    )
    # options nothing would read are refused: a user who set them expects what they say
    if moves != MoveSettings() and not (args.live_moves or args.rebalance):
        raise ConfigError(
            "--move and --precopy-* say how a stream moves off a decode: add --live-moves (or --rebalance)"
        )
    if policy != Policy() and not args.rebalance:
        raise ConfigError("--rebalance-above and --rebalance-below say when streams move: add --rebalance")
    return ProxySettings(
        args.prefill,
        args.decode,
        health_interval=args.health_interval,
        timeout=args.timeout,
        warm_up=args.warm_up,
        transfer=args.transfer,
        connect_timeout=args.connect_timeout,
        expose_internals=args.expose_internals,
        registry=args.registry,
        live_moves=args.live_moves,
        rebalance=policy if args.rebalance else None,
        limits=Limits(
            max_parts=args.max_parts,
            max_upstream_bytes=args.max_upstream_bytes,
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            keep_alive_s=args.keep_alive,
            max_connections=args.max_connections,
            max_connections_per_client=args.max_connections_per_client,
        ),
        moves=moves,
    )


def run(args: argparse.Namespace) -> int:
    if args.admin_token:
        token = admin_token(load_secret())
        if token is None:
            raise ConfigError(f"no shared secret to derive the admin token from: {HOW_TO_SET}")
        sys.stdout.write(token + "\n")
        return 0
    from kvbridge_proxy.app import build_app
    from kvbridge_proxy.limits import server

    chosen = settings(args)
    server(build_app(chosen), args.host, args.port, chosen.limits).run()
    return 0
