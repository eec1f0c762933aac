"""`kvbridge bench --engine vllm --live-moves --hosts`: the client's gap when a running stream moves, by how it moves.

Hosts on one bridge (`kvbridge_tools.bench.link.placed`): a prefill server, decodes A and B (KVBridgeConnector over
`--migration-backend`), redis, `kvbridge proxy --live-moves`, and the client (this process's threads). `--link` shapes
the prefill host's link. Each round starts 8 streams with a prompt of one context length on one decode (the other
cordoned), and once each has 32 tokens an operator drains that decode at the proxy with one way to move (`"move"`:
precopy, stop-and-copy, recompute).
The next round starts on the other decode, so no server restarts and each move lands on a decode whose cache
holds none of the round's prompts.

Per context and way, over the streams of its `--repeat` rounds (alternated: every context and way once, then again):
the client's gap at the handover (its last event from the decode it left to its first from the next), p50 and p99;
each decode's slowdown during the move, the median of a stream's token rate before over its rate during (on the
decode it leaves, from the drain to the cut, where the pre-copy runs, against before the drain; on the next, its
first 16 events against the rest); and the next decode's step, the median time a token took there after those 16,
the unit a cut's gap is paid in; and the proxy's split of each cut (p50s: the next decode's API server answering the
continuation, then its first event). Per way, the gap's flatness: its p50 at the longest context over its p50 at the
shortest, with a bootstrap interval over the streams.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from rich.progress import Progress

from kvbridge.base.errors import ConfigError, described
from kvbridge.cli.numbers import whole
from kvbridge.cli.output import err_console, print_json, print_table
from kvbridge_tools.bench import bootstrap
from kvbridge_tools.bench.link import Link, placed
from kvbridge_tools.bench.stats import percentile
from kvbridge_tools.harness.run_logs import bench_logs

MOVES = ("precopy", "stop-and-copy", "recompute")
CONTEXTS = (256, 1024, 4096, 7800)
STREAMS = 8
# tokens each stream asks for: the first still runs when the last has its first tokens (their prompts end at
# different times), with room for a pre-copy's stages and its turn before the cut. At 7,800 tokens the first of
# 8 streams had up to 950 tokens when its turn came: with 1,000, one of 8 ended before it (not moved) in some runs.
GENERATED = 1500
FIRST = 32  # tokens every stream has before the drain
SETTLE = 16  # events on the next decode counted as "during the move"
# the engines below the front end: with three engines' compute on two vCPUs, each hop of a cut through an API server
# or the proxy otherwise waits for a CPU (docs/elastic.md, "The front end's hops")
ENGINE_NICE = 10
MOVED = re.compile(
    r"stream (?P<move>\S+) \(request (?P<request>\S+)\) moved from (?P<source>\S+) to (?P<target>\S+)"
    r" after (?P<tokens>\d+) tokens \((?P<why>.+), (?P<outcome>\w+)\)"
)
# the proxy's split of a cut: the next decode's API server answering the continuation, then its first event
ANSWERED = re.compile(
    r"stream (?P<move>\S+): \S+ answered \S+ in (?P<answer_ms>[\d.]+) ms,"
    r" its first event came (?P<first_ms>[\d.]+) ms later"
)
COLUMNS = [
    "context",
    "move",
    "moved",
    "gap p50",
    "gap p99",
    "leaving decode slowdown",
    "next decode slowdown",
    "next decode step",
    "answer + first event",
]
FLATNESS_LEVEL, FLATNESS_RESAMPLES = 0.95, 2000


@attrs.define
class Stream:
    """What the client saw of one stream: each event's arrival and the tokens received by then."""

    arrivals: list[tuple[float, int]] = attrs.Factory(list)
    error: str = ""


@attrs.define
class Round:
    """What one round measured of the streams it moved, one entry a stream (None: too few events to tell)."""

    gaps: list[float] = attrs.Factory(list)
    leaving: list[float | None] = attrs.Factory(list)
    settling: list[float | None] = attrs.Factory(list)
    steps: list[float | None] = attrs.Factory(list)
    answers: list[float] = attrs.Factory(list)  # the proxy's split of each cut (ms): the answer, then the first event
    first_events: list[float] = attrs.Factory(list)
    moved: int = 0
    outcomes: set[str] = attrs.Factory(set)
    errors: list[str] = attrs.Factory(list)


def pooled(context: int, move: str, rounds: list[Round]) -> dict[str, Any]:
    """One report row: the streams of every round of `context` and `move` taken together."""
    gaps = sorted(g for r in rounds for g in r.gaps)
    step = _median([s for r in rounds for s in r.steps])
    return {
        "context": context,
        "move": move,
        "rounds": len(rounds),
        "moved": sum(r.moved for r in rounds),
        "outcomes": sorted(set().union(*(r.outcomes for r in rounds))),
        "errors": [e for r in rounds for e in r.errors][:3],
        "gap_ms": {
            "p50": percentile(gaps, 0.5, 1),
            "p99": percentile(gaps, 0.99, 1),
            "all": [round(g, 1) for g in gaps],
            "round_p50s": [percentile(r.gaps, 0.5, 1) for r in rounds],
        },
        "slowdown": {
            "leaving": _median([s for r in rounds for s in r.leaving]),
            "next": _median([s for r in rounds for s in r.settling]),
        },
        "next_step_ms": None if step is None else round(step, 2),
        "split_ms": {  # p50s of the proxy's split: the next decode's API server's answer, then its first event
            "answer": percentile([a for r in rounds for a in r.answers], 0.5, 1),
            "first_event": percentile([e for r in rounds for e in r.first_events], 0.5, 1),
        },
    }


def check(args: argparse.Namespace) -> None:
    if not getattr(args, "hosts", False):
        raise ConfigError("--live-moves moves streams between decodes on namespace hosts; add --hosts")
    if getattr(args, "compare", None) is not None or getattr(args, "load", False):
        raise ConfigError("--live-moves measures kvbridge's moves alone; drop --compare and --load")
    if getattr(args, "engine_cores", None) == "split":
        raise ConfigError("--live-moves runs three engines on two hosts' worth of CPUs: drop --engine-cores")


def run(args: argparse.Namespace) -> int:
    from kvbridge_tools.harness.tiny_model import given_or_tiny

    check(args)
    if args.plot:
        from kvbridge_tools.bench.plot import check_path

        check_path(args.plot)
    contexts = args.lengths or list(CONTEXTS)
    max_len = -(-(max(contexts) + GENERATED + 64) // 256) * 256
    link = getattr(args, "link", None) or Link()
    moves = [m for m in (args.moves or MOVES)]
    with (
        tempfile.TemporaryDirectory(prefix="kvbridge-bench-moves-") as tmp,
        bench_logs(args.keep_logs, Path(tmp)) as logs,
        placed(link, also=("decode_b", "registry", "proxy", "client"), engine_cores="shared") as where,
        Progress(console=err_console, transient=True, disable=bool(args.json)) as progress,
    ):
        root = Path(tmp)
        model = given_or_tiny(args.model_dir, root, max_len)
        task = progress.add_task("rounds", total=len(contexts) * len(moves) * args.repeat)
        rows = _run_placed(args, where, model, logs, max_len, contexts, moves, lambda: progress.advance(task))
    result = {
        "engine": "vllm",
        "model": args.model_dir or "tiny random Llama",
        "migration_backend": args.migration_backend,
        "streams": STREAMS,
        "executor": args.executor,  # where each server ran its model
        "precopy_tail": args.precopy_tail,  # the proxy's --precopy-tail; None: its default
        "engine_nice": args.engine_nice,  # the engines' nice steps below the front end
        "link": link.to_json(),
        "repeat": args.repeat,  # rounds of each context and way, their streams pooled
        "rows": rows,
        "flatness": flatness(rows),
    }
    if args.plot:
        plot(args.plot, rows)
    if args.json:
        print_json(result)
    else:
        print_table(
            f"kvbridge bench --live-moves: {STREAMS} streams moved at once, {args.repeat} round(s) each, "
            f"{link.describe()}, --executor {args.executor}, --engine-nice {args.engine_nice}",
            COLUMNS,
            [_row(r) for r in rows],
        )
        if result["flatness"]:
            print_table(
                "the gap's flatness: p50 at the longest context over p50 at the shortest",
                ["move", "contexts", "p50 over p50", f"{FLATNESS_LEVEL:.0%} interval"],
                [
                    [
                        move,
                        f"{f['to']} over {f['from']}",
                        _x(f["ratio"]),
                        f"{_x(f['interval'][0])}-{_x(f['interval'][1])}",
                    ]
                    for move, f in result["flatness"].items()
                ],
            )
    return 0


# Llumnix (OSDI '24): a live move's downtime for LLaMA-7B, 13-26 ms and flat from 256 to 8k tokens (for reference)
LLUMNIX_MS = {"Llumnix LLaMA-7B, at most (paper, GPU)": [(256, 26.0), (8192, 26.0)]}


def plot(path: str, rows: list[dict[str, Any]]) -> None:
    """The client's gap p50 against the context, one line per way to move, Llumnix's figures beside them."""
    from kvbridge_tools.bench.plot import write_chart

    series: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r["gap_ms"]["p50"] is not None:
            series.setdefault(f"{r['move']} p50", []).append((r["context"], r["gap_ms"]["p50"]))
    series |= LLUMNIX_MS
    write_chart(path, "a running stream moved: the client's gap", "context (tokens)", "gap (ms)", series, log_y=True)


def _row(r: dict[str, Any]) -> list[Any]:
    gap, slow, split = r["gap_ms"], r["slowdown"], r["split_ms"]
    return [
        r["context"],
        r["move"],
        f"{r['moved']}/{STREAMS * r['rounds']}",
        _ms(gap["p50"]),
        _ms(gap["p99"]),
        _x(slow["leaving"]),
        _x(slow["next"]),
        "-" if r["next_step_ms"] is None else f"{r['next_step_ms']:.1f} ms",
        "-" if split["answer"] is None else f"{split['answer']:.0f} + {split['first_event']:.0f} ms",
    ]


def flatness(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per way to move: the gap's p50 at the longest context over its p50 at the shortest, with its interval.

    The interval resamples each context's streams (bootstrap, percentile method)."""
    out = {}
    for move in dict.fromkeys(r["move"] for r in rows):
        measured = sorted((r for r in rows if r["move"] == move and r["gap_ms"]["all"]), key=lambda r: r["context"])
        if len(measured) < 2 or measured[0]["context"] == measured[-1]["context"]:
            continue
        short, long = (np.asarray(measured[i]["gap_ms"]["all"], dtype=float) for i in (0, -1))
        spread = np.median(long[bootstrap.resamples(len(long), FLATNESS_RESAMPLES, seed=1)], axis=-1) / np.median(
            short[bootstrap.resamples(len(short), FLATNESS_RESAMPLES, seed=2)], axis=-1
        )
        low, high = bootstrap.central(spread, FLATNESS_LEVEL)
        out[move] = {
            "from": measured[0]["context"],
            "to": measured[-1]["context"],
            "ratio": round(float(np.median(long) / np.median(short)), 3),
            "interval": [round(low, 3), round(high, 3)],
        }
    return out


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} ms"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


ROLES = (("kv_producer", "prefill"), ("kv_consumer", "decode"), ("kv_consumer", "decode_b"))  # servers, their hosts


def _run_placed(
    args: argparse.Namespace,
    where: Any,
    model: Path,
    logs: Path,
    max_len: int,
    contexts: list[int],
    moves: list[str],
    advance: Any,
) -> list[dict[str, Any]]:
    from kvbridge.base.secret import SECRET_ENV, admin_token
    from kvbridge_tools.harness.ports import free_port
    from kvbridge_tools.harness.redis import redis_server
    from kvbridge_tools.harness.vllm_server import connector_config, start_proxy, start_vllm, wait_healthy

    hosts = where.hosts
    secret = where.env.get(SECRET_ENV) or os.environ[SECRET_ENV]
    env = {**where.env, "VLLM_LOG_STATS_INTERVAL": "1"}
    transport = {"protocol": args.protocol} if args.protocol else {}
    with contextlib.ExitStack() as stack, hosts["client"].entered():
        registry = stack.enter_context(redis_server(logs, host=hosts["registry"]))

        def server(role: str, name: str) -> Any:
            host, port = hosts[name], free_port()
            config = connector_config(
                role,
                backend=args.migration_backend,
                registry=registry,
                advertise_url=f"http://{host.address}:{port}",
                drain_grace_s=3,
                **transport,
            )
            s = start_vllm(
                model,
                port=port,
                max_model_len=max_len,
                kv_transfer_config=config,
                env=env,
                log_dir=logs,
                host=host,
                executor=args.executor,
                engine_nice=args.engine_nice,
            )
            stack.callback(s.stop)
            return s

        prefill, a, b = (server(role, name) for role, name in ROLES)
        wait_healthy([prefill, a, b], timeout=600)
        proxy = start_proxy(
            [],
            [],
            log_dir=logs,
            host=hosts["proxy"],
            registry=registry,
            secret=secret,
            live_moves=True,
            expose_internals=True,
            options=[] if args.precopy_tail is None else ["--precopy-tail", str(args.precopy_tail)],
        )
        stack.callback(proxy.stop)
        vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
        bench = _Bench(proxy, str(model), {"Authorization": f"Bearer {admin_token(secret)}"}, vocab)
        bench.wait_warm(2)
        rounds: dict[tuple[int, str], list[Round]] = {(c, m): [] for c in contexts for m in moves}
        decodes = [a, b]
        for _ in range(args.repeat):
            for context in contexts:
                for move in moves:
                    source, target = decodes
                    try:
                        rounds[context, move].append(bench.round(context, move, source, target))
                    except ConfigError as exc:  # the round is reported as failed; the next ones still run
                        rounds[context, move].append(Round(errors=[str(exc)]))
                    decodes.reverse()
                    advance()
        return [pooled(context, move, done) for (context, move), done in rounds.items()]


class _Bench:
    def __init__(self, proxy: Any, model: str, admin: dict[str, str], vocab: int) -> None:
        import httpx

        self.proxy, self.model, self.admin, self.vocab = proxy, model, admin, vocab
        self.http = httpx.Client(timeout=httpx.Timeout(600, connect=10), trust_env=False)
        self.rounds = 0
        self.rng = random.Random(0)

    def call(self, action: str, server: Any, **extra: str) -> None:
        """An operator call at the proxy; asked again while the proxy does not know the server.

        A busy server's record can expire for a moment: the proxy takes it out until it is written again."""
        body = {"server": server.url, **extra}
        deadline = time.monotonic() + 60
        while True:
            r = self.http.post(f"{self.proxy.url}/admin/{action}", json=body, headers=self.admin)
            if r.status_code == 200:
                return
            if r.status_code != 404 or time.monotonic() > deadline:
                raise ConfigError(f"the proxy refused {action} of {server.url}: {r.status_code} {r.text}")
            time.sleep(0.5)

    def instances(self) -> dict[str, Any]:
        return self.http.get(f"{self.proxy.url}/instances").json()

    def wait_warm(self, pairs: int) -> None:
        _until(lambda: len(self.instances()["warmed"]) >= pairs, 300, "the proxy's warm-up of every pair")

    def on(self, server: Any) -> int:
        return sum(i["streams"] for i in self.instances()["decode"] if i["url"] == server.url)

    def round(self, context: int, move: str, source: Any, target: Any) -> Round:
        """8 streams of `context` prompt tokens on `source`, drained to `target` with `move`: what the client saw."""
        self.rounds += 1
        names = [f"bench-{self.rounds}-{n}" for n in range(STREAMS)]
        seen = [Stream() for _ in names]
        self.call("cordon", target)
        self.call("uncordon", source)
        threads = [
            threading.Thread(target=self._stream, args=(name, context, s), daemon=True) for name, s in zip(names, seen)
        ]
        for t in threads:
            t.start()
        _until(
            lambda: all(s.arrivals and s.arrivals[-1][1] >= FIRST for s in seen) or any(s.error for s in seen),
            300,
            "the streams' first tokens",
        )
        self.call("uncordon", target)
        drained = time.monotonic()
        self.call("drain", source, move=move)
        for t in threads:
            t.join(timeout=600)
        proxy_log = self.proxy.log_path.read_text()
        moved = {
            m["request"]: (m["move"], int(m["tokens"]), m["outcome"])
            for m in MOVED.finditer(proxy_log)
            if m["request"] in names
        }
        answered = {m["move"]: (float(m["answer_ms"]), float(m["first_ms"])) for m in ANSWERED.finditer(proxy_log)}
        out = Round(
            moved=len(moved), outcomes={m[2] for m in moved.values()}, errors=[s.error for s in seen if s.error]
        )
        for name, s in zip(names, seen):
            if name not in moved:
                continue
            move_id, cut = moved[name][0], moved[name][1]
            if move_id in answered:
                out.answers.append(answered[move_id][0])
                out.first_events.append(answered[move_id][1])
            gap = handover_gap(s.arrivals, cut)
            if gap is not None:
                out.gaps.append(gap)
            before = [a for a in s.arrivals if a[0] < drained]
            during = [a for a in s.arrivals if a[0] >= drained and a[1] <= cut]
            after = [a for a in s.arrivals if a[1] > cut][1:]  # from B's first event
            out.leaving.append(slowdown(before, during))
            out.settling.append(slowdown(after[SETTLE:], after[: SETTLE + 1]))
            steady = _rate(after[SETTLE:])
            out.steps.append(None if not steady else 1e3 / steady)
        if out.moved and not out.answers:  # each cut that moved a stream logs its split: the bench no longer reads it
            err_console.print(
                f"no split of this round's {out.moved} cuts found in the proxy's log: check its wording against "
                "ANSWERED (kvbridge_tools.bench.vllm_moves)",
                markup=False,
            )
        return out

    def _stream(self, name: str, context: int, out: Stream) -> None:
        prompt = [self.rng.randrange(10, self.vocab) for _ in range(context)]  # past the special tokens
        body = {"model": self.model, "prompt": prompt, "max_tokens": GENERATED, "temperature": 0, "ignore_eos": True}
        body |= {"stream": True, "return_token_ids": True}
        got = 0
        try:
            with self.http.stream(
                "POST", f"{self.proxy.url}/v1/completions", json=body, headers={"x-request-id": name}
            ) as r:
                if r.status_code != 200:
                    out.error = f"{r.status_code} {r.read()[:200]!r}"
                    return
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        event = json.loads(line[len("data: ") :])
                        if "error" in event:
                            out.error = str(event["error"])[:200]
                            return
                        got += len((event.get("choices") or [{}])[0].get("token_ids") or [])
                        out.arrivals.append((time.monotonic(), got))
        except Exception as exc:  # a bench reports what failed, it does not stop at it
            out.error = described(exc)


def slowdown(steady: list[tuple[float, int]], window: list[tuple[float, int]]) -> float | None:
    """How much slower a stream's tokens came in `window` than in `steady`: token rates over each span of arrivals.

    Rates, not gaps between events: a burst of events read at once has gaps of zero."""

    fast, slow = _rate(steady), _rate(window)
    return None if not fast or not slow else fast / slow


def _rate(arrivals: list[tuple[float, int]]) -> float | None:
    """Tokens a second over a span of arrivals."""
    if len(arrivals) < 2 or arrivals[-1][0] <= arrivals[0][0]:
        return None
    return (arrivals[-1][1] - arrivals[0][1]) / (arrivals[-1][0] - arrivals[0][0])


def _median(values: list[float | None]) -> float | None:
    return percentile([v for v in values if v is not None], 0.5)


def handover_gap(arrivals: list[tuple[float, int]], cut: int) -> float | None:
    """The client's gap (ms) between its last event from the decode it left (`cut` tokens by then) and the next."""
    last = [i for i, (_, count) in enumerate(arrivals) if count == cut]
    if not last or last[-1] + 1 >= len(arrivals):
        return None
    i = last[-1]
    return (arrivals[i + 1][0] - arrivals[i][0]) * 1e3


def _until(done: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise ConfigError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """Options of `--engine vllm --live-moves --hosts` (it takes --engine vllm's `--lengths` as context lengths)."""
    group.add_argument(
        "--live-moves",
        action="store_true",
        help="with --engine vllm --hosts: move 8 running streams at once between two decodes (kvbridge proxy "
        "--live-moves), by pre-copy, stop-and-copy and recompute, at each context length (--lengths, default "
        f"{','.join(map(str, CONTEXTS))}); the client's gap p50/p99 and each decode's slowdown during the move "
        "(kvbridge_tools.bench.vllm_moves, docs/elastic.md)",
    )
    group.add_argument(
        "--moves", nargs="+", choices=MOVES, default=None, help="with --live-moves: the ways to move (default: all)"
    )
    group.add_argument(
        "--precopy-tail",
        type=whole(0),
        default=None,
        metavar="TOKENS",
        help="with --live-moves: the proxy's --precopy-tail (a pre-copy cuts once at most this many tokens of the "
        "stream were not pre-copied; default the proxy's)",
    )
    group.add_argument(
        "--engine-nice",
        type=whole(0, 19),
        default=ENGINE_NICE,
        metavar="N",
        help="with --live-moves: each server's engine (its model's compute, and the connector's threads beside it) "
        "runs N nice steps below its API server, the proxy and the client, as vLLM's CPU backend keeps cores free "
        "for its front end (VLLM_CPU_NUM_OF_RESERVED_CPU) where a box has none to keep; 0: all alike "
        f"(default {ENGINE_NICE}; docs/elastic.md)",
    )
