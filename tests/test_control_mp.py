"""Acceptance: prefill and decode ranks in separate processes, Mooncake TCP on 127.0.0.1, side
channels between them. Prefill TP2 pulled by decode TP4 and the reverse: release exactly at the
last DONE, duplicate DONE, decode killed mid-pull, a pull overlapping an expiry, abort both ways."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from control_helpers import free_base_port, wait_for

from kvbridge.control import KVTransferParams
from kvbridge.proc import Child, ChildError

HERE = Path(__file__).parent
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH", "")])),
       "NO_PROXY": "127.0.0.1,localhost", "GLOG_minloglevel": "2"}


@attrs.frozen
class Share:
    rank: int  # prefill rank
    remote_head: int  # first head, local to the prefill rank
    local_head: int  # first head, local to the decode rank
    heads: int


def heads_of(tp: int, heads: int, rank: int) -> range:
    """Global KV heads held by `rank` under tensor parallelism `tp` (replicated when tp > heads)."""
    if tp <= heads:
        n = heads // tp
        return range(rank * n, (rank + 1) * n)
    h = rank // (tp // heads)
    return range(h, h + 1)


def plan(heads: int, p_tp: int, d_tp: int) -> tuple[dict[int, list[Share]], dict[int, int], list[int]]:
    """From first principles (heads split evenly across TP ranks): what each decode rank reads from
    which prefill rank, how many pulls each prefill rank expects, and the prefill ranks nobody reads."""
    sources: dict[int, list[Share]] = {}
    for d in range(d_tp):
        mine = heads_of(d_tp, heads, d)
        shares: list[Share] = []
        for h in mine:
            p = next(p for p in range(p_tp) if h in heads_of(p_tp, heads, p))  # the first replica
            if shares and shares[-1].rank == p:
                shares[-1] = attrs.evolve(shares[-1], heads=shares[-1].heads + 1)
            else:
                shares.append(Share(p, h - heads_of(p_tp, heads, p).start, h - mine.start, 1))
        sources[d] = shares
    expected = {p: sum(any(s.rank == p for s in sources[d]) for d in sources) for p in range(p_tp)}
    unpulled = [p for p, n in expected.items() if n == 0]
    return sources, expected, unpulled


class Cluster:
    """A prefill engine of P ranks and a decode engine of Q ranks, each rank its own process."""

    PREFILL_BLOCKS, DECODE_BLOCKS = 8, 6

    def __init__(self, heads: int, p_tp: int, d_tp: int) -> None:
        self.heads, self.p_tp, self.d_tp = heads, p_tp, d_tp
        self.sources, self.expected, self.unpulled = plan(heads, p_tp, d_tp)
        self.base = free_base_port(p_tp)
        self.prefill: list[Child] = []
        self.decode: list[Child] = []
        try:
            for r in range(p_tp):
                self.prefill.append(self.spawn("prefill", r, p_tp))
            for r in range(d_tp):
                self.decode.append(self.spawn("decode", r, d_tp))
            for c in self.prefill + self.decode:
                c.call("register")
        except BaseException:
            self.close()
            raise

    def spawn(self, role: str, rank: int, tp: int, engine: str = "") -> Child:
        child = Child("control_rank", env=ENV, name=f"{role}{rank}")
        held = heads_of(tp, self.heads, rank)
        child.call("setup", role=role, engine_id=engine or role, rank=rank, heads=len(held), head_lo=held.start,
                   blocks=self.PREFILL_BLOCKS if role == "prefill" else self.DECODE_BLOCKS,
                   port=self.base + rank if role == "prefill" else 0, lease_timeout_s=60.0)
        return child

    def params(self, request_id: str, blocks: list[int]) -> dict:
        """What the prefill engine returns through the proxy (vLLM's keys)."""
        return KVTransferParams(do_remote_prefill=True, remote_engine_id="prefill", remote_request_id=request_id,
                                remote_block_ids=[blocks], remote_host="127.0.0.1", remote_port=self.base,
                                tp_size=self.p_tp, remote_num_tokens=len(blocks) * 4).to_dict()

    def offer(self, request_id: str, blocks: list[int], timeout_s: float | None = None) -> None:
        for p, child in enumerate(self.prefill):
            # A rank nobody reads is released by one DONE from the first decode rank.
            child.call("offer", request_id=request_id, blocks=blocks, expected_pulls=self.expected[p] or 1,
                       timeout_s=timeout_s)

    def read(self, d: int, request_id: str, params: dict, local: list[int], child: Child | None = None) -> list:
        shares = [attrs.asdict(s) for s in self.sources[d]]
        return (child or self.decode[d]).call("read", request_id=request_id, params=params, sources=shares,
                                               local_blocks=local)

    def done(self, d: int, params: dict, epochs: list) -> list[bool]:
        return self.decode[d].call("done", params=params, epochs=epochs, also=self.unpulled if d == 0 else [])

    def released(self) -> list[list]:
        return [c.call("released") for c in self.prefill]

    def close(self) -> None:
        for c in self.prefill + self.decode:
            try:
                c.call("close", timeout=20)
            except ChildError:
                pass  # already gone (a killed rank): closing it by PID below is what matters
            c.close()


DIRECTIONS = {"prefill-tp2-decode-tp4": (4, 2, 4), "prefill-tp4-decode-tp2": (4, 4, 2),
              "prefill-tp4-decode-tp2-replicated-heads": (2, 4, 2)}


@pytest.fixture(scope="module", params=list(DIRECTIONS))
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    c = Cluster(*DIRECTIONS[request.param])
    yield c
    c.close()


def test_plan_from_first_principles() -> None:
    sources, expected, unpulled = plan(4, 2, 4)
    assert sources[3] == [Share(1, 1, 0, 1)] and expected == {0: 2, 1: 2} and unpulled == []
    sources, expected, unpulled = plan(4, 4, 2)
    assert sources[1] == [Share(2, 0, 0, 1), Share(3, 0, 1, 1)] and expected == {0: 1, 1: 1, 2: 1, 3: 1}
    sources, expected, unpulled = plan(2, 4, 2)
    assert sources[1] == [Share(2, 0, 0, 1)] and unpulled == [1, 3]


@pytest.mark.slow
def test_done_releases_exactly_at_the_last_done_and_duplicates_are_harmless(cluster: Cluster) -> None:
    rid, blocks, local = "req-done", [5, 2, 7], [0, 3, 4]
    cluster.offer(rid, blocks)
    params = cluster.params(rid, blocks)
    epochs = {d: cluster.read(d, rid, params, local) for d in range(cluster.d_tp)}
    for d in range(cluster.d_tp):
        cluster.decode[d].call("verify", local_blocks=local, remote_blocks=blocks)
    assert cluster.released() == [[] for _ in cluster.prefill], "nothing is released before any DONE"
    dones = {p: 0 for p in range(cluster.p_tp)}
    for d in range(cluster.d_tp):
        cluster.done(d, params, epochs[d])
        for s in cluster.sources[d]:
            dones[s.rank] += 1
        if d == 0:
            for p in cluster.unpulled:
                dones[p] += 1
        released = cluster.released()
        for p in range(cluster.p_tp):
            if dones[p] == (cluster.expected[p] or 1):
                assert released[p] == [[rid, "released", blocks]], f"prefill {p} after its last DONE"
            else:
                assert released[p] == [], f"prefill {p} released after {dones[p]} of {cluster.expected[p]} DONEs"
    # Every DONE again: all still valid (no LoadError), nothing released twice.
    for d in range(cluster.d_tp):
        cluster.done(d, params, epochs[d])
    assert cluster.released() == [[[rid, "released", blocks]] for _ in cluster.prefill]


@pytest.mark.slow
def test_lease_pull_overlapping_expiry_is_a_load_error(cluster: Cluster) -> None:
    rid, blocks, local = "req-overlap", [1, 6], [2, 5]
    cluster.offer(rid, blocks, timeout_s=30)
    params = cluster.params(rid, blocks)
    epochs = cluster.read(0, rid, params, local)  # the read completed...
    source = cluster.sources[0][0].rank
    before = len(cluster.prefill[source].call("released"))
    cluster.prefill[source].call("advance", seconds=31)  # ...but the lease runs out before its DONE
    wait_for(lambda: len(cluster.prefill[source].call("released")) > before, what="lease expiry")
    assert cluster.prefill[source].call("released")[-1] == [rid, "expired", blocks]
    cluster.prefill[source].call("reuse", blocks=blocks)  # the engine hands the blocks to another request
    with pytest.raises(ChildError) as err:
        cluster.decode[0].call("done", params=params, epochs=epochs)
    assert err.value.kind == "LoadError" and "recompute" in str(err.value)
    cluster.prefill[source].call("refill")  # restore the fingerprints for the other tests


@pytest.mark.slow
def test_abort_from_prefill_frees_both_sides(cluster: Cluster) -> None:
    rid, blocks, local = "req-abort-p", [3, 4], [1, 2]
    cluster.offer(rid, blocks)
    params = cluster.params(rid, blocks)
    epochs = {d: cluster.read(d, rid, params, local) for d in range(cluster.d_tp)}
    assert all(rid in c.call("state")["held"] for c in cluster.decode)
    for c in cluster.prefill:
        c.call("abort", request_id=rid)
    for c in cluster.prefill:
        wait_for(lambda c=c: [rid, "aborted", blocks] in c.call("released"), what="prefill release")
    for c in cluster.decode:  # every decode rank was told, and freed its blocks
        wait_for(lambda c=c: rid in c.call("state")["aborted"], what="abort at decode")
        assert rid not in c.call("state")["held"]
    with pytest.raises(ChildError) as err:
        cluster.decode[0].call("done", params=params, epochs=epochs[0])
    assert err.value.kind == "LoadError"


@pytest.mark.slow
def test_abort_from_decode_frees_both_sides(cluster: Cluster) -> None:
    rid, blocks, local = "req-abort-d", [0, 7], [3, 5]
    cluster.offer(rid, blocks)
    params = cluster.params(rid, blocks)
    cluster.read(0, rid, params, local)  # decode rank 0 is mid-request when its engine aborts it
    p = KVTransferParams.from_dict(params)
    every_prefill = [list(p.side_channel(r)) for r in range(cluster.p_tp)]
    for c in cluster.decode:
        c.call("abort", request_id=rid, peers=every_prefill)
    for c in cluster.prefill:
        wait_for(lambda c=c: [rid, "aborted", blocks] in c.call("released"), what="prefill release")
        assert rid not in c.call("state")["active"]
    assert all(rid not in c.call("state")["held"] for c in cluster.decode)


@pytest.mark.slow
def test_lease_decode_killed_mid_pull_is_released_at_expiry(cluster: Cluster) -> None:
    rid, blocks, local = "req-killed", [2, 3], [0, 1]
    cluster.offer(rid, blocks, timeout_s=60)
    params = cluster.params(rid, blocks)
    victim = cluster.spawn("decode", 0, cluster.d_tp, engine="decode-victim")
    try:
        victim.call("register")
        cluster.read(0, rid, params, local, child=victim)
        victim.kill()  # SIGKILL after its read, before any DONE
    finally:
        victim.close()
    for c in cluster.prefill:  # no DONE will ever come: the blocks stay held...
        assert rid in c.call("state")["active"] and rid not in [r[0] for r in c.call("released")]
    for c in cluster.prefill:  # ...until the lease runs out
        c.call("advance", seconds=61)
    for c in cluster.prefill:
        wait_for(lambda c=c: [rid, "expired", blocks] in c.call("released"), what="release at expiry")
        assert rid not in c.call("state")["active"]
