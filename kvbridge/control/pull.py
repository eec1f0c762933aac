"""The decode side of one request's migration, wired end to end: plan, readiness, leases, the
agent's pull, fenced DONEs and the notifier's release of ranks nobody reads.

`DecodeControl.start` does the short control round trips (find each prefill rank, wait for it to
be ready, BeginPull stating its release count), starts `KVAgent.pull`, and returns at once; when
the transfers end, `on_finished(request_id, error)` reports the outcome, on the transport's thread:
None, or the error that means "recompute" (a `LoadError` when a lease did not hold through the read,
the transport's error when the bytes did not move).

A read is confirmed one of two ways. Each prefill rank holds a lease's blocks for every decode rank
that began a pull until its DONE or the lease's deadline, whatever else happens to the lease
(`LeaseStatus.reads_held`): a read that ended well within the deadline its BeginPull was told read
intact bytes, so it is reported at once and its DONEs (which free the prefill blocks) go out after,
on a thread of their own, retried a few times (a DONE that never arrives ends in the lease's expiry).
Otherwise (a read that ended near or past the deadline, a prefill that promises no hold) the DONEs go
out first and their fenced answers decide. DONEs go out even after a failed transfer, so the prefill
side never waits for the lease to expire.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvbridge.agent import KVAgent, PullHandle, PullResult, RankInfo
from kvbridge.block_ids import BlockIds, block_array
from kvbridge.control.channel import ClientPool, ControlClient, ControlServer
from kvbridge.control.discovery import Registry, resolve
from kvbridge.control.messages import LeaseStatus
from kvbridge.control.params import KVTransferParams
from kvbridge.errors import KVBridgeError, LoadError
from kvbridge.topology import ParallelConfig, Plan

log = logging.getLogger(__name__)

FinishedCallback = Callable[[str, BaseException | None], None]
Leases = dict[int, tuple[ControlClient, int, int]]  # prefill rank -> client, lease epoch, release count

# A read counts as covered by the prefill's hold when it ended this much before the deadline its BeginPull
# was told, measured from before the BeginPull was sent (so the side channel's own delays only make the
# check stricter): far more than two hosts' monotonic clocks can drift apart over a lease (NTP keeps
# their rates within 0.05 %).
# One side-channel message from a decode rank (a BeginPull, a DONE) waits at most this long for its answer.
CONTROL_TIMEOUT_S = 5.0
HOLD_SLACK_S = 0.5
HOLD_SLACK_SHARE = 0.01
DONE_ATTEMPTS = 3  # a DONE sent after its read was reported: tries (then the prefill's lease expires)
DONE_RETRY_S = 0.05  # before the second try, doubling


def hold_deadline(asked: float, status: LeaseStatus) -> float:
    """Until when (this host's monotonic clock, `asked`: before the request `status` answers was sent) the
    prefill rank holds its blocks for this read; -inf when it promises no hold."""
    if not status.reads_held:
        return -math.inf
    return asked + status.remaining_s * (1 - HOLD_SLACK_SHARE) - HOLD_SLACK_S


def _blocks_read(plan: Plan, decode_rank: int, prefill_rank: int, blocks: Sequence[int]) -> BlockIds:
    """The prefill rank's block ids this decode rank reads (named in BeginPull, checked against the lease).
    Positions past the list are left for the agent to refuse with its own error."""
    ids = block_array(blocks)
    pos = [p.src_positions() for p in plan.pulls_for(decode_rank) if p.prefill_rank == prefill_rank]
    picked = np.concatenate(pos) if pos else np.empty(0, dtype=np.int64)
    return BlockIds(np.unique(ids[picked[picked < len(ids)]]))


class DecodeControl:
    """One decode rank's control plane: its agent, its side channel (told of aborts), its clients."""

    def __init__(
        self,
        agent: KVAgent,
        server: ControlServer,
        *,
        secret: str | bytes | None = None,
        registry: Registry | None = None,
        ready_timeout_s: float = 30.0,
        timeout_s: float = 5.0,
    ) -> None:
        self.agent = agent
        self.server = server
        self.name = f"{agent.engine_id}/{agent.rank}"
        self.registry = registry
        self.ready_timeout_s = ready_timeout_s
        self.clients = ClientPool(secret=secret, timeout_s=timeout_s, sender=self.name)
        self._infos: dict[tuple[str, int], RankInfo] = {}
        self._local_ids: dict[str, str] = {}  # prefill request id -> this engine's request id, while pulling
        self._lock = threading.Lock()
        self._later: ThreadPoolExecutor | None = None  # DONEs of reads already reported
        self._closed = False

    def _client(self, params: KVTransferParams, rank: int) -> tuple[ControlClient, tuple[str, int]]:
        addr = resolve(params, rank, registry=self.registry, wait_s=self.ready_timeout_s)
        return self.clients.get(*addr), addr

    def _info(self, client: ControlClient, addr: tuple[str, int], engine_id: str | None, rid: str) -> RankInfo:
        with self._lock:
            info = self._infos.get(addr)
        if info is None or (engine_id is not None and info.engine_id != engine_id):
            # not asked yet, or asked of an engine that has since restarted on this address: ask now
            info = client.get_info(wait_s=self.ready_timeout_s)
            with self._lock:
                self._infos[addr] = info
        if engine_id is not None and info.engine_id != engine_id:  # a stale address: not the blocks asked for
            raise LoadError(
                f"request {rid!r}: side channel {client.url} serves engine {info.engine_id!r}, not "
                f"{engine_id!r} named by the transfer params; recompute",
                peer=client.url,
                request=rid,
                cause="engine mismatch",
            )
        return info

    def start(
        self,
        request_id: str,
        params: KVTransferParams,
        local_blocks: Sequence[int],
        on_finished: FinishedCallback | None = None,
        timing: dict[str, float] | None = None,
    ) -> PullHandle:
        """Pull this rank's share of the request `params` describe into `local_blocks`.

        `timing`, if given, gets `offer_wait_ms` (how long the BeginPulls waited for prefill's offers) and
        `time.perf_counter()` stamps: `announced_at` (BeginPulls answered, the transfers about to be submitted),
        `transferred_at` (every transfer ended, the bytes verified) and `confirmed_at` (the read confirmed: by
        the prefill ranks' holds, or by the DONEs' answers; just before `on_finished`); and `nbytes` and
        `descriptors`, what the transfers moved.
        Raises LoadError (no active lease: recompute), TransferTimeout (a prefill rank never became
        ready) or the agent's errors before anything moves; later outcomes go to `on_finished`.
        """
        rid = str(params.remote_request_id)
        prefill = ParallelConfig(tp=params.tp_size, pcp=params.pcp_size, dcp=params.dcp_size, dp=params.dp_size)
        tokens = int(params.remote_num_tokens or 0)
        plan = self.agent.plan(prefill, tokens, prefill_dp=params.dp_rank)
        leases: Leases = {}
        held_until = math.inf  # the earliest end of the prefill ranks' holds of this read

        def stamp(name: str) -> None:
            if timing is not None:
                timing[name] = time.perf_counter()

        # Ranks nobody reads are released by the notifier, one DONE each (release count 1).
        notify = [(self._client(params, r)[0], 1) for r in plan.unpulled] if self.agent.rank == plan.notifier else []
        ranks = sorted({p.prefill_rank for p in plan.pulls_for(self.agent.rank)})

        def finished(result: PullResult) -> None:
            stamp("transferred_at")
            if timing is not None:  # what moved, for the engine's metrics before it hears of the outcome
                timing["nbytes"], timing["descriptors"] = result.nbytes, result.descriptors
            error = result.error
            if error is not None:
                with self._lock:  # a stale endpoint (a restarted prefill) is fetched again next time
                    self._infos.clear()
            held = error is None and time.monotonic() < held_until
            if not held:  # the DONEs' answers decide (a LoadError when a lease did not hold)
                error = self._send_dones(rid, leases, notify, error)
            self._forget(rid)
            stamp("confirmed_at")
            if on_finished is not None:
                on_finished(request_id, error)
            if held:  # the bytes are intact whatever the DONEs answer: they only free the prefill blocks now
                self._send_later(rid, leases, notify)

        with self._lock:
            self._local_ids[rid] = request_id
        try:
            infos = []
            waited = 0.0
            for rank in ranks:
                client, addr = self._client(params, rank)
                infos.append(self._info(client, addr, params.remote_engine_id, rid))
                count = plan.release_count(rank)
                asked = time.monotonic()
                status = client.begin_pull(
                    rid,
                    self.name,
                    notify=self.server.address,
                    expected_pulls=count,
                    wait_s=self.ready_timeout_s,
                    blocks=_blocks_read(plan, self.agent.rank, rank, params.block_ids),
                )
                leases[rank] = (client, status.epoch, count)
                held_until = min(held_until, hold_deadline(asked, status))
                waited += status.waited_ms
            if timing is not None:
                timing["offer_wait_ms"] = waited
            stamp("announced_at")
            return self.agent.pull(rid, infos, params.block_ids, local_blocks, tokens, on_done=finished)
        except BaseException as exc:
            self.release_unread(rid, params, plan, leases, notify, exc)
            self._forget(rid)
            raise

    def release_unread(
        self,
        rid: str,
        params: KVTransferParams,
        plan: Plan,
        leases: Leases,
        notify: list[tuple[ControlClient, int]],
        error: BaseException,
    ) -> None:
        """This rank will not use what it read (`error`): release what it announced (`leases`), the ranks it
        was to read but had not announced yet (their offer may still be on its way: a release-only DONE is
        kept until it comes) and the unread ranks (`notify`), right away. A rank whose side channel just
        left its BeginPull unanswered (killed or stalled) gets no DONE to wait on again: its lease expires."""
        release = list(notify)
        for rank in sorted({p.prefill_rank for p in plan.pulls_for(self.agent.rank)}):
            if rank not in leases:
                try:
                    client = self._client(params, rank)[0]
                except KVBridgeError as why:
                    log.warning("request %s: cannot find prefill rank %d to release it: %s", rid, rank, why)
                    continue
                if client.silent:
                    log.warning("request %s: %s does not answer; its lease expires instead", rid, client.url)
                    continue
                release.append((client, plan.release_count(rank)))
        self._send_dones(rid, leases, release, error)

    def _send_dones(
        self,
        rid: str,
        leases: Leases,
        release: list[tuple[ControlClient, int]],
        error: BaseException | None,
        *,
        held: bool = False,
    ) -> BaseException | None:
        """DONE to every announced lease (fenced unless the pull already failed, or `held`: the read is
        confirmed by the prefill ranks' holds) and a release-only DONE (with its release count) to each of
        `release`; returns the pull's outcome: None, or the error that means recompute. `held` DONEs are
        retried (DONE_ATTEMPTS), and what they find is only logged."""
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

    def _send_later(self, rid: str, leases: Leases, release: list[tuple[ControlClient, int]]) -> None:
        """The DONEs of a read already reported (its bytes held by the prefill ranks), off the caller's thread."""
        with self._lock:
            if self._later is None and not self._closed:
                self._later = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvbridge-done")
            later = self._later
        try:
            if later is None:
                raise RuntimeError("closed")
            later.submit(self._send_dones, rid, leases, release, None, held=True)
        except RuntimeError:  # closing: the prefill ranks' leases expire instead
            log.warning("request %s: decode control closed before its DONEs were sent; the leases expire", rid)

    def _forget(self, rid: str) -> None:
        with self._lock:
            self._local_ids.pop(rid, None)

    def local_id(self, remote_request_id: str) -> str | None:
        """This engine's id of a request being pulled (an abort from the prefill side names the prefill's id)."""
        with self._lock:
            return self._local_ids.get(remote_request_id)

    def abort(self, params: KVTransferParams, reason: str = "") -> int:
        """The decode engine aborted the request: tell every prefill rank of its group."""
        prefill = ParallelConfig(tp=params.tp_size, pcp=params.pcp_size, dcp=params.dcp_size, dp=params.dp_size)
        ranks = prefill.group(params.dp_rank)
        peers = [resolve(params, r, registry=self.registry, wait_s=self.ready_timeout_s) for r in ranks]
        return self.server.abort(str(params.remote_request_id), reason=reason, peers=peers)

    def close(self) -> None:
        """Send the DONEs still queued (each bounded by the clients' timeout and DONE_ATTEMPTS), then close."""
        with self._lock:
            self._closed = True
            later, self._later = self._later, None
        if later is not None:
            later.shutdown(wait=True)
        self.clients.close()
