"""Pure-Python TCP transport: the reference implementation and the fallback where no Mooncake wheel exists.

Every backend serves its registered memory on a listening socket. A transfer is one request
per connection round trip: a length-prefixed msgpack header with the remote ranges, then the
payload sent straight from registered memory with scatter/gather `sendmsg` and received in
place with `recvmsg_into`, so there is no Python-level copy and no syscall per block.

Only ranges inside registered memory are served, and only to callers that present the
per-endpoint token published in the endpoint info.
"""

from __future__ import annotations

import ctypes
import hmac
import logging
import queue
import secrets
import socket
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import attrs
import msgpack
import numpy as np

from kvbridge.backend import MigrationBackend, Op, Peer
from kvbridge.errors import ConfigError, InvalidDescriptor, PeerGone, ProtocolError, TransferFailed
from kvbridge.memory import Descriptors
from kvbridge.options import TransportOptions, option, parse
from kvbridge.types import BackendCapabilities, BackendConfig, EndpointInfo, MemoryKind, MemoryRegion

log = logging.getLogger(__name__)

_LEN = struct.Struct("!I")
_MAX_HEADER = 256 * 1024 * 1024
_IOV_CHUNK = 512  # well under IOV_MAX (1024 on Linux)


class _Views:
    """Memoryviews over registered regions, sliced per descriptor without copying."""

    def __init__(self) -> None:
        self._starts = np.empty(0, dtype=np.int64)
        self._views: list[memoryview] = []
        self._by_addr: dict[int, memoryview] = {}

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
        self._starts = np.array(order, dtype=np.int64)
        self._views = [self._by_addr[a] for a in order]

    def slices(self, addrs: np.ndarray, lengths: np.ndarray) -> list[memoryview]:
        """Views for ranges already checked to lie inside registered regions."""
        slot = np.searchsorted(self._starts, addrs, side="right") - 1
        offsets = addrs - self._starts[slot]
        views = self._views
        return [views[s][o : o + n] for s, o, n in zip(slot.tolist(), offsets.tolist(), lengths.tolist())]


def _send_frame(sock: socket.socket, obj: dict[str, Any]) -> None:
    body = msgpack.packb(obj, use_bin_type=True)
    sock.sendall(_LEN.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed")
        got += k
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> dict[str, Any]:
    (size,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if size > _MAX_HEADER:
        raise ProtocolError(f"tcp transport header of {size} bytes exceeds {_MAX_HEADER}")
    frame = msgpack.unpackb(_recv_exact(sock, size), raw=False)
    if not isinstance(frame, dict):
        raise ProtocolError("tcp transport header is not a map")
    return frame


def _sendmsg_all(sock: socket.socket, views: list[memoryview]) -> None:
    for i in range(0, len(views), _IOV_CHUNK):
        chunk = views[i : i + _IOV_CHUNK]
        while chunk:
            sent = sock.sendmsg(chunk)
            while chunk and sent >= len(chunk[0]):
                sent -= len(chunk[0])
                chunk = chunk[1:]
            if chunk and sent:
                chunk = [chunk[0][sent:], *chunk[1:]]


def _recvmsg_all(sock: socket.socket, views: list[memoryview]) -> None:
    for i in range(0, len(views), _IOV_CHUNK):
        chunk = views[i : i + _IOV_CHUNK]
        while chunk:
            got = sock.recvmsg_into(chunk)[0]
            if got == 0:
                raise ConnectionError("connection closed mid-payload")
            while chunk and got >= len(chunk[0]):
                got -= len(chunk[0])
                chunk = chunk[1:]
            if chunk and got:
                chunk = [chunk[0][got:], *chunk[1:]]


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
class TcpOptions(TransportOptions):
    """Options of the `tcp` transport."""

    port: int = option(0, "TCP port this backend serves its memory on; 0 picks a free one")
    connect_timeout: float = option(10.0, "seconds to wait for a peer to accept a connection before PeerGone")


class TcpBackend(MigrationBackend):
    """Reference transport over plain TCP sockets; options in `TcpOptions`."""

    name = "tcp"
    capabilities = BackendCapabilities(
        protocols=("tcp",), memory_kinds={MemoryKind.DRAM}, read=True, write=True, max_batch=None
    )

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        self._options: TcpOptions = parse(TcpOptions, config.options, what=f"backend {self.name!r}")
        self._views = _Views()
        self._token = secrets.token_hex(16)
        self._listener = socket.create_server((config.hostname, self._options.port))
        self._listener.settimeout(0.2)
        self._port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._server_threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        self._pools: list[queue.SimpleQueue[socket.socket]] = []
        accept = threading.Thread(target=self._accept_loop, name=f"kvbridge-tcp-accept-{self._port}", daemon=True)
        accept.start()
        self._server_threads.append(accept)

    # -- serving ------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.append(conn)
            t = threading.Thread(target=self._serve, args=(conn,), name="kvbridge-tcp-serve", daemon=True)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._stop.is_set():
                try:
                    frame = _recv_frame(conn)
                except (ConnectionError, OSError):
                    return
                if not self._handle(conn, frame):
                    return
        except (ConnectionError, OSError, ProtocolError) as exc:
            log.debug("tcp: connection dropped: %s", exc)
        finally:
            conn.close()

    def _handle(self, conn: socket.socket, frame: dict[str, Any]) -> bool:
        """Serve one request; False closes the connection."""
        token = frame.get("token")
        op = frame.get("op")
        raw = frame.get("ranges")
        if not isinstance(token, str) or not hmac.compare_digest(token, self._token):
            _send_frame(conn, {"ok": False, "error": "bad endpoint token: connect with this endpoint's current info"})
            return False
        if op not in ("read", "write") or not isinstance(raw, bytes) or len(raw) % 24:
            _send_frame(conn, {"ok": False, "error": "malformed request"})
            return False
        desc = np.frombuffer(raw, dtype="<i8").reshape(-1, 3)
        remote, length = desc[:, 1], desc[:, 2]
        with self._lock:
            local_index = self._local
            bad = local_index.outside(remote, length) if (length > 0).all() else np.array([0])
            error = ""
            if len(bad):
                i = int(bad[0])
                error = f"range [{int(remote[i]):#x}, +{int(length[i])}) is not registered here"
            views = None if error else self._views.slices(remote, length)
        if op == "read":
            if error:
                _send_frame(conn, {"ok": False, "error": error})
                return True
            _send_frame(conn, {"ok": True})
            _sendmsg_all(conn, views)  # type: ignore[arg-type]
            return True
        if error:
            _discard(conn, int(length[length > 0].sum()))
            _send_frame(conn, {"ok": False, "error": error})
            return True
        _recvmsg_all(conn, views)  # type: ignore[arg-type]
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
        return EndpointInfo(base.backend, base.protocol, base.address, base.regions, {"token": self._token})

    def _connect(self, endpoint: EndpointInfo) -> Any:
        host, _, port = endpoint.address.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"tcp endpoint address {endpoint.address!r} is not host:port")
        if "token" not in endpoint.extra:
            raise ConfigError(f"tcp endpoint {endpoint.address} carries no token; pass its endpoint_info() unchanged")
        pool: queue.SimpleQueue[socket.socket] = queue.SimpleQueue()
        pool.put(self._dial(host, int(port), endpoint.address))  # fail now if the peer is unreachable
        with self._lock:
            self._pools.append(pool)  # close() closes them: a peer object may outlive this backend
        return {"host": host, "port": int(port), "token": endpoint.extra["token"], "pool": pool}

    def _dial(self, host: str, port: int, name: str) -> socket.socket:
        try:
            sock = socket.create_connection((host, port), timeout=self._options.connect_timeout)
        except OSError as exc:
            raise PeerGone(f"cannot reach tcp peer {name}: {exc}; is it running?", peer=name, cause=str(exc)) from None
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _submit(self, peer: Peer, desc: Descriptors, op: Op) -> Future:
        with self._lock:
            local_views = self._views.slices(desc[:, 0], desc[:, 2])
        return self._spawn(lambda: self._exchange(peer, desc, op, local_views))

    def _exchange(self, peer: Peer, desc: Descriptors, op: Op, local_views: list[memoryview]) -> None:
        h = peer.handle
        try:
            sock = h["pool"].get_nowait()
        except queue.Empty:
            sock = self._dial(h["host"], h["port"], peer.name)
        try:
            _send_frame(sock, {"op": op, "token": h["token"], "ranges": _ranges(desc)})
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
        except (ConnectionError, OSError) as exc:
            sock.close()
            raise PeerGone(f"tcp peer {peer.name} dropped the connection during a {op}: {exc}",
                           peer=peer.name, cause=str(exc)) from None
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


def _drain(pool: queue.SimpleQueue[socket.socket]) -> None:
    """Close every idle connection of a peer's pool."""
    while True:
        try:
            pool.get_nowait().close()
        except queue.Empty:
            return
