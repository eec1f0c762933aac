"""One engine rank for the multi-process control-plane tests (`python -m control_rank`).

Run by `kvbridge_tools.harness.proc.Child`: a `KVAgent` on Mooncake TCP over a fingerprinted HND cache, and a side
channel — with a lease ledger on a prefill rank, an abort handler on a decode rank.

Decode ranks plan with `kvbridge.plan.topology` (through the agent), announce each read with
BeginPull (stating the prefill rank's release count from the plan), pull with `KVAgent.pull`,
and send fenced DONEs; the plan's notifier also releases the prefill ranks nobody reads.
"""

from __future__ import annotations

import logging
import sys
import threading
import time

import attrs
import numpy as np

from kvbridge.agent.kv_agent import KVAgent
from kvbridge.base.errors import LoadError
from kvbridge.control import (
    ControlClient,
    ControlServer,
    KVTransferParams,
    LeaseState,
    Ledger,
    open_registry,
    resolve,
)
from kvbridge.control.ledger import READ_HOLD_S
from kvbridge.plan.layout import vllm_layout
from kvbridge.plan.presets import PRESETS, ModelSpec
from kvbridge.plan.topology import HeadPlacement, ParallelConfig
from kvbridge.session.pull_control import PullControl
from kvbridge_tools.bench.shares import Share, fill, mismatches
from kvbridge_tools.harness.proc import serve


def model_with(kv_heads: int) -> ModelSpec:
    return attrs.evolve(PRESETS["tiny-gqa"], name=f"tiny-gqa-{kv_heads}h", kv_heads=kv_heads)


class Rank:
    def __init__(
        self,
        role: str,
        engine_id: str,
        rank: int,
        *,
        parallel: str,
        kv_heads: int,
        blocks: int,
        port: int = 0,
        secret: str | None = None,
        lease_timeout_s: float = 60.0,
        read_hold_s: float = READ_HOLD_S,
        metadata_server: str | None = None,
        hostname: str = "127.0.0.1",
        registry: str | None = None,
        host: str = "127.0.0.1",
    ):
        self.role, self.engine_id, self.rank, self.secret = role, engine_id, rank, secret
        self.name = f"{engine_id}/{rank}"
        self.model = model_with(kv_heads)
        self.parallel = ParallelConfig.parse(parallel)
        placement = HeadPlacement.of(self.model, self.parallel, role)
        self.global_heads = tuple(placement.heads(self.parallel.coords(rank).shard))
        m = self.model
        layer_bytes = 2 * blocks * placement.per_rank * m.block_size * m.head_dim * m.dtype_bytes
        self.buf = np.zeros(m.layers * layer_bytes, dtype=np.uint8)
        self.layout = vllm_layout(
            m,
            placement.per_rank,
            [self.buf.ctypes.data + i * layer_bytes for i in range(m.layers)],
            blocks,
            order="HND",
        )
        self.agent = KVAgent(
            engine_id,
            rank,
            self.parallel,
            self.layout,
            self.buf,
            backend="mooncake",
            hostname=hostname,
            metadata_server=metadata_server,
        )
        self.lock = threading.Lock()
        self.released: list[list] = []
        self.shares: dict[str, Share] = {}  # prefill: the requests whose fingerprints the cache holds
        self.held: dict[str, list[int]] = {}  # decode: blocks allocated per request
        self.aborted: list[str] = []
        self.pending: dict[str, dict] = {}  # decode: what a read left for its DONEs
        self.skew = 0.0  # added to the ledger's clock: `advance` makes a lease expire without waiting
        self.ledger = (
            Ledger(
                self._on_release,
                timeout_s=lease_timeout_s,
                read_hold_s=read_hold_s,
                clock=lambda: time.monotonic() + self.skew,
            )
            if role == "prefill"
            else None
        )
        self.registry = open_registry(registry)
        self.server = ControlServer(
            engine_id,
            rank,
            ledger=self.ledger,
            host=host,
            port=port,
            secret=secret,
            on_abort=self._on_abort,
            registry=self.registry,
            poll_interval_s=0.02,
        )
        self.clients: dict[tuple[str, int], ControlClient] = {}
        self.control = (
            PullControl(self.agent, self.server, secret=secret, registry=self.registry) if role == "decode" else None
        )

    def _on_release(self, lease: object, why: LeaseState) -> None:
        with self.lock:
            self.released.append([lease.request_id, why.value, list(lease.blocks)])  # type: ignore[attr-defined]

    def _on_abort(self, request_id: str, origin: str, reason: str) -> None:
        with self.lock:
            self.aborted.append(request_id)
            self.held.pop(request_id, None)  # the decode engine frees the blocks it allocated

    def client(self, params: KVTransferParams, rank: int) -> ControlClient:
        addr = resolve(params, rank, registry=self.registry, wait_s=30)
        if addr not in self.clients:
            self.clients[addr] = ControlClient(*addr, secret=self.secret, sender=self.name, timeout_s=10)
        return self.clients[addr]

    def share(self, block_ids: list[int], tokens: int) -> Share:
        n = -(-tokens // self.model.block_size)
        return Share(block_ids[:n], range(n), self.global_heads, tokens)


R: Rank | None = None


def setup(**kw: object) -> dict:
    global R
    R = Rank(**kw)  # type: ignore[arg-type]
    return {"address": list(R.server.address)}


def register() -> None:
    """The KV cache exists: publish the agent's RankInfo and become ready."""
    R.server.register(R.agent.info())


def offer(
    request_id: str, blocks: list[int], tokens: int, expected_pulls: int | None = None, timeout_s: float | None = None
) -> int:
    """Prefill finished `request_id`: its fingerprints are in `blocks`; hold them under a lease."""
    active = set(R.ledger.active)
    R.shares = {rid: s for rid, s in R.shares.items() if rid in active}
    R.shares[request_id] = R.share(blocks, tokens)
    fill(R.layout, R.buf, list(R.shares.values()))
    return R.ledger.offer(request_id, blocks, expected_pulls, timeout_s=timeout_s).epoch


def released() -> list:
    with R.lock:
        return list(R.released)


def state() -> dict:
    with R.lock:
        return {"held": sorted(R.held), "aborted": list(R.aborted), "active": R.ledger.active if R.ledger else []}


def advance(seconds: float) -> None:
    """Move the ledger's clock forward (the server's reaper then expires what is due)."""
    R.skew += seconds


def reuse(blocks: list[int]) -> None:
    """The prefill engine hands released blocks to another request (new contents)."""
    for region in R.layout.regions:
        for b in blocks:
            start = region.addr - R.buf.ctypes.data + b * region.block_stride
            R.buf[start : start + region.block_bytes] = 0xAB


def read(request_id: str, params: dict, local_blocks: list[int]) -> dict:
    """Announce and pull this decode rank's share of `request_id`; DONEs are sent by `done`."""
    p = KVTransferParams.from_dict(params)
    tokens = int(p.remote_num_tokens)
    prefill = ParallelConfig(tp=p.tp_size, pcp=p.pcp_size, dcp=p.dcp_size, dp=p.dp_size)
    plan = R.agent.plan(prefill, tokens, prefill_dp=p.dp_rank)
    with R.lock:
        R.held[request_id] = list(local_blocks)
    R.buf[:] = 0  # a fresh allocation: afterwards the cache must hold exactly this request's share
    epochs, infos = {}, []
    for rank in sorted({pull.prefill_rank for pull in plan.pulls_for(R.rank)}):
        client = R.client(p, rank)
        infos.append(client.get_info(wait_s=30))
        status = client.begin_pull(
            p.remote_request_id, R.name, notify=R.server.address, expected_pulls=plan.release_count(rank), wait_s=30
        )
        epochs[rank] = status.epoch
    handle = R.agent.pull(p.remote_request_id, infos, list(p.block_ids), local_blocks, tokens)
    handle.wait(60)
    notify = [rank for _engine, rank in handle.result.notify]
    R.pending[request_id] = {
        "epochs": epochs,
        "notify": notify,
        "counts": {r: plan.release_count(r) for r in [*epochs, *notify]},
    }
    return {"pulled": sorted(epochs), "notify": notify}


def pull(request_id: str, params: dict, local_blocks: list[int]) -> str | None:
    """The whole decode side through `PullControl`: returns None, or the error that means recompute."""
    with R.lock:
        R.held[request_id] = list(local_blocks)
    R.buf[:] = 0
    outcome: list = []
    handle = R.control.start(
        request_id,
        KVTransferParams.from_dict(params),
        local_blocks,
        on_finished=lambda rid, err: outcome.append((rid, err)),
    )
    handle.wait(60)
    assert outcome and outcome[0][0] == request_id, "on_finished ran once, before wait() returned"
    err = outcome[0][1]
    return None if err is None else f"{type(err).__name__}: {err}"


def done(request_id: str, params: dict) -> list[bool]:
    """DONE to every prefill rank read, and a release-only DONE to the ranks nobody reads; returns `released` flags.

    The DONEs to the ranks read are fenced: this raises LoadError if a lease did not hold through the read. The
    release-only DONEs go through the notifier.
    """
    p = KVTransferParams.from_dict(params)
    job = R.pending[request_id]
    statuses = [  # every DONE goes out (each ends this rank's read of that lease) before any LoadError
        R.client(p, rank).done(p.remote_request_id, R.name, epoch, expected_pulls=job["counts"][rank], check=False)
        for rank, epoch in job["epochs"].items()
    ]
    for status in statuses:
        if not status.valid:
            raise LoadError(f"lease of {request_id!r} was {status.state.value} at the DONE; recompute")
    out = [status.released for status in statuses]
    for rank in job["notify"]:
        out.append(R.client(p, rank).done(p.remote_request_id, R.name, 0, expected_pulls=1, check=False).released)
    return out


def verify(local_blocks: list[int], tokens: int) -> int:
    """The whole decode cache equals the fingerprints of its share: nothing missing, misplaced or extra."""
    share = R.share(local_blocks, tokens)
    bad, notes = mismatches(R.layout, R.buf, [share])
    if bad:
        raise AssertionError(f"{R.name}: {bad} wrong words, e.g. {notes}")
    return len(share.block_ids) * len(share.heads)


def abort(request_id: str, peers: list[list] = ()) -> int:
    with R.lock:
        R.held.pop(request_id, None)
    return R.server.abort(request_id, reason="test abort", peers=[tuple(p) for p in peers])


def close() -> None:
    for c in R.clients.values():
        c.close()
    if R.control is not None:
        R.control.close()
    R.server.close()
    R.agent.close()
    if R.registry is not None:
        R.registry.close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    serve(
        {
            f.__name__: f
            for f in (setup, register, offer, released, state, advance, reuse, read, pull, done, verify, abort, close)
        }
    )
