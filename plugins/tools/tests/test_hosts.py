"""The network-namespace hosts harness (kvbridge_tools.harness.hosts): links, faults, and cleanup."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvbridge_tools.harness.hosts import Hosts, HostsError, hosts_unavailable, parse_rate, remove_leftovers

MakeHosts = Callable[..., Hosts]
needs_hosts = pytest.mark.skipif(hosts_unavailable() is not None, reason=str(hosts_unavailable()))
PORT = 5000

# Echo server: listens on ADDR:PORT, says "ready", then echoes each connection's first message.
SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(16)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    c.sendall(c.recv(64)); c.close()
"""
# Client: exit 0 when the echo came back, 3 when connecting timed out (the bound is argv[3] seconds).
CLIENT = """
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
except TimeoutError:
    sys.exit(3)
c.sendall(b"ping"); assert c.recv(64) == b"ping"
"""
# UDP receiver: counts datagrams until one says "end", then prints the count.
RECEIVER = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)  # SO_RCVBUFFORCE: never drop for want of buffer
s.bind((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
n = 0
while s.recv(2048) != b"end":
    n += 1
print(n, flush=True)
"""
# UDP sender: argv[3] datagrams of argv[4] ("x" pads to 100 bytes, "end" is sent as is).
SENDER = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
data = b"x" * 100 if sys.argv[4] == "x" else sys.argv[4].encode()
for _ in range(int(sys.argv[3])):
    s.sendto(data, (sys.argv[1], int(sys.argv[2])))
"""


def _server(hosts: Hosts, name: str, script: str = SERVER) -> subprocess.Popen[str]:
    host = hosts[name]
    proc = host.popen([sys.executable, "-c", script, host.address, str(PORT)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _connect(hosts: Hosts, src: str, dst: str, timeout_s: float = 1.0) -> int:
    args = [sys.executable, "-c", CLIENT, hosts[dst].address, str(PORT), str(timeout_s)]
    return hosts[src].run(args, check=False, timeout=60).returncode


def _gone(pid: int) -> bool:
    """No such process, or a zombie its new parent has yet to reap."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _netns() -> list[str]:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout.split()


def test_hosts_talk_tcp_by_address_and_each_has_loopback(hosts_factory: MakeHosts) -> None:
    hosts = hosts_factory(["prefill", "decode"])
    assert [h.address for h in hosts] == ["198.51.100.1", "198.51.100.2"]
    _server(hosts, "decode")
    assert _connect(hosts, "prefill", "decode") == 0
    # 127.0.0.1 inside a host is that host's own loopback: the server is not reachable there from prefill.
    loop = [sys.executable, "-c", CLIENT, "127.0.0.1", str(PORT), "1"]
    assert hosts["prefill"].run(loop, check=False).returncode not in (0, 3)  # refused, nothing listens
    _server_lo = hosts["decode"].popen(
        [sys.executable, "-c", SERVER, "127.0.0.1", str(PORT + 1)], stdout=subprocess.PIPE, text=True
    )
    assert _server_lo.stdout is not None and _server_lo.stdout.readline().strip() == "ready"
    loop = [sys.executable, "-c", CLIENT, "127.0.0.1", str(PORT + 1), "1"]
    assert hosts["decode"].run(loop, check=False).returncode == 0


def test_partition_blocks_each_direction_and_heal_restores(hosts_factory: MakeHosts) -> None:
    hosts = hosts_factory(["prefill", "decode", "proxy"])
    _server(hosts, "decode")
    _server(hosts, "prefill")
    for direction in ("both", "forward", "back"):  # either half of a TCP handshake lost stops it
        hosts.partition("prefill", "decode", direction=direction)
        assert _connect(hosts, "prefill", "decode") == 3, direction
        assert _connect(hosts, "proxy", "decode") == 0  # other links are untouched
        hosts.heal("prefill", "decode")
        assert _connect(hosts, "prefill", "decode") == 0, direction


def test_loss_drops_a_random_share_in_one_direction(hosts_factory: MakeHosts) -> None:
    hosts = hosts_factory(["prefill", "decode"])
    n = 2000
    receiver = _server(hosts, "decode", RECEIVER)
    hosts.loss("prefill", "decode", 0.25)
    hosts.loss("decode", "prefill", 0.9)  # the other direction has its own rule: no effect on this one
    hosts["prefill"].run([sys.executable, "-c", SENDER, "198.51.100.2", str(PORT), str(n), "x"])
    hosts.loss("prefill", "decode", 0)
    hosts["prefill"].run([sys.executable, "-c", SENDER, "198.51.100.2", str(PORT), "1", "end"])
    out, _ = receiver.communicate(timeout=30)
    got = int(out)
    # 25 % of 2000 dropped: the standard deviation is ~1 %, so [10 %, 40 %] is far outside chance.
    assert 0.6 * n <= got <= 0.9 * n, got


def test_a_hosts_tcp_congestion_control_is_its_own_and_its_connections_use_it(hosts_factory: MakeHosts) -> None:
    # The machine's choice (BBR on this VM) is what every namespace starts with; a bench may set Linux's default.
    from kvbridge_tools.harness.hosts import HostsError, congestion_problem, machine_congestion

    other = next((cc for cc in ("reno", "cubic") if cc != machine_congestion() and not congestion_problem(cc)), None)
    if other is None:
        pytest.skip(f"this machine lets a namespace take no congestion control besides {machine_congestion()}")
    hosts = hosts_factory(["prefill", "decode"])
    with pytest.raises(HostsError, match="no TCP congestion control 'warp'"):  # said before any namespace is touched
        hosts.congestion("prefill", "warp")
    hosts.congestion("prefill", other)
    assert (hosts.tcp_congestion("prefill"), hosts.tcp_congestion("decode")) == (other, machine_congestion())
    _server(hosts, "decode")
    # A connection the host opens uses it (`ss -i` names each socket's congestion control).
    probe = (
        "import socket, subprocess, sys; s = socket.create_connection((sys.argv[1], int(sys.argv[2]))); "
        "print(subprocess.run(['ss', '-tin', 'dport', '=', sys.argv[2]], capture_output=True, text=True).stdout)"
    )
    out = hosts["prefill"].run([sys.executable, "-c", probe, "198.51.100.2", str(PORT)], capture_output=True, text=True)
    assert f" {other} " in out.stdout, out.stdout + out.stderr


def test_shape_installs_a_rate_limit_at_both_ends_and_removes_it(hosts_factory: MakeHosts) -> None:
    hosts = hosts_factory(["prefill", "decode"])
    _server(hosts, "decode")
    hosts.shape("prefill", rate="5gbit")
    assert hosts.rate("prefill") == 5 * 10**9
    assert _connect(hosts, "prefill", "decode") == 0
    ends = [("prefill", ["tc", "-s", "qdisc", "show", "dev", "eth0"])]
    for name, args in ends:
        out = hosts[name].run(args, capture_output=True, text=True).stdout
        assert "tbf" in out and "rate 5Gbit" in out, out
        assert "Sent 0 bytes" not in out, out  # the connection went through the shaper
    switch = subprocess.run(
        ["tc", "-n", hosts.switch, "-s", "qdisc", "show", "dev", f"port{hosts['prefill'].index}"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "rate 5Gbit" in switch and "Sent 0 bytes" not in switch, switch
    hosts.shape("prefill", rate=None)
    out = hosts["prefill"].run(["tc", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True).stdout
    assert "tbf" not in out
    assert hosts.rate("prefill") is None


def test_flap_runs_bounded_in_the_background_and_ends_healed(hosts_factory: MakeHosts) -> None:
    hosts = hosts_factory(["prefill", "decode"])
    _server(hosts, "decode")
    thread = hosts.flap("prefill", "decode", down_s=0.05, up_s=0.05, times=3)
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert _connect(hosts, "prefill", "decode") == 0
    # A flap that would run for minutes is stopped by close(), healed.
    long = hosts.flap("prefill", "decode", down_s=600, up_s=600, times=10)
    hosts.close()
    assert not long.is_alive()


@needs_hosts
def test_close_stops_processes_and_deletes_namespaces_after_an_exception() -> None:
    with pytest.raises(RuntimeError, match="boom"), Hosts(["prefill", "decode"]) as hosts:
        made = hosts.namespaces
        sleeper = hosts["decode"].popen(["sleep", "600"])
        # A grandchild in its own session escapes the process group; the namespace sweep stops it.
        escaped = hosts["prefill"].run(
            ["sh", "-c", "setsid sleep 600 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True
        )
        orphan = int(escaped.stdout)
        assert len(made) == 3 and all(ns in _netns() for ns in made)
        raise RuntimeError("boom")
    assert sleeper.poll() is not None
    assert _gone(orphan)
    assert not set(made) & set(_netns())


@needs_hosts
def test_leftovers_of_a_dead_run_are_removed() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"kvb{dead.pid}x0-decode"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in remove_leftovers()
        assert stale not in _netns()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)


def test_bad_input_is_refused_with_what_to_do() -> None:
    with pytest.raises(ValueError, match="distinct"):
        Hosts(["a", "a"])
    with pytest.raises(ValueError, match="lowercase"):
        Hosts(["Decode-1"])
    with pytest.raises(ValueError, match="fewer than 3"):
        Hosts(["a", "b", "c"], subnet="198.51.100.0/31")
    with pytest.raises(ValueError, match="holds this machine's own address 127.0.0.1"):
        Hosts(["a"], subnet="127.0.0.0/24")
    assert parse_rate("5gbit") == 5 * 10**9
    assert parse_rate("100mbit") == 10**8
    with pytest.raises(ValueError, match="e.g. 100mbit"):
        parse_rate("fast")


def test_delay_works_or_says_netem_is_missing(hosts_factory: MakeHosts) -> None:
    hosts = hosts_factory(["prefill", "decode"])
    try:
        hosts.delay("prefill", 10)
    except HostsError as e:
        assert "netem" in str(e)
    else:
        out = hosts["prefill"].run(["tc", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True).stdout
        assert "netem" in out and "delay 10ms" in out


def test_a_thread_can_enter_a_host_and_leave_it(hosts_factory: MakeHosts) -> None:
    import socket

    hosts = hosts_factory(["prefill", "decode"])
    _server(hosts, "decode")
    home = Path("/proc/thread-self/ns/net").stat().st_ino
    with hosts["prefill"].entered(), socket.create_connection(("198.51.100.2", PORT), timeout=5) as c:
        assert Path("/proc/thread-self/ns/net").stat().st_ino != home
        c.sendall(b"ping")
        assert c.recv(64) == b"ping"
    assert Path("/proc/thread-self/ns/net").stat().st_ino == home  # back in this machine's own namespace


# Prints what an engine pinning its model thread by NUMA node would read: kvbridge's view and vLLM's CPU platform's
# (its node directories' `cpuN` entries), then the CPUs the process may run on.
NODE_VIEW = """
import json, os, subprocess
from kvbridge.base import placement
# what vLLM's CPU platform runs at start-up (it crashed on a view without the map and the links)
subprocess.run(["lscpu", "--json", "--extended=CPU,CORE,NODE", "--online"], check=True, capture_output=True)
node = "/sys/devices/system/node"
dirs = sorted(d for d in os.listdir(node) if d.startswith("node") and d[4:].isdigit())
cpus = {d: sorted(c for c in os.listdir(f"{node}/{d}") if c.startswith("cpu") and c[3:].isdigit()) for d in dirs}
print(json.dumps([{k: sorted(v) for k, v in placement.numa_nodes().items()}, cpus, sorted(os.sched_getaffinity(0))]))
"""


def test_a_host_given_cpus_runs_there_and_shows_them_as_its_only_numa_node(hosts_factory: MakeHosts) -> None:
    import json
    import os

    from kvbridge.base import placement
    from kvbridge_tools.bench.link import split_cores

    hosts = hosts_factory(["prefill", "decode"])
    machine = sorted(os.sched_getaffinity(0))
    mine = split_cores(machine)[0] if len(machine) > 1 else (machine[0],)
    hosts["prefill"].cpus = mine
    views = {}
    for name in ("prefill", "decode"):
        done = hosts[name].run([sys.executable, "-c", NODE_VIEW], capture_output=True, text=True, timeout=60)
        views[name] = json.loads(done.stdout)
    nodes, dirs, allowed = views["prefill"]
    assert nodes == {"0": list(mine)} and dirs == {"node0": [f"cpu{c}" for c in mine]} and allowed == list(mine)
    # a host without CPUs of its own, and this machine itself, keep the machine's nodes and every CPU
    expected = {str(k): sorted(v) for k, v in placement.numa_nodes().items()}
    assert expected and views["decode"][0] == expected and views["decode"][2] == machine
    assert {str(k): sorted(v) for k, v in placement.numa_nodes().items()} == expected, "the machine's own is intact"


def test_a_nixl_read_between_hosts_crosses_the_link_so_a_partition_stops_it(hosts_factory: MakeHosts) -> None:
    """Without UCX held to TCP, two hosts' processes share one machine's memory: a read across a partition passed."""
    pytest.importorskip("nixl", reason="the NIXL plugin's wheel (scripts/setup --test)")
    from kvbridge_tools.harness.proc import Child, ChildError

    hosts = hosts_factory(["prefill", "decode"])
    peers = str(Path(__file__).parents[3] / "tests" / "peers")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [peers, os.environ.get("PYTHONPATH")]))}
    prefill = Child("backend_peer", env=env, name="prefill", prefix=hosts["prefill"].command([]))
    decode = Child("backend_peer", env=env, name="decode", prefix=hosts["decode"].command([]))
    try:
        size = 8 << 20
        served = prefill.call("init", backend="nixl", size=size, seed=7, options={"insecure": True})
        # a read that makes no progress fails at NIXL's own transfer timeout
        decode.call("init", backend="nixl", size=size, seed=-1, options={"insecure": True, "transfer_timeout": 2})
        decode.call("connect", endpoint=served["endpoint"])
        read = {"descriptors": [[0, 0, 1 << 20]], "op": "read", "remote_base": served["base"]}
        decode.call("transfer", **read)  # connected, over the link
        hosts.partition("prefill", "decode")
        with pytest.raises(ChildError) as cut:
            decode.call("transfer", **{**read, "descriptors": [[1 << 20, 1 << 20, 4 << 20]]})
        assert cut.value.kind in {"TransferTimeout", "TransferFailed"}, cut.value
    finally:
        decode.close()
        prefill.close()
