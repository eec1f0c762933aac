"""Close the listeners of transports that authenticate nobody to hosts that have not proved the secret.

`Guard.capture` attaches a classic BPF socket filter (``SO_ATTACH_FILTER``) to the listeners a transport's
library (Mooncake, UCX under NIXL) opens as it starts; admission is per process, because the filters are.
Why, whom it admits and what an address filter cannot do: docs/security.md ("Transports that authenticate nobody").
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import logging
import os
import socket
import struct
import threading
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path

import attrs

from kvbridge.errors import ConfigError
from kvbridge.options import TransportOptions, option
from kvbridge.secret import HOW_TO_SET, is_loopback, load_secret

log = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# A BPF program holds at most 4096 instructions; an admitted IPv4 host costs 2, an IPv6 one 9.
MAX_ADMITTED = 1000
_LOOPBACK: tuple[IPNetwork, ...] = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))

# linux/filter.h
_SO_ATTACH_FILTER = 26
_SKF_NET_OFF = -0x100000  # loads relative to the network header: the filter of a TCP socket sees the TCP one
_LD_W_ABS, _LD_B_ABS = 0x20, 0x30
_ALU_RSH_K, _ALU_AND_K = 0x74, 0x54
_JEQ_K, _JA = 0x15, 0x05
_RET_K = 0x06
_ACCEPT, _DROP = 0xFFFFFFFF, 0


@attrs.frozen
class GuardOptions(TransportOptions):
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


def filter_program(networks: Iterable[IPNetwork]) -> list[tuple[int, int, int, int]]:
    """A classic BPF program accepting segments whose source address is in one of `networks`.

    Every jump is local (a match returns at once), so the program has no 255-instruction jump limit
    to meet but BPF's own 4096 instructions.
    """
    v4 = [n for n in networks if n.version == 4]
    v6 = [n for n in networks if n.version == 6]
    block4: list[tuple[int, int, int, int]] = []
    for net in v4:
        block4.append((_LD_W_ABS, 0, 0, _SKF_NET_OFF + 12))  # IPv4 source address
        if net.prefixlen < 32:
            block4.append((_ALU_AND_K, 0, 0, int(net.netmask)))
        block4 += [(_JEQ_K, 0, 1, int(net.network_address)), (_RET_K, 0, 0, _ACCEPT)]
    block4.append((_RET_K, 0, 0, _DROP))
    block6: list[tuple[int, int, int, int]] = []
    for net in v6:
        words = struct.unpack("!4I", net.network_address.packed)
        masks = struct.unpack("!4I", net.netmask.packed)
        body: list[tuple[int, int, int, int]] = []
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
    block6.append((_RET_K, 0, 0, _DROP))
    head = [
        (_LD_B_ABS, 0, 0, _SKF_NET_OFF),  # version and header length
        (_ALU_RSH_K, 0, 0, 4),
        (_JEQ_K, 1, 0, 4),  # IPv4: skip the jump to the IPv6 tests
        (_JA, 0, 0, len(block4)),
    ]
    return head + block4 + block6


def _attach(fd: int, program: list[tuple[int, int, int, int]]) -> None:
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


class Admission:
    """The hosts this process's guarded listeners admit (process-wide: the filters are the process's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hosts: dict[IPAddress, str] = {}
        self._named: set[str] = set()  # hosts as given, admitted already: the per-request fast path
        self._guards: weakref.WeakSet[Guard] = weakref.WeakSet()

    def admit(self, host: str, why: str) -> bool:
        """Admit `host` (address or name) to every guarded listener; True if that changed anything."""
        if host in self._named:
            return False
        addrs = [a for a in resolve(host) if not any(a in n for n in _LOOPBACK)]
        if not addrs:
            return False
        with self._lock:
            fresh = [a for a in addrs if a not in self._hosts]
            if not fresh:
                return False
            if len(self._hosts) + len(fresh) > MAX_ADMITTED:
                log.error(
                    "kvbridge: %d hosts admitted already, not admitting %s (%s): restart the engine to forget "
                    "old peers, or name the peers' network with allow=",
                    len(self._hosts),
                    host,
                    why,
                )
                return False
            for a in fresh:
                self._hosts[a] = why
            self._named.add(host)
            guards = list(self._guards)
        log.info("kvbridge: admitting %s to guarded transport listeners (%s)", ", ".join(map(str, fresh)), why)
        for g in guards:
            g.refresh()
        return True

    def hosts(self) -> tuple[IPAddress, ...]:
        with self._lock:
            return tuple(self._hosts)

    def track(self, guard: Guard) -> None:
        with self._lock:
            self._guards.add(guard)

    def forget(self, guard: Guard) -> None:
        with self._lock:
            self._guards.discard(guard)

    def guards(self) -> list[Guard]:
        with self._lock:
            return list(self._guards)


ADMISSION = Admission()


def admit(host: str, why: str = "admitted by the caller") -> bool:
    """Admit `host` to this process's guarded transport listeners.

    kvbridge calls it for every host that proved the shared secret; call it yourself only for a peer you
    authenticated some other way (the Python API with no side channel, say).
    """
    return ADMISSION.admit(host, why)


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
        self._lock = threading.Lock()

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
                f"{self.what}: could not filter its listeners (SO_ATTACH_FILTER: {exc.strerror}), so any host could "
                "read registered memory; on a network you trust, set insecure=True"
            ) from None
        log.info(
            "%s: listeners on ports %s admit loopback%s%s and hosts that prove the shared secret",
            self.what,
            ", ".join(map(str, self._ports)) or "none",
            "".join(f", {n}" for n in self._own),
            "".join(f", {n}" for n in self._allow),
        )

    def networks(self) -> list[IPNetwork]:
        """The sources admitted now."""
        hosts = [ipaddress.ip_network(a) for a in ADMISSION.hosts()]
        return list(dict.fromkeys([*_LOOPBACK, *self._own, *self._allow, *hosts]))

    def refresh(self, *, strict: bool = False) -> None:
        """Attach the filter for the admitted hosts as they are now (after an admission)."""
        if self.open:
            return
        program = filter_program(self.networks())
        with self._lock:
            for key, fd in list(self._fds.items()):
                try:
                    _attach(fd, program)
                except OSError as exc:
                    if strict:
                        raise
                    log.warning("%s: could not update the filter of %s: %s", self.what, key, exc)

    def state(self) -> GuardState:
        return GuardState(self.what, self.open, self._ports, 0 if self.open else len(ADMISSION.hosts()))

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
