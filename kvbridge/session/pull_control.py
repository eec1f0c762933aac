"""The decode side of one request's migration, for whole-request and layer-wise pulls alike. See docs/internals.md."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import attrs
import numpy as np

from kvbridge.agent.kv_agent import KVAgent, PullHandle, PullResult, RankInfo
from kvbridge.base import watchdog
from kvbridge.base.block_ids import BlockIds, block_array
from kvbridge.base.errors import KVBridgeError, LoadError
from kvbridge.base.lanes import Lanes
from kvbridge.control.channel import ControlServer
from kvbridge.control.client import ClientPool, ControlClient
from kvbridge.control.discovery import DiscoveryRegistry, resolve
from kvbridge.control.messages import LeaseStatus
from kvbridge.control.params import KVTransferParams
from kvbridge.plan.topology import ParallelConfig, Plan
from kvbridge.session.layers import LayerReader
from kvbridge.session.machine import PullMachine, PullState
from kvbridge.session.outbox import Recorder
from kvbridge.session.pull import Leases, Release, Session
from kvbridge.session.read_first import Admitted, HeldRead
from kvbridge.session.releases import OwedReleases
from kvbridge.transport.contract import settle

log = logging.getLogger(__name__)

FinishedCallback = Callable[[str, BaseException | None], None]

# One side-channel message from a decode rank (a BeginPull, a DONE) waits at most this long for its answer.
CONTROL_TIMEOUT_S = 5.0
DONE_ATTEMPTS = 3  # a DONE sent after its read was reported: tries (then the prefill's lease expires)
DONE_RETRY_S = 0.05  # before the second try, doubling


def blocks_read(plan: Plan, decode_rank: int, prefill_rank: int, blocks: Sequence[int]) -> BlockIds:
    """The prefill rank's block ids this decode rank reads (named in BeginPull, checked against the lease).

    Positions past the list are left for the agent to refuse with its own error."""
    ids = block_array(blocks)
    pos = [p.src_positions() for p in plan.pulls_for(decode_rank) if p.prefill_rank == prefill_rank]
    picked = np.concatenate(pos) if pos else np.empty(0, dtype=np.int64)
    return BlockIds(np.unique(ids[picked[picked < len(ids)]]))


def lease_share(rid: str, url: str, status: LeaseStatus, skip: int, count: int) -> BlockIds:
    """The `count` blocks after the first `skip` of the lease `status` describes; LoadError when it holds fewer.

    A moved request's source names its blocks only in its lease (docs/elastic.md)."""
    blocks = status.blocks.array
    if not status.valid or len(blocks) < skip + count:
        raise LoadError(
            f"request {rid!r}: the lease on {url} is {status.state.value} with {len(blocks)} blocks; this decode "
            f"reads blocks {skip}..{skip + count - 1} of it; recompute",
            peer=url,
            request=rid,
            cause="lease short",
        )
    return BlockIds(blocks[skip : skip + count])


def prefill_parallel(params: KVTransferParams) -> ParallelConfig:
    """The prefill engine's parallel layout, as its params state it."""
    return ParallelConfig(tp=params.tp_size, pcp=params.pcp_size, dcp=params.dcp_size, dp=params.dp_size)


class PullControl:
    """One decode rank's control plane: its agent, its side channel (told of aborts), its clients."""

    def __init__(
        self,
        agent: KVAgent,
        server: ControlServer,
        *,
        secret: str | bytes | None = None,
        registry: DiscoveryRegistry | None = None,
        ready_timeout_s: float = 30.0,
        timeout_s: float = CONTROL_TIMEOUT_S,
        stats: Recorder | None = None,
        read_first: bool = True,
    ) -> None:
        """`stats` records the time of the DONEs sent after a pull was reported (the rest: `DecodeSide`).

        `read_first`: a whole-request pull from a prefill rank that still admits this reader starts its read with
        its BeginPull in flight, and uses it only once the answer says the lease held (docs/internals.md)."""
        self.agent = agent
        self.read_first = read_first
        self.stats = stats
        self.server = server
        self.name = f"{agent.engine_id}/{agent.rank}"
        self.registry = registry
        self.ready_timeout_s = ready_timeout_s
        self.clients = ClientPool(secret=secret, timeout_s=timeout_s, sender=self.name)
        self._infos: dict[str, RankInfo] = {}  # side channel url -> its rank
        self._admitted = Admitted()
        self._local_ids: dict[str, str] = {}  # prefill request id -> this engine's request id, while pulling
        self._lock = threading.Lock()
        # DONEs of reads already reported, each prefill server's on threads of its own: a silent one holds no other's
        self._later = Lanes(2, "kvbridge-done")
        self._owed = OwedReleases(self.name)  # release DONEs for prefill ranks that did not answer in time

    # -- the steps both kinds of pull share -----------------------------------------------------

    def _client(self, params: KVTransferParams, rank: int) -> ControlClient:
        return self.clients.get(*resolve(params, rank, registry=self.registry, wait_s=self.ready_timeout_s))

    def _info(self, client: ControlClient, engine_id: str | None, rid: str) -> RankInfo:
        with self._lock:
            info = self._infos.get(client.url)
        if info is None or (engine_id is not None and info.engine_id != engine_id):
            # not asked yet, or asked of an engine that has since restarted on this address: ask now
            info = client.get_info(wait_s=self.ready_timeout_s)
            with self._lock:
                self._infos[client.url] = info
            self._admitted.forget(client.url)  # another engine, or none known: nothing admits this reader yet
        if engine_id is not None and info.engine_id != engine_id:  # a stale address: not the blocks asked for
            raise LoadError(
                f"request {rid!r}: side channel {client.url} serves engine {info.engine_id!r}, not "
                f"{engine_id!r} named by the transfer params; recompute",
                peer=client.url,
                request=rid,
                cause="engine mismatch",
            )
        return info

    def _session(self, machine: PullMachine, params: KVTransferParams, tokens: int) -> Session:
        """Resolving: plan the pull and find the ranks nobody reads (the notifier releases those: one DONE each)."""
        plan = self.agent.plan(prefill_parallel(params), tokens, prefill_dp=params.dp_rank)
        notify = [(self._client(params, r), 1) for r in plan.unpulled] if self.agent.rank == plan.notifier else []
        ranks = sorted({p.prefill_rank for p in plan.pulls_for(self.agent.rank)})
        return Session(machine, str(params.remote_request_id), params, plan, ranks, notify)

    def _begin(
        self,
        s: Session,
        *,
        whole: bool,
        check: Callable[[int, ControlClient, RankInfo], None] | None = None,
        take: tuple[int, int] = (0, 0),
        cancelled: threading.Event | None = None,
        reading: bool = False,
    ) -> None:
        """Resolving -> leased: each rank's side channel and RankInfo (checked), BeginPull. See docs/internals.md.

        `cancelled`: decode dropped the request; a BeginPull still waiting for its answer stops waiting. `reading`:
        the read began first (`_warm`): the state stays."""
        waited = contact = begin = 0.0
        for rank in s.ranks:
            found = time.monotonic()
            client = s.clients[rank] if rank in s.clients else self._client(s.params, rank)
            info = s.infos[rank] if rank in s.infos else self._info(client, s.params.remote_engine_id, s.rid)
            if check is not None:
                check(rank, client, info)
            s.clients[rank], s.infos[rank] = client, info
            count = s.plan.release_count(rank)
            asked = s.machine.beat.busy()
            contact += asked - found
            status = client.begin_pull(
                s.rid,
                self.name,
                notify=self.server.address,
                expected_pulls=count,
                wait_s=self.ready_timeout_s,
                blocks=blocks_read(s.plan, self.agent.rank, rank, s.params.block_ids) if whole else (),
                cancelled=cancelled,
            )
            s.leases[rank] = (client, status.epoch, count)
            self._admitted.answered(client.url, asked, status)
            if status.info_digest and status.info_digest != info.digest():  # an endpoint that may be gone
                info = s.infos[rank] = self._registered_again(s, client, status.info_digest, reading=reading)
                if check is not None:
                    check(rank, client, info)
            if whole and s.params.lease_blocks:
                s.params = attrs.evolve(s.params, remote_block_ids=[lease_share(s.rid, client.url, status, *take)])
            if whole:
                s.hold(asked, status)
            waited += status.waited_ms
            begin += s.machine.beat.busy() - asked
        # first contact (the side channel's address, GetInfo); BeginPull less its wait for prefill's offer
        s.machine.parts.update(contact_ms=round(contact * 1e3, 3), begin_ms=round(max(0.0, begin * 1e3 - waited), 3))
        s.machine.offer_wait_ms = waited
        if not reading:
            s.machine.to(PullState.LEASED)

    def _registered_again(self, s: Session, client: ControlClient, digest: str, *, reading: bool) -> RankInfo:
        """The RankInfo of a rank that registered other memory under the same engine id (restarted) since it was known.

        A read not begun yet uses the rank's info as it is now; one begun with the old info is discarded (recompute)."""
        with self._lock:
            self._infos.pop(client.url, None)
        self._admitted.forget(client.url)
        info = None if reading else self._info(client, s.params.remote_engine_id, s.rid)
        if info is None or info.digest() != digest:
            raise LoadError(
                f"request {s.rid!r}: side channel {client.url} registered other memory since this rank learned of it "
                "(it restarted under the same engine id); nothing read with its old RankInfo is kept; recompute",
                peer=client.url,
                request=s.rid,
                cause="registered again",
            )
        return info

    def _warm(self, s: Session) -> bool:
        """Whether `s` may read before its BeginPulls' answers (their clients and infos then in `s`).

        Every rank it reads must be known, be the engine the params name, and admit this reader for a while yet."""
        if not self.read_first or s.params.lease_blocks or not s.params.remote_engine_id:
            return False  # a moved request's blocks are named only in its lease's answer
        clients = {rank: self._client(s.params, rank) for rank in s.ranks}
        with self._lock:
            infos = {rank: self._infos.get(c.url) for rank, c in clients.items()}
        for rank, info in infos.items():
            url = clients[rank].url
            if info is None or info.engine_id != s.params.remote_engine_id or not self._admitted.admits(url):
                return False
            s.clients[rank], s.infos[rank] = clients[rank], info
        return True

    def _confirm(self, s: Session, error: BaseException | None) -> BaseException | None:
        """Landing -> confirming -> done / fenced / failed: the DONE rule, for every pull. See docs/internals.md."""
        s.machine.to(PullState.CONFIRMING)
        if error is not None:
            with self._lock:  # a stale endpoint (a restarted prefill) is fetched again next time
                self._infos.clear()
            self._admitted.forget()
        if error is None and time.monotonic() < s.held_until:
            self._send_later(s)
        else:
            error = self._send_dones(s.rid, s.leases, s.notify, error)
        self._forget(s.rid)
        s.machine.end(error)
        return error

    def _abandon(self, s: Session, error: BaseException) -> None:
        """This rank won't use what it read: release every rank it holds or was to read. See docs/internals.md."""
        release = list(s.notify)
        for rank in s.ranks:
            if rank in s.leases:
                continue
            try:
                client = s.clients.get(rank) or self._client(s.params, rank)
            except KVBridgeError as why:
                log.warning("request %s: cannot find prefill rank %d to release it: %s", s.rid, rank, why)
                continue
            if client.silent:  # it may yet serve the BeginPull it left unanswered: release it once it answers
                log.warning("request %s: %s does not answer; it is released once it answers", s.rid, client.url)
                self._owed.owe(client, s.rid, s.plan.release_count(rank))
                continue
            release.append((client, s.plan.release_count(rank)))
        self._send_dones(s.rid, s.leases, release, error)
        self._forget(s.rid)
        s.machine.end(error)

    # -- whole-request pulls ---------------------------------------------------------------------

    def start(
        self,
        request_id: str,
        params: KVTransferParams,
        local_blocks: Sequence[int],
        on_finished: FinishedCallback | None = None,
        machine: PullMachine | None = None,
        *,
        skip: int = 0,
    ) -> PullHandle:
        """Pull this rank's share of the request `params` describe into `local_blocks`. See docs/internals.md."""
        machine = machine or PullMachine(request_id, "pull")
        tokens = int(params.remote_num_tokens or 0)
        s: Session | None = None

        def landed(result: PullResult) -> None:
            machine.nbytes, machine.descriptors, machine.retries = result.nbytes, result.descriptors, result.retries
            machine.parts.update(prepare_ms=round(result.prepare_ms, 3), land_ms=round(result.land_ms, 3))
            machine.to(PullState.LANDING)  # the agent landed what it read before calling back

        def confirm(result: PullResult) -> None:
            assert s is not None
            error = self._confirm(s, result.error)
            if on_finished is not None:
                on_finished(request_id, error)

        def finished(result: PullResult) -> None:
            landed(result)
            confirm(result)

        with self._lock:
            self._local_ids[str(params.remote_request_id)] = request_id
        handle: PullHandle | None = None
        gate: HeldRead | None = None
        try:
            s = self._session(machine, params, tokens)
            if self._warm(s):
                gate = HeldRead(landed, confirm)
                machine.to(PullState.READING, leasing=True)
                handle = self._read(s, local_blocks, tokens, gate.read)
                self._begin(s, whole=True, reading=True)
                gate.leased()
                return handle
            self._begin(s, whole=True, take=(skip, len(local_blocks)))
            machine.to(PullState.READING)
            return self._read(s, local_blocks, tokens, finished)
        except BaseException as exc:
            if s is None:
                self._forget(str(params.remote_request_id))
                machine.end(exc)
            elif gate is not None:  # a read begun first must end before decode reuses the blocks, unless it lands
                gate.failed()
                if handle is not None and not handle.abandon():
                    settle(handle.handles, self.clients.timeout_s, f"request {s.rid!r}")
                self._abandon(s, exc)
            elif machine.state in (PullState.RESOLVING, PullState.LEASED, PullState.READING):
                self._abandon(s, exc)
            raise

    def _read(
        self, s: Session, local_blocks: Sequence[int], tokens: int, on_done: Callable[[PullResult], None]
    ) -> PullHandle:
        infos = [s.infos[r] for r in s.ranks]
        handle = self.agent.pull(s.rid, infos, s.params.block_ids, local_blocks, tokens, on_done=on_done, plan=s.plan)
        for h in handle.handles:  # each transfer that ends is progress (the stall watchdog)
            h.add_done_callback(lambda _h: s.machine.beat.busy())
        return handle

    # -- layer-wise pulls ------------------------------------------------------------------------

    def stream(
        self,
        machine: PullMachine,
        params: KVTransferParams,
        local_blocks: Sequence[int],
        tokens: int,
        *,
        skip: int,
        timeout_s: float,
        cancelled: threading.Event,
    ) -> dict[str, float]:
        """Read the request layer by layer as prefill computes it, then `_confirm` it. See docs/internals.md."""
        s = self._session(machine, params, tokens)
        reader = LayerReader(self.agent, s, local_blocks, tokens, skip, timeout_s, cancelled)
        try:
            self._begin(s, whole=False, check=reader.check, cancelled=cancelled)
            machine.to(PullState.READING)
            reader.read()
            machine.to(PullState.LANDING)
            reader.land()
        except BaseException as exc:
            reader.retire(timeout_s)  # never leave a read running into blocks decode recomputes or reuses
            if cancelled.is_set():  # decode dropped the request: prefill need not keep it for anyone
                for client, _epoch, _count in s.leases.values():
                    try:
                        client.abort(s.rid, reason="decode dropped the request")
                    except KVBridgeError as why:
                        log.warning("request %s: could not abort it on %s: %s", s.rid, client.url, why)
            self._abandon(s, exc)  # the DONEs end this rank's reads (an aborted lease is held until its DONE)
            raise
        done_at = time.perf_counter()
        error = self._confirm(s, None)
        if error is not None:
            raise error
        return reader.phases(done_ms=(time.perf_counter() - done_at) * 1e3)

    # -- DONEs -----------------------------------------------------------------------------------

    def _send_dones(
        self, rid: str, leases: Leases, release: Release, error: BaseException | None, *, held: bool = False
    ) -> BaseException | None:
        """DONE every announced lease, release-only DONE each of `release`; the outcome. See docs/internals.md."""
        attempts = DONE_ATTEMPTS if held else 1
        for client, epoch, count in leases.values():
            try:
                status = self._done(client, rid, epoch, count, check=error is None and not held, attempts=attempts)
                if held and not status.valid:
                    log.info(
                        "request %s: lease on %s was %s at the DONE; the read had ended within its hold",
                        rid,
                        client.url,
                        status.state.value,
                    )
            except LoadError as exc:
                error = error or exc
            except KVBridgeError as exc:  # unreachable prefill: its lease expires
                if held:
                    log.warning("request %s: no DONE reached %s (its lease expires): %s", rid, client.url, exc)
                    continue
                error = error or LoadError(  # the data is unconfirmed
                    f"request {rid!r}: could not confirm the lease on {client.url}: {exc}; recompute",
                    peer=client.url,
                    request=rid,
                )
        for client, count in release:
            try:
                self._done(client, rid, 0, count, check=False, attempts=attempts)
            except KVBridgeError as exc:
                log.warning("request %s: could not release prefill rank %s: %s", rid, client.url, exc)
        return error

    def _done(
        self, client: ControlClient, rid: str, epoch: int, count: int, *, check: bool, attempts: int
    ) -> LeaseStatus:
        """One DONE, tried up to `attempts` times while the side channel fails (not when it answers)."""
        for attempt in range(attempts):
            try:
                return client.done(rid, self.name, epoch, expected_pulls=count, check=check)
            except LoadError:
                raise
            except KVBridgeError as exc:
                if attempt + 1 >= attempts:
                    raise
                log.info("request %s: DONE to %s failed (%s); trying again", rid, client.url, exc)
                time.sleep(DONE_RETRY_S * 2**attempt)  # bounded: DONE_ATTEMPTS tries
        raise AssertionError("unreachable")

    def _dones_held(self, s: Session) -> None:
        """The DONEs of a read already reported: timed (`done` phase), one line when slow."""
        begun = time.monotonic()
        self._send_dones(s.rid, s.leases, s.notify, None, held=True)
        took = time.monotonic() - begun
        peer = s.params.server
        if self.stats is not None:
            self.stats.record_phase("done", self.agent.backend.name, peer, took)
        watchdog.slow(log, f"DONEs of request {s.rid} from {self.name} to {peer}", {"done": took * 1e3})

    def _send_later(self, s: Session) -> None:
        """The DONEs of a read already confirmed (its bytes held by the prefill ranks), off the caller's thread."""
        try:
            self._later.submit(s.params.server, lambda: self._dones_held(s))
        except RuntimeError:  # closing: the prefill ranks' leases expire instead
            log.warning("request %s: decode control closed before its DONEs were sent; the leases expire", s.rid)

    # -- the rest --------------------------------------------------------------------------------

    def _forget(self, rid: str) -> None:
        with self._lock:
            self._local_ids.pop(rid, None)

    def local_id(self, remote_request_id: str) -> str | None:
        """This engine's id of a request being pulled (an abort from the prefill side names the prefill's id)."""
        with self._lock:
            return self._local_ids.get(remote_request_id)

    def abort(self, params: KVTransferParams, reason: str = "") -> int:
        """The decode engine aborted the request: tell every prefill rank of its group."""
        ranks = prefill_parallel(params).group(params.dp_rank)
        peers = [resolve(params, r, registry=self.registry, wait_s=self.ready_timeout_s) for r in ranks]
        return self.server.abort(str(params.remote_request_id), reason=reason, peers=peers)

    def close(self) -> None:
        """Send the DONEs still queued (each bounded by the clients' timeout and DONE_ATTEMPTS), then close."""
        self._later.shutdown(wait=True)
        self._owed.close(wait_s=self.clients.timeout_s)
        self.clients.close()
