"""The listener guard: the socket filter admits exactly the admitted sources, in the kernel too.

The BPF program is checked two ways: run by a small interpreter of the classic BPF instructions it uses
over hypothesis-drawn packets (accepted iff the source is in an admitted network), and attached by the
kernel to real listening sockets on loopback. Across hosts: tests/e2e/test_stranger.py.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import shutil
import socket
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge import create_backend
from kvbridge.base.errors import ConfigError
from kvbridge.transport import netguard
from kvbridge.transport.netguard import GuardOptions, filter_program

NET = 0x100000  # SKF_NET_OFF: the interpreter's packet starts at the network header


def run_bpf(program: list[tuple[int, int, int, int]], packet: bytes) -> int:
    """The program's verdict on an IP packet (the instructions filter_program emits, nothing else)."""
    a, pc, mem, ran = 0, 0, [None] * 16, 0
    for ran in range(len(program) + 1):  # noqa: B007 - no backward jumps: each instruction runs at most once
        op, jt, jf, k = program[pc]
        k &= 0xFFFFFFFF  # as the kernel gets it
        pc += 1
        if op == 0x06:
            run_bpf.ran = ran + 1  # type: ignore[attr-defined]
            return k
        if op == 0x02:
            mem[k] = a
            continue
        if op == 0x60:
            assert mem[k] is not None, "a scratch word loaded before it was stored"
            a = mem[k]
            continue
        if op in (0x20, 0x30):
            off = k - (1 << 32) + NET  # every load is relative to the network header (a negative offset)
            assert 0 <= off < len(packet), f"load outside the IP header at {off}"
            size = 4 if op == 0x20 else 1
            a = int.from_bytes(packet[off : off + size], "big")
        elif op == 0x74:
            a >>= k
        elif op == 0x54:
            a &= k
        elif op == 0x15:
            pc += jt if a == k else jf
        elif op == 0x35:
            pc += jt if a >= k else jf
        elif op == 0x05:
            pc += k
        else:
            raise AssertionError(f"unexpected BPF instruction {op:#x}")
    raise AssertionError("the program ran off its end")


def packet(src: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bytes:
    if src.version == 4:
        return bytes([0x45, 0]) + b"\0" * 10 + src.packed + b"\x7f\0\0\x01"
    return bytes([0x60]) + b"\0" * 7 + src.packed + ipaddress.IPv6Address("::1").packed


v4 = st.integers(0, 2**32 - 1).map(ipaddress.IPv4Address)
v6 = st.integers(0, 2**128 - 1).map(ipaddress.IPv6Address)
addresses = st.one_of(v4, v6)
networks = st.one_of(
    st.tuples(v4, st.integers(0, 32)).map(lambda t: ipaddress.ip_network(f"{t[0]}/{t[1]}", strict=False)),
    st.tuples(v6, st.integers(0, 128)).map(lambda t: ipaddress.ip_network(f"{t[0]}/{t[1]}", strict=False)),
)


# Hosts close together (shared prefixes: the tree's IPv6 levels branch) and networks of any prefix.
near6 = st.integers(0, 2**20).map(lambda i: ipaddress.IPv6Address((0xFD00 << 112) + (i << (i % 100))))
hosts = st.one_of(v4, v6, near6, st.integers(0, 300).map(lambda i: ipaddress.IPv4Address(0x0A000000 + i)))


@settings(max_examples=300, deadline=None)
@given(
    nets=st.lists(networks, max_size=6),
    admitted=st.lists(hosts, max_size=60),
    probes=st.lists(st.one_of(addresses, hosts), min_size=1, max_size=6),
)
def test_the_filter_accepts_exactly_the_admitted_networks(nets: list, admitted: list, probes: list) -> None:
    nets = nets + [ipaddress.ip_network(a) for a in admitted]
    program = filter_program(nets)
    # a probe inside each network, its neighbours, and the drawn ones
    inside = [n.network_address + (int(n.num_addresses) - 1) // 2 for n in nets]
    around = [a + d for a in admitted for d in (-1, 1) if 0 <= int(a) + d < 2 ** (a.max_prefixlen)]
    for addr in [*probes, *inside, *around]:
        want = any(addr in n for n in nets if n.version == addr.version)
        verdict = run_bpf(program, packet(addr))
        assert (verdict != 0) == want, (addr, nets)


@pytest.mark.parametrize("version", [4, 6])
def test_a_packet_runs_a_number_of_instructions_that_grows_with_the_log_of_the_hosts(version: int) -> None:
    ran = []
    for count in (10, 100, 1000):
        program = filter_program([ipaddress.ip_network(a) for a in netguard.example_hosts(version, count)])
        probe = netguard.example_hosts(version, count)[-1]  # the last of the sorted ones is as deep as any
        assert run_bpf(program, packet(probe)) != 0
        ran.append(max(run_bpf.ran, 1))  # type: ignore[attr-defined]
    # a linear filter ran ~3 (IPv4) and ~9 (IPv6) instructions per host before its match
    assert ran[2] < 60 and ran[2] - ran[1] < 3 * (ran[1] - ran[0] + 8), ran


def test_this_kernel_takes_1000_ipv4_and_300_ipv6_hosts_in_one_filter() -> None:
    nets = [*netguard._LOOPBACK, *(ipaddress.ip_network(a) for a in netguard.example_hosts(4, 1000))]
    nets += [ipaddress.ip_network(a) for a in netguard.example_hosts(6, 300)]
    assert len(filter_program(nets)) <= netguard.BPF_MAXINSNS
    assert netguard.filter_fits(nets), "the kernel refused 1,000 IPv4 and 300 IPv6 hosts (docs/security.md)"


def _listener() -> socket.socket:
    sock = socket.create_server(("127.0.0.1", 0))
    sock.settimeout(5)
    return sock


def _connects(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except TimeoutError:
        return False


def test_the_kernel_drops_connections_from_sources_not_admitted_and_admits_them_once_listed() -> None:
    server = _listener()
    try:
        port = server.getsockname()[1]
        fd = server.fileno()
        netguard._attach(fd, filter_program([ipaddress.ip_network("198.51.100.0/24")]))
        assert not _connects(port), "a loopback source was not admitted, yet it connected"
        netguard._attach(fd, filter_program([ipaddress.ip_network("127.0.0.0/8")]))
        assert _connects(port)
    finally:
        server.close()


def test_a_guard_finds_the_listeners_a_library_opens_and_not_kvbridges_own() -> None:
    guard = netguard.Guard("a library", "127.0.0.1", GuardOptions())
    own = None
    try:
        with guard.capture():
            theirs = _listener()  # what a native library opens during start-up
        with netguard.binding():
            own = _listener()
        assert guard.state().ports == (theirs.getsockname()[1],)
        netguard._attach(guard._fds[next(iter(guard._fds))], filter_program([ipaddress.ip_network("10.0.0.0/8")]))
        assert not _connects(theirs.getsockname()[1])
        guard.refresh()  # loopback is always admitted
        assert _connects(theirs.getsockname()[1])
    finally:
        guard.close()
        theirs.close()
        if own is not None:
            own.close()
    assert all(g is not guard for g in netguard.ADMISSION.guards()), "a closed guard is forgotten"


def test_a_states_watch_tells_every_change_of_who_is_admitted_and_nothing_else() -> None:
    # a vLLM worker asks its watch twice a step and puts what it tells in /metrics: a change it missed would leave
    # /metrics showing hosts admitted that are not, or the other way round
    watch = netguard.StatesWatch()
    assert watch.changed() == netguard.states(), "the first look tells every guard"
    assert watch.changed() is None
    guard = netguard.Guard("a library", "127.0.0.1", GuardOptions(admit_grace=0.0))
    theirs = None
    try:
        with guard.capture():
            theirs = _listener()
        told = watch.changed()
        assert guard.state() in told and told == netguard.states(), "a new guard was not told"
        assert watch.changed() is None
        host = str(netguard.example_hosts(4, 1)[0])
        netguard.ADMISSION.hold("test: watch", [host], "a test")
        told = watch.changed()
        assert guard.state() in told and guard.state().admitted == len(netguard.ADMISSION.hosts()), told
        netguard.ADMISSION.hold("test: watch, again", [host], "a test")  # admitted already: nothing changed
        assert watch.changed() is None
        netguard.ADMISSION.release("test: watch, again")
        netguard.ADMISSION.release("test: watch")
        assert netguard.ADMISSION.wait_until(lambda hosts: host not in map(str, hosts), 5.0)
        assert guard.state() in watch.changed(), "a host no longer admitted was not told"
    finally:
        guard.close()
        if theirs is not None:
            theirs.close()
    assert guard.state() not in netguard.states() and watch.changed() == netguard.states(), "a closed guard stayed"


def test_a_guard_admits_this_hosts_own_addresses(hosts_factory) -> None:  # noqa: ANN001
    # A local peer may connect from any of the host's addresses (UCX dials every interface's): those
    # connections were dropped when only loopback and the hostname were admitted.
    host = hosts_factory(["solo"])["solo"]
    with host.entered():
        assert [str(a) for a in netguard.local_addresses() if a.version == 4] == [host.address]
        guard = netguard.Guard("a library", "127.0.0.1", GuardOptions())
        try:
            with guard.capture():
                theirs = socket.create_server(("0.0.0.0", 0))
            with socket.create_connection((host.address, theirs.getsockname()[1]), timeout=2):
                pass
        finally:
            guard.close()
            theirs.close()


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_a_guarded_transport_refuses_a_routable_address_with_nobody_to_admit(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVBRIDGE_SECRET", raising=False)
    monkeypatch.delenv("KVBRIDGE_SECRET_FILE", raising=False)
    with pytest.raises(ConfigError, match=r"authenticates no peer.*KVBRIDGE_SECRET.*allow=.*insecure=True"):
        create_backend(backend, hostname="198.51.100.1")


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_the_trust_option_is_a_warning_at_every_start_and_open_in_the_state(
    backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvbridge.transport.netguard"):
        be = create_backend(backend, hostname="127.0.0.1", insecure=True)
    try:
        assert "accept ANY host" in caplog.text
        state = be.guard.state()
        assert state.open and state.ports
        assert any(s.open and s.what == state.what for s in netguard.states())
    finally:
        be.close()


def test_allow_takes_addresses_and_networks_and_names_a_bad_entry() -> None:
    assert netguard.parse_allow(" 10.0.0.7, 10.1.0.0/16,[fd00::1] ,") == (
        ipaddress.ip_network("10.0.0.7/32"),
        ipaddress.ip_network("10.1.0.0/16"),
        ipaddress.ip_network("fd00::1/128"),
    )
    with pytest.raises(ConfigError, match="'10.0.0.300' is not an address or a network"):
        netguard.parse_allow("10.0.0.300")


def test_a_guarded_transport_still_serves_loopback_peers() -> None:
    server, client = create_backend("mooncake", hostname="127.0.0.1"), create_backend("mooncake", hostname="127.0.0.1")
    try:
        kv = np.arange(1 << 16, dtype=np.uint8)
        out = np.zeros_like(kv)
        server.register_memory(kv)
        client.register_memory(out)
        peer = client.connect(server.endpoint_info())
        client.transfer(peer, [(out.ctypes.data, kv.ctypes.data, kv.nbytes)]).wait(30)
        assert np.array_equal(out, kv)
        assert not server.guard.state().open
    finally:
        client.close()
        server.close()


def _attached(sock: socket.socket) -> list[tuple[int, int, int, int]]:
    """The classic BPF program attached to `sock` (SO_GET_FILTER answers its length in instructions)."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(8 * netguard.BPF_MAXINSNS)
    size = ctypes.c_uint32(netguard.BPF_MAXINSNS)
    assert libc.getsockopt(sock.fileno(), socket.SOL_SOCKET, 26, buf, ctypes.byref(size)) == 0, ctypes.get_errno()
    return [struct.unpack_from("HBBI", buf.raw, 8 * i) for i in range(size.value)]


def _refused_and_whole(guard: netguard.Guard, theirs: socket.socket, first: int, more: int, match: str) -> None:
    """Hold `first` hosts, then `more`: the second is refused (GuardFull matching `match`), the filter unchanged."""
    many = [str(a) for a in netguard.example_hosts(4, first + more)]
    try:
        netguard.ADMISSION.hold("test: first", many[:first], "a test")
        before = _attached(theirs)
        assert before == [(op, jt, jf, k & 0xFFFFFFFF) for op, jt, jf, k in filter_program(guard.networks())]
        with pytest.raises(netguard.GuardFull, match=match):
            netguard.ADMISSION.hold("test: more", many[first:], "a test")
        assert _attached(theirs) == before, "a refused admission changed the filter"
        assert many[-1] not in map(str, netguard.ADMISSION.hosts())
        assert _connects(theirs.getsockname()[1])
    finally:
        netguard.ADMISSION.release("test: first")
        guard.close()
        theirs.close()


def test_a_filter_over_bpfs_instruction_limit_is_refused_by_name_and_the_filter_stays_whole() -> None:
    guard = netguard.Guard("a library", "127.0.0.1", GuardOptions(admit_grace=0.0))
    with guard.capture():
        theirs = _listener()
    already = len(netguard.ADMISSION.hosts())  # what earlier tests in this process admitted for its life
    _refused_and_whole(
        guard, theirs, 1000, 2000, rf"{already + 3000} hosts takes a filter of \d+ instructions, over the kernel's 4096"
    )


def refused_at_optmem_max() -> None:
    """Run by the next test inside a network namespace of its own whose net.core.optmem_max is 20480."""
    guard = netguard.Guard("a library", "127.0.0.1", GuardOptions(admit_grace=0.0))
    with guard.capture():
        theirs = _listener()
    match = r"refused the filter .*net\.core\.optmem_max \(20480 bytes\).*raise net\.core\.optmem_max"
    _refused_and_whole(guard, theirs, 100, 1900, match)


def test_a_host_the_kernel_cannot_take_is_refused_by_name_and_the_filter_stays_whole() -> None:
    # optmem_max is per network namespace (Linux 6.9 on); 20480 was its default before
    script = 'ip link set lo up && echo 20480 > /proc/sys/net/core/optmem_max && exec "$0" -c "$1"'
    code = "import test_netguard as t; t.refused_at_optmem_max()"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    if not shutil.which("unshare"):
        pytest.skip("unshare is not installed")
    done = subprocess.run(
        ["unshare", "-n", "sh", "-c", script, sys.executable, code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_doctor_shows_the_room_left_in_the_filter() -> None:
    from kvbridge.cli.doctor import guard_check

    check = guard_check()
    assert check.ok and "room for" in check.detail and "optmem_max" in check.detail, check
