"""Acceptance: prefill and decode ranks in separate processes, Mooncake TCP on 127.0.0.1, side channels between them.

Prefill TP2 pulled by decode TP4 and the reverse: release exactly at the last DONE, duplicate DONE, decode killed
mid-pull, a pull overlapping an expiry, abort both ways.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from control_helpers import pull_params, wait_for
from control_rank import model_with

from kvbridge.control import KVTransferParams
from kvbridge.plan.topology import ParallelConfig, Plan, plan
from kvbridge_tools.harness.ports import free_port
from kvbridge_tools.harness.proc import Child, ChildError

HERE = Path(__file__).parents[1]  # tests/: the helpers beside the tiers
ENV = {
    "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH", "")])),
    "NO_PROXY": "127.0.0.1,localhost",
    "GLOG_minloglevel": "2",
}


class Cluster:
    """A prefill engine and a decode engine, each rank its own process.

    The expected pulls come from the planner (`kvbridge.plan.topology.plan`), as the decode side computes them.
    """

    PREFILL_BLOCKS, DECODE_BLOCKS = 8, 6

    def __init__(self, kv_heads: int, prefill: str, decode: str, prefill_knows_counts: bool) -> None:
        self.kv_heads = kv_heads
        self.p_cfg, self.d_cfg = ParallelConfig.parse(prefill), ParallelConfig.parse(decode)
        self.p_tp, self.d_tp = self.p_cfg.world_size, self.d_cfg.world_size
        self.prefill_knows_counts = prefill_knows_counts
        self.base = free_port(span=self.p_tp)
        self.prefill: list[Child] = []
        self.decode: list[Child] = []
        try:
            for r in range(self.p_tp):
                self.prefill.append(self.spawn("prefill", r))
            for r in range(self.d_tp):
                self.decode.append(self.spawn("decode", r))
            for c in self.prefill + self.decode:
                c.call("register")
        except BaseException:
            self.close()
            raise

    def spawn(self, role: str, rank: int, engine: str = "") -> Child:
        child = Child("control_rank", env=ENV, name=f"{role}{rank}")
        cfg = self.p_cfg if role == "prefill" else self.d_cfg
        child.call(
            "setup",
            role=role,
            engine_id=engine or role,
            rank=rank,
            parallel=str(cfg),
            kv_heads=self.kv_heads,
            blocks=self.PREFILL_BLOCKS if role == "prefill" else self.DECODE_BLOCKS,
            port=self.base + rank if role == "prefill" else 0,
            lease_timeout_s=60.0,
        )
        return child

    def plan(self, tokens: int) -> Plan:
        return plan(self.p_cfg, self.d_cfg, model_with(self.kv_heads), tokens)

    def params(self, request_id: str, blocks: list[int], tokens: int) -> dict:
        """What the prefill engine returns through the proxy (vLLM's keys)."""
        return pull_params(request_id, blocks, self.base, tokens=tokens, tp_size=self.p_cfg.tp)

    def offer(self, request_id: str, blocks: list[int], tokens: int, timeout_s: float | None = None) -> None:
        p = self.plan(tokens)
        for r, child in enumerate(self.prefill):
            # Either the prefill side knows the release count (a rank nobody reads waits for the one
            # DONE of the plan's notifier), or it leaves it to the decode side's BeginPull/DONE.
            expected = max(p.release_count(r), 1) if self.prefill_knows_counts else None
            child.call(
                "offer",
                request_id=request_id,
                blocks=blocks,
                tokens=tokens,
                expected_pulls=expected,
                timeout_s=timeout_s,
            )

    def released(self) -> list[list]:
        return [c.call("released") for c in self.prefill]

    def close(self) -> None:
        for c in self.prefill + self.decode:
            try:
                c.call("close", timeout=20)
            except ChildError:
                pass  # already gone (a killed rank): closing it by PID below is what matters
            c.close()


# kv heads, prefill, decode, whether the prefill side offers with the release count
DIRECTIONS = {
    "prefill-tp2-decode-tp4": (4, "tp2", "tp4", True),
    "prefill-tp4-decode-tp2": (4, "tp4", "tp2", False),
    "prefill-tp4-decode-tp2-replicated-heads": (2, "tp4", "tp2", False),
}


@pytest.fixture(scope="module", params=list(DIRECTIONS))
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    c = Cluster(*DIRECTIONS[request.param])
    yield c
    c.close()


def test_done_directions_cover_ranks_nobody_reads() -> None:
    """The replicated-heads direction exercises the notifier's release-only DONE."""
    kv_heads, prefill, decode, _ = DIRECTIONS["prefill-tp4-decode-tp2-replicated-heads"]
    p = plan(ParallelConfig.parse(prefill), ParallelConfig.parse(decode), model_with(kv_heads), 20)
    assert p.unpulled and p.notifier == 0


def _sources(plan: Plan, d: int) -> set[int]:
    return {pull.prefill_rank for pull in plan.pulls_for(d)}


@pytest.mark.slow
def test_done_releases_exactly_at_the_last_done_and_duplicates_are_harmless(cluster: Cluster) -> None:
    rid, blocks, local, tokens = "req-done", [5, 2, 7], [0, 3, 4], 40
    plan = cluster.plan(tokens)
    cluster.offer(rid, blocks, tokens)
    params = cluster.params(rid, blocks, tokens)
    for d, c in enumerate(cluster.decode):
        got = c.call("read", request_id=rid, params=params, local_blocks=local)
        assert got["pulled"] == sorted(_sources(plan, d))
        assert got["notify"] == (list(plan.unpulled) if d == plan.notifier else [])
        assert c.call("verify", local_blocks=local, tokens=tokens) > 0  # every pulled byte is in place
    assert cluster.released() == [[] for _ in cluster.prefill], "nothing is released before any DONE"
    dones = dict.fromkeys(range(cluster.p_tp), 0)
    for d, c in enumerate(cluster.decode):
        c.call("done", request_id=rid, params=params)
        for p in _sources(plan, d) | (set(plan.unpulled) if d == plan.notifier else set()):
            dones[p] += 1
        released = cluster.released()
        for p in range(cluster.p_tp):
            if dones[p] == max(plan.release_count(p), 1):
                assert released[p] == [[rid, "released", blocks]], f"prefill {p} after its last DONE"
            else:
                assert released[p] == [], f"prefill {p} released after {dones[p]} of {plan.release_count(p)} DONEs"
    # Every DONE again: all still valid (no LoadError), nothing released twice.
    for c in cluster.decode:
        c.call("done", request_id=rid, params=params)
    assert cluster.released() == [[[rid, "released", blocks]] for _ in cluster.prefill]


@pytest.mark.slow
def test_done_decode_control_end_to_end(cluster: Cluster) -> None:
    """`PullControl` on every decode rank: pulls, fenced DONEs, notifier; every prefill rank released."""
    rid, blocks, local, tokens = "req-control", [4, 0, 6], [5, 1, 0], 48
    cluster.offer(rid, blocks, tokens)
    params = cluster.params(rid, blocks, tokens)
    for c in cluster.decode:
        assert c.call("pull", request_id=rid, params=params, local_blocks=local) is None
        assert c.call("verify", local_blocks=local, tokens=tokens) > 0
    for c in cluster.prefill:
        wait_for(lambda c=c: [rid, "released", blocks] in c.call("released"), what="release")


@pytest.mark.slow
def test_lease_pull_overlapping_expiry_is_a_load_error(cluster: Cluster) -> None:
    rid, blocks, local, tokens = "req-overlap", [1, 6], [2, 5], 20
    cluster.offer(rid, blocks, tokens, timeout_s=30)
    params = cluster.params(rid, blocks, tokens)
    source = cluster.decode[0].call("read", request_id=rid, params=params, local_blocks=local)["pulled"][0]
    assert cluster.decode[0].call("verify", local_blocks=local, tokens=tokens) > 0  # the read completed...
    cluster.prefill[source].call("advance", seconds=31)  # ...but the lease runs out before its DONE
    wait_for(lambda: [rid, "expired", blocks] in cluster.prefill[source].call("released"), what="lease expiry")
    cluster.prefill[source].call("reuse", blocks=blocks)  # the engine hands the blocks to another request
    with pytest.raises(ChildError) as err:
        cluster.decode[0].call("done", request_id=rid, params=params)
    assert err.value.kind == "LoadError" and "recompute" in str(err.value)


@pytest.mark.slow
def test_abort_from_prefill_frees_both_sides(cluster: Cluster) -> None:
    rid, blocks, local, tokens = "req-abort-p", [3, 4], [1, 2], 32
    cluster.offer(rid, blocks, tokens)
    params = cluster.params(rid, blocks, tokens)
    read: set[int] = set()
    for c in cluster.decode:
        read.update(c.call("read", request_id=rid, params=params, local_blocks=local)["pulled"])
    assert all(rid in c.call("state")["held"] for c in cluster.decode)
    for c in cluster.prefill:  # the prefill engine aborts the request on every rank
        c.call("abort", request_id=rid)
    for c in cluster.decode:  # every decode rank that began pulling was told, and freed its blocks
        wait_for(lambda c=c: rid in c.call("state")["aborted"], what="abort at decode")
        assert rid not in c.call("state")["held"]
    for r, c in enumerate(cluster.prefill):  # the lease is over, but blocks someone reads stay while reads run
        assert rid not in c.call("state")["active"]
        assert (rid in [x[0] for x in c.call("released")]) == (r not in read)
    for c in cluster.decode:  # each rank's DONEs end its reads: answered invalid (recompute)
        with pytest.raises(ChildError) as err:
            c.call("done", request_id=rid, params=params)
        assert err.value.kind == "LoadError"
    for c in cluster.prefill:
        wait_for(lambda c=c: [rid, "aborted", blocks] in c.call("released"), what="prefill release")


@pytest.mark.slow
def test_abort_from_decode_frees_both_sides(cluster: Cluster) -> None:
    rid, blocks, local, tokens = "req-abort-d", [0, 7], [3, 5], 17
    cluster.offer(rid, blocks, tokens)
    params = cluster.params(rid, blocks, tokens)
    read = cluster.decode[0].call("read", request_id=rid, params=params, local_blocks=local)["pulled"]  # mid-request
    p = KVTransferParams.from_dict(params)
    every_prefill = [list(p.side_channel(r)) for r in range(cluster.p_tp)]
    for c in cluster.decode:  # the decode engine aborts it on every rank and tells the prefill ranks
        c.call("abort", request_id=rid, peers=every_prefill)
    for r, c in enumerate(cluster.prefill):
        if r not in read:  # nobody reads it: freed at once
            wait_for(lambda c=c: [rid, "aborted", blocks] in c.call("released"), what="prefill release")
    for r in read:  # decode rank 0's read may still be running: its blocks stay until its DONE
        c = cluster.prefill[r]
        wait_for(lambda c=c: rid not in c.call("state")["active"], what="abort at prefill")
        assert rid not in [x[0] for x in c.call("released")]
    with pytest.raises(ChildError):  # its read ended: the DONE (invalid, the lease was aborted) frees them
        cluster.decode[0].call("done", request_id=rid, params=params)
    for c in cluster.prefill:
        wait_for(lambda c=c: [rid, "aborted", blocks] in c.call("released"), what="prefill release")
        assert rid not in c.call("state")["active"]
    assert all(rid not in c.call("state")["held"] for c in cluster.decode)


@pytest.mark.slow
def test_lease_decode_killed_mid_pull_is_released_at_expiry(cluster: Cluster) -> None:
    rid, blocks, local, tokens = "req-killed", [2, 3], [0, 1], 30
    cluster.offer(rid, blocks, tokens, timeout_s=60)
    params = cluster.params(rid, blocks, tokens)
    victim = cluster.spawn("decode", 0, engine="decode-victim")
    try:
        victim.call("register")
        victim.call("read", request_id=rid, params=params, local_blocks=local)
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
