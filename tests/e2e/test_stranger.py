"""A stranger on another host, holding no secret, against every transport that runs here.

Four namespace hosts: a prefill serving a patterned buffer behind a transport and an authenticated side
channel, a relay, a decode holding the secret, and a stranger who knows the transport endpoint (an observer saw it
go by) and uses the transport's own library, or plain sockets. With the default configuration the
decode reads the buffer and the stranger can neither read it, write it, connect to the transport's
ports (Mooncake and NIXL: `kvbridge.transport.netguard`), pass the tcp transport's handshake, nor get the layout
from the side channel. Also with the transport on hostname 127.0.0.1, where Mooncake and UCX still
listen on every interface. With the trust option (`insecure=True`), what docs/security.md says: anyone
who reaches the ports reads registered memory (over `tcp`, with the token the endpoint carries, which
an insecure side channel serves to anyone).

Admission follows proof of the peer, not of a packet: a stranger replaying every frame it recorded to every
rank, or a relay that a request named as the side channel, is never admitted (a Mooncake and a NIXL read of
registered memory from its host lands 0 bytes), and a decode admitted for its lease is dropped again once
the lease ended and the grace passed.
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

PEERS = str(Path(__file__).parents[1] / "peers")
SIZE = 1 << 20
TRANSPORTS = ["mooncake", "nixl", "tcp"]
GUARDED = ["mooncake", "nixl"]  # they authenticate nobody themselves


@pytest.fixture(scope="module")
def hosts(module_hosts_factory: Callable[..., Hosts]) -> Hosts:
    hosts = module_hosts_factory(["prefill", "decode", "stranger", "relay"])
    # A dropped SYN is retried for about two minutes by default; one retry bounds every blocked connect.
    for name in ("stranger", "relay", "decode"):
        hosts[name].run(["sysctl", "-q", "-w", "net.ipv4.tcp_syn_retries=1"])
    return hosts


def _env(secret: str | None) -> dict[str, str]:
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [PEERS, os.environ.get("PYTHONPATH")]))}
    env["KVBRIDGE_SECRET"] = secret or ""
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
            prefill.call("offer", request_id="r")
            pulled = _pull(hosts, decode, backend, host, port, secret, "r")
            assert pulled["digest"] == served["digest"], "the decode, holding the secret, must read the buffer"
        answer = stranger.call("stranger_side_channel", host=host, port=port)
        assert "refused" in answer.lower() and "layout" not in answer.lower() and "KVLayout" not in answer, answer
        _assert_stranger_got_nothing(stranger, hosts, backend, served, prefill)
    finally:
        prefill.close()


def _pull(
    hosts: Hosts, decode: Child, backend: str, host: str, port: int, secret: str, rid: str, **options: Any
) -> dict:
    return decode.call(
        "pull",
        backend=backend,
        hostname=hosts["decode"].address,
        host=host,
        port=port,
        secret=secret,
        options=options,
        request_id=rid,
    )


def _read_nothing(who: Child, hosts: Hosts, backend: str, endpoint: str) -> None:
    """`who` reads the registered memory `endpoint` names with the transport's own library: 0 bytes land."""
    name = who.name
    read = who.call(
        "stranger_library",
        backend=backend,
        hostname=hosts[name].address,
        endpoint=endpoint,
        op="read",
        size=SIZE,
        timeout=180,
    )
    assert read["untouched"] and read["rc"] != 0, f"{name} read registered memory: {read}"


@pytest.mark.parametrize("backend", GUARDED)
def test_a_stranger_replaying_every_recorded_frame_to_every_rank_is_never_admitted(
    hosts: Hosts, stranger: Child, secret: str, backend: str
) -> None:
    prefill, served = _serve(hosts, backend, secret)
    try:
        with _child(hosts, "decode", secret) as decode:
            prefill.call("offer", request_id="r")
            pulled = _pull(hosts, decode, backend, *served["side_channel"], secret, "r")
            assert pulled["digest"] == served["digest"]
            decode.call("finish", request_id="r")
            # requests and replies: a GetInfo (to no rank), a BeginPull and a DONE for the prefill, its replies
            frames = prefill.call("recorded")
            answers = stranger.call(
                "stranger_replay", frames=frames, targets=[served["side_channel"], pulled["side_channel"]]
            )
            assert "unanswered" not in answers, answers
            for side in (prefill, decode):
                assert hosts["stranger"].address not in side.call("admitted"), side.name
            for endpoint in (served["endpoint"], pulled["endpoint"]):
                _read_nothing(stranger, hosts, backend, endpoint)
    finally:
        prefill.close()


@pytest.mark.parametrize("backend", GUARDED)
def test_a_relay_named_as_the_side_channel_is_never_admitted(hosts: Hosts, secret: str, backend: str) -> None:
    prefill, served = _serve(hosts, backend, secret)
    try:
        with _child(hosts, "decode", secret) as decode, _child(hosts, "relay", None) as relay:
            port = relay.call(
                "relay", listen=hosts["relay"].address, host=served["side_channel"][0], port=served["side_channel"][1]
            )
            prefill.call("offer", request_id="r")
            pulled = _pull(hosts, decode, backend, hosts["relay"].address, port, secret, "r")
            assert pulled["digest"] == served["digest"], "a pull through a relay reads the transport directly"
            for side in (prefill, decode):
                assert hosts["relay"].address not in side.call("admitted"), side.name
            for endpoint in (served["endpoint"], pulled["endpoint"]):
                _read_nothing(relay, hosts, backend, endpoint)
    finally:
        prefill.close()


def test_an_admission_ends_when_the_last_lease_ended_and_the_grace_passed(hosts: Hosts, secret: str) -> None:
    prefill, served = _serve(hosts, "mooncake", secret, admit_grace=1.0)
    decode_host = hosts["decode"].address
    try:
        with _child(hosts, "decode", secret) as decode:
            prefill.call("offer", request_id="r")
            _pull(hosts, decode, "mooncake", *served["side_channel"], secret, "r")
            dial = {"host": hosts["prefill"].address, "ports": served["ports"], "connect_timeout": 2.0}
            assert set(decode.call("stranger_dial", **dial).values()) == {"connected"}, "admitted while it reads"
            decode.call("finish", request_id="r")  # the lease is released: its last DONE
            assert prefill.call("wait_unadmitted", host=decode_host, within=60.0), prefill.call("admitted")
            assert "connected" not in decode.call("stranger_dial", **dial).values(), "admitted after its lease"
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
            assert pulled["digest"] == served["digest"], "idle strangers locked a decode holding the secret out"
            decode.call("tcp_handshake_begin", host=address, port=port)
            assert stranger.call("stranger_idle", host=address, port=port, count=300) == 600
            assert decode.call("tcp_handshake_finish", secret=secret), (
                "the stranger's flood evicted a decode's handshake"
            )
    finally:
        stranger.call("stranger_release")
        prefill.close()
