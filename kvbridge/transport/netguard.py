"""Close the listeners of transports that authenticate nobody to hosts that have not proved the secret.

`Guard.capture` attaches a classic BPF socket filter (``SO_ATTACH_FILTER``) to the listeners a transport's
library (Mooncake, UCX under NIXL) opens as it starts; admission is per process, because the filters are.
An address is admitted while something holds it (a lease, a peer relation: `Admission.hold`) and for a grace
after the last hold ends; a filter the kernel refuses refuses the new peer (`GuardFull`), never goes stale.
Why, whom it admits and what an address filter cannot do: docs/security.md ("Transports that authenticate nobody").
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import heapq
import ipaddress
import logging
import math
import os
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import attrs

from kvbridge.base.errors import ConfigError
from kvbridge.base.options import BackendOptions, option
from kvbridge.base.secret import HOW_TO_SET, is_loopback, load_secret
from kvbridge.base.threadname import NamedThread

log = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Hosts admitted at once, whatever the kernel would take: a bound on what peers can make this process track.
MAX_ADMITTED = 4000
BPF_MAXINSNS = 4096  # the kernel's bound on a classic BPF program
# Admitted hosts are found by a comparison tree (a packet runs O(log n) instructions); its leaves compare
# this many values one after another.
_LEAF = 8
DEFAULT_GRACE_S = 30.0
OPTMEM = "/proc/sys/net/core/optmem_max"
_LOOPBACK: tuple[IPNetwork, ...] = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))

# linux/filter.h
_SO_ATTACH_FILTER = 26
_SKF_NET_OFF = -0x100000  # loads relative to the network header: the filter of a TCP socket sees the TCP one
_LD_W_ABS, _LD_B_ABS, _LD_MEM, _ST = 0x20, 0x30, 0x60, 0x02
_ALU_RSH_K, _ALU_AND_K = 0x74, 0x54
_JEQ_K, _JGE_K, _JA = 0x15, 0x35, 0x05
_RET_K = 0x06
_ACCEPT, _DROP = 0xFFFFFFFF, 0
Insn = tuple[int, int, int, int]


class GuardFull(ConfigError):
    """The kernel (or kvbridge's bound) takes no filter admitting one more host: the new peer is refused."""


@attrs.frozen
class GuardOptions(BackendOptions):
    """Options of a transport whose listeners kvbridge guards (it cannot authenticate peers itself)."""

    secret: str | bytes | None = option(
        None, "shared secret (16+ bytes) peers prove on the side channel; default: $KVBRIDGE_SECRET or secret_file"
    )
    secret_file: str | None = option(None, "file holding the shared secret (default: $KVBRIDGE_SECRET_FILE)")
    insecure: bool = option(
        False,
        "trust the network: accept connections from any host on this transport's listeners, which authenticate "
        "nobody (whoever reaches them can read and write registered memory); logged as a warning at every start",
    )
    allow: str = option(
        "",
        "comma-separated addresses or networks (CIDR) admitted to this transport's listeners besides loopback and "
        "hosts that proved the shared secret (for data-plane addresses other than the side channel's)",
    )
    admit_grace: float = option(
        DEFAULT_GRACE_S,
        "seconds a peer's host stays admitted after the last lease or peer relation that needed it ended "
        "(process-wide: the last guard started sets it)",
        min=0.0,
        max=86400.0,
    )


def parse_allow(text: str) -> tuple[IPNetwork, ...]:
    """`allow`'s networks; a bad entry is a ConfigError naming it."""
    nets = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        try:
            nets.append(ipaddress.ip_network(item.strip("[]"), strict=False))
        except ValueError:
            raise ConfigError(
                f"allow entry {item!r} is not an address or a network (e.g. 10.0.0.7 or 10.0.0.0/24)"
            ) from None
    return tuple(nets)


def resolve(host: str) -> tuple[IPAddress, ...]:
    """The addresses `host` (an address or a name, IPv6 in brackets or not) stands for; () if it resolves to none."""
    host = host.strip().strip("[]")
    try:
        return (_unmapped(ipaddress.ip_address(host.split("%", 1)[0])),)
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return ()
    return tuple(dict.fromkeys(_unmapped(ipaddress.ip_address(str(i[4][0]).split("%", 1)[0])) for i in infos))


def _without_port(hostname: str) -> str:
    """The host of ``host``, ``host:port``, ``[v6]`` or ``[v6]:port``.

    Mooncake takes ``ip:port`` with a metadata server."""
    if hostname.startswith("["):
        return hostname[1:].split("]", 1)[0]
    if hostname.count(":") == 1:
        return hostname.split(":", 1)[0]
    return hostname


def local_addresses() -> tuple[IPAddress, ...]:
    """The addresses of this host's interfaces (in this process's network namespace), loopback left out."""
    found: set[IPAddress] = set()
    net = Path("/proc/thread-self/net")  # the calling thread's namespace (/proc/net is the main thread's)
    net = net if net.is_dir() else Path("/proc/net")
    with contextlib.suppress(OSError):  # IPv4: the local routing table's host routes
        lines = (net / "fib_trie").read_text().splitlines()
        for above, line in zip(lines, lines[1:]):
            if line.strip() == "/32 host LOCAL":
                with contextlib.suppress(ValueError, IndexError):
                    found.add(ipaddress.IPv4Address(above.split()[-1]))
    with contextlib.suppress(OSError):
        for line in (net / "if_inet6").read_text().splitlines():
            with contextlib.suppress(ValueError, IndexError):
                found.add(ipaddress.IPv6Address(int(line.split()[0], 16)))
    return tuple(a for a in found if not a.is_loopback)


def _unmapped(addr: IPAddress) -> IPAddress:
    # A dual-stack socket names an IPv4 peer ::ffff:a.b.c.d; its packets carry the IPv4 address.
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def filter_program(networks: Iterable[IPNetwork]) -> list[Insn]:
    """A classic BPF program accepting segments whose source address is in one of `networks`.

    Networks with a prefix (loopback, `allow`) are tested one after another; single hosts, however many, by
    a balanced comparison tree over their sorted addresses (IPv6: one level per 32-bit word), so a packet
    runs O(log n) instructions and a host costs about 1.3 instructions (IPv4; IPv6 hosts sharing their
    first 96 bits too). Every block ends in a return, and far jumps go through ``JA`` (32-bit offsets), so
    the 8-bit offsets of conditional jumps never overflow.
    """
    nets = list(dict.fromkeys(networks))
    v4 = [n for n in nets if n.version == 4 and n.prefixlen < 32]
    v6 = [n for n in nets if n.version == 6 and n.prefixlen < 128]
    hosts4 = sorted({int(n.network_address) for n in nets if n.version == 4 and n.prefixlen == 32})
    hosts6 = sorted(
        {struct.unpack("!4I", n.network_address.packed) for n in nets if n.version == 6 and n.prefixlen == 128}
    )
    block4: list[Insn] = []
    for net in v4:
        block4.append((_LD_W_ABS, 0, 0, _SKF_NET_OFF + 12))  # IPv4 source address
        block4.append((_ALU_AND_K, 0, 0, int(net.netmask)))
        block4 += [(_JEQ_K, 0, 1, int(net.network_address)), (_RET_K, 0, 0, _ACCEPT)]
    if hosts4:
        block4 += [(_LD_W_ABS, 0, 0, _SKF_NET_OFF + 12), *_one_of(hosts4)]
    else:
        block4.append((_RET_K, 0, 0, _DROP))
    block6: list[Insn] = []
    for net in v6:
        words = struct.unpack("!4I", net.network_address.packed)
        masks = struct.unpack("!4I", net.netmask.packed)
        body: list[Insn] = []
        jumps = []
        for i, (word, mask) in enumerate(zip(words, masks, strict=True)):
            if not mask:
                continue
            body.append((_LD_W_ABS, 0, 0, _SKF_NET_OFF + 8 + 4 * i))  # IPv6 source address, word i
            if mask != 0xFFFFFFFF:
                body.append((_ALU_AND_K, 0, 0, mask))
            jumps.append(len(body))
            body.append((_JEQ_K, 0, 0, word))
        body.append((_RET_K, 0, 0, _ACCEPT))
        for at in jumps:  # a mismatch skips to the next network's test
            op, _jt, _jf, k = body[at]
            body[at] = (op, 0, len(body) - at - 1, k)
        block6 += body
    if hosts6:
        for i in range(4):  # the source address's words into scratch memory M[0..3]: loaded once
            block6 += [(_LD_W_ABS, 0, 0, _SKF_NET_OFF + 8 + 4 * i), (_ST, 0, 0, i)]
        block6 += _words_one_of(hosts6, 0)
    else:
        block6.append((_RET_K, 0, 0, _DROP))
    head = [
        (_LD_B_ABS, 0, 0, _SKF_NET_OFF),  # version and header length
        (_ALU_RSH_K, 0, 0, 4),
        (_JEQ_K, 1, 0, 4),  # IPv4: skip the jump to the IPv6 tests
        (_JA, 0, 0, len(block4)),
    ]
    return head + block4 + block6


def _one_of(values: list[int]) -> list[Insn]:
    """Accept if register A is one of the sorted `values`, else drop (a balanced tree; the block ends in returns)."""
    if len(values) <= _LEAF:
        n = len(values)
        return [*((_JEQ_K, n - i, 0, v) for i, v in enumerate(values)), (_RET_K, 0, 0, _DROP), (_RET_K, 0, 0, _ACCEPT)]
    mid = _split(len(values))
    left = _one_of(values[:mid])
    return [(_JGE_K, 0, 1, values[mid]), (_JA, 0, 0, len(left)), *left, *_one_of(values[mid:])]


def _split(n: int) -> int:
    """Where a tree node splits `n` sorted values: whole leaves on the left, so leaves hold _LEAF values but one."""
    leaves = -(-n // _LEAF)
    return (leaves + 1) // 2 * _LEAF


def _branch(items: list[tuple[int, list[Insn]]]) -> list[Insn]:
    """Run the block of the value register A equals (`items` sorted by value), or drop; blocks end in returns."""
    if len(items) > _LEAF:
        mid = _split(len(items))
        left = _branch(items[:mid])
        return [(_JGE_K, 0, 1, items[mid][0]), (_JA, 0, 0, len(left)), *left, *_branch(items[mid:])]
    header = 2 * len(items) + 1
    out: list[Insn] = []
    at = header
    for i, (value, block) in enumerate(items):
        out += [(_JEQ_K, 0, 1, value), (_JA, 0, 0, at - (2 * i + 2))]
        at += len(block)
    out.append((_RET_K, 0, 0, _DROP))
    for _value, block in items:
        out += block
    return out


def _words_one_of(keys: list[tuple[int, ...]], level: int) -> list[Insn]:
    """Accept if the IPv6 source (its words in M[0..3]) is one of the sorted `keys` (their words from `level` on)."""
    load = (_LD_MEM, 0, 0, level)
    if level == 3:
        return [load, *_one_of([k[0] for k in keys])]
    if len(keys) == 1:  # one host left under this prefix: its remaining words, one after another
        rest = keys[0]
        out: list[Insn] = []
        for i, word in enumerate(rest):
            out += [(_LD_MEM, 0, 0, level + i), (_JEQ_K, 0, 2 * (len(rest) - i) - 1, word)]
        return [*out, (_RET_K, 0, 0, _ACCEPT), (_RET_K, 0, 0, _DROP)]
    groups: dict[int, list[tuple[int, ...]]] = {}
    for key in keys:
        groups.setdefault(key[0], []).append(key[1:])
    return [load, *_branch([(word, _words_one_of(rest, level + 1)) for word, rest in groups.items()])]


def _attach(fd: int, program: list[Insn]) -> None:
    code = b"".join(struct.pack("HBBI", op, jt, jf, k & 0xFFFFFFFF) for op, jt, jf, k in program)
    buf = ctypes.create_string_buffer(code, len(code))
    fprog = struct.pack("HL", len(program), ctypes.addressof(buf))  # struct sock_fprog {u16 len; filter *}
    sock = socket.socket(fileno=fd)
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, fprog)
    finally:
        sock.detach()  # the fd is the guard's own dup; it closes it


def tcp_listeners() -> dict[str, int]:
    """This process's listening TCP sockets: socket inode (``socket:[N]``) -> a file descriptor of it."""
    found: dict[str, int] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = int(name)
            link = os.readlink(f"/proc/self/fd/{name}")
        except (ValueError, OSError):  # closed since the listing
            continue
        if not link.startswith("socket:"):
            continue
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if (
                sock.family in (socket.AF_INET, socket.AF_INET6)
                and sock.type == socket.SOCK_STREAM
                and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            ):
                found[link] = fd
        except OSError:
            pass
        finally:
            sock.detach()
    return found


# Held while a guard looks for a transport's new listeners, and while kvbridge's own listeners (the side
# channel, the tcp transport) bind: a listener of kvbridge's own opened meanwhile must not be filtered.
_LISTENING = threading.RLock()


@contextlib.contextmanager
def binding() -> Iterator[None]:
    """Bind a listener of kvbridge's own inside this, so no guard takes it for a transport's."""
    with _LISTENING:
        yield


@attrs.define
class _Hold:
    """Why some addresses are admitted: a lease, a peer relation. It ends at `until` (inf: until released)."""

    addrs: frozenset[IPAddress]
    why: str
    until: float  # monotonic


class Admission:
    """The hosts this process's guarded listeners admit (process-wide: the filters are the process's).

    An address is admitted while a hold names it, and `grace_s` after the last hold naming it ended; `admit` (the
    caller's own word) admits for the life of the process. A host whose admission the guards cannot take (the
    kernel refuses the filter) is refused with `GuardFull`; the filters stay as they were.

    Every pull holds its reader's hosts and releases them, so a loaded prefill keeps a hold per request of the last
    `grace_s`: hundreds. Each step therefore costs what it changes, never a pass over every hold: holds count the
    hosts they name (`_refs`), ends wait in a heap, and the sweeper wakes only when the earliest end moves earlier.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()  # also serializes filter updates: the filters follow one admitted set
        self._changed = threading.Condition(self._lock)
        self._holds: dict[str, _Hold] = {}
        self._refs: collections.Counter[IPAddress] = collections.Counter()  # holds naming each address
        self._why: dict[IPAddress, str] = {}  # why the first hold naming an address named it
        self._ends: list[tuple[float, str]] = []  # (until, key) heap; an entry older than its hold's until is stale
        self._wakes_at = math.inf  # when the sweeper wakes next (inf: when told)
        self._permanent: dict[IPAddress, str] = {}
        self._hosts: dict[IPAddress, str] = {}  # admitted now -> why (first reason)
        self._guards: weakref.WeakSet[Guard] = weakref.WeakSet()
        self._changes = 0  # grows whenever the admitted hosts or the guards change: `version`
        self.grace_s = DEFAULT_GRACE_S
        self._sweeper: threading.Thread | None = None
        self._clock = time.monotonic

    def admit(self, host: str, why: str) -> bool:
        """Admit `host` (address or name) to every guarded listener for good; True if that changed anything.

        Raises GuardFull when the guards cannot take it."""
        addrs = _routable(resolve(host))
        with self._lock:
            fresh = [a for a in addrs if a not in self._permanent]
            for a in fresh:
                self._permanent[a] = why
            try:
                return self._apply(why)
            except GuardFull:
                for a in fresh:
                    del self._permanent[a]
                raise

    def hold(self, key: str, hosts: Iterable[str], why: str, *, ttl: float | None = None) -> tuple[IPAddress, ...]:
        """Admit `hosts` (addresses) while `key` is held: until `release(key)`, or for `ttl` seconds from now.

        Holding a key again adds its hosts and extends it. Returns the addresses held. Raises GuardFull (and
        holds nothing new) when the guards cannot take them."""
        addrs = frozenset(_routable(a for h in hosts for a in resolve(h)))
        if not addrs:
            return ()
        now = self._clock()
        until = math.inf if ttl is None else now + ttl
        with self._lock:
            old = self._holds.get(key)
            added = addrs - old.addrs if old else addrs
            self._holds[key] = _Hold(
                addrs | (old.addrs if old else frozenset()), why, until if old is None else max(old.until, until)
            )
            self._count(added, why, +1)
            if any(a not in self._hosts for a in added):  # a hold only adds: the filters change for a new host only
                try:
                    self._apply(why)
                except GuardFull:
                    self._count(added, why, -1)
                    if old is None:
                        del self._holds[key]
                    else:
                        self._holds[key] = old
                    raise
            self._ends_at(key)
        return tuple(addrs)

    def release(self, key: str) -> None:
        """`key` no longer needs its hosts: each goes `grace_s` from now, unless something else holds it."""
        with self._lock:
            hold = self._holds.get(key)
            if hold is not None and hold.until > (now := self._clock()):
                hold.until = now
                self._ends_at(key)

    def _count(self, addrs: Iterable[IPAddress], why: str, step: int) -> None:
        for a in addrs:
            self._refs[a] += step
            if self._refs[a] <= 0:
                del self._refs[a]
                self._why.pop(a, None)
            else:
                self._why.setdefault(a, why)

    def _ends_at(self, key: str) -> None:
        """`key`'s hold has a new end: queue it, and wake the sweeper if that is before it would wake."""
        until = self._holds[key].until
        if until == math.inf:
            return
        heapq.heappush(self._ends, (until, key))
        if self._sweeper is None or not self._sweeper.is_alive():
            self._wakes_at = until + self.grace_s
            self._sweeper = NamedThread(target=self._sweep, name="kvbridge-admission", daemon=True)
            self._sweeper.start()
        elif until + self.grace_s < self._wakes_at:
            self._changed.notify_all()

    def _wanted(self) -> dict[IPAddress, str]:
        wanted = dict(self._permanent)
        for a in self._refs:
            wanted.setdefault(a, self._why[a])
        return wanted

    def _apply(self, why: str) -> bool:
        """Bring the guards' filters to the admitted set as it is now (under the lock); True if it changed."""
        wanted = self._wanted()
        if len(wanted) > MAX_ADMITTED:
            raise GuardFull(
                f"kvbridge: {len(self._hosts)} hosts admitted already, at most {MAX_ADMITTED} are: not admitting "
                f"more ({why}); lower admit_grace so peers gone are forgotten sooner, or name the peers' network "
                "with allow="
            )
        if wanted.keys() == self._hosts.keys():
            return False
        gone = [a for a in self._hosts if a not in wanted]
        fresh = [a for a in wanted if a not in self._hosts]
        updated: list[Guard] = []
        try:
            for g in list(self._guards):
                g.update(wanted.keys())
                updated.append(g)
        except GuardFull:
            for g in updated:  # back to what every other guard still has: never half a set
                g.update(self._hosts.keys())
            raise
        self._hosts = wanted
        self._changes += 1
        if fresh:
            log.info("kvbridge: admitting %s to guarded transport listeners (%s)", ", ".join(map(str, fresh)), why)
        if gone:
            log.info("kvbridge: no longer admitting %s (nothing holds them)", ", ".join(map(str, gone)))
        self._changed.notify_all()
        return True

    def _sweep(self) -> None:
        """Forget the holds that ended more than the grace ago, and their hosts (a thread of its own)."""
        with self._lock:
            while True:
                now = self._clock()
                ended = False
                while self._ends and self._ends[0][0] + self.grace_s <= now:
                    until, key = heapq.heappop(self._ends)
                    hold = self._holds.get(key)
                    if hold is not None and hold.until == until:  # else stale: the hold was extended or ended later
                        del self._holds[key]
                        self._count(hold.addrs, hold.why, -1)
                        ended = True
                if ended:
                    try:
                        self._apply("a hold ended")  # removes hosts only: a smaller filter
                    except GuardFull as exc:
                        log.error("kvbridge: could not drop hosts no longer held: %s", exc)
                if not self._ends:
                    self._sweeper, self._wakes_at = None, math.inf
                    return
                self._wakes_at = self._ends[0][0] + self.grace_s
                self._changed.wait(max(0.01, self._wakes_at - now))

    def hosts(self) -> tuple[IPAddress, ...]:
        with self._lock:
            return tuple(self._hosts)

    def wait_until(self, predicate: Callable[[tuple[IPAddress, ...]], bool], timeout: float) -> bool:
        """Wait (at most `timeout` s) until `predicate(admitted hosts)` holds; whether it does."""
        with self._lock:
            return self._changed.wait_for(lambda: predicate(tuple(self._hosts)), timeout)

    def track(self, guard: Guard) -> None:
        with self._lock:
            self._guards.add(guard)
            self._changes += 1

    def forget(self, guard: Guard) -> None:
        with self._lock:
            self._guards.discard(guard)
            self._changes += 1

    def version(self) -> tuple[int, int]:
        """Moves whenever `states()` may have; with the guard count, as an unclosed guard leaves when collected."""
        return self._changes, len(self._guards)

    def guards(self) -> list[Guard]:
        with self._lock:
            return list(self._guards)


def _routable(addrs: Iterable[IPAddress]) -> list[IPAddress]:
    """Leaving out loopback (always admitted) and the unspecified address (no packet comes from it)."""
    return [a for a in addrs if not a.is_unspecified and not any(a in n for n in _LOOPBACK)]


ADMISSION = Admission()


def admit(host: str, why: str = "admitted by the caller") -> bool:
    """Admit `host` to this process's guarded transport listeners, for the life of the process.

    kvbridge's side channel admits peers itself, each for as long as a lease or relation needs it; call this
    only for a peer you authenticated some other way (the Python API with no side channel, say). Raises
    GuardFull when the guards cannot take another host.
    """
    return ADMISSION.admit(host, why)


def transport_hosts() -> tuple[str, ...]:
    """The addresses this process's guarded transports reach peers from: what its peers must admit.

    A transport on a routable hostname: that host's addresses; on loopback or every interface: every address
    of this host (loopback left out)."""
    found: dict[IPAddress, None] = {}
    for g in ADMISSION.guards():
        host = g.host
        named = () if host in ("", "0.0.0.0", "::") or is_loopback(host) else resolve(host)
        for a in _routable(named or local_addresses()):
            found[a] = None
    return tuple(map(str, found))


@attrs.frozen
class GuardState:
    """What `kvbridge doctor` and `/metrics` show of one guarded transport."""

    what: str
    open: bool
    ports: tuple[int, ...]
    admitted: int


class Guard:
    """The listening sockets one transport's library opened, filtered to admitted hosts.

    Refuses, before the library starts, an address other hosts reach when nobody can be admitted (no
    secret, no `allow`) and the network is not trusted (`insecure`).
    """

    def __init__(self, what: str, hostname: str, opts: GuardOptions) -> None:
        self.what = what
        self.open = bool(opts.insecure)
        self._allow = parse_allow(opts.allow)
        secret = opts.secret or load_secret(opts.secret_file)
        host = _without_port(hostname)
        self.host = host
        if not (self.open or secret or self._allow or is_loopback(host)):
            raise ConfigError(
                f"{what} would listen on {hostname!r}, which other hosts can reach, and it authenticates no peer: "
                "kvbridge admits to its ports only hosts that prove the shared secret on the side channel, and "
                f"none is set. {HOW_TO_SET}; or name the peers with allow=ADDRESS[/PREFIX],...; or bind to "
                '127.0.0.1; or, on a network you trust, set insecure=True (vLLM: "insecure": true in '
                "kv_connector_extra_config)"
            )
        # This host's own addresses: a local peer (UCX, say) may connect from any of them, not only loopback.
        own = {*local_addresses(), *(() if host in ("", "0.0.0.0", "::") else resolve(host))}
        self._own = tuple(ipaddress.ip_network(a) for a in sorted(own, key=lambda a: (a.version, int(a))))
        self._fds: dict[str, int] = {}
        self._ports: tuple[int, ...] = ()
        self._program: list[Insn] | None = None  # attached to every listener in _fds
        self._lock = threading.Lock()
        ADMISSION.grace_s = opts.admit_grace

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Start the transport's library inside this: the listeners it opens are guarded when it returns."""
        with _LISTENING:
            before = tcp_listeners()
            yield
            new = {k: fd for k, fd in tcp_listeners().items() if k not in before}
            with self._lock:
                for key, fd in new.items():
                    try:
                        self._fds[key] = os.dup(fd)
                    except OSError:
                        continue
                self._ports = tuple(sorted({_port(fd) for fd in self._fds.values()} - {0}))
        ADMISSION.track(self)
        if self.open:
            log.warning(
                "%s: its listeners (ports %s) accept ANY host (insecure: the network is trusted); whoever reaches "
                "them can read and write registered memory. Without insecure, kvbridge admits only hosts that "
                "prove the shared secret",
                self.what,
                ", ".join(map(str, self._ports)) or "none",
            )
            return
        try:
            self.refresh(strict=True)
        except OSError as exc:
            self.close()
            raise ConfigError(
                f"{self.what}: could not filter its listeners (SO_ATTACH_FILTER: {exc.strerror or exc}), so any host "
                "could read registered memory; on a network you trust, set insecure=True"
            ) from None
        log.info(
            "%s: listeners on ports %s admit loopback%s%s and hosts that prove the shared secret",
            self.what,
            ", ".join(map(str, self._ports)) or "none",
            "".join(f", {n}" for n in self._own),
            "".join(f", {n}" for n in self._allow),
        )

    def networks(self, hosts: Iterable[IPAddress] | None = None) -> list[IPNetwork]:
        """The sources admitted (with `hosts` admitted; default: as now)."""
        held = [ipaddress.ip_network(a) for a in (ADMISSION.hosts() if hosts is None else hosts)]
        return list(dict.fromkeys([*_LOOPBACK, *self._own, *self._allow, *held]))

    def refresh(self, *, strict: bool = False) -> None:
        """Attach the filter for the admitted hosts as they are now. `strict`: raise OSError as the kernel does."""
        with ADMISSION._lock:
            try:
                self.update(ADMISSION.hosts())
            except GuardFull as exc:
                if strict:
                    raise OSError(exc.args[0]) from None
                log.error("%s", exc)

    def update(self, hosts: Iterable[IPAddress]) -> None:
        """Filter every listener to admit `hosts` (and loopback, this host, `allow`).

        Or raise GuardFull, changing no listener's filter."""
        if self.open:
            return
        hosts = tuple(hosts)
        program = filter_program(self.networks(hosts))
        if len(program) > BPF_MAXINSNS:
            raise GuardFull(
                f"{self.what}: admitting {len(hosts)} hosts takes a filter of {len(program)} instructions, over the "
                f"kernel's {BPF_MAXINSNS}: not admitting more; name the peers' network with allow= (docs/security.md)"
            )
        with self._lock:
            done: list[int] = []
            for key, fd in self._fds.items():
                try:
                    _attach(fd, program)
                except OSError as exc:
                    for back in done if self._program is not None else ():
                        with contextlib.suppress(OSError):  # it held this filter a moment ago: it fits
                            _attach(back, self._program)
                    raise GuardFull(self._refusal(key, len(hosts), program, exc)) from None
                done.append(fd)
            self._program = program

    def _refusal(self, key: str, hosts: int, program: list[Insn], exc: OSError) -> str:
        what = (
            f"{self.what}: the kernel refused the filter of {key} admitting {hosts} hosts ({len(program)} "
            f"instructions): {exc.strerror}"
        )
        if exc.errno != errno.ENOMEM:
            return f"{what}; not admitting the new peer"
        return (
            f"{what}: net.core.optmem_max ({optmem_max()} bytes) bounds a socket's filter, and a new filter is "
            "charged while the old one still is. Not admitting the new peer: raise net.core.optmem_max "
            "(sysctl -w net.core.optmem_max=262144; docs/security.md gives the sizes), lower admit_grace so peers "
            "gone are forgotten sooner, or name the peers' network with allow="
        )

    def state(self) -> GuardState:
        return GuardState(self.what, self.open, self._ports, 0 if self.open else len(ADMISSION.hosts()))

    def listener(self, port: int) -> socket.socket | None:
        """A socket on the guarded listener bound to `port` (its own handle: close it), or None if there is none."""
        with self._lock:
            for fd in self._fds.values():
                if _port(fd) == port:
                    return socket.socket(fileno=os.dup(fd))
        return None

    def close(self) -> None:
        """Release the guard's handles on the sockets (the library closes its own). Safe to call twice."""
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        ADMISSION.forget(self)
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def _port(fd: int) -> int:
    sock = socket.socket(fileno=fd)
    try:
        return int(sock.getsockname()[1])
    except OSError:
        return 0
    finally:
        sock.detach()


def optmem_max() -> int | None:
    """net.core.optmem_max: the bytes of option memory (a socket filter's, among others) a socket may hold."""
    try:
        return int(Path(OPTMEM).read_text())
    except (OSError, ValueError):
        return None


def example_hosts(version: int, count: int) -> list[IPAddress]:
    """`count` host addresses to size filters with.

    IPv4 from 10.0.0.1 on; IPv6 in one /64, spread over its low 64 bits as interface ids are (each differs from the
    others in its last two words)."""
    if version == 4:
        return [ipaddress.IPv4Address(0x0A000001 + i) for i in range(count)]
    base = int(ipaddress.IPv6Address("fd00:6b76::"))
    return [ipaddress.IPv6Address(base + (i + 1) * 0x9E3779B97F4A7C15 % (1 << 64)) for i in range(count)]


def filter_fits(networks: list[IPNetwork]) -> bool:
    """Whether this kernel takes the filter for `networks` over one as large (as a refresh does).

    Tried on a listener of our own."""
    program = filter_program(networks)
    if len(program) > BPF_MAXINSNS:
        return False
    try:
        with socket.create_server(("127.0.0.1", 0)) as sock:
            _attach(sock.fileno(), program)
            _attach(sock.fileno(), program)
    except OSError:
        return False
    return True


def capacity(version: int, admitted: Iterable[IPAddress] = ()) -> int:
    """How many more hosts of IP `version` (`example_hosts`) a filter here takes beside `admitted`.

    At most MAX_ADMITTED in all."""
    base = [*_LOOPBACK, *(ipaddress.ip_network(a) for a in admitted)]
    low, high = 0, MAX_ADMITTED - len(base) + len(_LOOPBACK)
    hosts = [ipaddress.ip_network(a) for a in example_hosts(version, max(high, 0))]
    while low < high:  # the most that fit: a filter is monotone in its hosts
        mid = (low + high + 1) // 2
        if filter_fits(base + hosts[:mid]):
            low = mid
        else:
            high = mid - 1
    return max(low, 0)


def self_test() -> str | None:
    """Why this kernel cannot guard listeners (None: it can): attach a filter to a listener of our own."""
    try:
        with socket.create_server(("127.0.0.1", 0)) as sock:
            _attach(sock.fileno(), filter_program(_LOOPBACK))
    except OSError as exc:
        return f"SO_ATTACH_FILTER failed: {exc.strerror}"
    if not os.path.isdir("/proc/self/fd"):
        return "/proc/self/fd is missing (the guard finds a library's listeners there)"
    return None


def states() -> list[GuardState]:
    """Every guarded transport of this process, open ones included."""
    return [g.state() for g in ADMISSION.guards()]


@attrs.define
class StatesWatch:
    """What changed in `states()` (ports aside) since the last look, cheap enough to ask every engine step."""

    _version: tuple[int, int] | None = None
    _seen: list[tuple[str, bool, int]] | None = None

    def changed(self) -> list[GuardState] | None:
        """Every guard's state if any changed since the last call (the first call: all of them), else None."""
        version = ADMISSION.version()  # read before the states: a change between the two is seen next time
        if version == self._version:
            return None
        self._version = version
        now = states()
        seen = [(g.what, g.open, g.admitted) for g in now]
        if seen == self._seen:
            return None
        self._seen = seen
        return now
