"""Fuzzing the TCP transport's listener (hypothesis), over real loopback sockets: random, truncated,
oversized, forged and replayed handshakes, and malformed requests on an authenticated connection.
Each is refused with a logged warning, the listener keeps serving a legitimate reader, and nothing
(threads, sockets, memory held by kvbridge) grows."""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import threading
import time
import tracemalloc
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge import create_backend
from kvbridge.transports import tcp

SECRET = b"tcp-fuzz-secret-0123456789abcdef"
FAST = settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


class Warnings(logging.Handler):
    """Counts kvbridge's warnings, kept from pytest's capture so thousands of them cost no memory."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0
        self.last = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        self.last = record.getMessage()


class Listener:
    def __init__(self) -> None:
        self.kv = np.arange(1 << 16, dtype=np.uint8)
        self.backend = create_backend("tcp", hostname="127.0.0.1", secret=SECRET, handshake_timeout=5)
        self.backend.register_memory(self.kv)
        self.address = ("127.0.0.1", self.backend._port)
        self.key = tcp._secret_key(SECRET)
        self.warnings = Warnings()

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
    logger = logging.getLogger("kvbridge.transports.tcp")
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
    """Run after the fuzzing above (same module listener): a reader with the secret still reads, and another
    round of hostile connections leaves no thread, socket or allocation behind."""
    reader = create_backend("tcp", hostname="127.0.0.1", secret=SECRET)
    out = np.zeros_like(listener.kv)
    reader.register_memory(out)
    hostile = [os.urandom(n) for n in range(0, 300, 3)] + [struct.pack("!I", 1 << 30)] * 50
    # pytest's capture handlers keep every record (and a record its exception's frames): only count here.
    logger = logging.getLogger("kvbridge.transports.tcp")
    handlers, logger.handlers = logger.handlers, [listener.warnings]
    try:
        peer = reader.connect(listener.backend.endpoint_info())
        reader.transfer(peer, [(out.ctypes.data, listener.kv.ctypes.data, out.nbytes)]).wait(10)
        assert np.array_equal(out, listener.kv)
        for payload in hostile:  # warm-up: caches, the accept loop's first allocations
            listener.refused(payload)
        _settle(threading.active_count())
        threads, fds = threading.active_count(), _fds()
        tracemalloc.start()
        try:
            before = tracemalloc.take_snapshot()
            for payload in hostile:
                listener.refused(payload)
            _settle(threads)
            grown = _growth(before, tracemalloc.take_snapshot())
        finally:
            tracemalloc.stop()
        assert threading.active_count() <= threads and _fds() <= fds, "threads or sockets leaked"
        assert grown < 32 * 1024, f"{grown} more bytes held after {len(hostile)} hostile connections"
        out[:] = 0
        reader.transfer(peer, [(out.ctypes.data, listener.kv.ctypes.data, out.nbytes)]).wait(10)
        assert np.array_equal(out, listener.kv)
    finally:
        logger.handlers = handlers
        reader.close()


def _growth(before: tracemalloc.Snapshot, after: tracemalloc.Snapshot) -> int:
    """Bytes allocated between the snapshots and still held (tracemalloc's own snapshots left out)."""
    skip = [tracemalloc.Filter(False, tracemalloc.__file__)]
    diff = after.filter_traces(skip).compare_to(before.filter_traces(skip), "filename")
    return sum(d.size_diff for d in diff)


def _settle(threads: int) -> None:
    """Serving threads end just after their connection closes: wait (bounded) for them to go."""
    deadline = time.monotonic() + 10
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.01)
