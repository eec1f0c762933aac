"""`kvbridge bench --prefill SPEC --decode SPEC`: every rank of two differently parallel engines.

A prefill process and a decode process (each hosting all ranks of its side, one agent and one
transport endpoint per rank) are started with `kvbridge_tools.harness.proc.Child`. The prefill ranks fill their
shares with recoverable fingerprints; every decode rank pulls its share of every request; with
`--verify` each decode rank checks that its buffer holds exactly its share, and every prefill
rank's release count is checked against the pulls (and unpulled notices) it received.
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvbridge.base.errors import ConfigError
from kvbridge.cli.output import console, print_json, print_table
from kvbridge.plan.presets import get_preset
from kvbridge.plan.topology import ParallelConfig, plan
from kvbridge_tools.bench.parallel_rank import LAYOUTS
from kvbridge_tools.harness.proc import Child

# Context-parallel pairs (prefill -> decode), MLA and GQA, against tensor and data parallelism; the tests plan and
# run each.
CONTEXT_PAIRS = [
    ("tiny-mla", "tp8,dp2", "tp8,dp2"),
    ("tiny-mla", "tp8,pcp2,dcp8", "tp8,dp2"),
    ("tiny-mla", "tp8,pcp2,dcp8", "tp8,dcp4,dp2"),
    ("tiny-mla", "tp8,pcp2,dcp4", "tp4,dcp2,dp4"),
    ("tiny-mla", "tp8,pcp2,dcp2", "tp4,dcp4,dp4"),
    ("tiny-mla", "tp8,pcp2", "tp4,dcp2"),
    ("tiny-gqa", "tp8,dp2", "tp8,dp2"),
    ("tiny-gqa", "tp8,pcp2,dcp2", "tp8,dp2"),
    ("tiny-gqa", "tp8,pcp2,dcp2", "tp8,dcp2,dp2"),
    ("tiny-gqa", "tp8,pcp2,dcp2", "tp4,dp4"),
    ("tiny-gqa", "tp16,dcp2", "tp8,dcp2,dp2"),
]
DEFAULT_TOKENS = 2500
CLOSE_TIMEOUT = 60.0


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--prefill", metavar="SPEC", help="prefill parallelism, e.g. tp8,pcp2,dcp8 (selects this mode)")
    group.add_argument("--decode", metavar="SPEC", help="decode parallelism, e.g. tp8,dcp4,dp2")
    group.add_argument(
        "--verify", action="store_true", help="check every decode rank holds exactly its share and every release count"
    )
    group.add_argument("--kv-layout", default=LAYOUTS[0], choices=LAYOUTS, help=f"cache layout (default {LAYOUTS[0]})")


class ParallelBench:
    """A prefill and a decode child process, reused across cases."""

    def __init__(self) -> None:
        self.prefill = Child("kvbridge_tools.bench.parallel_rank", name="bench-prefill")
        try:
            self.decode = Child("kvbridge_tools.bench.parallel_rank", name="bench-decode")
        except BaseException:
            self.prefill.close()
            raise

    def run(
        self,
        prefill: str,
        decode: str,
        model: str,
        tokens: int = DEFAULT_TOKENS,
        *,
        requests: int | None = None,
        backend: str = "mooncake",
        protocol: str | None = None,
        layout: str = LAYOUTS[0],
        verify: bool = True,
        timeout: float = 300.0,
    ) -> dict[str, Any]:
        """One case: set both sides up, pull every request, verify; returns the figures and the verdict."""
        p, d = ParallelConfig.parse(prefill), ParallelConfig.parse(decode)
        spec = get_preset(model)
        n = requests or max(p.dp, d.dp)
        reqs = [{"id": f"req-{i}", "tokens": tokens, "prefill_dp": i % p.dp, "decode_dp": i % d.dp} for i in range(n)]
        for r in reqs:  # refuse an impossible pair before any process allocates anything
            plan(p, d, spec, tokens, prefill_dp=r["prefill_dp"], decode_dp=r["decode_dp"])
        common = dict(model=model, requests=reqs, backend=backend, protocol=protocol, layout=layout)
        ps = self.prefill.call("setup", timeout=timeout, side="prefill", engine_id="prefill", spec=prefill, **common)
        ds = self.decode.call("setup", timeout=timeout, side="decode", engine_id="decode", spec=decode, **common)
        pulled = self.decode.call("pull", timeout=timeout, infos=ps["infos"], blocks=ps["blocks"], verify=verify)
        expected = self.prefill.call("release_counts", timeout=timeout, decode=decode)
        release_ok = all(
            pulled["received"].get(rid, {}).get(rank, 0) == count and (count or rank in pulled["received"].get(rid, {}))
            for rid, counts in expected.items()
            for rank, count in counts.items()
        )
        return {
            "prefill": str(p),
            "decode": str(d),
            "model": model,
            "tokens": tokens,
            "requests": n,
            "prefill_ranks": p.world_size,
            "decode_ranks": d.world_size,
            "bytes": pulled["bytes"],
            "descriptors": pulled["descriptors"],
            "pulls": pulled["pulls"],
            "seconds": pulled["seconds"],
            "gbps": pulled["bytes"] / pulled["seconds"] / 1e9 if pulled["seconds"] else 0.0,
            "verified": (not pulled["bad"] and release_ok) if verify else None,
            "bad_ranks": pulled["bad"],
            "release_ok": release_ok,
            "expected_release": expected,
            "received": pulled["received"],
            "prefill_process": {k: ps.get(k) for k in ("rss_mib", "threads", "setup_s")},
            "decode_process": {k: pulled.get(k) for k in ("rss_mib", "threads")} | {"setup_s": ds["setup_s"]},
        }

    def close(self) -> None:
        """Stop both children at once: each closes one transport endpoint per rank, slowly (see `parallel_rank`)."""
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda child: child.close(timeout=CLOSE_TIMEOUT), (self.decode, self.prefill)))

    def __enter__(self) -> ParallelBench:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run(args: argparse.Namespace) -> int:
    if not (args.prefill and args.decode):
        raise ConfigError("the parallel bench needs both --prefill SPEC and --decode SPEC (e.g. tp8,pcp2,dcp8)")
    model = args.model or "tiny-gqa"
    with ParallelBench() as bench:
        r = bench.run(
            args.prefill,
            args.decode,
            model,
            args.tokens or DEFAULT_TOKENS,
            requests=args.requests,
            backend=args.migration_backend,
            protocol=args.protocol,
            layout=args.kv_layout,
            verify=args.verify,
        )
    if args.json:
        print_json(r)
    else:
        print_table(
            f"kvbridge bench: {r['prefill']} -> {r['decode']}, {model}, "
            f"{r['tokens']} tokens x {r['requests']} requests",
            ["ranks P/D", "pulls", "descriptors", "MiB", "seconds", "GB/s", "verified"],
            [
                (
                    f"{r['prefill_ranks']}/{r['decode_ranks']}",
                    r["pulls"],
                    r["descriptors"],
                    f"{r['bytes'] / 2**20:.2f}",
                    f"{r['seconds']:.3f}",
                    f"{r['gbps']:.3f}",
                    {None: "not checked", True: "yes", False: "NO"}[r["verified"]],
                )
            ],
        )
        for side in ("prefill", "decode"):
            proc = r[f"{side}_process"]
            console.print(
                f"{side} process (all {r[f'{side}_ranks']} ranks): {proc['rss_mib']} MiB resident, "
                f"{proc['threads']} threads"
            )
        for rank, bad in r["bad_ranks"].items():
            console.print(f"decode rank {rank}: {bad['wrong_words']} wrong words, e.g. {bad['first'][:2]}")
        if not r["release_ok"]:
            console.print(f"release counts differ: expected {r['expected_release']}, received {r['received']}")
    return 1 if r["verified"] is False else 0
