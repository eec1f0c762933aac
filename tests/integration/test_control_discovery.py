"""Discovery with real servers: redis and etcd, on 127.0.0.1 and on a host of their own.

The servers start on free ports and are stopped by PID; on a host of their own (network namespaces) the ranks are
on others. Also: the same etcd serving as Mooncake's metadata server while kvbridge's registry uses it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
from control_helpers import etcd_server, rank_info, redis_server, wait_for

from kvbridge.base import wire
from kvbridge.base.errors import ConfigError, PeerGone, TransferTimeout
from kvbridge.control import (
    ControlClient,
    ControlServer,
    DiscoveryRegistry,
    EtcdRegistry,
    KVTransferParams,
    RankRecord,
    RedisRegistry,
    open_registry,
    resolve,
)
from kvbridge_tools.harness.ports import free_port
from kvbridge_tools.harness.proc import Child

HERE = Path(__file__).parents[1]  # tests/: the helpers beside the tiers


@pytest.fixture(params=["redis", "etcd"])
def registry(request: pytest.FixtureRequest) -> Iterator[DiscoveryRegistry]:
    url = request.getfixturevalue(f"{request.param}_url")
    reg = open_registry(url)
    assert isinstance(reg, RedisRegistry if request.param == "redis" else EtcdRegistry)
    yield reg
    reg.close()


def test_registry_publish_lookup_ranks_remove(registry: DiscoveryRegistry) -> None:
    engine = f"engine-{os.getpid()}-{id(registry)}"
    registry.publish(RankRecord(engine, 1, "127.0.0.1", 7001, ready=False))
    registry.publish(RankRecord(engine, 0, "127.0.0.1", 7000, ready=True, meta={"tp": "2"}))
    registry.publish(RankRecord(engine + "-other", 0, "127.0.0.1", 9000))
    found = registry.lookup(engine, 0)
    assert found is not None and time.time() < found.expires <= time.time() + registry.rank_ttl_s
    assert attrs.evolve(found, expires=0.0) == RankRecord(engine, 0, "127.0.0.1", 7000, True, {"tp": "2"})
    assert [r.rank for r in registry.ranks(engine)] == [0, 1]
    registry.publish(RankRecord(engine, 1, "127.0.0.1", 7001, ready=True))  # replaces
    assert registry.lookup(engine, 1).ready
    registry.remove(engine, 1)
    registry.remove(engine, 1)  # idempotent
    assert registry.lookup(engine, 1) is None and [r.rank for r in registry.ranks(engine)] == [0]
    assert registry.lookup("nobody", 0) is None


def test_rank_records_expire_unless_renewed_and_one_under_another_key_is_ignored(
    registry: DiscoveryRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    """A rank's record lives `rank_ttl_s` past its last renewal (store, MAC); a copy at another rank's key is not it."""
    engine, secret = f"ttl-{id(registry)}", secrets.token_hex(16)
    ours = open_registry(registry.url, secret=secret)
    ours.rank_ttl_s = 1.5
    reader = open_registry(registry.url, secret=secret)
    try:
        ours.publish(RankRecord(engine, 0, "127.0.0.1", 7000, ready=True))
        first = reader.lookup(engine, 0)
        assert first is not None and first.expires <= time.time() + 1.5
        wait_for(lambda: time.time() > first.expires + 1, what="the first record's time to live to pass")
        renewed = reader.lookup(engine, 0)
        assert renewed is not None and renewed.expires > first.expires  # the publisher renews it
        # a signed record copied to rank 1's key, and an old signed one written back at its own key
        copy = ours._get(f"kvbridge/ranks/{engine}/0")
        assert copy is not None
        ours._put(f"kvbridge/ranks/{engine}/1", copy, 60)
        stale = ours.sealer.seal(RankRecord(engine, 2, "127.0.0.1", 7002, ready=True, expires=time.time() - 1))
        ours._put(f"kvbridge/ranks/{engine}/2", wire.encode(stale), 60)
        with caplog.at_level(logging.WARNING, logger="kvbridge.control.discovery"):
            assert reader.lookup(engine, 1) is None and reader.lookup(engine, 2) is None
            assert [r.rank for r in reader.ranks(engine)] == [0]
        assert f"record of kvbridge/ranks/{engine}/0 (copied to another key)" in caplog.text
        ours.close()  # the rank dies without withdrawing: its record goes with its time to live
        wait_for(lambda: reader.lookup(engine, 0) is None, timeout=30, what="the dead rank's record to expire")
    finally:
        for rank in (0, 1, 2):
            reader.remove(engine, rank)
        ours.close()
        reader.close()


def test_registry_server_announces_readiness_and_withdraws(registry: DiscoveryRegistry) -> None:
    engine = f"prefill-{id(registry)}"
    server = ControlServer(engine, 0, registry=registry)
    try:
        record = registry.lookup(engine, 0)
        assert record is not None and not record.ready and record.address == server.address
        with pytest.raises(TransferTimeout, match="registered but not ready"):
            registry.wait_ready(engine, 0, timeout_s=0.2)
        server.register(rank_info(engine, 0, endpoint=b"E"))
        params = KVTransferParams(do_remote_prefill=True, remote_engine_id=engine, remote_request_id="r")
        addr = resolve(params, 0, registry=registry, wait_s=5)
        assert addr == server.address
        with ControlClient(*addr) as client:
            assert client.get_info().endpoint == b"E"
    finally:
        server.close()
    assert registry.lookup(engine, 0) is None
    with pytest.raises(TransferTimeout, match="not registered"):
        registry.wait_ready(engine, 0, timeout_s=0.2)


def test_registry_unreachable_is_a_clear_error() -> None:
    port = free_port(span=1)
    for url in (f"redis://127.0.0.1:{port}", f"etcd://127.0.0.1:{port}"):
        reg = open_registry(url)
        with pytest.raises(PeerGone, match="check that (redis|etcd) is running"):
            reg.lookup("e", 0)
        with pytest.raises(PeerGone):
            ControlServer("e", 0, registry=reg)  # a server that cannot announce itself does not start
        reg.close()


def test_registry_urls() -> None:
    assert open_registry(None) is None and open_registry("p2p") is None and open_registry("P2PHANDSHAKE") is None
    with pytest.raises(ConfigError, match="unknown registry URL"):
        open_registry("zookeeper://127.0.0.1:2181")
    params = KVTransferParams(remote_engine_id="e", remote_request_id="r", remote_host="10.0.0.1", remote_port=5600)
    assert resolve(params, 3) == ("10.0.0.1", 5603)  # peer-to-peer: base port + rank
    with pytest.raises(ConfigError, match="remote_host"):
        resolve(KVTransferParams(), 0)


@pytest.mark.slow
@pytest.mark.parametrize("store", ["etcd", "redis"])
def test_discovery_across_hosts_finds_the_prefill_rank_and_pulls(
    hosts_factory,
    tmp_path: Path,
    store: str,  # noqa: ANN001
) -> None:
    """Three hosts: the registry on one, a prefill and a decode rank on the others, the side channel authenticated.

    The decode rank finds the prefill rank through the registry and pulls fingerprinted KV across hosts. With etcd,
    Mooncake keeps its segment metadata in the same etcd; with redis (which this Mooncake wheel cannot use for its
    metadata) Mooncake does its own peer-to-peer handshake.
    """
    hosts = hosts_factory(["metadata", "prefill", "decode"])
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH", "")])),
        "GLOG_minloglevel": "2",
    }
    secret = secrets.token_hex(16)
    children = []
    with contextlib.ExitStack() as stack:
        server = etcd_server if store == "etcd" else redis_server
        url = stack.enter_context(server(tmp_path, host=hosts["metadata"]))
        stack.callback(lambda: [c.close() for c in children])
        for role in ("prefill", "decode"):
            host = hosts[role]
            child = Child("control_rank", env={**env, "KVBRIDGE_SECRET": secret}, name=role, prefix=host.command([]))
            children.append(child)
            child.call(
                "setup",
                role=role,
                engine_id=f"{role}-{store}",
                rank=0,
                parallel="tp1",
                kv_heads=2,
                blocks=4,
                metadata_server=url if store == "etcd" else None,
                hostname=f"{host.address}:{free_port(span=1)}" if store == "etcd" else host.address,
                registry=url,
                host=host.address,
                secret=secret,
            )
        prefill, decode = children
        prefill.call("register")
        decode.call("register")
        rid = f"r-{store}"
        prefill.call("offer", request_id=rid, blocks=[3, 1], tokens=32)  # count left to the decode side
        # No host or port in the params: the registry says where the prefill rank is.
        params = KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=f"prefill-{store}",
            remote_request_id=rid,
            remote_block_ids=[[3, 1]],
            tp_size=1,
            remote_num_tokens=32,
        ).to_dict()
        assert decode.call("read", request_id=rid, params=params, local_blocks=[0, 2])["pulled"] == [0]
        assert decode.call("verify", local_blocks=[0, 2], tokens=32) > 0
        assert decode.call("done", request_id=rid, params=params) == [True]
        assert prefill.call("released") == [[rid, "released", [3, 1]]]
        with hosts["metadata"].entered():
            registry = open_registry(url)
            assert [r.engine_id for r in registry.ranks(f"prefill-{store}")] == [f"prefill-{store}"]
            if store == "etcd":
                etcd = EtcdRegistry(url)
                mooncake_keys = etcd._post(
                    "kv/range",
                    {"key": etcd._b64("mooncake/"), "range_end": etcd._b64("mooncake0"), "count_only": True},
                )
                assert int(mooncake_keys.get("count", 0)) > 0, "Mooncake keeps its segment metadata in the same etcd"
        for c in children:
            c.call("close")


@pytest.mark.parametrize("password", ["s3cret-pass", "p%40ss%3Aw0rd", "pw"])
def test_registry_errors_never_name_the_password_in_its_url(password: str) -> None:
    port = free_port(span=1)
    for url in (f"redis://:{password}@127.0.0.1:{port}/0", f"redis://user:{password}@127.0.0.1:{port}"):
        reg = open_registry(url)
        try:
            with pytest.raises(PeerGone) as err:
                reg.lookup("e", 0)
            assert password not in str(err.value) and password not in err.value.peer
            assert "***@127.0.0.1" in str(err.value)
        finally:
            reg.close()
    for url in (f"etcd://user:{password}@127.0.0.1:{port}", f"zookeeper://:{password}@127.0.0.1:2181"):
        with pytest.raises((PeerGone, ConfigError)) as err:
            reg = open_registry(url)
            try:
                reg.lookup("e", 0)  # type: ignore[union-attr]
            finally:
                reg.close()  # type: ignore[union-attr]
        assert password not in str(err.value)
