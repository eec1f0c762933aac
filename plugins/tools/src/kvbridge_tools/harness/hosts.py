"""Hosts on one machine: network namespaces joined by a bridge, with shaped and faulty links.

Test and bench tooling, not library code. Each host is a network namespace with one veth link to a
"switch" namespace that holds the bridge, so the root namespace is never touched and no packet can
leave the machine. Every link can be rate-limited (`tc tbf` at both ends, so both directions), and
the switch filters forwarded packets (nftables, bridge family) to drop a random share of them per
direction or all of them (a partition). Delay needs the kernel's `netem`, which is not everywhere.

Namespace names carry ``kvb<pid>x<n>-`` so concurrent runs never collide; namespaces whose pid is
gone (a run that was killed) are removed when the next `Hosts` starts. On exit every process the
hosts started is stopped by its PID (TERM, then KILL), then every process still inside one of the
namespaces, and every namespace is deleted by name, also when the body raised.

    with Hosts(["prefill", "decode"]) as hosts:
        server = hosts["decode"].popen([sys.executable, "-m", "http.server", "--bind", "198.51.100.2"])
        hosts.partition("prefill", "decode")
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import itertools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvbridge.base.errors import KVBridgeError

log = logging.getLogger(__name__)

PREFIX = "kvb"
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,15}$")
_OURS = re.compile(rf"^{PREFIX}(\d+)x\d+-")
_SBIN = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
_TOOLS = {"ip": "iproute2", "tc": "iproute2", "nft": "nftables"}
_CLONE_NEWNET = 0x40000000
_STOP_S = 5.0  # a process gets this long after SIGTERM before SIGKILL
# What every process the harness starts is given: a process group of its own (stopped as one), in the caller's
# session. A session of its own is a scheduling group of its own too (Linux's autogroup, on by default), and there a
# mostly idle process, the proxy, waited up to 1.25 s for a CPU while the servers' groups kept both CPUs busy:
# docs/measurements/stalls.md, "Scheduling groups".
OWN_GROUP: dict[str, Any] = {"process_group": 0}
_counter = itertools.count()
_RATE = re.compile(r"^(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)?$", re.IGNORECASE)
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


class HostsError(KVBridgeError, RuntimeError):
    """A namespace, link or filter could not be set up or changed (the reason is in the message)."""


def _tool(name: str) -> str | None:
    return shutil.which(name, path=_SBIN)


def hosts_unavailable() -> str | None:
    """Why `Hosts` cannot run here (not root, a tool missing), or None when it can."""
    if os.geteuid() != 0:
        return "network-namespace hosts need root (ip netns, tc, nft)"
    missing = sorted({f"{tool} ({pkg})" for tool, pkg in _TOOLS.items() if _tool(tool) is None})
    if missing:
        return f"missing {', '.join(missing)}: `scripts/setup --test` installs them"
    return None


MAX_RATE_BITS = 10**12


def parse_rate(rate: str | int) -> int:
    """Bits per second from an int or a tc rate such as ``"5gbit"`` or ``"100mbit"``."""
    if isinstance(rate, int) and not isinstance(rate, bool):
        bits = rate
    else:
        m = _RATE.match(str(rate).strip())
        if m is None:
            raise ValueError(f"rate {rate!r} is not a rate: write it as tc does, e.g. 100mbit, 5gbit")
        bits = int(float(m.group(1)) * _RATE_UNITS[(m.group(2) or "bit").lower()])
    if bits < 8000:
        raise ValueError(f"rate {rate!r} is below 8 kbit/s; pick a rate tc can shape, e.g. 100mbit")
    if bits > MAX_RATE_BITS:  # tc's tbf refused the burst of 1 ms at the rate (over 4 GiB) once the hosts were up
        raise ValueError(f"rate {rate!r} is above 1 tbit/s; pick a rate a NIC has, e.g. 400gbit")
    return bits


CONGESTION = "net.ipv4.tcp_congestion_control"


def _sysctl_path(name: str) -> Path:
    return Path("/proc/sys", *name.split("."))


def machine_congestion() -> str:
    """The TCP congestion control of this process's network namespace (new namespaces start with it)."""
    try:
        return _sysctl_path(CONGESTION).read_text().strip()
    except OSError:
        return "unknown"


def _sysctl_words(name: str) -> list[str]:
    try:
        return _sysctl_path(name).read_text().split()
    except OSError:  # (where the kernel does not say, the namespace's own write says why)
        return []


def congestion_problem(
    name: str, *, available: list[str] | None = None, allowed: list[str] | None = None
) -> str | None:
    """Why a namespace host cannot take TCP congestion control `name` on this machine; None where it can.

    Linux lets a network namespace other than the machine's take only the allowed ones (`-EPERM` else):
    `net.ipv4.tcp_allowed_congestion_control`, which holds reno and the machine's default unless an admin adds more."""
    available = _sysctl_words("net.ipv4.tcp_available_congestion_control") if available is None else available
    allowed = _sysctl_words("net.ipv4.tcp_allowed_congestion_control") if allowed is None else allowed
    if available and name not in available:
        return f"this kernel has no TCP congestion control {name!r} (it has {', '.join(available)})"
    if allowed and name not in allowed:
        return (
            f"this machine does not allow TCP congestion control {name!r} in a network namespace (it allows "
            f"{', '.join(allowed)}); allow it with `sysctl -w net.ipv4.tcp_allowed_congestion_control="
            f'"{" ".join([*allowed, name])}"`, or pick an allowed one'
        )
    return None


def _sh(args: Sequence[str], timeout: float = 30.0, stdin: str | None = None) -> str:
    """Run a setup command; raise HostsError with its stderr when it fails."""
    try:
        done = subprocess.run(list(args), input=stdin, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise HostsError(f"`{' '.join(args)}` did not finish in {timeout:g} s") from e
    if done.returncode != 0:
        raise HostsError(f"`{' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_pids(netns: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=30)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def _stop_pids(pids: Iterable[int], deadline_s: float = _STOP_S) -> None:
    """TERM each pid, KILL those still there after the bound (processes that are not our children)."""
    pids = [p for p in pids if p != os.getpid()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    end = time.monotonic() + deadline_s
    while pids and time.monotonic() < end:
        pids = [p for p in pids if _alive(p) and not _zombie(p)]
        if pids:
            time.sleep(0.05)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _delete_netns(netns: str) -> None:
    _stop_pids(_netns_pids(netns))
    done = subprocess.run(["ip", "netns", "del", netns], capture_output=True, text=True, timeout=30)
    if done.returncode != 0 and netns in _list_netns():
        raise HostsError(f"could not delete network namespace {netns}: {done.stderr.strip()}")


def _list_netns() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_leftovers() -> list[str]:
    """Delete the namespaces of earlier runs whose process is gone; return their names."""
    removed = []
    for netns in _list_netns():
        m = _OURS.match(netns)
        if m and not _alive(int(m.group(1))):
            _delete_netns(netns)
            removed.append(netns)
    if removed:
        log.info("removed %d network namespaces left by dead runs: %s", len(removed), ", ".join(removed))
    return removed


# Run inside `ip netns exec` (which gives each command a mount namespace of its own and a fresh /sys): lists the CPUs
# $1 names (a mask in $2, each in $3) as the host's one NUMA node over the machine's own node files, as lscpu and an
# engine read them (lscpu follows each cpuN link and needs the map and distance), then runs the rest of the command
# on those CPUs only. Without a meminfo, vLLM sizes memory from the machine's totals, as on a host with no NUMA files.
# The hosts share this machine's memory, which real hosts do not: UCX (NIXL) would move the bytes through shared
# memory or cross-memory attach, past the links and every fault on them (a read across a partition succeeded at
# once). Every process on a host is held to UCX's TCP transport.
ON_THE_LINK = {"UCX_TLS": "tcp"}
_OWN_CPUS = """set -e
node=/sys/devices/system/node
mount -t tmpfs -o size=64k,mode=755 kvbridge-node "$node"
mkdir "$node/node0"
for f in online possible has_cpu has_memory has_normal_memory; do echo 0 > "$node/$f"; done
echo "$1" > "$node/node0/cpulist"
echo "$2" > "$node/node0/cpumap"
echo 10 > "$node/node0/distance"
for cpu in $3; do ln -s "/sys/devices/system/cpu/cpu$cpu" "$node/node0/cpu$cpu"; done
list=$1
shift 3
exec taskset -c "$list" "$@"
"""


def cpu_list(cpus: Iterable[int]) -> str:
    """CPUs as Linux writes a list of them: `0-3,8`."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


@attrs.define
class Host:
    """One host: a network namespace with one address on the hosts' subnet and `lo` up.

    `cpus`: where set, the host's own CPUs, as a machine of its own would have them: its processes run on them only
    and see them as the machine's one NUMA node in /sys. An engine that pins its model thread to the last core of each
    node (vLLM's NixlConnector on a CPU platform, KVBridgeConnector's `cpu_affinity: reserved`) then pins it to this
    host's, not to the one core every host of this machine shares, and its other threads stay on this host's CPUs."""

    name: str
    netns: str
    address: str
    index: int
    cpus: tuple[int, ...] = ()
    _procs: list[subprocess.Popen[Any]] = attrs.field(factory=list, repr=False)

    def command(self, args: Sequence[str]) -> list[str]:
        """`args` prefixed so that it runs inside this host's namespace (and on its own CPUs, where it has them).

        It moves bytes to other hosts over the links only (`ON_THE_LINK`)."""
        prefix = ["ip", "netns", "exec", self.netns]
        if self.cpus:
            mask = f"{sum(1 << c for c in self.cpus):x}"
            listed = " ".join(map(str, self.cpus))
            prefix += ["sh", "-c", _OWN_CPUS, "kvbridge-host-cpus", cpu_list(self.cpus), mask, listed]
        return [*prefix, "env", *(f"{k}={v}" for k, v in ON_THE_LINK.items()), *args]

    def popen(self, args: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start `args` inside the host (a process group of its own); it is stopped when the hosts close."""
        kwargs = {**OWN_GROUP, **kwargs}
        proc = subprocess.Popen(self.command(args), **kwargs)
        self._procs.append(proc)
        return proc

    def run(
        self, args: Sequence[str], *, check: bool = True, timeout: float = 60.0, **kwargs: Any
    ) -> subprocess.CompletedProcess[Any]:
        """Run `args` inside the host to completion (bounded by `timeout`)."""
        return subprocess.run(self.command(args), check=check, timeout=timeout, **kwargs)

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """Run the calling thread inside this host's network namespace until the block ends.

        Threads it starts meanwhile are born there and stay there: a client that must reach the
        hosts (which the root namespace cannot) runs this way without a process of its own.
        """
        libc = ctypes.CDLL(None, use_errno=True)
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            target = os.open(f"/var/run/netns/{self.netns}", os.O_RDONLY)
            try:
                if libc.setns(target, _CLONE_NEWNET) != 0:
                    raise HostsError(f"cannot enter {self.netns}: {os.strerror(ctypes.get_errno())}")
            finally:
                os.close(target)
            try:
                yield
            finally:
                if libc.setns(own, _CLONE_NEWNET) != 0:
                    raise HostsError(f"cannot leave {self.netns}: {os.strerror(ctypes.get_errno())}")
        finally:
            os.close(own)

    def stop(self, deadline_s: float = _STOP_S) -> None:
        """Stop every process this host started: TERM its group, KILL after the bound."""
        running = [p for p in self._procs if p.poll() is None]
        for proc in running:
            _signal(proc, signal.SIGTERM)
        end = time.monotonic() + deadline_s
        for proc in running:
            try:
                proc.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(proc, signal.SIGKILL)
                proc.wait(timeout=30)
        self._procs.clear()


def _signal(proc: subprocess.Popen[Any], sig: int) -> None:
    # The group id is the leader's pid, which is ours until we reap it (poll() said it runs).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            os.kill(proc.pid, sig)


@attrs.define
class _Flap:
    thread: threading.Thread
    stop: threading.Event


def _own_addresses() -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses of this machine's own interfaces (the namespace this process runs in)."""
    try:
        out = subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [ipaddress.ip_address(a["local"]) for link in json.loads(out) for a in link.get("addr_info", ())]


class Hosts:
    """N hosts on one bridge, each a network namespace; a context manager that removes all it made.

    Host i (in the order given) gets the (i+1)-th address of `subnet`. Faults between hosts are
    nftables rules in the switch namespace, applied atomically, so hosts' own firewall rules and
    the traffic on each host's `lo` are untouched.
    """

    def __init__(self, names: Sequence[str], subnet: str = "198.51.100.0/24", mtu: int = 1500) -> None:
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"host names must be distinct and at least one, got {list(names)}")
        for name in names:
            if not _NAME.match(name):
                raise ValueError(f"host name {name!r}: use 1-16 lowercase letters, digits or _, a letter first")
        net = ipaddress.ip_network(subnet)
        clash = [a for a in _own_addresses() if a in net]
        if clash:
            raise ValueError(
                f"subnet {subnet} holds this machine's own address {clash[0]}; pick a documentation range it does "
                "not use (198.51.100.0/24, 203.0.113.0/24)"
            )
        addrs = itertools.islice(net.hosts(), len(names))
        self.subnet = net
        self.mtu = mtu
        self.prefix = f"{PREFIX}{os.getpid()}x{next(_counter)}-"
        self.switch = f"{self.prefix}switch"
        self._hosts = {
            name: Host(name=name, netns=f"{self.prefix}{name}", address=str(addr), index=i)
            for i, (name, addr) in enumerate(zip(names, addrs))
        }
        if len(self._hosts) < len(names):
            raise ValueError(f"subnet {subnet} has room for fewer than {len(names)} hosts")
        self._made: list[str] = []
        self._lock = threading.Lock()
        self._drops: dict[tuple[str, str], float] = {}  # (src, dst) -> share dropped; 1.0 is a partition
        self._partitions: set[tuple[str, str]] = set()
        self._rates: dict[str, int] = {}
        self._flaps: list[_Flap] = []
        self._open = False

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> Hosts:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        """Make the switch and the hosts; on any failure remove what was made and raise HostsError."""
        reason = hosts_unavailable()
        if reason:
            raise HostsError(reason)
        remove_leftovers()
        self._open = True
        try:
            self._add_netns(self.switch)
            _sh(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
            _sh(["ip", "-n", self.switch, "link", "set", "br0", "up"])
            for host in self._hosts.values():
                self._add_host(host)
            self._nft()
        except BaseException:
            self.close()
            raise

    def _add_netns(self, netns: str) -> None:
        _sh(["ip", "netns", "add", netns])
        self._made.append(netns)

    def _add_host(self, host: Host) -> None:
        self._add_netns(host.netns)
        port = f"port{host.index}"
        mtu = str(self.mtu)
        _sh(["ip", "-n", self.switch, "link", "add", port, "mtu", mtu, "type", "veth", "peer", "name", "eth0",
             "netns", host.netns])  # fmt: skip
        _sh(["ip", "-n", self.switch, "link", "set", port, "master", "br0", "up"])
        _sh(["ip", "-n", host.netns, "link", "set", "lo", "up"])
        _sh(["ip", "-n", host.netns, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", "eth0"])
        _sh(["ip", "-n", host.netns, "link", "set", "eth0", "up"])

    def close(self) -> None:
        """Stop flaps and every process, delete every namespace; safe to call twice."""
        if not self._open:
            return
        errors = []
        for flap in self._flaps:
            flap.stop.set()
        for flap in self._flaps:
            flap.thread.join(timeout=30)
        self._flaps.clear()
        for host in self._hosts.values():
            try:
                host.stop()
            except Exception as e:  # keep going: the namespaces must go whatever happened
                errors.append(e)
        for netns in reversed(self._made):
            try:
                _delete_netns(netns)
            except Exception as e:
                errors.append(e)
        self._made.clear()
        self._open = False
        if errors:
            raise HostsError(f"cleanup of {self.prefix}* failed: {errors}")

    # -- access ------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Host:
        try:
            return self._hosts[name]
        except KeyError:
            raise KeyError(f"no host {name!r}; hosts: {', '.join(self._hosts)}") from None

    def __iter__(self) -> Iterator[Host]:
        return iter(self._hosts.values())

    @property
    def names(self) -> list[str]:
        return list(self._hosts)

    @property
    def namespaces(self) -> list[str]:
        """Every namespace these hosts made (the switch too)."""
        return list(self._made)

    def tcp_counters(self, host: str) -> dict[str, int]:
        """`host`'s TCP retransmissions since its namespace was made (its kernel's counters, per namespace).

        `segments`: segments sent again; `syn`: SYNs and SYN-ACKs sent again (each a connect delayed by the
        initial retransmission timeout, 1 s); `timeouts`: retransmission timers that fired."""
        text = self[host].run(["cat", "/proc/net/snmp", "/proc/net/netstat"], capture_output=True, text=True).stdout
        lines = text.splitlines()
        values: dict[str, int] = {}
        # each table is two lines: "Tcp: Name Name ..." then "Tcp: 1 2 ..."
        for names, numbers in zip(lines, lines[1:], strict=False):
            kind, _, rest = names.partition(":")
            if numbers.startswith(f"{kind}:") and not rest.split()[0].lstrip("-").isdigit():
                for name, n in zip(rest.split(), numbers.partition(":")[2].split(), strict=False):
                    values[f"{kind}.{name}"] = int(n)
        return {
            "segments": values.get("Tcp.RetransSegs", 0),
            "syn": values.get("TcpExt.TCPSynRetrans", 0),
            "timeouts": values.get("TcpExt.TCPTimeouts", 0),
        }

    # -- links ---------------------------------------------------------------------------------
    def shape(self, host: str, rate: str | int | None) -> None:
        """Limit `host`'s link to `rate` in both directions (tc tbf at both ends); None removes it."""
        h = self[host]
        ends = [(h.netns, "eth0"), (self.switch, f"port{h.index}")]
        if rate is None:
            if self._rates.pop(h.name, None) is not None:
                for netns, dev in ends:
                    _sh(["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"])
            return
        bits = parse_rate(rate)
        # A burst of ~1 ms at the rate (at least 128 KiB, so that one GSO packet passes whole) keeps
        # the long-run rate accurate at 10 Gbit without letting more than a millisecond through.
        burst = max(bits // 8 // 1000, 128 * 1024)
        for netns, dev in ends:
            _sh(["tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{bits}bit",
                 "burst", str(burst), "latency", "50ms"])  # fmt: skip
        self._rates[h.name] = bits

    def congestion(self, host: str, name: str) -> None:
        """Make `host`'s TCP use congestion control `name` (`cubic`, `bbr`, ...): its own, as another machine's."""
        problem = congestion_problem(name)
        if problem:
            raise HostsError(problem)
        _sh(["ip", "netns", "exec", self[host].netns, "tee", str(_sysctl_path(CONGESTION))], stdin=name)

    def tcp_congestion(self, host: str) -> str:
        """The TCP congestion control `host` uses."""
        return _sh(["ip", "netns", "exec", self[host].netns, "cat", str(_sysctl_path(CONGESTION))]).strip()

    def rate(self, host: str) -> int | None:
        """The rate `host`'s link is shaped to, in bits per second, or None."""
        return self._rates.get(self[host].name)

    def delay(self, host: str, ms: float, jitter_ms: float = 0.0) -> None:
        """Delay every packet on `host`'s link by `ms` each way (needs netem; HostsError where it is absent)."""
        h = self[host]
        if h.name in self._rates:
            raise HostsError(f"{host}'s link is shaped; delay and shape on one link are not supported together")
        args = ["delay", f"{ms}ms"] + ([f"{jitter_ms}ms"] if jitter_ms else [])
        for netns, dev in [(h.netns, "eth0"), (self.switch, f"port{h.index}")]:
            done = subprocess.run(
                ["tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", "netem", *args],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            if done.returncode != 0:
                why = done.stderr.strip()
                if "unknown" in why.lower():
                    why = f"this kernel has no netem qdisc (sch_netem), so delay and jitter are unavailable: {why}"
                raise HostsError(f"cannot delay {host}'s link: {why}")

    # -- faults --------------------------------------------------------------------------------
    def loss(self, src: str, dst: str, share: float) -> None:
        """Drop `share` (0..1) of the packets from `src` to `dst`, chosen at random; 0 removes it."""
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"loss share must be within [0, 1], got {share}")
        key = (self[src].name, self[dst].name)
        with self._lock:
            if share == 0:
                self._drops.pop(key, None)
            else:
                self._drops[key] = share
            self._apply()

    def partition(self, a: str, b: str, direction: str = "both") -> None:
        """Drop every packet a->b ("forward"), b->a ("back"), or both ways."""
        pairs = {"forward": [(a, b)], "back": [(b, a)], "both": [(a, b), (b, a)]}
        if direction not in pairs:
            raise ValueError(f"direction must be one of both, forward, back; got {direction!r}")
        with self._lock:
            self._partitions.update((self[s].name, self[d].name) for s, d in pairs[direction])
            self._apply()

    def heal(self, a: str, b: str) -> None:
        """Undo every partition between a and b (both directions); loss stays."""
        with self._lock:
            self._partitions -= {(self[a].name, self[b].name), (self[b].name, self[a].name)}
            self._apply()

    def flap(self, a: str, b: str, *, down_s: float, up_s: float, times: int) -> threading.Thread:
        """Partition a<->b for `down_s`, heal for `up_s`, `times` times, in a background thread.

        The thread ends healed; `close()` stops it early. Join the returned thread to wait for it.
        """
        if times < 1 or down_s < 0 or up_s < 0:
            raise ValueError(f"flap needs times >= 1 and durations >= 0, got {times=}, {down_s=}, {up_s=}")
        self[a], self[b]  # noqa: B018 -- fail here, not in the thread, on a wrong name
        stop = threading.Event()

        def run() -> None:
            try:
                for _ in range(times):
                    self.partition(a, b)
                    stopped = stop.wait(down_s)
                    self.heal(a, b)
                    if stopped or stop.wait(up_s):
                        return
            except HostsError:
                log.exception("flap %s<->%s failed", a, b)

        thread = threading.Thread(target=run, name=f"flap-{a}-{b}", daemon=True)
        self._flaps.append(_Flap(thread=thread, stop=stop))
        thread.start()
        return thread

    def _apply(self) -> None:
        if not self._open:
            raise HostsError("the hosts are closed")
        self._nft()

    def _nft(self) -> None:
        _sh(["ip", "netns", "exec", self.switch, "nft", "-f", "-"], stdin=self._ruleset())

    def _ruleset(self) -> str:
        """The whole fault table, replaced in one transaction (so no packet sees half a change)."""
        rules = []
        for src, dst in sorted(self._partitions):
            rules.append(f"ip saddr {self[src].address} ip daddr {self[dst].address} counter drop")
        for (src, dst), share in sorted(self._drops.items()):
            if (src, dst) in self._partitions:
                continue
            per_million = round(share * 1_000_000)
            rules.append(
                f"ip saddr {self[src].address} ip daddr {self[dst].address} "
                f"numgen random mod 1000000 < {per_million} counter drop"
            )
        body = "".join(f"    {rule}\n" for rule in rules)
        # `table ...` first creates it if missing; `delete` then `table` again rebuilds it empty.
        return (
            "table bridge kvb_faults {}\n"
            "delete table bridge kvb_faults\n"
            "table bridge kvb_faults {\n"
            "  chain faults {\n"
            "    type filter hook forward priority 0; policy accept;\n"
            f"{body}"
            "  }\n"
            "}\n"
        )
