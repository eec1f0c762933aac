"""kvbridge's LMDeploy migration backend against LMDeploy 0.18's real classes.

Two processes act as a prefill and a decode worker (what LMDeploy's CacheEngine does around its
backend, with LMDeploy's pydantic messages and `build_cache_pool_assignments`) over Mooncake TCP
on 127.0.0.1. In-process tests cover planning and failure paths on the loopback transport.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import os
import secrets
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import numpy as np
import pytest

pytest.importorskip("lmdeploy.pytorch.disagg.messages", reason="needs lmdeploy 0.18 (scripts/setup --test)")

from lmdeploy.pytorch.disagg.config import DistServeEngineConfig  # noqa: E402
from lmdeploy.pytorch.disagg.conn.protocol import (  # noqa: E402
    DistServeCachePoolInfo,
    DistServeInitRequest,
    DistServeKVTransferEndpointInfo,
    MigrationProtocol,
)
from lmdeploy.pytorch.disagg.messages import (  # noqa: E402
    AssignmentInstruct,
    DistServeRegisterMRMessage,
    MigrationAssignment,
)
from lmdeploy.pytorch.engine.cache_engine.migration import build_cache_pool_assignments  # noqa: E402

from kvbridge.adapters.lmdeploy import AdapterSettings, KVBridgeLMDeployBackend  # noqa: E402
from kvbridge.adapters.lmdeploy.plan import instruct_array, plan  # noqa: E402
from kvbridge.base.errors import ConfigError, InvalidDescriptor, ProtocolError, TransferFailed, TransferTimeout  # noqa: E402
from kvbridge.base.types import MemoryRegion  # noqa: E402
from kvbridge_tools.bench import lmdeploy as lmdeploy_bench  # noqa: E402
from kvbridge_tools.bench.lmdeploy_rank import engine_config  # noqa: E402
from kvbridge_tools.cli import bench as bench_cli  # noqa: E402
from kvbridge_tools.harness.proc import Child, ChildError  # noqa: E402

LAYERS, P_BLOCKS, D_BLOCKS, BLOCK_BYTES = 3, 40, 24, 512
ENV = {
    "KVBRIDGE_LMDEPLOY_TRANSPORT": "mooncake",
    "KVBRIDGE_LMDEPLOY_HOSTNAME": "127.0.0.1",
    "KVBRIDGE_LMDEPLOY_TIMEOUT": "60",
    "KVBRIDGE_LMDEPLOY": "1",
}
RANK = "kvbridge_tools.bench.lmdeploy_rank"
# (prefill block, decode block): a contiguous run, a reversed run, and scattered blocks.
PAIRS = [[p, d] for p, d in zip(range(10, 18), range(2, 10))] + [[30, 12], [29, 13], [28, 14]] + [[0, 20], [39, 16]]


def _cfg(blocks: int) -> DistServeEngineConfig:
    return engine_config(blocks, block_size=16)


def _handshake(prefill: Child, decode: Child) -> None:
    p_ep = prefill.call("initialize", remote_engine_id="decode-0", remote_blocks=D_BLOCKS, protocol="TCP")
    d_ep = decode.call("initialize", remote_engine_id="prefill-0", remote_blocks=P_BLOCKS, protocol="TCP")
    decode.call("connect", remote_engine_id="prefill-0", endpoint=p_ep)
    prefill.call("connect", remote_engine_id="decode-0", endpoint=d_ep)


@pytest.fixture(scope="module")
def pair(module_hosts_factory) -> Iterator[tuple[Child, Child]]:  # noqa: ANN001
    """A prefill and a decode worker on two hosts (network namespaces), each transport on its host's address.

    The endpoints are signed with a shared secret (an unsigned or foreign one is refused, and Mooncake's listeners
    admit only the host a signed endpoint names).
    """
    hosts = module_hosts_factory(["prefill", "decode"])
    secret = {"KVBRIDGE_SECRET": secrets.token_hex(16)}
    prefill, decode = (
        Child(
            RANK,
            env={**ENV, **secret, "KVBRIDGE_LMDEPLOY_HOSTNAME": hosts[name].address},
            name=name,
            prefix=hosts[name].command([]),
        )
        for name in ("prefill", "decode")
    )
    try:
        for child, engine_id, blocks, fill in (
            (prefill, "prefill-0", P_BLOCKS, True),
            (decode, "decode-0", D_BLOCKS, False),
        ):
            made = child.call(
                "setup",
                engine_id=engine_id,
                layers=LAYERS,
                blocks=blocks,
                block_bytes=BLOCK_BYTES,
                fill=fill,
                backend="Mooncake",
            )
            # The worker resolved LMDeploy's "Mooncake" through the registry to kvbridge's class.
            assert made["backend"] == "kvbridge.adapters.lmdeploy.backend.KVBridgeLMDeployBackend"
        _handshake(prefill, decode)
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


# -- registration in a fresh interpreter ------------------------------------------------------

_PROBE = (
    "import json, sys; import lmdeploy.pytorch.disagg.backend\n"
    "from lmdeploy.pytorch.disagg.backend.backend import MIGRATION_BACKENDS as M\n"
    "print(json.dumps({k: f'{v.__module__}.{v.__qualname__}' for k, v in M.module_dict.items()}))"
)


def _fresh(code: str, **env: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=120, cwd="/"
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_fresh_interpreter_gets_kvbridge_for_mooncake() -> None:
    names = json.loads(_fresh(_PROBE, KVBRIDGE_LMDEPLOY="1"))
    assert names["Mooncake"] == "kvbridge.adapters.lmdeploy.backend.KVBridgeLMDeployBackend"
    assert names["KVBridge"] == names["Mooncake"]


@pytest.mark.parametrize("first", ["kvbridge.adapters.lmdeploy", "lmdeploy.pytorch.disagg.backend"])
def test_either_import_order_gets_kvbridge_for_mooncake(first: str) -> None:
    """Importing kvbridge's adapter first runs LMDeploy's registry inside that import, before kvbridge's class is."""
    out = subprocess.run(
        [sys.executable, "-c", f"import {first}\n{_PROBE}"],
        env={**os.environ, "KVBRIDGE_LMDEPLOY": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    assert out.returncode == 0 and "could not register" not in out.stderr, out.stderr
    names = json.loads(out.stdout.strip().splitlines()[-1])
    assert names["Mooncake"] == names["KVBridge"] == "kvbridge.adapters.lmdeploy.backend.KVBridgeLMDeployBackend"


def test_the_adapter_imported_first_under_pytest_gets_kvbridge_for_mooncake(tmp_path: Path) -> None:
    """Under pytest, pytest's assertion rewriter loads the adapter, not the finders behind it.

    kvbridge ships a pytest plugin, and pytest marks every module of a plugin's distribution for rewriting, so the
    rewriter loads each kvbridge module (an editable install's only where its egg-info is on the path: the conftest
    marks them as an installed wheel's are). LMDeploy's registry, run inside the adapter's import, then kept
    LMDeploy's own Mooncake backend."""
    (tmp_path / "conftest.py").write_text('import pytest\n\npytest.register_assert_rewrite("kvbridge")\n')
    (tmp_path / "test_order.py").write_text(
        "def test_order():\n"
        "    import kvbridge.adapters.lmdeploy\n"
        "    from lmdeploy.pytorch.disagg.backend.backend import MIGRATION_BACKENDS as M\n"
        "    name = M.get('Mooncake').__module__\n"
        "    assert name == 'kvbridge.adapters.lmdeploy.backend', name\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_order.py")],
        env={**os.environ, "KVBRIDGE_LMDEPLOY": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]


def test_env_switch_keeps_lmdeploys_own_backend() -> None:
    names = json.loads(_fresh(_PROBE, KVBRIDGE_LMDEPLOY="0"))
    assert names["Mooncake"] == "lmdeploy.pytorch.disagg.backend.mooncake.MooncakeBackend"
    assert "KVBridge" not in names


def test_hook_is_installed_by_a_pth_file_and_imports_nothing_else() -> None:
    site = Path(sysconfig.get_paths()["purelib"])
    assert (site / "kvbridge_lmdeploy.pth").read_text().startswith("import kvbridge_lmdeploy")
    loaded = set(json.loads(_fresh("import json, sys; print(json.dumps(sorted(sys.modules)))")))
    assert "kvbridge_lmdeploy" in loaded
    heavy = {
        m for m in loaded if m.split(".")[0] in ("lmdeploy", "torch", "mmengine") or m.startswith("kvbridge.adapters")
    }
    assert not heavy, f"a bare interpreter imported {sorted(heavy)}"


# -- two processes on two hosts over Mooncake TCP ----------------------------------------------------------


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_migrate_verifies_every_byte(pair: tuple[Child, Child], async_op: bool) -> None:
    _prefill, decode = pair
    decode.call("reset")
    assert decode.call("verify", pairs=PAIRS)["wrong_blocks"] == len(PAIRS)  # the check can fail
    result = decode.call("migrate", remote_engine_id="prefill-0", pairs=PAIRS, async_op=async_op, protocol="TCP")
    assert result["instructs"] == LAYERS * len(PAIRS)
    assert result["bytes"] == LAYERS * len(PAIRS) * BLOCK_BYTES
    assert decode.call("verify", pairs=PAIRS) == {"wrong_blocks": 0, "stray_blocks": 0, "checked": len(PAIRS)}
    if async_op:
        assert result["ticks"] >= 1, "the event loop must run while an async migration is in flight"
    else:
        assert result["ticks"] == 0, "a synchronous migration completes without yielding"


def test_prefill_side_reads_from_decode_too(pair: tuple[Child, Child]) -> None:
    """The links are symmetric: the prefill worker can read the decode pool (blocks swap roles)."""
    prefill, decode = pair
    decode.call("reset")
    decode.call("migrate", remote_engine_id="prefill-0", pairs=PAIRS[:4])
    before = prefill.call("verify", pairs=[[p, p] for p in range(P_BLOCKS)])
    assert before["wrong_blocks"] == 0
    # Prefill block 35 now receives decode block 2 (which holds prefill block 10's fingerprint).
    prefill.call("migrate", remote_engine_id="decode-0", pairs=[[2, 35]])
    after = prefill.call("verify", pairs=[[p, p] for p in range(P_BLOCKS)])
    assert after["wrong_blocks"] == 1
    assert prefill.call("verify", pairs=[[10, 35]])["wrong_blocks"] == 0


def test_unknown_engine_is_named(pair: tuple[Child, Child]) -> None:
    _prefill, decode = pair
    with pytest.raises(ChildError, match="no link to remote engine 'nobody'") as err:
        decode.call("migrate_raw", remote_engine_id="nobody", instructs=[[0, 0, 0, 8]])
    assert err.value.kind == "ConfigError"


def test_unregistered_mr_key_names_engine_and_instruct(pair: tuple[Child, Child]) -> None:
    _prefill, decode = pair
    with pytest.raises(ChildError, match=r"remote engine prefill-0: instruct #1 \(mr_key=5") as err:
        decode.call("migrate_raw", remote_engine_id="prefill-0", instructs=[[0, 0, 0, 8], [5, 0, 0, 8]])
    assert err.value.kind == "InvalidDescriptor"
    with pytest.raises(ChildError, match=r"instruct #0 .* past the end of the remote region"):
        decode.call(
            "migrate_raw", remote_engine_id="prefill-0", instructs=[[0, 0, LAYERS * P_BLOCKS * BLOCK_BYTES - 8, 16]]
        )


@pytest.mark.parametrize("op", ["store", "load"])
def test_store_and_load_are_refused_clearly(pair: tuple[Child, Child], op: str) -> None:
    _prefill, decode = pair
    with pytest.raises(ChildError, match=rf"{op}\(\) is not supported.*use p2p_migrate") as err:
        decode.call(op, remote_engine_id="prefill-0", pairs=PAIRS[:1])
    assert err.value.kind == "ConfigError"


def test_drop_disconnects_and_unregisters_then_reconnects(pair: tuple[Child, Child]) -> None:
    prefill, decode = pair
    assert decode.call("drop", remote_engine_id="prefill-0") == {"links": [], "registered": 0}
    with pytest.raises(ChildError, match="no link to remote engine 'prefill-0'"):
        decode.call("migrate", remote_engine_id="prefill-0", pairs=PAIRS[:1])
    prefill.call("drop", remote_engine_id="decode-0")
    _handshake(prefill, decode)
    decode.call("reset")
    decode.call("migrate", remote_engine_id="prefill-0", pairs=PAIRS, async_op=True)
    assert decode.call("verify", pairs=PAIRS)["wrong_blocks"] == 0


# -- in process: planning and failures on the loopback transport ------------------------------


def _pools(blocks: int) -> tuple[DistServeCachePoolInfo, ...]:
    return (
        DistServeCachePoolInfo(shape=(LAYERS, blocks, BLOCK_BYTES), dtype="torch.uint8", element_size=1, entry_axis=1),
    )


def test_contiguous_blocks_coalesce_to_one_descriptor_per_layer() -> None:
    pairs = [(p, d) for p, d in zip(range(5, 25), range(0, 20))]
    batch = build_cache_pool_assignments(_pools(D_BLOCKS), _pools(P_BLOCKS), pairs)
    local = {0: MemoryRegion(1 << 20, LAYERS * D_BLOCKS * BLOCK_BYTES)}
    remote = {0: MemoryRegion(1 << 30, LAYERS * P_BLOCKS * BLOCK_BYTES)}
    p = plan(instruct_array(batch), local, remote, engine="prefill-0")
    assert len(batch) == LAYERS * 20
    assert p.descriptors.tolist() == [
        [(1 << 20) + layer * D_BLOCKS * BLOCK_BYTES, (1 << 30) + (layer * P_BLOCKS + 5) * BLOCK_BYTES, 20 * BLOCK_BYTES]
        for layer in range(LAYERS)
    ]
    # Scattered blocks stay one descriptor per instruct; the bytes are the same.
    scattered = build_cache_pool_assignments(_pools(D_BLOCKS), _pools(P_BLOCKS), [(3, 0), (1, 1), (7, 2)])
    s = plan(instruct_array(scattered), local, remote, engine="prefill-0")
    assert len(s.descriptors) == len(scattered) and s.nbytes == len(scattered) * BLOCK_BYTES


def _loopback_pair(
    keys: tuple[bytes | None, bytes | None] = (None, None), hostnames: tuple[str, str] = ("127.0.0.1", "127.0.0.1")
) -> tuple[KVBridgeLMDeployBackend, KVBridgeLMDeployBackend, np.ndarray, np.ndarray]:
    """A prefill and a decode backend over the loopback transport, linked both ways as LMDeploy's proxy links them.

    `keys` (shared secrets) and `hostnames` are the prefill's and the decode's.
    """
    src = np.arange(LAYERS * P_BLOCKS * BLOCK_BYTES, dtype=np.uint64).astype(np.uint8)
    dst = np.zeros(LAYERS * D_BLOCKS * BLOCK_BYTES, dtype=np.uint8)
    sides = {}
    for me, other, arr, mine, theirs, secret, host in (
        ("p", "d", src, P_BLOCKS, D_BLOCKS, keys[0], hostnames[0]),
        ("d", "p", dst, D_BLOCKS, P_BLOCKS, keys[1], hostnames[1]),
    ):
        settings = AdapterSettings(
            transport="loopback", protocol="loopback", hostname=host, timeout=10, secret=secret, fault_injection={}
        )
        b = KVBridgeLMDeployBackend(settings)
        b.p2p_initialize(
            DistServeInitRequest(
                local_engine_id=me,
                local_engine_config=_cfg(mine),
                remote_engine_id=other,
                remote_engine_config=_cfg(theirs),
                protocol=MigrationProtocol.TCP,
                rank=0,
            )
        )
        _register_pool(b, other, arr)
        sides[me] = b
    for me, other in (("p", "d"), ("d", "p")):
        info = json.dumps(sides[other].endpoint_info(me, MigrationProtocol.TCP))
        conn = DistServeKVTransferEndpointInfo(protocol=MigrationProtocol.TCP, endpoint_info=info)
        sides[me].p2p_connect(other, conn)
    return sides["p"], sides["d"], src, dst


SECRET = b"lmdeploy-test-secret-0123456789"


def test_endpoints_are_signed_and_a_signed_peer_is_admitted_to_guarded_listeners() -> None:
    from kvbridge.transport import netguard

    prefill, decode, _src, _dst = _loopback_pair((SECRET, SECRET), ("198.51.100.77", "198.51.100.78"))
    try:
        info = prefill.endpoint_info("d", MigrationProtocol.TCP)
        assert info["host"] == "198.51.100.77" and len(info["mac"]) == 64 and SECRET.decode() not in json.dumps(info)
        admitted = {str(a) for a in netguard.ADMISSION.hosts()}
        assert {"198.51.100.77", "198.51.100.78"} <= admitted, "each side admits the host its peer signed for"
        for tampered in (
            {**info, "host": "198.51.100.66"},
            {**info, "mac": "0" * 64},
            {k: v for k, v in info.items() if k != "mac"},
        ):
            conn = DistServeKVTransferEndpointInfo(protocol=MigrationProtocol.TCP, endpoint_info=json.dumps(tampered))
            with pytest.raises(ProtocolError, match=r"(unsigned|signed with another secret).*same KVBRIDGE_SECRET"):
                decode.p2p_connect("p", conn)
        assert "198.51.100.66" not in {str(a) for a in netguard.ADMISSION.hosts()}
    finally:
        prefill.close()
        decode.close()


def _resigned(info: dict, **changes: object) -> DistServeKVTransferEndpointInfo:
    """`info` with `changes`, signed again as an engine holding SECRET signs (sorted compact JSON, HMAC-SHA256)."""
    from kvbridge.base.secret import LMDEPLOY, derive

    body = {k: v for k, v in {**info, **changes}.items() if k != "mac"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    body["mac"] = hmac.new(derive(SECRET, LMDEPLOY), text.encode(), hashlib.sha256).hexdigest()  # type: ignore[arg-type]
    return DistServeKVTransferEndpointInfo(protocol=MigrationProtocol.TCP, endpoint_info=json.dumps(body))


def test_a_signed_endpoint_is_taken_once_by_the_engine_it_is_for_from_the_engine_that_made_it_before_it_expires() -> (
    None
):
    """Once, as its engine's, by the engine it names, within ENDPOINT_TTL_S; the same text as three engines: refused."""
    prefill, decode, _src, _dst = _loopback_pair((SECRET, SECRET))
    try:
        for other in ("x", "y"):  # two more links on decode, to engines that did not make the endpoint
            decode.p2p_initialize(
                DistServeInitRequest(
                    local_engine_id="d",
                    local_engine_config=_cfg(D_BLOCKS),
                    remote_engine_id=other,
                    remote_engine_config=_cfg(P_BLOCKS),
                    protocol=MigrationProtocol.TCP,
                    rank=0,
                )
            )
        info = prefill.endpoint_info("d", MigrationProtocol.TCP)
        assert (info["engine"], info["for"]) == ("p", "d") and time.time() < info["expires"]
        conn = DistServeKVTransferEndpointInfo(protocol=MigrationProtocol.TCP, endpoint_info=json.dumps(info))
        for other in ("x", "y"):
            with pytest.raises(ProtocolError, match=rf"remote engine '{other}' was made by 'p' for 'd'.*misrouted"):
                decode.p2p_connect(other, conn)
        decode.p2p_connect("p", conn)  # its own engine, the one it is for: taken
        with pytest.raises(ProtocolError, match="taken before: True.*replayed"):
            decode.p2p_connect("p", conn)
        for changes in (
            {"nonce": "n" * 32, "expires": time.time() - 1},  # expired
            {"nonce": "m" * 32, "expires": time.time() + 3600},  # signed far ahead: refused too
            {"nonce": "o" * 32, "for": "x"},  # made for another engine
        ):
            with pytest.raises(ProtocolError, match="refused as misrouted, stale or replayed"):
                decode.p2p_connect("p", _resigned(info, **changes))
        decode.p2p_connect("p", _resigned(info, nonce="p" * 32))  # a fresh nonce, in time: taken
    finally:
        prefill.close()
        decode.close()


def test_an_engine_without_the_secret_is_refused_by_one_that_has_it() -> None:
    with pytest.raises(ProtocolError, match="'p' is unsigned"):
        _loopback_pair((None, SECRET))


def test_transport_failure_names_engine_and_instruct() -> None:
    prefill, decode, src, dst = _loopback_pair()
    try:
        batch = build_cache_pool_assignments(_pools(D_BLOCKS), _pools(P_BLOCKS), [(7, 3), (9, 4)])
        assignment = MigrationAssignment(protocol=MigrationProtocol.TCP, remote_engine_id="p", batch=batch)
        assert decode.links["p"].remote_engine_config.num_gpu_blocks == P_BLOCKS
        decode.transports["loopback"].inject(fail_completion=1)
        with pytest.raises(
            TransferFailed,
            match=r"remote engine 'p' failed: a batch of 6 instructs starting at "
            r"instruct #0 \(mr_key=0, source_offset=1536",
        ):
            asyncio.run(decode.p2p_migrate(assignment, async_op=True))
        asyncio.run(decode.p2p_migrate(assignment, async_op=True))  # the fault was one-shot
        got = dst.reshape(LAYERS, D_BLOCKS, BLOCK_BYTES)[:, 3]
        assert np.array_equal(got, src.reshape(LAYERS, P_BLOCKS, BLOCK_BYTES)[:, 7])
        # The documented callable: the kvbridge_transfer_* series, read by a real Prometheus parser.
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.parser import text_string_to_metric_families

        registry = CollectorRegistry()
        registry.register(decode.metrics.collector())
        samples = {
            (s.name, s.labels.get("reason")): s.value
            for f in text_string_to_metric_families(generate_latest(registry).decode())
            for s in f.samples
        }
        moved = 2 * LAYERS * BLOCK_BYTES  # two block pairs, every layer
        assert samples[("kvbridge_transfer_bytes_total", None)] == moved
        assert samples[("kvbridge_transfers_total", None)] == 1
        assert samples[("kvbridge_transfer_seconds_count", None)] == 1
        assert samples[("kvbridge_transfer_failures_total", "transfer")] == 1
        assert decode.metrics.snapshot()["transfers"][0]["bytes"] == moved
        # Under a transfer deadline, a failed batch is resubmitted once: the migration succeeds, a retry counted.
        decode.transports["loopback"].transfer_deadline_s = 10.0
        decode.transports["loopback"].inject(fail_completion=1)
        asyncio.run(decode.p2p_migrate(assignment, async_op=True))
        samples = {
            s.name: s.value
            for f in text_string_to_metric_families(generate_latest(registry).decode())
            for s in f.samples
            if s.name in ("kvbridge_transfer_retries_total", "kvbridge_transfers_total")
        }
        assert samples == {"kvbridge_transfer_retries_total": 1, "kvbridge_transfers_total": 2}
        assert decode.metrics.snapshot()["retries"] == [{"transport": "loopback", "peer": "p", "count": 1}]
    finally:
        prefill.close()
        decode.close()


def test_connect_refuses_a_foreign_endpoint() -> None:
    prefill, decode, _src, _dst = _loopback_pair()
    try:
        lmdeploy_style = json.dumps({"mr_info": {}, "session_id": "127.0.0.1:1234"})
        with pytest.raises(ProtocolError, match="remote engine 'p' did not send a kvbridge endpoint"):
            decode.p2p_connect(
                "p", DistServeKVTransferEndpointInfo(protocol=MigrationProtocol.TCP, endpoint_info=lmdeploy_style)
            )
        with pytest.raises(ConfigError, match="uses MigrationProtocol.RDMA"):
            decode.p2p_connect(
                "p", DistServeKVTransferEndpointInfo(protocol=MigrationProtocol.RDMA, endpoint_info="{}")
            )
        bad = [AssignmentInstruct(mr_key=0, source_offset=-8, target_offset=0, length=8)]
        with pytest.raises(InvalidDescriptor, match="instruct #0 .* negative offset"):
            asyncio.run(
                decode.p2p_migrate(MigrationAssignment(protocol=MigrationProtocol.TCP, remote_engine_id="p", batch=bad))
            )
    finally:
        prefill.close()
        decode.close()


# -- the bench mode ----------------------------------------------------------------------------


def test_engine_option_picks_the_lmdeploy_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    assert bench_cli.MODES["lmdeploy"] == "kvbridge_tools.bench.lmdeploy"
    # Only this mode's options: the parser must accept them beside the shared ones.
    monkeypatch.setattr(bench_cli, "MODES", {"lmdeploy": bench_cli.MODES["lmdeploy"]})
    parser = argparse.ArgumentParser()
    bench_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["bench", "--engine", "lmdeploy", "--model", "tiny-gqa", "--lmdeploy-pattern", "scattered", "--repeat", "2"]
    )
    assert bench_cli.pick_mode(args) == "lmdeploy"
    assert (args.lmdeploy_pattern, args.repeat, args.migration_backend) == ("scattered", 2, "mooncake")
    assert bench_cli.pick_mode(parser.parse_args(["bench"])) == "pair"


@pytest.mark.parametrize("pattern", lmdeploy_bench.PATTERNS)
def test_bench_block_pairs_fit_both_pools(pattern: str) -> None:
    pairs, p_total, d_total = lmdeploy_bench.block_pairs(pattern, blocks=16, requests=3)
    arr = np.asarray(pairs)
    assert p_total != d_total and len(arr) == 48
    assert len(set(arr[:, 0])) == 48 and len(set(arr[:, 1])) == 48  # no block used twice on a side
    assert arr[:, 0].max() < p_total and arr[:, 1].max() < d_total


@pytest.mark.slow
def test_bench_runs_verified_and_reports_both_strategies(capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(
        model="tiny-gqa",
        tokens=64,
        requests=2,
        migration_backend="mooncake",
        protocol=None,
        json=True,
        engine="lmdeploy",
        lmdeploy_pattern="contiguous",
        repeat=1,
    )
    assert lmdeploy_bench.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    strategies = [r["strategy"] for r in report["rows"]]
    assert strategies == ["kvbridge (sync)", "kvbridge (async)", "per-instruct (lmdeploy 0.18)"]
    assert all(r["verified"] and r["gbps_median"] > 0 for r in report["rows"])
    # 2 layers x 2 requests of 4 contiguous blocks: kvbridge merges each request's run per layer.
    assert report["rows"][0]["instructs"] == 16 and report["rows"][0]["descriptors"] == 4


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_a_stuck_transfer_times_out_naming_the_engine_once_its_read_no_longer_writes(async_op: bool) -> None:
    """The error comes once the late read ended: LMDeploy frees the blocks on it, and the read wrote them after."""
    prefill, decode, src, dst = _loopback_pair()
    decode.settings = attrs.evolve(decode.settings, timeout=0.05)
    try:
        batch = build_cache_pool_assignments(_pools(D_BLOCKS), _pools(P_BLOCKS), [(7, 3)])
        decode.transports["loopback"].inject(delay=1.0)  # the read starts 1 s after its submission
        with pytest.raises(TransferTimeout, match=r"engine 'p' failed: .*instruct #0 .* not finished within 0.05s"):
            asyncio.run(
                decode.p2p_migrate(
                    MigrationAssignment(protocol=MigrationProtocol.TCP, remote_engine_id="p", batch=batch),
                    async_op=async_op,
                )
            )
        landed = dst.reshape(LAYERS, D_BLOCKS, BLOCK_BYTES)[:, 3]
        assert np.array_equal(landed, src.reshape(LAYERS, P_BLOCKS, BLOCK_BYTES)[:, 7]), "written after the error"
    finally:
        prefill.close()
        decode.close()


def test_a_link_dropped_during_its_migration_keeps_its_peer_and_memory_until_the_reads_end() -> None:
    """LMDeploy may drop a link while a migration on it runs: the read must still land, and then nothing is held."""
    prefill, decode, src, dst = _loopback_pair()
    transport = decode.transports["loopback"]
    region = MemoryRegion(addr=dst.ctypes.data, length=dst.nbytes)
    errors: list[BaseException] = []
    try:
        batch = build_cache_pool_assignments(_pools(D_BLOCKS), _pools(P_BLOCKS), [(7, 3), (9, 5)])
        transport.inject(delay=2.0)  # the read starts 2 s after its submission

        def migrate() -> None:
            assignment = MigrationAssignment(protocol=MigrationProtocol.TCP, remote_engine_id="p", batch=batch)
            try:
                asyncio.run(decode.p2p_migrate(assignment))
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                errors.append(exc)

        migration = threading.Thread(target=migrate)
        migration.start()
        for _ in range(500):  # bounded: the submission comes within milliseconds
            if transport.submissions:
                break
            time.sleep(0.01)
        assert transport.submissions == 1
        moved = np.zeros_like(dst)  # the pool registered again elsewhere first: the read still lands in the old one
        _register_pool(decode, "p", moved)
        reregistered = {r.addr for r in transport.registered}
        decode.p2p_drop_connect("p")
        dropped = {r.addr for r in transport.registered}
        assert migration.is_alive(), "the migration ended within its 2 s hold: nothing above ran during it"
        assert "p" not in decode.links
        assert reregistered == dropped == {region.addr, moved.ctypes.data}, "unregistered under a read in flight"
        # LMDeploy's proxy links the pair again while the old read still runs: the new link's memory is its own
        _link_again(decode, prefill, dst)
        migration.join(10)
        assert not migration.is_alive() and errors == []
        for p_block, d_block in ((7, 3), (9, 5)):
            landed = dst.reshape(LAYERS, D_BLOCKS, BLOCK_BYTES)[:, d_block]
            assert np.array_equal(landed, src.reshape(LAYERS, P_BLOCKS, BLOCK_BYTES)[:, p_block])
        assert [r.addr for r in transport.registered] == [region.addr], "the new link's memory went with the old one"
        decode.p2p_drop_connect("p")
        assert transport.registered == ()
        again = MigrationAssignment(protocol=MigrationProtocol.TCP, remote_engine_id="p", batch=batch)
        with pytest.raises(ConfigError, match="no link to remote engine 'p'.*call p2p_initialize"):
            asyncio.run(decode.p2p_migrate(again))
    finally:
        prefill.close()
        decode.close()


def _register_pool(backend: KVBridgeLMDeployBackend, remote: str, arr: np.ndarray) -> None:
    """`arr` as the backend's cache pool 0 for its link to `remote`, as LMDeploy's CacheEngine registers a pool."""
    pool = {"mr_key": 0, "addr": arr.ctypes.data, "offset": 0, "length": arr.nbytes}
    backend.register_memory_region(
        DistServeRegisterMRMessage(protocol=MigrationProtocol.TCP, remote_engine_id=remote, **pool)
    )


def _link_again(decode: KVBridgeLMDeployBackend, prefill: KVBridgeLMDeployBackend, dst: np.ndarray) -> None:
    decode.p2p_initialize(
        DistServeInitRequest(
            local_engine_id="d",
            local_engine_config=_cfg(D_BLOCKS),
            remote_engine_id="p",
            remote_engine_config=_cfg(P_BLOCKS),
            protocol=MigrationProtocol.TCP,
            rank=0,
        )
    )
    _register_pool(decode, "p", dst)
    info = json.dumps(prefill.endpoint_info("d", MigrationProtocol.TCP))
    decode.p2p_connect("p", DistServeKVTransferEndpointInfo(protocol=MigrationProtocol.TCP, endpoint_info=info))


def test_settings_come_from_the_environment() -> None:
    s = AdapterSettings.from_env(
        {
            "KVBRIDGE_LMDEPLOY_TRANSPORT": "tcp",
            "KVBRIDGE_LMDEPLOY_HOSTNAME": "10.0.0.7",
            "KVBRIDGE_LMDEPLOY_DEVICES": "mlx5_0, mlx5_1",
            "KVBRIDGE_LMDEPLOY_TIMEOUT": "0",
            "LMDEPLOY_USE_ASYNC_MIGRATION": "1",
        }
    )
    assert (s.transport, s.hostname, s.timeout, s.async_migration) == ("tcp", "10.0.0.7", None, True)
    assert [s.device_for(r) for r in range(3)] == ["mlx5_0", "mlx5_1", "mlx5_0"]
    assert AdapterSettings.from_env({}).transport == "mooncake"
    for bad in ("soon", "nan"):  # NaN was taken, a wait that neither waits nor ends
        with pytest.raises(ConfigError, match=f"KVBRIDGE_LMDEPLOY_TIMEOUT='{bad}' is not a number"):
            AdapterSettings.from_env({"KVBRIDGE_LMDEPLOY_TIMEOUT": bad})
    assert AdapterSettings.from_env({"KVBRIDGE_LMDEPLOY_TIMEOUT": "inf"}).timeout is None  # forever, as 0 says
    # on/off: "0" was on (any value was) and "on" left the network untrusted; a value that is neither is refused
    flags = {"LMDEPLOY_USE_ASYNC_MIGRATION": "0", "KVBRIDGE_LMDEPLOY_INSECURE": "on"}
    flagged = AdapterSettings.from_env(flags)
    assert (flagged.async_migration, flagged.insecure) == (False, True)
    for name in flags:
        with pytest.raises(ConfigError, match=f"{name}='enabled': set it to 1 .* or 0"):
            AdapterSettings.from_env({name: "enabled"})


def test_a_protocol_the_transport_lacks_says_how_to_fix_it() -> None:
    backend = KVBridgeLMDeployBackend(AdapterSettings(transport="tcp", hostname="127.0.0.1"))
    with pytest.raises(ConfigError, match="MigrationProtocol.RDMA; set KVBRIDGE_LMDEPLOY_PROTOCOL"):
        backend.p2p_initialize(
            DistServeInitRequest(
                local_engine_id="d",
                local_engine_config=_cfg(4),
                remote_engine_id="p",
                remote_engine_config=_cfg(4),
                protocol=MigrationProtocol.RDMA,
                rank=0,
            )
        )
    backend.close()


def test_the_backends_metrics_use_the_session_recorder_stay_bounded_and_sum_what_was_recorded() -> None:
    from kvbridge.adapters.lmdeploy.metrics import FOLD_EVERY, TransferMetrics
    from kvbridge.session.metrics import TransferRecord

    metrics = TransferMetrics()
    assert isinstance(metrics, TransferRecord)  # one recorder for both adapters
    for i in range(1000):
        metrics.record("tcp", "p", 0.001 * (i % 7), 0.0, 10, 2)
    for _ in range(300):
        metrics.record_failure("tcp", "p", TransferTimeout("stuck"))
    metrics.record_retries("tcp", "p", 3)
    assert sum(map(len, metrics.data.values())) < FOLD_EVERY  # a long-lived engine does not grow a list
    snap = metrics.snapshot()
    assert snap["transfers"] == [
        {
            "transport": "tcp",
            "peer": "p",
            "bytes": 10_000,
            "descriptors": 2000,
            "count": 1000,
            "seconds_sum": pytest.approx(sum(0.001 * (i % 7) for i in range(1000))),
        }
    ]
    assert snap["failures"] == [{"transport": "tcp", "peer": "p", "reason": "timeout", "count": 300}]
    assert snap["retries"] == [{"transport": "tcp", "peer": "p", "count": 3}]
