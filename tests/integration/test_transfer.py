"""Two real processes move bytes through real transports (Mooncake TE over TCP, kvbridge's tcp)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvbridge_tools.harness.proc import Child, ChildError, stop_all_threads

PEERS = str(Path(__file__).parents[1] / "peers")
# the children import what this process imports (kvbridge_tools included), and the peers
CHILD_PATH = os.pathsep.join(filter(None, [PEERS, os.environ.get("PYTHONPATH", "")]))
MiB = 1 << 20
BACKENDS = ["mooncake", "tcp"]


def sha(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()


def pattern(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8)


class Pair:
    """`server` holds a seeded pattern, `client` a zeroed buffer connected to it."""

    def __init__(self, backend: str, size: int, client_size: int | None = None) -> None:
        env = {"PYTHONPATH": CHILD_PATH}
        self.size = size
        self.backend = backend
        self.server = Child("backend_peer", env=env, name=f"{backend}-server")
        self.client = Child("backend_peer", env=env, name=f"{backend}-client")
        self.s = self.server.call("init", backend=backend, size=size, seed=7)
        self.c = self.client.call("init", backend=backend, size=client_size or size, seed=-1)
        self.client.call("connect", endpoint=self.s["endpoint"])

    def transfer(self, desc: np.ndarray, op: str = "read") -> dict[str, int]:
        return self.client.call("transfer", descriptors=desc.tolist(), op=op, remote_base=self.s["base"])

    def close(self) -> None:
        self.client.close()
        self.server.close()


@pytest.fixture(params=BACKENDS)
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    p = Pair(request.param, 64 * MiB)
    yield p
    p.close()


def test_read_one_large_region(pair: Pair) -> None:
    out = pair.transfer(np.array([[0, 0, pair.size]]))
    assert out["nbytes"] == pair.size
    assert pair.client.call("digest") == sha(pattern(pair.size, 7))


def test_write_one_large_region(pair: Pair) -> None:
    pair.transfer(np.array([[0, 0, pair.size]]), op="write")  # zeros over the pattern
    assert pair.server.call("digest") == sha(np.zeros(pair.size, dtype=np.uint8))


@pytest.mark.parametrize("op", ["read", "write"])
def test_many_fragmented_descriptors_beyond_the_batch_limit(pair: Pair, op: str) -> None:
    # 6000 scattered 4 KiB blocks: more than Mooncake TCP admits per call (~2048); a stride of 7
    # (coprime to n) is a permutation in which no two neighbours continue each other, so none merge.
    block, n = 4096, 6000
    perm = (np.arange(n) * 7) % n
    desc = np.stack([np.arange(n) * block, perm * block, np.full(n, block)], axis=1)
    out = pair.transfer(desc, op=op)
    assert out["descriptors"] == n
    src = pattern(pair.size, 7)
    if op == "read":
        expect = np.zeros(pair.size, dtype=np.uint8)
        expect[: n * block] = src[: n * block].reshape(n, block)[perm].reshape(-1)
        assert pair.client.call("digest") == sha(expect)
    else:
        expect = src.copy()
        expect[: n * block].reshape(n, block)[perm] = 0
        assert pair.server.call("digest") == sha(expect)


def test_contiguous_blocks_merge_into_one_run_cut_to_the_transport_piece_size(pair: Pair) -> None:
    n, block = 2048, 8192  # 16 MiB in 2048 contiguous blocks
    desc = np.stack([np.arange(n) * block, np.arange(n) * block, np.full(n, block)], axis=1)
    # tcp takes the run whole; Mooncake TCP gets it in 4 MiB pieces, one per lane
    assert pair.transfer(desc)["descriptors"] == {"tcp": 1, "mooncake": 4}[pair.backend]
    assert pair.client.call("digest") == sha(
        np.concatenate([pattern(pair.size, 7)[: n * block], np.zeros(pair.size - n * block, np.uint8)])
    )


def test_memory_outside_the_peer_registration_is_refused(pair: Pair) -> None:
    with pytest.raises(ChildError) as err:
        pair.transfer(np.array([[0, pair.size - 100, 4096]]))
    assert err.value.kind == "InvalidDescriptor"
    assert "not registered" in str(err.value)
    pair.transfer(np.array([[0, 0, 4096]]))  # the engine is still usable


def test_memory_the_peer_unregistered_fails_in_the_transport(pair: Pair) -> None:
    # The client's copy of the endpoint still lists the region; only the transport can notice.
    pair.server.call("unregister")
    with pytest.raises(ChildError) as err:
        pair.transfer(np.array([[0, 0, 4096]]))
    assert err.value.kind in {"TransferFailed", "InvalidDescriptor"}
    assert pair.client.proc.poll() is None  # no crash


def test_a_dead_peer_fails_the_transfer_instead_of_hanging(pair: Pair) -> None:
    pair.server.kill()
    with pytest.raises(ChildError) as err:
        pair.client.call("transfer", descriptors=[[0, 0, 4096]], op="read", remote_base=pair.s["base"], timeout=60)
    assert err.value.kind in {"TransferFailed", "PeerGone", "TransferTimeout"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_reads_stalled_on_one_peer_hold_none_of_the_reads_from_another(backend: str) -> None:
    """More reads than the transport has `workers` wait on a stopped peer; a read from another peer still runs.

    With one pool of worker threads for every peer they held all of them, and a read from a healthy peer queued
    behind them: Mooncake TCP failed it at its transfer deadline, kvbridge's TCP ran it once they had failed."""
    import kvbridge

    env = {"PYTHONPATH": CHILD_PATH}
    stopped = Child("backend_peer", env=env, name=f"{backend}-stopped")
    live = Child("backend_peer", env=env, name=f"{backend}-live")
    me = kvbridge.create_backend(backend)
    try:
        s = stopped.call("init", backend=backend, size=16 * MiB, seed=7)
        h = live.call("init", backend=backend, size=16 * MiB, seed=8)
        buf = np.zeros(32 * MiB, dtype=np.uint8)
        me.register_memory(buf)
        to_stopped, to_live = (me.connect(bytes.fromhex(x["endpoint"])) for x in (s, h))

        def read(peer, offset: int, base: int):  # type: ignore[no-untyped-def]
            return me.transfer(peer, [[buf.ctypes.data + offset, base, MiB]])

        for peer, base in ((to_stopped, s["base"]), (to_live, h["base"])):
            read(peer, 0, base).wait(30)  # connected both ways
        stop_all_threads(stopped.pid)
        ended: list[str] = []
        stuck = [read(to_stopped, (i + 1) * MiB, s["base"]) for i in range(me.options.workers + 2)]
        for handle in stuck:
            handle.add_done_callback(lambda _h: ended.append("stuck"))
        healthy = read(to_live, 16 * MiB, h["base"])
        healthy.add_done_callback(lambda _h: ended.append("healthy"))
        healthy.wait(60)
        assert ended[:1] == ["healthy"], f"the healthy peer's read ended after a stalled one's: {ended}"
        assert sha(buf[16 * MiB : 17 * MiB]) == sha(pattern(16 * MiB, 8)[:MiB])
        os.kill(stopped.pid, signal.SIGCONT)
        for handle in stuck:  # each ends, read or failed: none is left running
            with contextlib.suppress(kvbridge.KVBridgeError):
                handle.wait(60)
        assert all(handle.done() for handle in stuck)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stopped.pid, signal.SIGCONT)
        me.close()
        stopped.close()
        live.close()


def test_mooncake_refuses_a_metadata_server_its_wheel_cannot_speak() -> None:
    import kvbridge
    from kvbridge_mooncake.backend import _supports_redis_metadata

    if _supports_redis_metadata():
        pytest.skip("this Mooncake wheel has redis metadata support")
    with pytest.raises(kvbridge.ConfigError, match="without redis metadata support"):
        kvbridge.create_backend("mooncake", metadata_server="redis://127.0.0.1:1")
