"""NIXL's own fault paths beyond the conformance suite: a peer that never answers, and closing with requests in flight.

The hung peer is real: UCX is limited to its TCP transport (where a read needs the remote worker to make progress)
and the reading side's peer never makes any, as a stopped process would not.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import kvbridge
from kvbridge.base.errors import TransferFailed, TransferTimeout
from kvbridge_tools.harness.fixtures import wait_for
from kvbridge_tools.harness.proc import Child, stop_all_threads

SIZE = 8 << 20


@pytest.fixture
def stalled(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[tuple]:
    """A reader (with the test's `transfer_timeout`, default 1 s) connected to a peer that never answers.

    Yields the reader, the peer as it sees it, both buffers and the peer, which serves once told (`expect_reads`)."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # read by UCX when each agent's backend starts
    kvbridge.reset_plugins()
    hung = kvbridge.create_backend("nixl", progress_interval=3600)  # never progresses while idle
    reader = kvbridge.create_backend("nixl", transfer_timeout=getattr(request, "param", 1.0))
    src, dst = np.ones(SIZE, np.uint8), np.zeros(SIZE, np.uint8)
    hung.register_memory(src)
    reader.register_memory(dst)
    peer = reader.connect(hung.endpoint_info())
    yield reader, peer, src, dst, hung
    reader.close()
    hung.close()
    kvbridge.reset_plugins()


def test_a_request_past_transfer_timeout_is_aborted_and_released(stalled: tuple) -> None:
    reader, peer, src, dst, _hung = stalled
    handle = reader.transfer(peer, [(dst.ctypes.data, src.ctypes.data, SIZE)])
    with pytest.raises(TransferTimeout) as err:
        handle.wait(0.05)  # the caller's own, shorter timeout first: the request goes on
    assert "0.05" in str(err.value) and not handle.done()
    with pytest.raises(TransferTimeout, match="within 1.0s and was aborted") as err:
        handle.wait(30)
    assert err.value.peer == peer.handle
    assert reader._inflight == []  # its NIXL request was released


def test_a_read_aborted_unfinished_still_writes_its_destination_so_nixl_declares_late_writes(stalled: tuple) -> None:
    """NIXL's release of an unfinished request does not stop it (UCX's cancel leaves an RMA get running).

    Once the peer serves it, the aborted read lands whole, after its handle failed. So the plugin declares late
    writes, and kvbridge lands every read into a live cache in a buffer first (`kvbridge.agent.landing`)."""
    reader, peer, src, dst, hung = stalled
    assert reader.capabilities.late_writes
    handle = reader.transfer(peer, [(dst.ctypes.data, src.ctypes.data, SIZE)])
    with pytest.raises(TransferTimeout, match="was aborted"):
        handle.wait(30)
    assert reader._inflight == [] and not dst.any()  # released, nothing written yet
    hung.expect_reads(1)  # the peer now serves what it was asked before
    wait_for(lambda: np.array_equal(dst, src), timeout=20, what="the aborted read's bytes to land late")


@pytest.mark.parametrize("stalled", [600.0], indirect=True)  # only close can end the request
def test_close_aborts_what_is_in_flight(stalled: tuple) -> None:
    reader, peer, src, dst, _hung = stalled
    handle = reader.transfer(peer, [(dst.ctypes.data, src.ctypes.data, SIZE)])
    assert not handle.done()
    reader.close()
    with pytest.raises(TransferFailed, match="aborted: the backend was closed"):
        handle.wait(5)
    assert reader._inflight == []


def _thread_cpu_s(native_id: int) -> float:
    """User + system CPU seconds one thread of this process has used."""
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_read_a_stopped_peer_never_serves_waits_without_a_busy_core(monkeypatch: pytest.MonkeyPatch) -> None:
    # A decode reading from a stopped prefill (SIGSTOP, UCX over TCP): the progress thread polls the request
    # until it ends, and must not spin a core all that time (it yielded between polls without pause: 1.0 core).
    monkeypatch.setenv("UCX_TLS", "tcp")
    kvbridge.reset_plugins()
    peers = str(Path(__file__).parents[3] / "tests" / "peers")
    peer_proc = Child("backend_peer", env={"PYTHONPATH": os.pathsep.join([peers, *sys.path])}, name="nixl-stopped")
    reader = None
    try:
        served = peer_proc.call("init", backend="nixl", size=SIZE, seed=7)
        reader = kvbridge.create_backend("nixl", transfer_timeout=600)
        dst = np.zeros(SIZE, np.uint8)
        reader.register_memory(dst)
        peer = reader.connect(bytes.fromhex(served["endpoint"]))
        reader.transfer(peer, [(dst.ctypes.data, served["base"], SIZE)]).wait(30)  # connected, and it reads
        stop_all_threads(peer_proc.pid)  # kill returns before a running thread stops: it could serve this read
        handle = reader.transfer(peer, [(dst.ctypes.data, served["base"], SIZE)])
        thread = reader._progress.native_id
        cpu, began = _thread_cpu_s(thread), time.monotonic()
        with pytest.raises(TransferTimeout):
            handle.wait(3.0)  # the caller's own timeout: the request stays in flight, unserved
        cpu, waited = _thread_cpu_s(thread) - cpu, time.monotonic() - began
        assert not handle.done() and len(reader._inflight) == 1
        assert cpu < 0.25 * waited, f"the progress thread used {cpu:.2f} s of CPU in {waited:.1f} s of waiting"
    finally:
        os.kill(peer_proc.pid, signal.SIGCONT)
        if reader is not None:
            reader.close()
        peer_proc.close()
        kvbridge.reset_plugins()


def test_a_passive_side_serves_reads_while_its_owner_says_peers_read(monkeypatch: pytest.MonkeyPatch) -> None:
    # Over UCX TCP a read advances only as the side read from makes progress. Idle, that side progresses every
    # `progress_interval` (here never: the fixture above shows a read then never ends); while its owner says leases
    # are being read (`expect_reads`, from the ledger's BeginPull to the release) it serves them at once.
    monkeypatch.setenv("UCX_TLS", "tcp")
    kvbridge.reset_plugins()
    passive = kvbridge.create_backend("nixl", progress_interval=3600)
    reader = kvbridge.create_backend("nixl", transfer_timeout=600)
    try:
        src = np.random.default_rng(3).integers(0, 256, SIZE, dtype=np.uint8)
        dst = np.zeros(SIZE, np.uint8)
        passive.register_memory(src)
        reader.register_memory(dst)
        peer = reader.connect(passive.endpoint_info())
        passive.expect_reads(1)
        reader.transfer(peer, [(dst.ctypes.data, src.ctypes.data, SIZE)]).wait(60)
        assert np.array_equal(dst, src)
        passive.expect_reads(0)
        assert passive._idle_interval() == 3600  # back to idle: its owner announces reads, and none is left
        dst[:] = 0
        passive.expect_reads(2)
        reader.transfer(peer, [(dst.ctypes.data + i, src.ctypes.data + i, 4096) for i in range(0, SIZE, 1 << 20)]).wait(
            60
        )
        assert all(np.array_equal(dst[i : i + 4096], src[i : i + 4096]) for i in range(0, SIZE, 1 << 20))
    finally:
        reader.close()
        passive.close()
        kvbridge.reset_plugins()
