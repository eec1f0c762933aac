"""The checks of `scripts/gpu-check` (docs/gpu.md), one per child process.

A check runs as `python -m kvbridge_tools.harness.gpu_check STEP --device cuda --transport tcp --result FILE`.
Each writes {status, detail, data} as JSON to FILE.

They drive kvbridge's own code, nothing copied: the device conformance suite (`kvbridge.testing.devices`,
through pytest), the pair bench (`kvbridge bench`), the landing rearrangement (`KVAgent.pull` with a
`kvbridge.agent.landing.LandingBuffers`) and layer-wise publishing (`kvbridge.session.stream.Producer`).
On the `cpu` device the same steps run on host memory, where nothing is queued: what they prove about a
GPU is proven only where one ran them.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvbridge.base.errors import described

REPO = Path(__file__).resolve().parents[5]  # plugins/tools/src/kvbridge_tools/harness
OTHER_TRANSPORTS = ("mooncake", "nixl")  # carried one per call: the others' parametrizations are left out
CONFORMANCE = {  # device -> (test file, class running DeviceConformance on it)
    "cuda": ("plugins/cuda/tests/test_cuda_conformance.py", "TestCudaConformance"),
    "cpu": ("tests/unit/test_conformance.py", "TestCpuConformance"),
}
BENCH = ["--model", "small", "--tokens", "1024", "--requests", "4", "--repeat", "3"]  # 16 MiB per request
LANDING_SHAPE = (2, 8, 4, 16, 64)  # layers, blocks, heads, tokens per block, fp16 K+V content per token

Outcome = tuple[str, str, dict[str, Any]]  # status ("pass", "fail", "skip"), detail, data


def environment(args: argparse.Namespace) -> Outcome:
    """Versions and the card; the device and the transport must both be available to kvbridge."""
    import torch

    import kvbridge

    data: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        data["card"] = torch.cuda.get_device_name(0)
        data["cuda_devices"] = torch.cuda.device_count()
        data["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    devices = {i.name: i for i in kvbridge.list_devices()}
    backends = {i.name: i for i in kvbridge.list_backends()}
    data["plugins"] = {
        i.name: ("available" if i.available else i.reason) for i in [*devices.values(), *backends.values()]
    }
    data["refused"] = [f"{i.name}: {i.reason}" for i in kvbridge.refused_plugins()]
    problems = [
        f"{kind} {name}: {'not registered' if info is None else info.reason}"
        for kind, name, info in (
            ("device", args.device, devices.get(args.device)),
            ("transport", args.transport, backends.get(args.transport)),
        )
        if info is None or not info.available
    ]
    where = data.get("card", "no GPU")
    if problems:
        return "fail", "; ".join(problems), data
    return "pass", f"{where}, torch {data['torch']} (CUDA {data['torch_cuda']}), {args.transport} available", data


def conformance(args: argparse.Namespace) -> Outcome:
    """The device conformance suite through pytest, over tcp, loopback and the carried transport.

    Any skip fails the step (on a GPU machine a skipped GPU test means the GPU was not used).
    """
    path, cls = CONFORMANCE[args.device]
    expr = " and ".join([cls, *(f"not {t}" for t in OTHER_TRANSPORTS if t != args.transport)])
    xml = Path(args.out) / "conformance.xml"
    cmd = [sys.executable, "-m", "pytest", path, "-k", expr, "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    proc = subprocess.run(cmd, cwd=REPO, timeout=max(args.limit - 5, 5), check=False)
    if not xml.is_file():
        return "fail", f"pytest exit status {proc.returncode}, no report", {}
    cases = list(ET.parse(xml).getroot().iter("testcase"))
    outcome = {"passed": 0, "failed": 0, "skipped": 0}
    bad = []
    for case in cases:
        kinds = {child.tag for child in case}
        kind = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
        outcome[kind] += 1
        if kind != "passed":
            bad.append(f"{case.get('name')}: {kind}")
    names = " ".join(str(c.get("name")) for c in cases)
    data = {**outcome, "not_passed": bad[:20], "selected": expr, "file": path}
    detail = f"{outcome['passed']} passed, {outcome['failed']} failed, {outcome['skipped']} skipped ({cls})"
    if proc.returncode != 0 or not cases or bad:
        return "fail", detail, data
    if args.transport not in names:
        return "fail", f"{detail}; no test ran over {args.transport}", data
    return "pass", detail, data


def pair_bench(args: argparse.Namespace) -> Outcome:
    """`kvbridge bench` between two processes, both KV caches on the device (one GPU: both on cuda:0).

    The KV is verified byte for byte, beside the raw transport measured in the same run.
    """
    runs = []
    for protocol in _bench_protocols(args.transport):
        cmd = [
            sys.executable,
            "-m",
            "kvbridge",
            "bench",
            "--migration-backend",
            args.transport,
            "--device",
            args.device,
        ]
        cmd += [*(["--protocol", protocol] if protocol else []), *BENCH, "--json"]
        proc = subprocess.run(
            cmd, cwd=REPO, capture_output=True, text=True, timeout=max(args.limit - 5, 5), check=False
        )
        sys.stderr.write(proc.stderr)
        try:
            result = json.loads(proc.stdout)
        except json.JSONDecodeError:
            tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
            runs.append({"protocol": protocol, "verified": False, "error": f"exit {proc.returncode}: {tail[0]}"})
            continue
        runs.append(
            {
                "protocol": protocol or "default",
                "path": _path(args.device, args.transport, protocol),
                "verified": bool(result["verified"]) and proc.returncode == 0,
                "kvbridge_gbps": round(result["kvbridge"]["gbps"], 3),
                "raw_gbps": round(result["raw"]["gbps"], 3),
                "ratio": round(result["ratio"], 3),
                "ratio_range": [round(r, 3) for r in result["ratio_range"]],
                "strategy": result["strategy"]["used"],
                "bytes_per_request": result["config"]["bytes_per_request"],
                "latency_ms_median": round(result["kvbridge"]["latency_ms"]["median"], 2),
                "problems": result["problems"],
            }
        )
    detail = "; ".join(
        f"{r['protocol']}: {r['error']}"
        if "error" in r
        else f"{r['protocol']}: {r['kvbridge_gbps']:.2f} GB/s, raw {r['raw_gbps']:.2f} GB/s ({r['ratio']:.0%}), "
        f"{'verified' if r['verified'] else 'NOT VERIFIED'}, {r['path']}"
        for r in runs
    )
    return ("pass" if runs and all(r["verified"] for r in runs) else "fail"), detail, {"runs": runs, "args": BENCH}


def _bench_protocols(transport: str) -> list[str | None]:
    """Mooncake's TCP and, where the wheel was built with it, its intra-node NVLink transport."""
    if transport != "mooncake":
        return [None]
    import mooncake.engine

    from kvbridge_mooncake.spec import wheel_supports

    return ["tcp", *(["nvlink"] if "intra_nvlink" in wheel_supports(mooncake.engine) else [])]


def _path(device: str, transport: str, protocol: str | None) -> str:
    """Whether the transport reads the device's memory in place or kvbridge stages it through host memory."""
    import kvbridge
    from kvbridge.transport import staging

    if device == "cpu":
        return "host memory"
    try:
        backend = kvbridge.create_backend(transport, protocol=protocol)
    except Exception as exc:  # the bench itself says whether the transport works; this only labels the path
        return f"path unknown ({described(exc)})"
    try:
        direct = staging.reaches(kvbridge.get_device(device), backend)
    finally:
        backend.close()
    return "in place (device memory)" if direct else "staged through pinned host memory"


def landing(args: argparse.Namespace) -> Outcome:
    """Every pair of vLLM KV cache layouts (6 x 6): decode pulls a request from prefill through `KVAgent.pull`.

    `KVAgent.pull` lands the peer's blocks and rearranges them on the device; each block must then equal prefill's,
    and blocks outside the request stay zero. Over the in-process loopback transport, staged where it cannot reach
    the device (no engine, no network).
    """
    import torch

    from kvbridge.adapters.vllm.cache import ASCEND_KV_TUPLE, ORDERS, byte_views, describe_kv_caches
    from kvbridge.agent.kv_agent import KVAgent
    from kvbridge.agent.landing import LandingBuffers
    from kvbridge.plan.topology import ParallelConfig

    layouts = [n for n in ORDERS if n != ASCEND_KV_TUPLE]
    L, B, H, N, C = LANDING_SHAPE
    tokens = 3 * N - 5
    src_blocks, dst_blocks = [6, 1, 4], [2, 7, 0]
    wrong = []
    landed = 0  # pairs that went through a landing buffer (the others: like layouts, read in place)
    gen = torch.Generator(device=args.device).manual_seed(3)
    for src, dst in itertools.product(layouts, layouts):
        p_kv, d_kv = _caches(src, args.device), _caches(dst, args.device)
        for t in p_kv.values():
            t.copy_(torch.randn(t.shape, generator=gen, device=args.device, dtype=torch.float16))
        p_layout, p_storages = describe_kv_caches(p_kv, layout=src, block_size=N, tp_size=1)
        d_layout, d_storages = describe_kv_caches(d_kv, layout=dst, block_size=N, tp_size=1)
        with contextlib.ExitStack() as stack:
            prefill = KVAgent(
                "prefill", 0, ParallelConfig(), p_layout, p_storages, backend="loopback", device=args.device
            )
            stack.callback(prefill.close)
            decode = KVAgent(
                "decode", 0, ParallelConfig(), d_layout, d_storages, backend="loopback", device=args.device
            )
            stack.callback(decode.close)
            decode.landing_buffers = LandingBuffers(
                decode.backend, d_layout, byte_views(d_kv, layout=dst), decode.device
            )
            prefill.publish(src_blocks)
            result = decode.pull("r", [prefill.info()], src_blocks, dst_blocks, tokens).wait(30)
            landed += decode.landing_buffers.idle_bytes > 0
        if result.error is not None:
            wrong.append(f"{src}->{dst}: {result.error}")
            continue
        untouched = [b for b in range(B) if b not in dst_blocks]
        for name in p_kv:
            if not torch.equal(d_kv[name][dst_blocks], p_kv[name][src_blocks]) or d_kv[name][untouched].any():
                wrong.append(f"{src}->{dst}: {name} differs")
                break
    pairs = len(layouts) ** 2
    data = {
        "pairs": pairs,
        "landed": landed,
        "layouts": layouts,
        "shape_LBHNC": list(LANDING_SHAPE),
        "wrong": wrong[:20],
    }
    detail = (
        f"{pairs - len(wrong)} of {pairs} layout pairs byte-exact on {args.device} "
        f"({landed} landed and rearranged there, {pairs - landed} alike: read in place)"
    )
    return ("pass" if not wrong else "fail"), detail + (f"; {wrong[0]}" if wrong else ""), data


def _caches(layout: str, device: str) -> dict[str, Any]:
    """vLLM's per-layer `[B, H, N, C]` views of one zeroed buffer laid out in `layout`'s physical order."""
    import torch

    from kvbridge.adapters.vllm.cache import ORDERS

    sizes = LANDING_SHAPE
    strides, size = [0] * 5, 1
    for d in reversed(ORDERS[layout]):
        strides[d], size = size, size * sizes[d]
    full = torch.as_strided(torch.zeros(size, dtype=torch.float16, device=device), sizes, strides)
    return {f"model.layers.{i}.self_attn.attn": full[i] for i in range(sizes[0])}


def layerwise(args: argparse.Namespace) -> Outcome:
    """Layer-wise streaming's prefill side: every published layer holds what the queued device work wrote.

    Each layer's KV is written by queued device work on a stream of its own, `save_layer` records a mark (a CUDA
    event) and returns, and a publisher thread waits for it and publishes the layer (device -> pinned host mirror).
    A peer then reads every published block: each must hold what the queued work wrote, so a mark that did not
    cover the work would show.
    """

    import kvbridge
    from kvbridge.agent.kv_agent import KVAgent
    from kvbridge.control.ledger import Ledger
    from kvbridge.plan.layout import vllm_layout
    from kvbridge.plan.presets import PRESETS
    from kvbridge.plan.topology import ParallelConfig
    from kvbridge.session.stream import LayerwiseMeta, Producer, StreamStart

    model = PRESETS["small"]
    device = kvbridge.get_device(args.device)
    blocks, stream_blocks = 8, (3, 5)
    layer_bytes = 2 * blocks * model.kv_heads * model.block_size * model.head_dim * model.dtype_bytes
    buf = device.allocate(model.layers * layer_bytes)
    base = device.regions(buf)[0].addr
    layout = vllm_layout(
        model, model.kv_heads, [base + i * layer_bytes for i in range(model.layers)], blocks, order="HND"
    )
    agent = KVAgent("prefill", 0, ParallelConfig(), layout, buf, backend="loopback", device=args.device)
    aborted: list[str] = []
    producer = Producer(Ledger(lambda *_: None), lambda tid, why: aborted.append(f"{tid}: {why}"), model.block_size)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(model.layers)]
    producer.register(agent, names)
    tokens = len(stream_blocks) * model.block_size
    unpublished_on_return = 0  # layers not yet published when save_layer returned: the forward did not wait
    marks = agent.record() is not None
    try:
        producer.apply(LayerwiseMeta(starts=[StreamStart("r", "t", stream_blocks, tokens)], computed={"r": tokens}))
        with _side_stream(args.device):
            for i, name in enumerate(names):
                _queue_layer(buf, i * layer_bytes, (i + 1) * layer_bytes, i + 1)
                producer.save_layer(name)
                unpublished_on_return += producer.query("t", 0).ready[i] < tokens
        producer.apply(LayerwiseMeta(ends={"r": False}))  # waits for every layer saved so far
        ready = producer.query("t", 0).ready
        got = _read_published(agent, stream_blocks)
    finally:
        producer.close()
        agent.close()
    wrong = [i for i, layer in enumerate(got) if not (layer == i + 1).all()]
    data = {
        "layers": model.layers,
        "marks": "CUDA events" if marks and args.device == "cuda" else ("device marks" if marks else "none"),
        "layers_unpublished_when_save_layer_returned": int(unpublished_on_return),
        "ready": list(ready),
        "wrong_layers": wrong,
        "aborted": aborted,
    }
    ok = ready == (tokens,) * model.layers and not wrong and not aborted
    how = (
        f"marks recorded; {unpublished_on_return} of {model.layers} layers were still running when save_layer returned"
        if marks
        else "nothing to mark on host memory: published inline"
    )
    detail = f"{model.layers} layers published {'in full, bytes as written' if ok else 'WRONG'}; {how}"
    return ("pass" if ok else "fail"), detail, data


@contextlib.contextmanager
def _side_stream(device: str) -> Iterator[None]:
    """Queue the "forward" on a CUDA stream of its own, as an engine may.

    A mark recorded on another stream than the writes' would not cover them.
    """
    if device != "cuda":
        yield
        return
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the buffer's zeroing, queued on the default stream, first
    with torch.cuda.stream(side):
        yield


def _queue_layer(buf: Any, lo: int, hi: int, value: int) -> None:
    """Write one layer's bytes as an engine's kernels do: queued, behind work that keeps the GPU busy."""
    if isinstance(buf, np.ndarray):
        buf[lo:hi] = value
        return
    import torch

    torch.cuda._sleep(20_000_000)  # about 10 ms of GPU cycles queued ahead of the write
    buf[lo:hi].fill_(value)


def _read_published(agent: Any, blocks: tuple[int, ...]) -> list[np.ndarray]:
    """Each layer's published blocks as a peer reads them (from the host mirror, where staged)."""
    import kvbridge

    regions = agent.info().layout.regions
    per_layer: dict[int, list[Any]] = {}
    for r in regions:
        per_layer.setdefault(r.layer, []).append(r)
    total = sum(r.block_bytes for r in regions) * len(blocks)
    host = np.zeros(total, dtype=np.uint8)
    reader = kvbridge.create_backend("loopback")
    try:
        reader.register_memory(host)
        peer = reader.connect(agent.backend.endpoint_info())
        desc, off, spans = [], 0, []
        for layer in sorted(per_layer):
            start = off
            for r in per_layer[layer]:
                for b in blocks:
                    desc.append((host.ctypes.data + off, r.addr + b * r.block_stride, r.block_bytes))
                    off += r.block_bytes
            spans.append((start, off))
        reader.transfer(peer, np.array(desc, dtype=np.int64), "read").wait(30)
    finally:
        reader.close()
    return [host[a:b] for a, b in spans]


STEPS: dict[str, Callable[[argparse.Namespace], Outcome]] = {
    "environment": environment,
    "conformance": conformance,
    "pair-bench": pair_bench,
    "landing": landing,
    "layerwise": layerwise,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvbridge_tools.harness.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("step", choices=sorted(STEPS))
    p.add_argument("--device", choices=sorted(CONFORMANCE), default="cuda")
    p.add_argument("--transport", default="tcp")
    p.add_argument("--out", default=".")
    p.add_argument("--result", required=True, help="file to write the step's JSON result into")
    p.add_argument("--limit", type=float, default=60.0, help="seconds this step may take")
    args = p.parse_args(argv)
    start = time.monotonic()
    try:
        status, detail, data = STEPS[args.step](args)
    except Exception as exc:  # the step failed; its traceback goes to its log, the reason to the table
        import traceback

        traceback.print_exc()
        status, detail, data = "fail", described(exc), {}
    result = {"name": args.step, "status": status, "seconds": round(time.monotonic() - start, 2), "detail": detail}
    Path(args.result).write_text(json.dumps({**result, "data": data}, indent=2, default=str) + "\n")
    return 0 if status != "fail" else 1


if __name__ == "__main__":
    sys.exit(main())
