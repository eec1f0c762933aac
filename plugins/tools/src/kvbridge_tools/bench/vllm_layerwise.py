"""`kvbridge bench --engine vllm --transfer layerwise`: layer-wise streaming against pull mode on real vLLM servers.

Both modes run on the same prefill + decode pair (both servers run `"transfer": "layerwise"`, which also serves
pull requests), request by request in turn, so each length's figures are paired.

Per request, as a client of a PD proxy sees it (the bench plays the proxy): `client_ttft_ms` is from
sending the request to the decode's first token (decode answers with `max_tokens` 1). Pull: prefill,
then decode with prefill's params. Layer-wise: both at once with one transfer id. From the decode's
answer (`kvbridge_timing`): `transfer_ms` (time some read was in flight), `hidden_ms` (of it, the part
before the last poll that still found prefill computing: a lower bound on what overlapped compute),
`hidden_pct`, `exposed_ms` (transfer_ms - hidden_ms; a faster read lowers it where it lowers hidden_pct),
`tail_ms` (from that poll to the last byte), `done_ms` (the fenced DONEs after the last byte);
from prefill's answer, `prefill_ms` (its engine's time for the request); `ttft_vs_pull`, the median over
pairs of each pair's layer-wise / pull TTFT (which of a pair goes first alternates), and
`ttft_vs_pull_range`, the lowest and highest pair; `ttft_vs_pull_ci90`, a 90 % bootstrap interval of
that median (`verdict` in the table: faster or slower when the interval lies on one side of 1.0, a tie
when it holds 1.0: one request's prefill can vary by more than the effect). Prefill computes prompts in
chunks (`--max-num-batched-tokens`, default 256 here), so KV is readable per layer and per chunk.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from rich.progress import Progress

from kvbridge.cli.output import err_console, print_json, print_table
from kvbridge_tools.bench.pair import frozen_heap, paired_ratio
from kvbridge_tools.bench.stats import percentile
from kvbridge_tools.harness.run_logs import bench_logs

CHUNK_TOKENS = 256


def _post(http: Any, url: str, body: dict) -> tuple[dict, float]:
    r = http.post(f"{url}/v1/completions", json=body)
    r.raise_for_status()
    return r.json(), time.perf_counter()


def _timing(answer: dict) -> dict[str, float]:
    return (answer.get("kv_transfer_params") or {}).get("kvbridge_timing") or {}


def _one(http: Any, prefill: Any, decode: Any, base: dict, text: str, identity: dict, layerwise: bool) -> dict:
    to_prefill: dict[str, Any] = {"do_remote_decode": True}
    start = time.perf_counter()
    if not layerwise:
        first, _ = _post(http, prefill.url, {**base, "prompt": text, "kv_transfer_params": to_prefill})
        answer, end = _post(
            http, decode.url, {**base, "prompt": text, "kv_transfer_params": first["kv_transfer_params"]}
        )
    else:
        tid = uuid.uuid4().hex
        mode = {"transfer_mode": "layerwise", "transfer_id": tid}
        got: dict[str, Any] = {}

        def prefill_side() -> None:
            got["first"] = _post(
                http, prefill.url, {**base, "prompt": text, "kv_transfer_params": {**to_prefill, **mode}}
            )[0]

        side = threading.Thread(target=prefill_side)
        side.start()
        params = {**identity, **mode, "do_remote_prefill": True, "remote_request_id": tid}
        try:
            answer, end = _post(http, decode.url, {**base, "prompt": text, "kv_transfer_params": params})
        finally:
            side.join(timeout=600)  # the prefill request ends either way: the next request is not overlapped
        first = got["first"]
    row = {"client_ttft_ms": (end - start) * 1e3, **_timing(answer)}
    if "prefill_ms" in _timing(first):
        row["prefill_ms"] = _timing(first)["prefill_ms"]
    return row


def _cell(row: dict[str, Any], col: str) -> Any:
    if col == "ttft_vs_pull" and row.get("ttft_vs_pull_range"):
        low, high = row["ttft_vs_pull_range"]
        return f"{row[col]:.3f} ({low:.2f}-{high:.2f})"
    if col == "verdict" and row.get("ttft_vs_pull_ci90"):
        low, high = row["ttft_vs_pull_ci90"]
        word = "faster" if high < 1 else "slower" if low > 1 else "tie"
        return f"{word} ({low:.2f}-{high:.2f})"
    return row.get(col, "")


def run(args: argparse.Namespace) -> int:
    import httpx

    from kvbridge_tools.harness.tiny_model import given_or_tiny, random_prompt
    from kvbridge_tools.harness.vllm_server import connector_config, start_vllm, wait_healthy

    lengths = args.lengths or [64, 256, 1024, 1900]
    reps = args.requests or 5
    rows: list[dict] = []
    with (
        tempfile.TemporaryDirectory(prefix="kvbridge-bench-layerwise-") as tmp,
        bench_logs(args.keep_logs, Path(tmp)) as logs,
        Progress(console=err_console, transient=True, disable=bool(args.json)) as progress,
    ):
        root = Path(tmp)
        longest = max(lengths) + 2
        model = given_or_tiny(args.model_dir, root, longest)
        common = {
            "max_model_len": max(1024, longest),
            "log_dir": logs,
            "env": {"VLLM_LOG_STATS_INTERVAL": "1"},
            "executor": args.executor,
        }
        chunked = ["--max-num-batched-tokens", str(CHUNK_TOKENS)]
        prefill = start_vllm(
            model,
            kv_transfer_config=connector_config("kv_producer", transfer="layerwise"),
            extra_args=chunked,
            **common,
        )
        decode = start_vllm(model, kv_transfer_config=connector_config("kv_consumer", transfer="layerwise"), **common)
        http = httpx.Client(timeout=600, trust_env=False)
        try:
            wait_healthy([prefill, decode], timeout=600)
            with frozen_heap():
                base = {"model": str(model), "temperature": 0, "ignore_eos": True, "max_tokens": 1}
                # Warm-up, both ways; the pulled one tells where prefill's side channel is.
                first, _ = _post(
                    http,
                    prefill.url,
                    {**base, "prompt": random_prompt(40, 0), "kv_transfer_params": {"do_remote_decode": True}},
                )
                p = first["kv_transfer_params"]
                identity = {k: p[k] for k in ("remote_engine_id", "remote_host", "remote_port", "tp_size")}
                _post(http, decode.url, {**base, "prompt": random_prompt(40, 0), "kv_transfer_params": p})
                _one(http, prefill, decode, base, random_prompt(40, 1), identity, layerwise=True)
                task = progress.add_task("requests", total=2 * len(lengths) * reps)
                for n in lengths:
                    pairs: list[dict[str, dict]] = []
                    failed = {"pull": 0, "layerwise": 0}
                    for i in range(reps):
                        pair: dict[str, dict] = {}
                        # in turn, paired under the same load; which goes first alternates, so whatever the
                        # first of a pair pays does not always fall on the same mode
                        for mode in ("pull", "layerwise") if i % 2 == 0 else ("layerwise", "pull"):
                            text = random_prompt(n, seed=n * 1000 + i * 2 + (mode == "layerwise"))
                            try:
                                pair[mode] = _one(http, prefill, decode, base, text, identity, mode == "layerwise")
                            except httpx.HTTPStatusError as exc:  # a failed load (policy fail): counted, not hidden
                                failed[mode] += 1
                                err_console.print(f"{mode} request of {n} tokens failed: {exc.response.text[:200]}")
                            progress.advance(task)
                        pairs.append(pair)
                    samples = {mode: [p[mode] for p in pairs if mode in p] for mode in ("pull", "layerwise")}
                    for mode, got in samples.items():
                        row: dict[str, Any] = {
                            "transfer": mode,
                            "prompt_tokens": n,
                            "requests": reps,
                            "failed": failed[mode],
                        }
                        for key in (
                            "client_ttft_ms",
                            "prefill_ms",
                            "control_ms",
                            "transfer_ms",
                            "hidden_ms",
                            "exposed_ms",
                            "tail_ms",
                            "done_ms",
                        ):
                            values = [g[key] for g in got if key in g]
                            if values:
                                row[key] = percentile(values, 0.5, 2)
                        if mode == "layerwise":
                            pct = [100 * g["hidden_ms"] / g["transfer_ms"] for g in got if g.get("transfer_ms")]
                            row["hidden_pct"] = percentile(pct, 0.5, 2) if pct else None
                        rows.append(row)
                    # the median and range of each pair's ratio, as the transfer bench reports raw against
                    # kvbridge: one request's prefill can vary by more than the effect
                    both = [p for p in pairs if len(p) == 2]
                    ratio = (
                        paired_ratio(
                            [p["layerwise"]["client_ttft_ms"] for p in both],
                            [p["pull"]["client_ttft_ms"] for p in both],
                        )
                        if both
                        else None
                    )
                    rows[-1]["ttft_vs_pull"] = round(ratio["ratio"], 3) if ratio else None
                    rows[-1]["ttft_vs_pull_range"] = [round(r, 3) for r in ratio["ratio_range"]] if ratio else None
                    rows[-1]["ttft_vs_pull_ci90"] = [round(r, 3) for r in ratio["ratio_ci90"]] if ratio else None
        finally:
            http.close()
            prefill.stop()
            decode.stop()
    if args.json:
        print_json({"engine": "vllm", "transfer": "layerwise vs pull", "chunk_tokens": CHUNK_TOKENS, "rows": rows})
    else:
        cols = [
            "transfer",
            "prompt_tokens",
            "requests",
            "failed",
            "client_ttft_ms",
            "ttft_vs_pull",
            "verdict",
            "prefill_ms",
            "control_ms",
            "transfer_ms",
            "hidden_ms",
            "hidden_pct",
            "exposed_ms",
            "tail_ms",
        ]
        print_table(
            f"vLLM PD, layer-wise streaming vs pull (medians; ttft_vs_pull: median of the pairs (lowest-highest); "
            "verdict: from its 90 % bootstrap interval; "
            f"prefill chunks of {CHUNK_TOKENS} tokens; --json for every figure)",
            cols,
            [[_cell(r, c) for c in cols] for r in rows],
        )
    # a failed request is a failed bench: its figures are printed above, the status says it
    return 1 if any(r["failed"] for r in rows) else 0
