"""`kvbridge trace`: send requests through a running `kvbridge proxy` and show each one's timeline."""

from __future__ import annotations

import argparse
import random
import string
from typing import Any

from kvbridge.base.errors import ConfigError
from kvbridge.cli.numbers import whole
from kvbridge.control.discovery import url_problem


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trace",
        help="send requests through kvbridge proxy and show where each spent its time",
        description="Send one completion per prompt length through a running `kvbridge proxy` and print the "
        "x-kvbridge-timing of each: prefill, handover, the decode's pull (queue, control, transfer, DONEs) and "
        "decode to first token, in ms (docs/operations.md explains each phase).",
        epilog="example: kvbridge trace http://127.0.0.1:8000 --lengths 64 512 2048",
    )
    p.add_argument("proxy", metavar="URL", type=_url, help="the proxy's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the first one the proxy's servers serve)")
    p.add_argument(
        "--lengths",
        type=whole(),
        nargs="+",
        default=[64, 256, 1024],
        metavar="N",
        help="prompt lengths in characters (default 64 256 1024)",
    )
    p.add_argument("--max-tokens", type=whole(), default=8, help="tokens to generate per request (default 8)")
    p.add_argument(
        "--stream",
        action="store_true",
        help="stream the answers (the decode's pull phases then stay in its server's metrics only)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=run)


def _url(text: str) -> str:
    if problem := url_problem(text):
        raise argparse.ArgumentTypeError(problem)
    return text.rstrip("/")


def _model(http: Any, proxy: str) -> str:
    models = http.get(f"{proxy}/v1/models").raise_for_status().json()["data"]
    if not models:
        raise ConfigError(f"the servers behind {proxy} serve no model; pass --model")
    return str(models[0]["id"])


def trace(
    proxy: str, lengths: list[int], *, model: str | None = None, max_tokens: int = 8, stream: bool = False
) -> list[dict[str, Any]]:
    """One request per length through the proxy; each row: id, length, total_ms and the phases."""
    import httpx

    from kvbridge.session.timeline import HEADER, parse

    proxy = proxy.rstrip("/")
    rows = []
    rng = random.Random(0)
    with httpx.Client(timeout=600, trust_env=False) as http:
        try:
            model = model or _model(http, proxy)
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise ConfigError(
                f"cannot ask {proxy} for its servers' model ({exc}); is `kvbridge proxy` running there? Or pass --model"
            ) from None
        for n in lengths:
            body = {
                "model": model,
                "prompt": "".join(rng.choice(string.ascii_lowercase) for _ in range(n)),
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": stream,
            }
            with http.stream("POST", f"{proxy}/v1/completions", json=body) as r:
                r.read()
                if r.status_code != 200:
                    raise ConfigError(f"{proxy} answered {r.status_code}: {r.text[:300]}")
                if HEADER not in r.headers:
                    raise ConfigError(f"{proxy} sent no {HEADER} header: is it `kvbridge proxy`?")
                t = parse(r.headers[HEADER])
            rows.append({"id": t.request_id, "prompt_chars": n, "total_ms": t.total_ms, **t.phases})
    return rows


def run(args: argparse.Namespace) -> int:
    from kvbridge.cli.output import print_json, print_table
    from kvbridge.session.timeline import PHASES

    rows = trace(args.proxy, args.lengths, model=args.model, max_tokens=args.max_tokens, stream=args.stream)
    if args.json:
        print_json(rows)
        return 0
    cols = [p for p in PHASES if any(p in r for r in rows)]
    print_table(
        f"kvbridge trace: {args.proxy} (ms)",
        ["prompt", *[c.removesuffix("_ms") for c in cols], "total"],
        [(r["prompt_chars"], *(f"{r[c]:.1f}" if c in r else "" for c in cols), f"{r['total_ms']:.1f}") for r in rows],
    )
    return 0
