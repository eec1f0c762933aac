"""Pure-Python TCP transport: the reference, and the fallback where no Mooncake wheel exists. See docs/internals.md."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import hmac
import logging
import queue
import secrets
import socket
import struct
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import attrs
import msgpack
import numpy as np

from kvbridge.base.errors import (
    ConfigError,
    InvalidDescriptor,
    PeerGone,
    ProtocolError,
    TransferFailed,
    TransferTimeout,
)
from kvbridge.base.memory import Descriptors
from kvbridge.base.options import BackendOptions, option
from kvbridge.base.secret import TCP, check_listen, derive, load_secret
from kvbridge.base.threadname import NamedThread
from kvbridge.base.types import BackendCapabilities, BackendConfig, EndpointInfo, MemoryKind, MemoryRegion
from kvbridge.transport import netguard
from kvbridge.transport.contract import MigrationBackend, Op, Peer

log = logging.getLogger(__name__)

_LEN = struct.Struct("!I")
_MAX_AUTH_FRAME = 1024  # what an unauthenticated connection may make the server read
_MAX_HEADER = 64 * 1024 * 1024  # after authentication: 2.8 million descriptors in one request
_CHALLENGE_BYTES = 16
_MAX_DISCARD = 1 << 30  # a refused write larger than this closes the connection instead of being drained
_HANDSHAKE_TIMEOUT_S = 10.0  # a connection that does not authenticate in time is dropped
_MAX_HANDSHAKES = 64  # connections (a thread each) that have not authenticated yet; a new one evicts the oldest
_EVICT_LOG_S = 10.0  # at most one warning this often about evicted handshakes (a flood must not flood the log)
_TRANSFER_DEADLINE_S = 30.0  # seconds a request may make no progress before the connection is dropped
_ACCEPT_BACKOFF_S = (0.01, 1.0)  # after a failed accept (EMFILE, ...) or thread start: first and longest pause
_IOV_CHUNK = 512  # well under IOV_MAX (1024 on Linux)


class _Views:
    """Memoryviews over registered regions, sliced per descriptor without copying. See docs/internals.md."""

    def __init__(self) -> None:
        self._by_addr: dict[int, memoryview] = {}
        self._rebuild()

    def add(self, regions: Sequence[MemoryRegion]) -> None:
        for r in regions:
            self._by_addr[r.addr] = memoryview((ctypes.c_char * r.length).from_address(r.addr)).cast("B")
        self._rebuild()

    def remove(self, regions: Sequence[MemoryRegion]) -> None:
        for r in regions:
            view = self._by_addr.pop(r.addr, None)
            if view is not None:
                view.release()
        self._rebuild()

    def _rebuild(self) -> None:
        order = sorted(self._by_addr)
        views = [self._by_addr[a] for a in order]
        starts = np.array(order, dtype=np.int64)
        ends = starts + np.array([len(v) for v in views], dtype=np.int64)
        # reach[i]: of the regions starting at or before region i, the one that ends last. It holds byte p
        # whenever any region does (p at or after region i's start, i the last such region): regions may
        # overlap, a later one nested inside an earlier.
        reach = np.zeros(len(order), dtype=np.int64)
        for i in range(1, len(order)):
            best = reach[i - 1]
            reach[i] = i if ends[i] >= ends[best] else best
        self._starts, self._ends, self._reach, self._views = starts, ends, reach, views

    def slices(self, addrs: np.ndarray, lengths: np.ndarray) -> list[memoryview]:
        """Views for ranges already checked to lie inside registered spans, in order. See docs/internals.md."""
        addrs = np.asarray(addrs, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        if len(self._views) == 0:
            return []
        slot = self._reach[np.clip(np.searchsorted(self._starts, addrs, side="right") - 1, 0, None)]
        offsets = addrs - self._starts[slot]
        room = np.maximum(self._ends[slot] - addrs, 0)
        views = self._views
        if bool((lengths <= room).all()):  # the common case: every range inside one region
            return [views[s][o : o + n] for s, o, n in zip(slot.tolist(), offsets.tolist(), lengths.tolist())]
        out: list[memoryview] = []
        for addr, n in zip(addrs.tolist(), lengths.tolist()):
            out.extend(self._pieces(addr, n))
        return out

    def _pieces(self, addr: int, n: int) -> list[memoryview]:
        """One range as views of the regions it crosses; stops short at a byte no region holds."""
        pieces: list[memoryview] = []
        while n > 0:
            i = int(np.searchsorted(self._starts, addr, side="right")) - 1
            if i < 0:
                break
            s = int(self._reach[i])
            end = int(self._ends[s])
            if end <= addr:
                break
            take = min(n, end - addr)
            offset = addr - int(self._starts[s])
            pieces.append(self._views[s][offset : offset + take])
            addr, n = addr + take, n - take
        return pieces


def _nbytes(views: list[memoryview]) -> int:
    return sum(len(v) for v in views)


def _send_frame(sock: socket.socket, obj: dict[str, Any]) -> None:
    body = msgpack.packb(obj, use_bin_type=True)
    sock.sendall(_LEN.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """`n` bytes; with a `deadline` (monotonic), TimeoutError once it passes, however the bytes trickle in."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline passed")
            sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed")
        got += k
    return bytes(buf)


def _recv_frame(sock: socket.socket, limit: int = _MAX_HEADER, deadline: float | None = None) -> dict[str, Any]:
    return _recv_body(sock, _recv_exact(sock, _LEN.size, deadline), limit, deadline)


def _recv_body(sock: socket.socket, prefix: bytes, limit: int, deadline: float | None = None) -> dict[str, Any]:
    """The frame whose length `prefix` was read already."""
    (size,) = _LEN.unpack(prefix)
    if size > limit:
        raise ProtocolError(f"tcp transport header of {size} bytes exceeds {limit}")
    try:
        frame = msgpack.unpackb(_recv_exact(sock, size, deadline), raw=False)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ProtocolError(f"tcp transport header is not msgpack: {exc}") from None
    if not isinstance(frame, dict):
        raise ProtocolError("tcp transport header is not a map")
    return frame


def _mac(key: bytes, role: bytes, *challenges: bytes) -> bytes:
    return hmac.new(key, b"kvbridge-tcp-v1/" + role + b"".join(challenges), hashlib.sha256).digest()


def _secret_key(secret: bytes) -> bytes:
    """The transport's own key from the shared secret, so a MAC here is never valid on the side channel."""
    return derive(secret, TCP) or b""  # never empty: called with a secret only


def _advance(chunk: list[memoryview], n: int) -> list[memoryview]:
    """`chunk` without its first `n` bytes."""
    while chunk and n >= len(chunk[0]):
        n -= len(chunk[0])
        chunk = chunk[1:]
    return [chunk[0][n:], *chunk[1:]] if chunk and n else chunk


def _sendmsg_all(sock: socket.socket, views: list[memoryview]) -> None:
    for i in range(0, len(views), _IOV_CHUNK):
        chunk = views[i : i + _IOV_CHUNK]
        while chunk:
            chunk = _advance(chunk, sock.sendmsg(chunk))


def _recvmsg_all(sock: socket.socket, views: list[memoryview]) -> None:
    for i in range(0, len(views), _IOV_CHUNK):
        chunk = views[i : i + _IOV_CHUNK]
        while chunk:
            got = sock.recvmsg_into(chunk)[0]
            if got == 0:
                raise ConnectionError("connection closed mid-payload")
            chunk = _advance(chunk, got)


def _discard(sock: socket.socket, n: int) -> None:
    scratch = memoryview(bytearray(min(n, 1 << 20) or 1))
    while n > 0:
        k = sock.recv_into(scratch[: min(n, len(scratch))])
        if k == 0:
            raise ConnectionError("connection closed")
        n -= k


def _ranges(desc: np.ndarray) -> bytes:
    return np.ascontiguousarray(desc, dtype="<i8").tobytes()


@attrs.frozen
class TcpOptions(BackendOptions):
    """Options of the `tcp` transport."""

    port: int = option(0, "TCP port this backend serves its memory on; 0 picks a free one", min=0, max=65535)
    connect_timeout: float = option(10.0, "seconds to wait for a peer to accept a connection", min=0.001, max=3600)
    handshake_timeout: float = option(
        _HANDSHAKE_TIMEOUT_S, "seconds a connection has to finish its whole handshake", min=0.001, max=3600
    )
    max_handshakes: int = option(
        _MAX_HANDSHAKES, "unauthenticated connections at once; more evict the oldest", min=1, max=65536
    )
    transfer_deadline: float = option(
        _TRANSFER_DEADLINE_S, "seconds a transfer may make no progress (then retried once)", min=0.001, max=86400
    )
    secret: str | bytes | None = option(None, "shared secret (16+ bytes; default: $KVBRIDGE_SECRET or secret_file)")
    secret_file: str | None = option(None, "file holding the shared secret (default: $KVBRIDGE_SECRET_FILE)")
    insecure: bool = option(False, "listen on a non-loopback address without a secret (logs a warning)")


class TcpBackend(MigrationBackend):
    """Reference transport over plain TCP sockets; options in `TcpOptions`."""

    name = "tcp"
    capabilities = BackendCapabilities(
        protocols=("tcp",), memory_kinds={MemoryKind.DRAM}, read=True, write=True, max_batch=None
    )

    options_class = TcpOptions

    def __init__(self, config: BackendConfig, options: TcpOptions | None = None) -> None:
        super().__init__(config, options)
        opts: TcpOptions = self.options  # type: ignore[assignment]
        secret = opts.secret or load_secret(opts.secret_file)
        if isinstance(secret, str):
            secret = secret.encode()
        check_listen("the tcp transport", config.hostname, secret, insecure=opts.insecure)
        self._views = _Views()
        # With a shared secret the key never leaves this host; without one (loopback, or the insecure
        # opt-in) a random per-endpoint token is the key, published to whoever may read the endpoint info.
        self._token = "" if secret else secrets.token_hex(16)
        self._key = _secret_key(secret) if secret else self._token.encode()
        self._peer_key = _secret_key(secret) if secret else None
        with netguard.binding():  # it authenticates its own peers: no guard may filter it
            self._listener = socket.create_server((config.hostname, opts.port))
        self._listener.settimeout(0.2)
        self._port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._server_threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        self._pools: list[queue.SimpleQueue[socket.socket]] = []
        self._pending: OrderedDict[socket.socket, str] = OrderedDict()  # unauthenticated: source host, oldest first
        self._evicted, self._evict_logged = 0, 0.0  # evictions since the last warning about them, and its time
        # No progress within the deadline: the connection is dropped (a socket timeout after the handshake), and
        # the base class resubmits the part once (see kvbridge.transport.contract).
        self.transfer_deadline_s = opts.transfer_deadline
        accept = NamedThread(target=self._accept_loop, name=f"kvbridge-tcp-accept-{self._port}", daemon=True)
        accept.start()
        self._server_threads.append(accept)

    # -- serving ------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        """Accept until closed. See docs/internals.md."""
        pause = 0.0
        while not self._stop.is_set():
            try:
                conn, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set():
                    return  # close() closed the listener
                pause = min(max(pause * 2, _ACCEPT_BACKOFF_S[0]), _ACCEPT_BACKOFF_S[1])
                log.warning("tcp transport %s: accept failed (%s); retrying in %.2fs", self._address(), exc, pause)
                self._stop.wait(pause)
                continue
            if self._admit(conn, addr):
                pause = 0.0
            else:
                pause = min(max(pause * 2, _ACCEPT_BACKOFF_S[0]), _ACCEPT_BACKOFF_S[1])
                self._stop.wait(pause)

    def _admit(self, conn: socket.socket, addr: Any) -> bool:
        """Serve a new connection on a thread of its own. See docs/internals.md."""
        host = addr[0] if isinstance(addr, tuple) and addr else ""
        with self._lock:
            victim = self._victim() if len(self._pending) >= self.options.max_handshakes else None
            self._pending[conn] = host
            self._conns.append(conn)
        if victim is not None:
            with contextlib.suppress(OSError):  # shutdown wakes its thread in recv; close would not
                victim.shutdown(socket.SHUT_RDWR)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            NamedThread(target=self._serve, args=(conn,), name="kvbridge-tcp-serve", daemon=True).start()
        except (OSError, RuntimeError) as exc:  # RuntimeError: can't start new thread
            self._forget(conn)
            log.warning("tcp transport %s: cannot serve %s: %s; closed it", self._address(), _host_port(addr), exc)
            return False
        return True

    def _victim(self) -> socket.socket:
        """Under _lock: take the pending handshake to evict (the oldest of the busiest source) out of `_pending`."""
        busiest = Counter(self._pending.values()).most_common(1)[0][0]
        victim = next(c for c, h in self._pending.items() if h == busiest)
        del self._pending[victim]
        self._evicted, now = self._evicted + 1, time.monotonic()
        if now - self._evict_logged >= _EVICT_LOG_S:
            msg = "tcp transport %s: max_handshakes (%d) reached: closed the oldest from %s (%d such since the last)"
            log.warning(msg, self._address(), self.options.max_handshakes, busiest, self._evicted)
            self._evicted, self._evict_logged = 0, now
        return victim

    def _forget(self, conn: socket.socket) -> None:
        conn.close()
        with self._lock:
            if conn in self._conns:
                self._conns.remove(conn)
            self._pending.pop(conn, None)

    def _serve(self, conn: socket.socket) -> None:
        peer, authenticated = "an unknown peer", False
        try:
            host, port = conn.getpeername()[:2]
            peer = f"{host}:{port}"
            if not self._authenticate(conn, peer):
                return
            authenticated = True
            deadline = self.options.transfer_deadline
            while not self._stop.is_set():
                try:
                    conn.settimeout(None)  # an idle pooled connection waits for its next request
                    prefix = _recv_exact(conn, _LEN.size)
                except (ConnectionError, OSError):
                    return
                # From here the request makes progress or its connection is dropped (a socket timeout: OSError).
                conn.settimeout(deadline)
                if not self._handle(conn, _recv_body(conn, prefix, _MAX_HEADER), peer):
                    return
        except ProtocolError as exc:
            log.warning("tcp transport %s: refused %s: %s", self._address(), peer, exc)
        except (ConnectionError, OSError) as exc:
            # A kvbridge peer authenticates at once: a connection that drops before is refused, and said so.
            with self._lock:
                evicted = conn not in self._pending and not authenticated  # _admit said so already
            level, when = (logging.DEBUG, "") if authenticated else (logging.WARNING, " before authenticating")
            log.log(
                logging.DEBUG if evicted else level,
                "tcp transport %s: %s dropped%s: %s",
                self._address(),
                peer,
                when,
                exc,
            )
        finally:
            self._forget(conn)

    def _authenticate(self, conn: socket.socket, peer: str) -> bool:
        """Challenge-response before anything else; False: refused. See docs/internals.md."""
        challenge = secrets.token_bytes(_CHALLENGE_BYTES)
        deadline = time.monotonic() + self.options.handshake_timeout
        try:
            conn.settimeout(self.options.handshake_timeout)
            _send_frame(conn, {"challenge": challenge})
            hello = _recv_frame(conn, _MAX_AUTH_FRAME, deadline)
        except TimeoutError:
            raise ProtocolError(
                f"no authentication within the {self.options.handshake_timeout:g}s handshake timeout"
            ) from None
        mac, theirs = hello.get("mac"), hello.get("challenge")
        if not isinstance(mac, bytes) or not isinstance(theirs, bytes) or len(theirs) != _CHALLENGE_BYTES:
            error = "malformed authentication"
        elif not hmac.compare_digest(mac, _mac(self._key, b"client", challenge)):
            error = "bad credentials: connect with this endpoint's current info and the same shared secret"
        else:
            with self._lock:  # authenticated: no longer pending, so no eviction; or evicted already: refused
                evicted = self._pending.pop(conn, None) is None
            if evicted:
                raise ConnectionError("evicted by newer connections (max_handshakes) before it authenticated")
            _send_frame(conn, {"ok": True, "mac": _mac(self._key, b"server", challenge, theirs)})
            return True
        log.warning("tcp transport %s: refused %s: %s", self._address(), peer, error)
        _send_frame(conn, {"ok": False, "error": error})
        return False

    def _handle(self, conn: socket.socket, frame: dict[str, Any], peer: str) -> bool:
        """Serve one request of an authenticated connection; False closes the connection."""
        op = frame.get("op")
        raw = frame.get("ranges")
        if op not in ("read", "write") or not isinstance(raw, bytes) or not raw or len(raw) % 24:
            log.warning("tcp transport %s: malformed request from %s: closed", self._address(), peer)
            _send_frame(conn, {"ok": False, "error": "malformed request"})
            return False
        desc = np.frombuffer(raw, dtype="<i8").reshape(-1, 3)
        remote, length = desc[:, 1], desc[:, 2]
        with self._lock:
            local_index = self._local
            bad = local_index.outside(remote, length)
            error = ""
            if len(bad):
                i = int(bad[0])
                error = f"range [{int(remote[i]):#x}, +{int(length[i])}) is not registered here"
                log.warning("tcp transport %s: %s from %s: %s", self._address(), op, peer, error)
            views = [] if error else self._views.slices(remote, length)
            if not error and _nbytes(views) != sum(length.tolist()):
                # RegionIndex found the ranges registered, yet the views fall short: never send or land short
                error = f"ranges of {sum(length.tolist())} bytes are not all in registered memory here"
                log.error("tcp transport %s: %s from %s: %s (a bug: report it)", self._address(), op, peer, error)
        if op == "read":
            if error:
                _send_frame(conn, {"ok": False, "error": error})
                return True
            _send_frame(conn, {"ok": True})
            _sendmsg_all(conn, views)
            return True
        if error:
            total = sum(length.tolist())  # Python ints: a hostile sum must not wrap around
            if not 0 < total <= _MAX_DISCARD:
                return False  # not worth reading: the writer sees the connection close
            _discard(conn, total)
            _send_frame(conn, {"ok": False, "error": error})
            return True
        _recvmsg_all(conn, views)
        _send_frame(conn, {"ok": True})
        return True

    # -- MigrationBackend hooks -------------------------------------------------------------

    def _register(self, regions: Sequence[MemoryRegion]) -> None:
        self._views.add(regions)

    def _unregister(self, regions: Sequence[MemoryRegion]) -> None:
        self._views.remove(regions)

    def _address(self) -> str:
        return f"{self.config.hostname}:{self._port}"

    def endpoint(self) -> EndpointInfo:
        base = super().endpoint()
        extra = {"token": self._token} if self._token else {"auth": "secret"}
        return EndpointInfo(base.backend, base.protocol, base.address, base.regions, extra)

    def _connect(self, endpoint: EndpointInfo) -> Any:
        host, _, port = endpoint.address.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"tcp endpoint address {endpoint.address!r} is not host:port")
        token = endpoint.extra.get("token")
        if token:
            key = str(token).encode()
        elif self._peer_key is not None:
            key = self._peer_key
        else:
            raise ConfigError(
                f"tcp endpoint {endpoint.address} authenticates with the shared secret and none is "
                "configured here: set KVBRIDGE_SECRET (or KVBRIDGE_SECRET_FILE) to the same secret"
            )
        pool: queue.SimpleQueue[socket.socket] = queue.SimpleQueue()
        handle = {"host": host, "port": int(port), "key": key, "pool": pool}
        pool.put(self._dial(handle, endpoint.address))  # fail now if the peer is unreachable or refuses us
        with self._lock:
            self._pools.append(pool)  # close() closes them: a peer object may outlive this backend
        return handle

    def _dial(self, h: dict[str, Any], name: str) -> socket.socket:
        """A connection to the peer, authenticated both ways."""
        timeout = self.options.connect_timeout
        try:
            sock = socket.create_connection((h["host"], h["port"]), timeout=timeout)
        except OSError as exc:
            raise _lost(name, "to connect", exc) from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            challenge = _recv_frame(sock, _MAX_AUTH_FRAME).get("challenge")
            if not isinstance(challenge, bytes):
                raise ProtocolError("no challenge")
            mine = secrets.token_bytes(_CHALLENGE_BYTES)
            _send_frame(sock, {"mac": _mac(h["key"], b"client", challenge), "challenge": mine})
            reply = _recv_frame(sock, _MAX_AUTH_FRAME)
            mac, why = reply.get("mac"), f"refused to authenticate this engine: {reply.get('error')}"
            if reply.get("ok"):
                good = isinstance(mac, bytes) and hmac.compare_digest(mac, _mac(h["key"], b"server", challenge, mine))
                why = "" if good else "did not prove it holds the endpoint's key (another peer, or another secret)"
            if why:
                hint = "use the peer's current endpoint info and the same KVBRIDGE_SECRET"
                raise TransferFailed(f"tcp peer {name} {why}; {hint}", peer=name, cause="authentication")
        except (OSError, ProtocolError) as exc:
            sock.close()
            raise _lost(name, "in the handshake", exc) from None
        except BaseException:
            sock.close()
            raise
        # A peer that stops sending or reading mid-transfer fails it here instead of holding it forever.
        sock.settimeout(self.options.transfer_deadline)
        return sock

    def _submit(self, peer: Peer, desc: Descriptors, op: Op) -> Future:
        with self._lock:
            local_views = self._views.slices(desc[:, 0], desc[:, 2])
        if _nbytes(local_views) != int(desc[:, 2].sum()):  # checked against the registration: a bug if so
            raise InvalidDescriptor(
                f"local ranges of a tcp {op} with {peer.name} are not all in registered memory here",
                peer=peer.name,
                cause="local views fall short",
            )
        return self._spawn(peer, lambda: self._exchange(peer, desc, op, local_views))

    def _exchange(self, peer: Peer, desc: Descriptors, op: Op, local_views: list[memoryview]) -> None:
        h = peer.handle
        try:
            sock = h["pool"].get_nowait()
        except queue.Empty:
            sock = self._dial(h, peer.name)
        try:
            _send_frame(sock, {"op": op, "ranges": _ranges(desc)})
            if op == "write":
                _sendmsg_all(sock, local_views)
            reply = _recv_frame(sock)
            if not reply.get("ok"):
                sock.close()
                cause = str(reply.get("error", "unknown error"))
                kind = InvalidDescriptor if "not registered" in cause else TransferFailed
                raise kind(f"tcp peer {peer.name} refused the {op}: {cause}", peer=peer.name, cause=cause)
            if op == "read":
                _recvmsg_all(sock, local_views)
        except OSError as exc:
            sock.close()
            raise _lost(peer.name, f"during a {op}", exc) from None
        h["pool"].put(sock)

    def _disconnect(self, peer: Peer) -> None:
        _drain(peer.handle["pool"])

    def _shutdown(self) -> None:
        self._stop.set()
        self._listener.close()
        with self._lock:
            for pool in self._pools:
                _drain(pool)
            for conn in self._conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for t in self._server_threads:
            t.join(timeout=2)


def _lost(peer: str, when: str, exc: BaseException) -> PeerGone | TransferTimeout:
    """A socket timeout is a stall, which the base class resubmits once; any other error, a peer gone."""
    if isinstance(exc, TimeoutError):
        return TransferTimeout(f"tcp peer {peer} made no progress {when} ({exc})", peer=peer, cause="stalled")
    return PeerGone(f"tcp peer {peer} failed {when}: {exc}; is it running?", peer=peer, cause=str(exc))


def _host_port(addr: Any) -> str:
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) >= 2 else "an unknown peer"


def _drain(pool: queue.SimpleQueue[socket.socket]) -> None:
    """Close every idle connection of a peer's pool."""
    while True:
        try:
            pool.get_nowait().close()
        except queue.Empty:
            return
