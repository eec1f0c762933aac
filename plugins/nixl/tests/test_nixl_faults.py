"""NIXL's own fault paths, beyond the conformance suite: a peer that never answers, and closing with requests
in flight. The hung peer is real: UCX is limited to its TCP transport (where a read needs the remote worker
to make progress) and the reading side's peer never makes any, as a stopped process would not."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import kvbridge
from kvbridge.errors import TransferFailed, TransferTimeout

SIZE = 8 << 20


@pytest.fixture
def stalled(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[tuple]:
    """A reader (with the test's `transfer_timeout`, default 1 s) connected to a peer that never answers."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # read by UCX when each agent's backend starts
    kvbridge.reset_plugins()
    hung = kvbridge.create_backend("nixl", progress_interval=3600)  # never progresses while idle
    reader = kvbridge.create_backend("nixl", transfer_timeout=getattr(request, "param", 1.0))
    src, dst = np.ones(SIZE, np.uint8), np.zeros(SIZE, np.uint8)
    hung.register_memory(src)
    reader.register_memory(dst)
    peer = reader.connect(hung.endpoint_info())
    yield reader, peer, src, dst
    reader.close()
    hung.close()
    kvbridge.reset_plugins()


def test_a_request_past_transfer_timeout_is_aborted_and_released(stalled: tuple) -> None:
    reader, peer, src, dst = stalled
    handle = reader.transfer(peer, [(dst.ctypes.data, src.ctypes.data, SIZE)])
    with pytest.raises(TransferTimeout) as err:
        handle.wait(0.05)  # the caller's own, shorter timeout first: the request goes on
    assert "0.05" in str(err.value) and not handle.done()
    with pytest.raises(TransferTimeout, match="within 1.0s and was aborted") as err:
        handle.wait(30)
    assert err.value.peer == peer.handle
    assert reader._inflight == []  # its NIXL request was released


@pytest.mark.parametrize("stalled", [600.0], indirect=True)  # only close can end the request
def test_close_aborts_what_is_in_flight(stalled: tuple) -> None:
    reader, peer, src, dst = stalled
    handle = reader.transfer(peer, [(dst.ctypes.data, src.ctypes.data, SIZE)])
    assert not handle.done()
    reader.close()
    with pytest.raises(TransferFailed, match="aborted: the backend was closed"):
        handle.wait(5)
    assert reader._inflight == []
