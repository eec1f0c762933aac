"""One engine rank for the multi-process control-plane tests (`python -m control_rank`, run by
`kvbridge.proc.Child`): a Mooncake TCP backend, a fingerprinted HND KV cache in numpy, and a
side channel — with a lease ledger on a prefill rank, an abort handler on a decode rank.

KV cache of a rank: int32 array [layers, 2 (K/V), blocks, local heads, block tokens, head dim];
element (l, kv, b, global head h, t, d) of a prefill rank holds `fingerprint(l, kv, b, h, t, d)`,
so a decode rank proves every pulled byte came from the right block, head and position.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time

import numpy as np

import kvbridge
from kvbridge.control import ControlClient, ControlServer, KVTransferParams, Ledger, LeaseState, open_registry, resolve
from kvbridge.proc import serve

LAYERS, TOKENS, DIM = 2, 4, 8
ITEM = 4  # int32


def fingerprint(layer: np.ndarray, kv: np.ndarray, block: np.ndarray, head: np.ndarray, token: np.ndarray,
                dim: np.ndarray) -> np.ndarray:
    return ((((layer * 2 + kv) * 1000 + block) * 64 + head) * TOKENS + token) * DIM + dim + 1


class Rank:
    def __init__(self, role: str, engine_id: str, rank: int, *, heads: int, head_lo: int, blocks: int,
                 port: int = 0, secret: str | None = None, lease_timeout_s: float = 60.0,
                 metadata_server: str | None = None, hostname: str = "127.0.0.1", registry: str | None = None):
        self.role, self.engine_id, self.rank = role, engine_id, rank
        self.name = f"{engine_id}/{rank}"
        self.heads, self.head_lo, self.secret = heads, head_lo, secret
        self.kv = np.zeros((LAYERS, 2, blocks, heads, TOKENS, DIM), dtype=np.int32)
        if role == "prefill":
            self.fill()
        self.backend = kvbridge.create_backend("mooncake", hostname=hostname, metadata_server=metadata_server)
        self.backend.register_memory(self.kv)
        self.released: list[list] = []
        self.held: dict[str, list[int]] = {}  # decode: blocks allocated per request
        self.aborted: list[str] = []
        self.lock = threading.Lock()
        self.skew = 0.0  # added to the ledger's clock: `advance` makes a lease expire without waiting
        self.ledger = (Ledger(self._on_release, timeout_s=lease_timeout_s, clock=lambda: time.monotonic() + self.skew)
                       if role == "prefill" else None)
        self.registry = open_registry(registry)
        self.server = ControlServer(engine_id, rank, ledger=self.ledger, port=port, secret=secret,
                                    on_abort=self._on_abort, registry=self.registry, poll_interval_s=0.02)
        self.clients: dict[tuple[str, int], ControlClient] = {}

    def fill(self) -> None:
        idx = np.indices(self.kv.shape, dtype=np.int32)
        self.kv[...] = fingerprint(idx[0], idx[1], idx[2], idx[3] + self.head_lo, idx[4], idx[5])

    def _on_release(self, lease: object, why: LeaseState) -> None:
        with self.lock:
            self.released.append([lease.request_id, why.value, list(lease.blocks)])  # type: ignore[attr-defined]

    def _on_abort(self, request_id: str, origin: str, reason: str) -> None:
        with self.lock:
            self.aborted.append(request_id)
            self.held.pop(request_id, None)  # the decode engine frees the blocks it allocated

    def client(self, addr: tuple[str, int]) -> ControlClient:
        if addr not in self.clients:
            self.clients[addr] = ControlClient(*addr, secret=self.secret, sender=self.name, timeout_s=10)
        return self.clients[addr]


R: Rank | None = None


def setup(**kw: object) -> dict:
    global R
    R = Rank(**kw)  # type: ignore[arg-type]
    return {"address": list(R.server.address), "session": R.backend.endpoint().address}


def register() -> None:
    """The KV cache exists: publish it and become ready."""
    layout = json.dumps({"shape": list(R.kv.shape), "head_lo": R.head_lo, "dtype": "int32"}).encode()
    R.server.register(layout=layout, endpoint=R.backend.endpoint_info())


def offer(request_id: str, blocks: list[int], expected_pulls: int, timeout_s: float | None = None) -> int:
    return R.ledger.offer(request_id, blocks, expected_pulls, timeout_s=timeout_s).epoch


def released() -> list:
    with R.lock:
        return list(R.released)


def state() -> dict:
    with R.lock:
        return {"held": sorted(R.held), "aborted": list(R.aborted), "active": R.ledger.active if R.ledger else []}


def refill() -> None:
    """Restore the fingerprints (after `reuse`)."""
    R.fill()


def advance(seconds: float) -> None:
    """Move the ledger's clock forward (the server's reaper then expires what is due)."""
    R.skew += seconds


def reuse(blocks: list[int]) -> None:
    """The prefill engine reuses released blocks for another request (new contents)."""
    R.kv[:, :, blocks] = -7


def abort(request_id: str, peers: list[list] = ()) -> int:
    with R.lock:
        R.held.pop(request_id, None)
    return R.server.abort(request_id, reason="test abort", peers=[tuple(p) for p in peers])


def _descriptors(rb: np.ndarray, lb: np.ndarray, remote_shape: list[int], remote_base: int, remote_head: int,
                 local_head: int, n_heads: int) -> np.ndarray:
    """(local, remote, length) per (layer, K/V, block): `n_heads` contiguous heads of an HND block."""
    head_bytes = TOKENS * DIM * ITEM
    _, _, r_blocks, r_heads, _, _ = remote_shape
    l_blocks, l_heads = R.kv.shape[2], R.kv.shape[3]
    layer, kv = np.meshgrid(np.arange(LAYERS), np.arange(2), indexing="ij")
    lk = (layer * 2 + kv).reshape(-1, 1)
    remote = remote_base + ((lk * r_blocks + rb) * r_heads + remote_head) * head_bytes
    local = R.kv.ctypes.data + ((lk * l_blocks + lb) * l_heads + local_head) * head_bytes
    return np.stack([local.ravel(), remote.ravel(), np.full(local.size, n_heads * head_bytes)], axis=1)


def read(request_id: str, params: dict, sources: list[dict], local_blocks: list[int], wait_s: float = 30.0) -> list:
    """Begin a pull from every source prefill rank and read its heads; returns the lease epochs."""
    p = KVTransferParams.from_dict(params)
    with R.lock:
        R.held[request_id] = list(local_blocks)
    epochs = []
    for src in sources:
        client = R.client(resolve(p, src["rank"], registry=R.registry, wait_s=wait_s))
        info = client.get_info(wait_s=wait_s)
        peer = R.backend.connect(info.endpoint)
        remote_shape = json.loads(info.layout)["shape"]
        status = client.begin_pull(p.remote_request_id, R.name, notify=R.server.address, wait_s=wait_s)
        base = peer.endpoint.regions[0].addr
        desc = _descriptors(np.asarray(p.block_ids), np.asarray(local_blocks), remote_shape, base,
                            src["remote_head"], src["local_head"], src["heads"])
        R.backend.transfer(peer, desc, op="read").wait(30)
        epochs.append([src["rank"], status.epoch])
    return epochs


def done(params: dict, epochs: list[list], also: list[int] = ()) -> list[bool]:
    """DONE to every rank read (fenced: raises LoadError if a lease did not hold), and a release-only
    DONE (epoch 0) to the prefill ranks in `also` that nobody reads."""
    p = KVTransferParams.from_dict(params)
    out = [R.client(resolve(p, rank, registry=R.registry)).done(p.remote_request_id, R.name, epoch).released
           for rank, epoch in epochs]
    for rank in also:
        out.append(R.client(resolve(p, rank, registry=R.registry)).done(p.remote_request_id, R.name, 0,
                                                                         check=False).released)
    return out


def verify(local_blocks: list[int], remote_blocks: list[int]) -> int:
    """Check every pulled element against the fingerprint of the prefill block it came from."""
    idx = np.indices((LAYERS, 2, len(local_blocks), R.heads, TOKENS, DIM), dtype=np.int32)
    expect = fingerprint(idx[0], idx[1], np.asarray(remote_blocks, dtype=np.int32)[idx[2]], idx[3] + R.head_lo,
                         idx[4], idx[5])
    got = R.kv[:, :, local_blocks]
    bad = int((got != expect).sum())
    if bad:
        raise AssertionError(f"{R.name}: {bad} of {got.size} pulled elements are wrong")
    return got.size


def close() -> None:
    for c in R.clients.values():
        c.close()
    R.server.close()
    R.backend.close()
    if R.registry is not None:
        R.registry.close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    serve({f.__name__: f for f in (setup, register, offer, released, state, advance, reuse, refill, abort, read, done, verify,
                                   close)})
