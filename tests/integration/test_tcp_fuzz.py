"""Fuzzing the TCP transport's listener (hypothesis), over real loopback sockets.

Random, truncated, oversized, forged and replayed handshakes, and malformed requests on an authenticated
connection: each is refused with a logged warning, the listener keeps serving a legitimate reader, and nothing
(threads, sockets, memory held by kvbridge) grows.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvbridge import create_backend
from kvbridge.transport import tcp
from kvbridge_tools.harness.leaks import Counted, held_after, only_to

SECRET = b"tcp-fuzz-secret-0123456789abcdef"
FAST = settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


class Listener:
    def __init__(self) -> None:
        self.kv = np.arange(1 << 16, dtype=np.uint8)
        self.backend = create_backend("tcp", hostname="127.0.0.1", secret=SECRET, handshake_timeout=5)
        self.backend.register_memory(self.kv)
        self.address = ("127.0.0.1", self.backend._port)
        self.key = tcp._secret_key(SECRET)
        self.warnings = Counted()

    def exchange(self, payload: bytes, *, authenticate: bool = False) -> bytes:
        """Connect, (authenticate,) send `payload`, close our side; what the server sent until it closed."""
        with socket.create_connection(self.address, timeout=10) as s:
            challenge = tcp._recv_frame(s, tcp._MAX_AUTH_FRAME)["challenge"]
            if authenticate:
                mine = os.urandom(16)
                tcp._send_frame(s, {"mac": tcp._mac(self.key, b"client", challenge), "challenge": mine})
                assert tcp._recv_frame(s, tcp._MAX_AUTH_FRAME)["ok"]
            out = bytearray()
            try:
                s.sendall(payload)
                s.shutdown(socket.SHUT_WR)
                while chunk := s.recv(65536):  # bounded by the socket timeout: the server must close
                    out += chunk
            except (ConnectionResetError, BrokenPipeError):  # it closed with our bytes unread
                pass
            except OSError as exc:
                if exc.errno != errno.ENOTCONN:  # (the same, seen by shutdown)
                    raise
            return bytes(out)

    def refused(self, payload: bytes, *, authenticate: bool = False) -> bytes:
        before = self.warnings.count
        reply = self.exchange(payload, authenticate=authenticate)
        assert self.warnings.count > before, f"refused without a logged reason: {payload[:40]!r}"
        return reply


@pytest.fixture(scope="module")
def listener() -> Iterator[Listener]:
    lst = Listener()
    logger = logging.getLogger("kvbridge.transport.tcp")
    logger.addHandler(lst.warnings)
    propagate, logger.propagate = logger.propagate, False
    try:
        yield lst
    finally:
        logger.removeHandler(lst.warnings)
        logger.propagate = propagate
        lst.backend.close()


def frame(obj: object) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack("!I", len(body)) + body


values = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=48) | st.text(max_size=16)


@FAST
@given(payload=st.binary(max_size=2048))
def test_fuzz_random_bytes_instead_of_the_handshake(listener: Listener, payload: bytes) -> None:
    reply = listener.refused(payload)
    assert b"ok" not in reply or msgpack.unpackb(reply[4:])["ok"] is False


@FAST
@given(size=st.integers(tcp._MAX_AUTH_FRAME + 1, 2**32 - 1), tail=st.binary(max_size=64))
def test_fuzz_oversized_handshake_is_refused_before_it_is_read(listener: Listener, size: int, tail: bytes) -> None:
    # The header claims up to 4 GiB; the server refuses on the header alone (the connection would
    # otherwise wait for bytes that never come, and the socket timeout fails the test).
    listener.refused(struct.pack("!I", size) + tail)
    assert "exceeds 1024" in listener.warnings.last


@FAST
@given(
    hello=st.dictionaries(st.sampled_from(["mac", "challenge", "token", "op"]), values, max_size=4),
    cut=st.integers(0, 8),
)
def test_fuzz_forged_or_truncated_handshakes(listener: Listener, hello: dict, cut: int) -> None:
    data = frame(hello)
    reply = listener.refused(data[: len(data) - cut] if cut else data)
    if reply:
        assert msgpack.unpackb(reply[4:])["ok"] is False


def test_replayed_handshake_is_refused(listener: Listener) -> None:
    """A handshake recorded from a legitimate connection answers that connection's challenge only."""
    with socket.create_connection(listener.address, timeout=10) as s:
        challenge = tcp._recv_frame(s, tcp._MAX_AUTH_FRAME)["challenge"]
        recorded = frame({"mac": tcp._mac(listener.key, b"client", challenge), "challenge": os.urandom(16)})
        s.sendall(recorded)
        assert tcp._recv_frame(s, tcp._MAX_AUTH_FRAME)["ok"]
    for _ in range(100):
        reply = listener.refused(recorded)
        assert msgpack.unpackb(reply[4:])["error"].startswith("bad credentials")


@FAST
@given(
    op=st.sampled_from(["read", "write", "READ", ""]) | values,
    ranges=st.binary(max_size=100)
    | st.lists(st.tuples(*[st.integers(-(2**63), 2**63 - 1)] * 3), min_size=1, max_size=6).map(
        lambda rows: np.array(rows, dtype="<i8").tobytes()
    ),
    extra=st.dictionaries(st.sampled_from(["token", "x"]), values, max_size=2),
)
def test_fuzz_malformed_requests_after_authenticating(
    listener: Listener, op: object, ranges: bytes, extra: dict
) -> None:
    """An authenticated peer still gets only registered memory, and a malformed header closes the connection."""
    reply = listener.refused(frame({"op": op, "ranges": ranges, **extra}), authenticate=True)
    if reply:
        assert msgpack.unpackb(reply[4 : 4 + struct.unpack("!I", reply[:4])[0]])["ok"] is False


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_listener_keeps_serving_and_nothing_grows(listener: Listener) -> None:
    """Run after the fuzzing above (same module listener): a reader with the secret still reads.

    Another round of hostile connections leaves no thread, socket or allocation behind.
    """
    reader = create_backend("tcp", hostname="127.0.0.1", secret=SECRET)
    out = np.zeros_like(listener.kv)
    reader.register_memory(out)
    hostile = [os.urandom(n) for n in range(0, 300, 3)] + [struct.pack("!I", 1 << 30)] * 50

    def again() -> None:
        for payload in hostile:
            listener.refused(payload)
        _settle(threads)

    try:
        # pytest's capture handlers keep every record, and a record the frames of its exception: only count here.
        # (pytest adds them at each test's start to every logger that does not propagate, this one too.)
        with only_to({"kvbridge.transport.tcp": listener.warnings}):
            peer = reader.connect(listener.backend.endpoint_info())
            reader.transfer(peer, [(out.ctypes.data, listener.kv.ctypes.data, out.nbytes)]).wait(10)
            assert np.array_equal(out, listener.kv)
            for payload in hostile:  # warm-up: caches, the accept loop's first allocations
                listener.refused(payload)
            _settle(threading.active_count())
            threads, fds = threading.active_count(), _fds()
            grown = held_after(again)
            assert threading.active_count() <= threads and _fds() <= fds, "threads or sockets leaked"
            assert grown.bytes < 32 * 1024, f"{grown} held after {len(hostile)} hostile connections"
            out[:] = 0
            reader.transfer(peer, [(out.ctypes.data, listener.kv.ctypes.data, out.nbytes)]).wait(10)
            assert np.array_equal(out, listener.kv)
    finally:
        reader.close()


def _settle(threads: int) -> None:
    """Serving threads end just after their connection closes: wait (bounded) for them to go."""
    deadline = time.monotonic() + 10
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.01)


# -- the listener under load: a handshake deadline, a cap on handshakes, an accept loop that goes on ---------


def _closed_by_server(s: socket.socket, timeout: float) -> bool:
    """Whether the server closes `s` (EOF or reset) within `timeout`; bytes it sends first are skipped."""
    s.settimeout(timeout)
    try:
        while s.recv(4096):
            pass
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return True


def test_a_handshake_trickled_a_byte_at_a_time_is_dropped_at_the_deadline() -> None:
    """The handshake timeout bounds the whole handshake, not each recv.

    A byte every 0.2 s against a 1 s deadline keeps a per-recv timeout waiting for ever (1024 bytes may follow),
    and must not keep this one.
    """
    server = create_backend("tcp", hostname="127.0.0.1", secret=SECRET, handshake_timeout=1)
    try:
        with socket.create_connection(("127.0.0.1", server._port), timeout=10) as s:
            tcp._recv_frame(s, tcp._MAX_AUTH_FRAME)
            s.sendall(struct.pack("!I", 1000))  # a hello of 1000 bytes, announced
            closed = False
            for _ in range(100):  # 20 s at most: far past the deadline
                try:
                    s.sendall(b"\x00")
                except (ConnectionResetError, BrokenPipeError):
                    closed = True
                    break
                if _closed_by_server(s, 0.2):
                    closed = True
                    break
            assert closed, "a trickling handshake held its connection for 20 s against a 1 s handshake timeout"
    finally:
        server.close()


def _idle(n: int, port: int) -> list[socket.socket]:
    """`n` connections that never authenticate (a stranger's, left idle)."""
    idle: list[socket.socket] = []
    try:
        for _ in range(n):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
    except BaseException:
        for s in idle:
            s.close()
        raise
    return idle


def test_connections_past_max_handshakes_evict_the_oldest_and_an_authenticated_peer_still_reads() -> None:
    server = create_backend("tcp", hostname="127.0.0.1", secret=SECRET, handshake_timeout=60, max_handshakes=4)
    kv = np.arange(1 << 16, dtype=np.uint8)
    server.register_memory(kv)
    reader = create_backend("tcp", hostname="127.0.0.1", secret=SECRET)
    out = np.zeros_like(kv)
    reader.register_memory(out)
    idle: list[socket.socket] = []
    try:
        peer = reader.connect(server.endpoint_info())  # authenticated before the flood: its connection is pooled
        idle = _idle(4, server._port)  # every handshake slot: each gets its challenge, none answers
        for s in idle:
            assert "challenge" in tcp._recv_frame(s, tcp._MAX_AUTH_FRAME)
        idle += _idle(3, server._port)
        for s in idle[:3]:  # the three oldest made room for the three newest
            assert _closed_by_server(s, 10), "a connection past max_handshakes did not evict the oldest"
        reader.transfer(peer, [(out.ctypes.data, kv.ctypes.data, out.nbytes)]).wait(10)
        assert np.array_equal(out, kv)
    finally:
        for s in idle:
            s.close()
        reader.close()
        server.close()


def test_300_idle_strangers_on_this_host_do_not_lock_out_a_fresh_peer_holding_the_secret() -> None:
    """Issue 44 (10): idle unauthenticated connections filled the handshake slots and a new peer was closed at once."""
    server = create_backend("tcp", hostname="127.0.0.1", secret=SECRET)  # default max_handshakes and deadline
    kv = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8)
    server.register_memory(kv)
    reader = create_backend("tcp", hostname="127.0.0.1", secret=SECRET)
    out = np.zeros_like(kv)
    reader.register_memory(out)
    idle = _idle(300, server._port)
    try:
        peer = reader.connect(server.endpoint_info())
        reader.transfer(peer, [(out.ctypes.data, kv.ctypes.data, out.nbytes)]).wait(30)
        assert np.array_equal(out, kv)
    finally:
        for s in idle:
            s.close()
        reader.close()
        server.close()


_EMFILE_CHILD = """
import logging, os, resource, sys
import numpy as np
from kvbridge import create_backend
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
kv = np.arange(1 << 16, dtype=np.uint8)
backend = create_backend("tcp", hostname="127.0.0.1", secret=sys.argv[1].encode(), handshake_timeout=60)
backend.register_memory(kv)
highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 3, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
print(backend.endpoint_info().hex(), flush=True)
sys.stdin.read()
backend.close()
"""


def test_accept_loop_goes_on_after_running_out_of_file_descriptors() -> None:
    """A listener in a process at its RLIMIT_NOFILE serves an authenticated peer again once connections close.

    Meanwhile accept() fails with EMFILE while connections pile up.
    """
    import queue
    import subprocess
    import sys

    child = subprocess.Popen(
        [sys.executable, "-c", _EMFILE_CHILD, SECRET.decode()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.SimpleQueue[str] = queue.SimpleQueue()
    drain = threading.Thread(target=lambda: [lines.put(line) for line in child.stderr], daemon=True)  # type: ignore[union-attr]
    drain.start()
    flood: list[socket.socket] = []
    reader = create_backend("tcp", hostname="127.0.0.1", secret=SECRET, connect_timeout=10)
    try:
        info = bytes.fromhex(child.stdout.readline().strip())  # type: ignore[union-attr]
        assert info, "the child listener did not start"
        from kvbridge.base import wire
        from kvbridge.base.types import EndpointInfo

        endpoint = wire.decode(info, EndpointInfo)
        port = int(endpoint.address.rpartition(":")[2])
        flood = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(8)]
        seen = []
        while not any("accept failed" in line for line in seen):
            seen.append(lines.get(timeout=30))  # queue.Empty fails the test: no EMFILE was logged
        for s in flood:
            s.close()
        out = np.zeros(1 << 16, dtype=np.uint8)
        reader.register_memory(out)
        peer = reader.connect(endpoint)  # PeerGone if the accept loop ended
        reader.transfer(peer, [(out.ctypes.data, endpoint.regions[0].addr, out.nbytes)]).wait(10)
        assert np.array_equal(out, np.arange(1 << 16, dtype=np.uint8))
    finally:
        for s in flood:
            s.close()
        reader.close()
        child.stdin.close()  # type: ignore[union-attr]
        try:
            child.wait(timeout=15)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        drain.join(timeout=5)


# -- transfers across adjacent regions, and a transfer deadline ---------------------------------------------

SPLIT = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
SIZE = 4 << 20


@st.composite
def _crossing(draw: st.DrawFn) -> tuple[int, int, int, int, int]:
    """Split points on each side, and a range (offset, length) crossing the remote split."""
    remote_split = draw(st.integers(1, SIZE - 1))
    local_split = draw(st.integers(1, SIZE - 1))
    offset = draw(st.integers(max(0, remote_split - (2 << 20) + 1), remote_split - 1))
    length = draw(st.integers(remote_split - offset + 1, min(SIZE - offset, 2 << 20)))
    return remote_split, local_split, offset, length, draw(st.sampled_from(["read", "write"]))


@SPLIT
@given(case=_crossing())
@example(case=(SIZE // 2, SIZE // 2, SIZE // 2 - 1, 2 << 20, "read"))  # short on both sides alike: "succeeded"
def test_transfers_across_adjacent_regions_move_the_right_bytes(case: tuple[int, int, int, int, str]) -> None:
    """A range across the boundary of two adjacent regions of one buffer moves exactly its bytes, or fails.

    The buffer is registered as two adjacent regions on each side (RegionIndex and merge_runs see one span); the
    range never lands short or hangs.
    """
    remote_split, local_split, offset, length, op = case
    rng = np.random.default_rng(offset)
    remote = rng.integers(0, 256, SIZE, dtype=np.uint8)
    local = rng.integers(0, 256, SIZE, dtype=np.uint8)
    want_remote, want_local = remote.copy(), local.copy()
    server = create_backend("tcp", hostname="127.0.0.1", secret=SECRET)
    client = create_backend("tcp", hostname="127.0.0.1", secret=SECRET, transfer_deadline=10)
    try:
        for backend, buf, split in ((server, remote, remote_split), (client, local, local_split)):
            base = buf.ctypes.data
            backend.register_memory([(base, split), (base + split, SIZE - split)])
        peer = client.connect(server.endpoint_info())
        # the local range starts so that it crosses the local split too, where it can
        start = max(0, min(local_split - 1, SIZE - length))
        client.transfer(peer, [(local.ctypes.data + start, remote.ctypes.data + offset, length)], op).wait(30)
        if op == "read":
            want_local[start : start + length] = remote[offset : offset + length]
        else:
            want_remote[offset : offset + length] = local[start : start + length]
        assert np.array_equal(local, want_local) and np.array_equal(remote, want_remote)
    finally:
        client.close()
        server.close()


def test_a_peer_that_stalls_mid_transfer_fails_it_within_the_deadline() -> None:
    """A peer that says ok and then sends nothing: the read fails (retried once) instead of waiting for ever.

    Stalled is not gone: the retry dials the peer again (a socket timeout once passed for a dropped connection, and
    a part that failed so was not retried)."""
    from kvbridge.base.errors import TransferTimeout
    from kvbridge.base.types import EndpointInfo, MemoryRegion

    key = tcp._secret_key(SECRET)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(30)
    release = threading.Event()
    held: list[socket.socket] = []

    def stalling_peer() -> None:
        for _ in range(2):  # the first attempt's connection, then the retry's
            conn, _ = listener.accept()
            held.append(conn)
            challenge = os.urandom(16)
            tcp._send_frame(conn, {"challenge": challenge})
            hello = tcp._recv_frame(conn, tcp._MAX_AUTH_FRAME)
            tcp._send_frame(conn, {"ok": True, "mac": tcp._mac(key, b"server", challenge, hello["challenge"])})
            if tcp._recv_frame(conn).get("op") == "read":
                tcp._send_frame(conn, {"ok": True})  # and then no payload
        release.wait(60)

    fake = threading.Thread(target=stalling_peer, daemon=True)
    fake.start()
    client = create_backend("tcp", hostname="127.0.0.1", secret=SECRET, transfer_deadline=0.5)
    out = np.zeros(4096, dtype=np.uint8)
    client.register_memory(out)
    try:
        region = MemoryRegion(1 << 20, 4096)
        endpoint = EndpointInfo("tcp", "tcp", f"127.0.0.1:{listener.getsockname()[1]}", (region,), {"auth": "secret"})
        peer = client.connect(endpoint)
        handle = client.transfer(peer, [(out.ctypes.data, region.addr, out.nbytes)])
        with pytest.raises(TransferTimeout, match="so did its retry") as failed:
            handle.wait(30)
        assert handle.done(), "the transfer is still stuck in the transport"
        assert failed.value.retries == 1 and len(held) == 2, f"not retried on a new connection: {failed.value}"
    finally:
        release.set()
        fake.join(timeout=10)
        for conn in held:
            conn.close()
        listener.close()
        client.close()
