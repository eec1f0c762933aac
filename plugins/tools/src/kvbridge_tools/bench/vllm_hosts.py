"""`kvbridge bench --engine vllm --hosts`: decode TTFT and the KV transfer across network-namespace hosts.

Four hosts on one bridge (`kvbridge_tools.bench.link.placed`): the prefill vLLM server, the decode vLLM
server (KVBridgeConnector over `--migration-backend`, Mooncake TCP by default), `kvbridge proxy`,
and the client (this process's measuring thread, `Host.entered`). Every listener is on its host's
address, the servers get a fresh `KVBRIDGE_SECRET` (unless one is set), and `--link` shapes the
prefill host's link.

Each request goes through the proxy, whole and one token long, so its `x-kvbridge-timing` header
carries the decode's pull phases: decode TTFT is the proxy's decode request to its answer (the pull
phases and `decode_first_token_ms`), the transfer is the `transfer_ms` phase. The KV bytes it moved
are the decode server's `kvbridge_transfer_bytes_total` before and after. Right after each request,
the pair bench's raw transport (`kvbridge_tools.bench.pair_rank`, one descriptor) reads the same number
of bytes between the same two hosts, so each request pairs with a raw read on the same link at the
same moment; the ratio is the pair bench's paired ratio (raw seconds / transfer seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from rich.progress import Progress

from kvbridge.base.errors import ConfigError
from kvbridge.cli.output import err_console, print_json, print_table
from kvbridge.plan.presets import get_preset
from kvbridge.session import timeline
from kvbridge_tools.bench.link import Link, Placed, placed
from kvbridge_tools.bench.pair import DEFAULT_MODEL, frozen_heap, paired_ratio, ratio_cell
from kvbridge_tools.bench.pool_layout import DEFAULT_LAYOUT
from kvbridge_tools.bench.stats import percentile
from kvbridge_tools.harness.proc import Child
from kvbridge_tools.harness.run_logs import bench_logs

BYTES_COUNTER = "kvbridge_transfer_bytes_total"
COLUMNS = ["tokens", "requests", "recomputed", "decode TTFT", "KV MiB", "transfer", "transfer GB/s", "raw GB/s",
           "of raw (range)", "client TTFT"]  # fmt: skip


def check(args: argparse.Namespace) -> None:
    """Refuse what `--hosts` does not measure, before any server starts."""
    if getattr(args, "transfer", "pull") != "pull":
        raise ConfigError("--engine vllm --hosts measures pull mode; drop --transfer layerwise")
    if getattr(args, "compare", None) is not None:
        raise ConfigError(
            "--engine vllm --hosts measures KVBridgeConnector against the raw transport on the same link; "
            "drop --compare (pick the transport with --migration-backend)"
        )


def run(args: argparse.Namespace) -> int:
    from kvbridge_tools.bench.vllm import LENGTHS
    from kvbridge_tools.harness.tiny_model import given_or_tiny

    check(args)
    lengths = args.lengths or list(LENGTHS)
    max_len = max(1024, -(-(max(lengths) + 16) // 256) * 256)  # as the loopback bench sizes it
    reps = args.requests or 5
    link = getattr(args, "link", None) or Link()
    with (
        tempfile.TemporaryDirectory(prefix="kvbridge-bench-vllm-hosts-") as tmp,
        bench_logs(args.keep_logs, Path(tmp)) as logs,
        placed(link, also=("proxy", "client"), engine_cores=args.engine_cores) as where,
        Progress(console=err_console, transient=True, disable=bool(args.json)) as progress,
    ):
        root = Path(tmp)
        model = given_or_tiny(args.model_dir, root, max_len)
        task = progress.add_task("requests", total=len(lengths) * reps)
        rows = _run_placed(args, where, model, logs, max_len, lengths, reps, lambda: progress.advance(task))
    result = {
        "engine": "vllm",
        "model": args.model_dir or "tiny random Llama (2 layers, 2 KV heads x 64)",
        "migration_backend": args.migration_backend,
        "protocol": args.protocol,
        "hosts": {
            **{name: where.address[name] for name in ("prefill", "decode", "proxy", "client")},
            "link": link.to_json(),
        },
        "rows": rows,
    }
    if args.json:
        print_json(result)
    else:
        _print(result)
    return 0


def _run_placed(
    args: argparse.Namespace,
    where: Placed,
    model: Path,
    logs: Path,
    max_len: int,
    lengths: list[int],
    reps: int,
    advance: Any,
) -> list[dict[str, Any]]:
    from kvbridge_tools.harness.vllm_server import connector_config, start_proxy, start_vllm, wait_healthy

    hosts = where.hosts
    env = {**where.env, "VLLM_LOG_STATS_INTERVAL": "1"}
    transport = {"protocol": args.protocol} if args.protocol else {}

    def server(role: str, name: str) -> Any:
        config = connector_config(role, backend=args.migration_backend, **transport)
        return start_vllm(
            model,
            executor=args.executor,
            max_model_len=max_len,
            kv_transfer_config=config,
            env=env,
            log_dir=logs,
            host=hosts[name],
        )

    # The client's thread runs on the client host: the root namespace cannot reach the hosts.
    with contextlib.ExitStack() as stack, hosts["client"].entered():
        prefill = server("kv_producer", "prefill")
        stack.callback(prefill.stop)
        decode = server("kv_consumer", "decode")
        stack.callback(decode.stop)
        wait_healthy([prefill, decode], timeout=600)
        # The proxy's warm-up is the pair's first handover, so none measured here pays first contact.
        proxy = start_proxy([prefill.url], [decode.url], log_dir=logs, host=hosts["proxy"], timeout=300)
        stack.callback(proxy.stop)
        block = 32  # start_vllm's block size: a request moves whole blocks
        raw = _RawPair(args, where, (-(-max(lengths) // block) + 1) * block * kv_bytes_per_token(model))
        stack.callback(raw.close)
        with frozen_heap():
            return _measure(args, proxy, decode, raw, str(model), lengths, reps, advance)


def kv_bytes_per_token(model: Path) -> int:
    """The KV bytes one token takes in the servers' cache, from the model's config.json.

    That is K and V of every layer, fp32 as the bench serves them.
    """
    import json

    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return int(cfg["num_hidden_layers"]) * 2 * int(kv_heads) * int(head_dim) * 4


class _RawPair:
    """The pair bench's raw transport between the prefill and decode hosts: one descriptor per read."""

    def __init__(self, args: argparse.Namespace, where: Placed, nbytes: int) -> None:
        spec = get_preset(DEFAULT_MODEL)
        blocks = max(1, math.ceil(nbytes / (spec.bytes_per_token() * spec.block_size)))
        self.capacity = blocks * spec.bytes_per_token() * spec.block_size
        self.timeout = float(getattr(args, "timeout", 120.0))
        self.sides = {
            name: Child("kvbridge_tools.bench.pair_rank", name=f"raw-{name}", prefix=where.prefix[name], env=where.env)
            for name in ("prefill", "decode")
        }
        common = dict(
            backend=args.migration_backend,
            protocol=args.protocol,
            device="cpu",
            model=spec.name,
            options={},
            layout=DEFAULT_LAYOUT,
            blocks=blocks,
        )
        self.src = self.sides["prefill"].call("init", hostname=where.address["prefill"], **common)
        self.sides["decode"].call("init", hostname=where.address["decode"], **common)
        self.sides["prefill"].call("admit", host=where.address["decode"])
        self.sides["decode"].call("admit", host=where.address["prefill"])
        self.sides["decode"].call("connect", endpoint=self.src["endpoint"])
        self.read(min(self.capacity, 1 << 20))  # first contact (the transport's connection) is not measured

    def read(self, nbytes: int) -> float:
        """Seconds to read `nbytes` from the prefill host to the decode host, one descriptor."""
        if nbytes > self.capacity:
            raise ConfigError(
                f"a request moved {nbytes} bytes, more than the raw pool's {self.capacity}: the model's KV is "
                "larger than this bench sizes for; use shorter --lengths"
            )
        reply = self.sides["decode"].call(
            "raw", src_base=self.src["base"], nbytes=nbytes, wait_s=self.timeout, timeout=self.timeout + 30
        )
        return float(reply["seconds"])

    def close(self) -> None:
        for side in self.sides.values():
            with contextlib.suppress(Exception):  # closing what failed must not hide why it failed
                side.call("close")
            side.close()


def _bytes_read(http: Any, decode: Any) -> float:
    from kvbridge_tools.harness.vllm_server import parse_metrics

    return parse_metrics(http.get(f"{decode.url}/metrics").text).get(BYTES_COUNTER, 0.0)


def _measure(
    args: argparse.Namespace,
    proxy: Any,
    decode: Any,
    raw: _RawPair,
    model: str,
    lengths: list[int],
    reps: int,
    advance: Any,
) -> list[dict[str, Any]]:
    import httpx

    from kvbridge_tools.harness.tiny_model import random_prompt

    http = httpx.Client(timeout=300, trust_env=False)
    rows = []
    try:
        for n in lengths:
            ttft, decode_ttft, transfer, moved, raw_s, failed = [], [], [], [], [], 0
            for i in range(reps):
                before = _bytes_read(http, decode)
                body = {"model": model, "prompt": random_prompt(n, seed=n * 1000 + i), "max_tokens": 1,
                        "temperature": 0, "ignore_eos": True, "stream": False}  # fmt: skip
                start = time.perf_counter()
                r = http.post(f"{proxy.url}/v1/completions", json=body, headers={"x-request-id": uuid.uuid4().hex})
                took = time.perf_counter() - start
                r.raise_for_status()
                phases = timeline.parse(r.headers[timeline.HEADER]).phases
                nbytes = int(_bytes_read(http, decode) - before)
                advance()
                if "transfer_ms" not in phases or nbytes <= 0:  # recomputed: nothing moved to compare
                    failed += 1
                    continue
                ttft.append(took * 1e3)
                decode_ttft.append(
                    sum(phases.get(p, 0.0) for p in timeline.PULL_PHASES) + phases["decode_first_token_ms"]
                )
                transfer.append(phases["transfer_ms"])
                moved.append(nbytes)
                raw_s.append(raw.read(nbytes))
            rows.append(_row(n, reps, failed, ttft, decode_ttft, transfer, moved, raw_s, args))
    finally:
        http.close()
    return rows


def _row(
    n: int,
    reps: int,
    failed: int,
    ttft: list[float],
    decode_ttft: list[float],
    transfer: list[float],
    moved: list[int],
    raw_s: list[float],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One prompt length's figures: medians and p90s (`bench.stats.percentile`), GB/s from the median times."""
    row: dict[str, Any] = {"prompt_tokens": n, "requests": reps, "pulls_failed": failed}
    if not moved:
        return row
    link = getattr(args, "link", None) or Link()
    nbytes = int(statistics.median(moved))
    kv_gbps = nbytes / (statistics.median(transfer) / 1e3) / 1e9
    raw_gbps = nbytes / statistics.median(raw_s) / 1e9
    share = (lambda gbps: gbps * 8e9 / link.rate_bits) if link.rate_bits else (lambda _gbps: None)
    row.update(
        {
            "kv_bytes": nbytes,
            "ttft_ms": percentile(ttft, 0.5, 2),
            "ttft_p90_ms": percentile(ttft, 0.9, 2),
            "decode_ttft_ms": percentile(decode_ttft, 0.5, 2),
            "decode_ttft_p90_ms": percentile(decode_ttft, 0.9, 2),
            "transfer_ms": percentile(transfer, 0.5, 2),
            "transfer_p90_ms": percentile(transfer, 0.9, 2),
            "transfer_gbps": kv_gbps,
            "transfer_share_of_link": share(kv_gbps),
            "raw_ms": percentile([s * 1e3 for s in raw_s], 0.5, 2),
            "raw_gbps": raw_gbps,
            "raw_share_of_link": share(raw_gbps),
            # raw seconds / transfer seconds, request by request (each raw read right after its request)
            **paired_ratio(raw_s, [t / 1e3 for t in transfer]),
        }
    )
    return row


def _print(result: dict[str, Any]) -> None:
    h = result["hosts"]
    rate = h["link"]["rate_bits"]

    def share(v: float | None) -> str:
        return "" if v is None else f"{v:.0%}"

    rows = []
    for r in result["rows"]:
        if "kv_bytes" not in r:
            rows.append([r["prompt_tokens"], r["requests"], r["pulls_failed"], *[""] * 7])
            continue
        rows.append(
            [
                r["prompt_tokens"],
                r["requests"],
                r["pulls_failed"],
                f"{r['decode_ttft_ms']} / {r['decode_ttft_p90_ms']}",
                f"{r['kv_bytes'] / 2**20:.2f}",
                f"{r['transfer_ms']} / {r['transfer_p90_ms']}",
                f"{r['transfer_gbps']:.3f}" + (f" ({share(r['transfer_share_of_link'])})" if rate else ""),
                f"{r['raw_gbps']:.3f}" + (f" ({share(r['raw_share_of_link'])})" if rate else ""),
                ratio_cell(r),
                f"{r['ttft_ms']} / {r['ttft_p90_ms']}",
            ]
        )
    print_table(
        f"vLLM PD across hosts: KVBridgeConnector over {result['migration_backend']}, prefill {h['prefill']}, "
        f"decode {h['decode']}, proxy {h['proxy']}, client {h['client']}, link {h['link']['described']}; "
        "ms: median / p90 per request; GB/s from the median times (share of the link's rate)",
        COLUMNS,
        rows,
    )
