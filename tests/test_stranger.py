"""A stranger on another host, holding no secret, against every transport that runs here.

Three namespace hosts: a prefill serving a patterned buffer behind a transport and an authenticated side
channel, a decode holding the secret, and a stranger who knows the transport endpoint (an observer saw it
go by) and uses the transport's own library, or plain sockets. With the default configuration the
decode reads the buffer and the stranger can neither read it, write it, connect to the transport's
ports (Mooncake and NIXL: `kvbridge.netguard`), pass the tcp transport's handshake, nor get the layout
from the side channel. Also with the transport on hostname 127.0.0.1, where Mooncake and UCX still
listen on every interface. With the trust option (`insecure=True`), what docs/security.md says: anyone
who reaches the ports reads registered memory (over `tcp`, with the token the endpoint carries, which
an insecure side channel serves to anyone).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbridge_tools.harness.hosts import Hosts
from kvbridge_tools.harness.proc import Child

PEERS = str(Path(__file__).parent / "peers")
SIZE = 1 << 20
TRANSPORTS = ["mooncake", "nixl", "tcp"]
GUARDED = ["mooncake", "nixl"]  # they authenticate nobody themselves


@pytest.fixture(scope="module")
def hosts(module_hosts_factory: Callable[..., Hosts]) -> Hosts:
    hosts = module_hosts_factory(
        ["prefill", "decode", "stranger"],
    )
    # A dropped SYN is retried for about two minutes by default; one retry bounds every blocked connect.
    hosts["stranger"].run(["sysctl", "-q", "-w", "net.ipv4.tcp_syn_retries=1"])
    return hosts


def _env(secret: str | None) -> dict[str, str]:
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [PEERS, os.environ.get("PYTHONPATH")]))}
    env["KVBRIDGE_SECRET"] = secret or ""
    # These hosts share one machine's memory, which real hosts do not: held to TCP, UCX cannot take a
    # shared-memory path around the network (docs/hosts.md).
    env["UCX_TLS"] = "tcp"
    return env


def _child(hosts: Hosts, host: str, secret: str | None) -> Child:
    return Child("host_peer", env=_env(secret), name=host, prefix=hosts[host].command([]))


@pytest.fixture
def secret() -> str:
    return secrets.token_hex(16)


@pytest.fixture
def stranger(hosts: Hosts) -> Iterator[Child]:
    with _child(hosts, "stranger", None) as child:
        yield child


def _serve(
    hosts: Hosts, backend: str, secret: str | None, *, hostname: str | None = None, **options: Any
) -> tuple[Child, dict]:
    prefill = _child(hosts, "prefill", secret)
    served = prefill.call(
        "serve_buffer",
        backend=backend,
        hostname=hostname or hosts["prefill"].address,
        size=SIZE,
        seed=7,
        options=options,
        secret=secret,
    )
    return prefill, served


def _assert_stranger_got_nothing(
    stranger: Child, hosts: Hosts, backend: str, served: dict, prefill: Child, target: str | None = None
) -> None:
    address = hosts["stranger"].address
    if backend in GUARDED:
        dialed = stranger.call(
            "stranger_dial", host=hosts["prefill"].address, ports=served["ports"], connect_timeout=2.0
        )
        assert served["ports"] and "connected" not in dialed.values(), dialed
    read = stranger.call(
        "stranger_library",
        backend=backend,
        hostname=address,
        endpoint=served["endpoint"],
        op="read",
        size=SIZE,
        address=target,
        timeout=180,
    )
    assert read["digest"] != served["digest"], f"the stranger read the buffer: {read}"
    assert read["rc"] != 0, read
    wrote = stranger.call(
        "stranger_library",
        backend=backend,
        hostname=address,
        endpoint=served["endpoint"],
        op="write",
        size=SIZE,
        address=target,
        timeout=180,
    )
    assert wrote["rc"] != 0, wrote
    assert prefill.call("digest") == served["digest"], "the stranger wrote into registered memory"


@pytest.mark.parametrize("backend", TRANSPORTS)
def test_a_stranger_on_another_host_reads_nothing_writes_nothing_and_learns_no_layout(
    hosts: Hosts, stranger: Child, secret: str, backend: str
) -> None:
    prefill, served = _serve(hosts, backend, secret)
    try:
        with _child(hosts, "decode", secret) as decode:
            host, port = served["side_channel"]
            pulled = decode.call(
                "pull",
                backend=backend,
                hostname=hosts["decode"].address,
                host=host,
                port=port,
                secret=secret,
                options={},
            )
            assert pulled == served["digest"], "the decode, holding the secret, must read the buffer across hosts"
        answer = stranger.call("stranger_side_channel", host=host, port=port)
        assert "refused" in answer.lower() and "layout" not in answer.lower() and "KVLayout" not in answer, answer
        _assert_stranger_got_nothing(stranger, hosts, backend, served, prefill)
    finally:
        prefill.close()


@pytest.mark.parametrize("backend", GUARDED)
def test_a_transport_on_loopback_is_closed_to_other_hosts_although_it_listens_on_every_interface(
    hosts: Hosts, stranger: Child, backend: str
) -> None:
    prefill, served = _serve(hosts, backend, None, hostname="127.0.0.1")
    try:
        dialed = stranger.call(
            "stranger_dial", host=hosts["prefill"].address, ports=served["ports"], connect_timeout=2.0
        )
        assert served["ports"] and "connected" not in dialed.values(), dialed
        # Mooncake's endpoint names 127.0.0.1; the stranger dials the host's address instead, as an attacker
        # would (NIXL's metadata lists every interface's address already).
        port = served["endpoint_address"].rsplit(":", 1)[-1]
        target = f"{hosts['prefill'].address}:{port}" if backend == "mooncake" else None
        _assert_stranger_got_nothing(stranger, hosts, backend, served, prefill, target)
    finally:
        prefill.close()


@pytest.mark.parametrize("backend", TRANSPORTS)
def test_the_trust_option_opens_the_listeners_to_anyone_as_documented(
    hosts: Hosts, stranger: Child, backend: str
) -> None:
    prefill, served = _serve(hosts, backend, None, insecure=True)
    try:
        dialed = stranger.call(
            "stranger_dial", host=hosts["prefill"].address, ports=served["ports"], connect_timeout=2.0
        )
        assert "connected" in dialed.values(), dialed  # UCX also listens on 127.0.0.1, which no other host reaches
        read = stranger.call(
            "stranger_library",
            backend=backend,
            hostname=hosts["stranger"].address,
            endpoint=served["endpoint"],
            op="read",
            size=SIZE,
            timeout=180,
        )
        assert read["rc"] == 0 and read["digest"] == served["digest"], read
    finally:
        prefill.close()


def test_idle_strangers_on_another_host_do_not_lock_a_peer_holding_the_secret_out_of_the_tcp_transport(
    hosts: Hosts, stranger: Child, secret: str
) -> None:
    """Issue 44 (10): 300 idle connections from a stranger filled the tcp transport's handshake slots.

    A fresh decode still reads the buffer byte for byte, and a decode's handshake in flight when 300 more come
    survives them (the stranger's own connections are evicted first).
    """
    prefill, served = _serve(hosts, "tcp", secret)
    try:
        address, port = hosts["prefill"].address, served["ports"][0]
        with _child(hosts, "decode", secret) as decode:
            assert stranger.call("stranger_idle", host=address, port=port, count=300) == 300
            host, side = served["side_channel"]
            pulled = decode.call(
                "pull", backend="tcp", hostname=hosts["decode"].address, host=host, port=side, secret=secret, options={}
            )
            assert pulled == served["digest"], "idle strangers locked a decode holding the secret out"
            decode.call("tcp_handshake_begin", host=address, port=port)
            assert stranger.call("stranger_idle", host=address, port=port, count=300) == 600
            assert decode.call("tcp_handshake_finish", secret=secret), (
                "the stranger's flood evicted a decode's handshake"
            )
    finally:
        stranger.call("stranger_release")
        prefill.close()
