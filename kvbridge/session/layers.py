"""The reading state of a layer-wise pull: poll each prefill rank's stream, read what is done. See docs/internals.md."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np

from kvbridge.base.block_ids import block_array
from kvbridge.base.errors import LoadError, TransferTimeout
from kvbridge.base.memory import total_bytes
from kvbridge.control.client import ControlClient
from kvbridge.control.messages import STREAM_FIRST_VERSION, StreamStatus
from kvbridge.plan.descriptors import pull_descriptors
from kvbridge.plan.layout import KVLayout
from kvbridge.session.pull import Session
from kvbridge.transport.contract import TransferHandle, settle

if TYPE_CHECKING:
    from kvbridge.agent.kv_agent import KVAgent, RankInfo
    from kvbridge.agent.landing import Landed

# Decode asks prefill for its progress with a long poll: prefill holds the QueryStream until it wakes
# its readers (or the lease ends), at most this long, so decode reads as soon as there is something to
# read without busy polling (each poll answered takes the prefill's GIL from its compute).
# Longer than a step (a poll that times out costs a round trip for nothing); decode notices
# its own cancellation between polls.
STREAM_WAIT_S = 0.5
# Against a prefill that answers at once (no long poll), decode polls this often, backing off.
POLL_MIN_S, POLL_MAX_S = 0.0005, 0.002


def busy_s(intervals: list[tuple[float, float]], until: float | None = None) -> float:
    """Seconds covered by the union of `intervals` (cut at `until`)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if until is not None:
            b = min(b, until)
        if b <= a:
            continue
        a = max(a, end)
        if b > a:
            total += b - a
            end = b
    return total


def held_s(held_ms: float, round_trip_s: float) -> float:
    """A StreamStatus's `held_ms` in seconds, at most the round trip it was part of (it comes off the wire)."""
    return min(held_ms / 1e3, round_trip_s) if math.isfinite(held_ms) and held_ms > 0 else 0.0


def sub_layout(layout: KVLayout, layers: Sequence[int]) -> KVLayout:
    """The layout of `layers` only (their regions), for planning a read of those layers."""
    return attrs.evolve(layout, regions=[r for r in layout.regions if r.layer in layers])


class LayerReader:
    """One layer-wise pull's reads: what each rank streamed, what was read, what still lands."""

    def __init__(
        self,
        agent: KVAgent,
        session: Session,
        local_blocks: Sequence[int],
        tokens: int,
        skip: int,
        timeout_s: float,
        cancelled: threading.Event,
    ) -> None:
        self.agent, self.s, self.tokens, self.timeout_s, self.cancelled = agent, session, tokens, timeout_s, cancelled
        self.layers = agent.layout.model.layers
        self.bs = agent.layout.model.block_size
        self.total = -(-tokens // self.bs)
        self.skip = skip
        # by block position (converted once per stream, not per read); decode's prefix hits are skipped (-1)
        self.local = np.concatenate([np.full(skip, -1, dtype=np.int64), block_array(local_blocks)])
        self.pulls = list(session.plan.pulls_for(agent.rank))
        self.peers: dict[int, tuple[object, bool]] = {}  # prefill rank -> transport peer, reads land
        self.handles: list[TransferHandle] = []
        self.landings: list[tuple[TransferHandle, Landed]] = []  # reads into landing buffers, not yet in the cache
        self.spans: list[list[float]] = []
        self.began = time.time()
        self.control_s = 0.0
        self.computing_until = 0.0  # the prompt's compute ended no earlier (this host's clock)
        self.ended = 0.0

    def check(self, rank: int, client: ControlClient, info: RankInfo) -> None:
        """Before BeginPull: the prefill rank's cache can be streamed from, and how its reads land."""
        buffers = self.agent.landing_buffers
        if buffers is not None and not buffers.direct(info.layout):
            raise LoadError(
                f"request {self.s.rid!r}: prefill rank {rank} arranges its KV cache unlike this decode rank; "
                'layer-wise streaming needs the same layout and block size on both sides (or "transfer": "pull")',
                peer=client.url,
                request=self.s.rid,
                cause="layout",
            )
        # A transport that may still write after a failed read (Mooncake TCP) reads into landing
        # buffers, copied into the cache once each read succeeded, as pull mode does.
        lands = buffers is not None and all(buffers.lands(info.layout, p) for p in self.pulls if p.prefill_rank == rank)
        self.peers[rank] = (self.agent.connect(info), lands)

    def read(self) -> None:
        """Poll and read until every rank's every layer holds the whole prompt and every read ended well."""
        s, rid = self.s, self.s.rid
        self.control_s = time.time() - self.began
        self.computing_until = time.time()
        sent = {rank: [self.skip] * self.layers for rank in s.ranks}  # per rank and layer: positions requested
        subs: dict[tuple[int, tuple[int, ...]], tuple[KVLayout, KVLayout]] = {}
        delay, last_progress = POLL_MIN_S, time.monotonic()
        versions = dict.fromkeys(s.ranks, STREAM_FIRST_VERSION)
        finished: set[int] = set()  # ranks whose every layer holds the whole prompt
        while True:
            if self.cancelled.is_set():
                raise LoadError(f"request {rid!r}: decode dropped it while streaming", request=rid, cause="cancelled")
            progressed, complete = False, True
            round_began = time.monotonic()
            self._land_finished()
            for rank in s.ranks:
                client, epoch, _count = s.leases[rank]
                asked, asked_at = time.monotonic(), time.time()
                st = client.query_stream(
                    rid, epoch, seen=versions[rank], wait_s=0.0 if rank in finished else STREAM_WAIT_S
                )
                versions[rank] = st.version
                groups, rank_complete = self._groups(client, st, sent[rank])
                if rank_complete:
                    if rank not in finished:
                        # The lease was valid at every answer so far (each one checks it), so nothing reused
                        # the blocks before this one; from it on, a prefill that holds reads keeps them for
                        # this rank until its DONE or the deadline.
                        s.hold(asked, st.lease)
                    finished.add(rank)
                else:
                    complete = False
                # When the prompt's compute ended, as a lower bound on this host's clock: after this query
                # arrived (so after it was sent) if the answer says layers are still to come, and, if the
                # query was held, not before it had been held for `held_ms` (nothing had moved when it
                # arrived; a held answer that completes the stream was sent when its last layer was saved).
                # Reads before that overlapped the compute.
                held = held_s(st.held_ms, time.time() - asked_at)
                if not rank_complete or held > 0:
                    self.computing_until = max(self.computing_until, asked_at + held)
                for (a, b), group in groups.items():
                    key = (rank, tuple(group))
                    if key not in subs:
                        subs[key] = (sub_layout(self.agent.layout, group), sub_layout(s.infos[rank].layout, group))
                    self._read(rank, st, a, b, group, *subs[key])
                    for layer in group:
                        sent[rank][layer] = b
                    progressed = True
            if complete:
                break
            now = time.monotonic()
            if progressed:
                last_progress, delay = now, POLL_MIN_S
            elif now - last_progress > self.timeout_s:
                raise TransferTimeout(
                    f"request {rid!r}: prefill computed no new layer for {self.timeout_s}s; raise pull_timeout_s "
                    "for prompts that take longer per step",
                    request=rid,
                    cause="timeout",
                )
            elif now - round_began < POLL_MIN_S:  # answered at once, unchanged: a prefill that does not hold
                delay = min(delay * 2, POLL_MAX_S)
                time.sleep(delay)  # bounded by the timeout above
        settle(self.handles, self.timeout_s, f"request {rid!r}")
        error = next((e for e in (h.exception() for h in self.handles) if e is not None), None)
        if error is not None:
            raise error

    def _groups(
        self, client: ControlClient, st: StreamStatus, sent: list[int]
    ) -> tuple[dict[tuple[int, int], list[int]], bool]:
        """The layers readable beyond what was requested, grouped by (first, end) block position.

        Also returns whether the rank's every layer holds the whole prompt."""
        rid = self.s.rid
        if not st.lease.valid:
            raise LoadError(
                f"request {rid!r}: lease on {client.url} is {st.lease.state.value} mid-stream; recompute",
                peer=client.url,
                request=rid,
                cause=st.lease.state.value,
            )
        if st.tokens and st.tokens != self.tokens:
            raise LoadError(
                f"request {rid!r}: prefill streams a prompt of {st.tokens} tokens, decode holds {self.tokens}; "
                "the proxy must send both servers the same prompt",
                peer=client.url,
                request=rid,
                cause="prompt",
            )
        have = len(st.lease.blocks)
        ready = [min(have, self.total if r >= self.tokens else r // self.bs) for r in (st.ready or (0,) * self.layers)]
        groups: dict[tuple[int, int], list[int]] = {}
        for layer in range(self.layers):
            if ready[layer] > sent[layer]:
                groups.setdefault((sent[layer], ready[layer]), []).append(layer)
        return groups, all(r >= self.total for r in ready)

    def _read(
        self, rank: int, st: StreamStatus, a: int, b: int, group: list[int], mine: KVLayout, theirs: KVLayout
    ) -> None:
        """Submit the reads of block positions [a, b) of `group`'s layers from `rank`."""
        peer, lands = self.peers[rank]
        info = self.s.infos[rank]
        for p in self.pulls:
            if p.prefill_rank != rank:
                continue
            first = {"src_first": p.src_first + a * p.src_step, "dst_first": p.dst_first + a * p.dst_step}
            sub = attrs.evolve(p, num_blocks=b - a, **first)
            land = None
            if lands:
                land = self.agent.landing_buffers.prepare(
                    self.s.rid, sub, info.layout, st.lease.blocks, self.local, self.tokens, layers=group
                )
                desc = land.descriptors
            else:
                desc = pull_descriptors(sub, mine, theirs, self.local, st.lease.blocks)
            span = [time.time(), 0.0]  # submitted, completed (set by the transport's thread)
            try:
                h = self.agent.backend.transfer(peer, desc, "read")
            except BaseException:
                if land is not None:
                    land.finish(False, moved=False)
                raise
            if land is not None:
                self.landings.append((h, land))
            h.add_done_callback(lambda _h, span=span: span.__setitem__(1, time.time()))
            self.handles.append(h)
            self.spans.append(span)
            self.s.machine.nbytes += total_bytes(desc)
            self.s.machine.descriptors += len(desc)

    def _land_finished(self) -> None:
        """Copy the landed reads that succeeded into the cache and give their buffers back.

        The others stay (still running, or failed: `retire` retires them)."""
        for item in list(self.landings):
            h, land = item
            if h.done() and h.exception() is None:
                self.landings.remove(item)  # before the copy: a copy that fails still gives its buffer back
                land.finish(True)

    def land(self) -> None:
        """Landing: every read succeeded, the landed ones go into the cache now."""
        self._land_finished()
        self.ended = time.time()

    def retire(self, timeout_s: float) -> None:
        """After a failure nothing is copied in: a direct read is waited for, a landed one frees its buffer as it ends.

        A landed read that failed retires its buffer: it may write late."""
        landed = {id(h) for h, _land in self.landings}
        settle([h for h in self.handles if id(h) not in landed], timeout_s, f"request {self.s.rid!r}")
        for h, land in self.landings:
            h.add_done_callback(lambda h, land=land: land.finish(False, moved=h.exception() is not None))

    def phases(self, done_ms: float) -> dict[str, float]:
        """The read's phases (ms). See docs/internals.md."""
        # a callback may still be running when the reads settled: its transfer ended by now
        intervals = [(a, b or self.ended) for a, b in self.spans]
        busy = busy_s(intervals)
        hidden = busy_s(intervals, until=self.computing_until)
        phases = {
            "control_ms": self.control_s * 1e3,
            "transfer_ms": busy * 1e3,
            "hidden_ms": hidden * 1e3,
            "exposed_ms": (busy - hidden) * 1e3,
            "tail_ms": (self.ended - self.computing_until) * 1e3,
            "done_ms": done_ms,
        }
        return {k: round(v, 3) for k, v in phases.items()}
