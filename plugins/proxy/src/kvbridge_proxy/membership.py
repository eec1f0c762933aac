"""The proxy's pools and who is in them: the registry's members, health probes, warm-up and rebalancing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import httpx

from kvbridge.base.errors import ConfigError, KVBridgeError, described
from kvbridge.control.discovery import ServerRecord, url_problem
from kvbridge.control.params import KVTransferParams
from kvbridge_proxy.members import StaticMembers, open_members
from kvbridge_proxy.metrics import ProxyMetrics
from kvbridge_proxy.rebalance import Policy, kv_usage
from kvbridge_proxy.release import ReleaseLease
from kvbridge_proxy.settings import ProxySettings
from kvbridge_proxy.upstreams import Instance, NoInstance, Pool, since
from kvbridge_proxy.wire import prefill_body

log = logging.getLogger("kvbridge_proxy.app")  # the proxy's one logger, whichever module logs (operators filter on it)

PROBE_TIMEOUT_S = 5.0
SLOW_PROBES = 3
# Where a request finds every server of a role taken out, those are probed at once (one may be back since the last
# health round): each within this long, and at most once in this long per role, however many requests wait.
REVIVE_TIMEOUT_S = 1.0
REVIVE_INTERVAL_S = 0.2
# A health round probes at most this many servers at once: probes all started together hold the event loop
# (requests and registry reads wait behind them).
PROBES_IN_FLIGHT = 64
# A serving server whose record lapsed stays in rotation this long while it answers health probes. A record lapses when
# its announcer is late by two thirds of the TTL, as on a box starved for seconds: every decode's record may lapse at
# once, and a stream being moved then finds no decode to go to. A server that withdraws its record drained first.
LAPSE_GRACE_S = 30.0
REGISTRY_INTERVAL_S = 0.5  # the registry is read this often (or each health interval, if shorter): a join is seen
REGISTRY_UNREAD_SAID_S = 60.0  # a registry that stays unreadable is said again this often, not at every read


def identity_of(record: ServerRecord) -> KVTransferParams | None:
    """Where a server's KV can be pulled from, from its registry record (None: the record does not say)."""
    if not record.side_host or not record.side_port or record.dp_size != 1:
        return None  # with DP the proxy cannot know which engine holds a request
    return KVTransferParams(
        remote_engine_id=record.server_id,
        remote_host=record.side_host,
        remote_port=record.side_port,
        tp_size=record.tp_size,
        pp_size=record.pp_size,
    )


def pools_of(settings: ProxySettings) -> dict[str, Pool]:
    """The pools of the servers given (`--prefill`, `--decode`); with a registry they may start empty."""
    dynamic = settings.registry is not None
    return {
        role: Pool(role, urls, expose=settings.expose_internals, registry=dynamic)
        for role, urls in (("prefill", settings.prefill), ("decode", settings.decode))
    }


class Membership:
    """The pools of prefill and decode servers, kept to what is up: the registry, health probes, warm-up, rebalancing.

    Also where each prefill's side channel is (layer-wise requests) and which pairs made first contact."""

    def __init__(
        self,
        settings: ProxySettings,
        pools: dict[str, Pool],
        client: httpx.AsyncClient,
        secret: bytes | None,
        metrics: ProxyMetrics,
        release_lease: ReleaseLease,
    ) -> None:
        self.client = client
        self.release_lease = release_lease  # a warm-up no decode took: its prefill's lease
        self.pools = pools  # (`pools_of`)
        metrics.watch(pools)
        self.transfer = settings.transfer
        self.rebalance = settings.rebalance
        self.health_interval = settings.health_interval
        self.warm_up = settings.warm_up
        self.metrics = metrics
        # where each prefill server's side channel is (from its last answer; forgotten while it is down): to release
        # its leases, and in layerwise to stream from (`identity`)
        self.side_channels: dict[str, KVTransferParams] = {}
        self.warm: set[tuple[str, str]] = set()  # (prefill, decode) pairs warmed since both were last up
        self.warming: dict[tuple[str, str], asyncio.Task] = {}
        # To check the registry's records.
        self.members = None if settings.registry is None else open_members(settings.registry, secret=secret)
        if self.members is not None and not secret and not isinstance(self.members, StaticMembers):
            log.warning(
                "the proxy has no KVBRIDGE_SECRET: it takes every record in %s unchecked; anyone who can write "
                "there can add servers (docs/elastic.md)",
                self.members.url,
            )
        self._reviving: dict[str, asyncio.Future[None]] = {}  # role -> its probe of the servers taken out (`pick`)
        self._revived: dict[str, float] = {}  # role -> when that probe last ended (time.monotonic())
        self.membership_rounds = 0  # registry reads done: a test waits for one after a change
        self.health_rounds = 0  # rounds that probed every server (`kvbridge bench --scale` times them)
        self._unusable: set[str] = set()  # registry records' URLs that name no server (`url_problem`), said once
        self._unread_since: float | None = None  # since when the registry could not be read (`read_members`)
        self._unread_said = 0.0  # when that was last said

    # -- membership ----------------------------------------------------------------------------

    def sync(self, records: Sequence[ServerRecord]) -> None:
        """Make the pools' announced servers the registry's: join the new, drop the gone, mark the draining."""
        wanted = {(r.role, r.url.rstrip("/")): r for r in records}
        for role, pool in self.pools.items():
            for inst in list(pool.instances):
                record = wanted.pop((role, inst.url), None)
                if record is None:
                    if inst.announced and self._lapse_kept(inst):
                        continue
                    if inst.announced:
                        inst.lapsed = 0.0
                        pool.leave(inst)
                        self.metrics.forget(inst)
                        self.side_channels.pop(inst.url, None)
                        self.warm = {pair for pair in self.warm if inst.url not in pair}
                        log.warning("%s server %s left the registry: taken out", role, inst.url)
                    elif inst.draining:  # a static server whose record went: serving as configured
                        inst.draining = False
                    continue
                if inst.lapsed:
                    log.warning("%s server %s: its record is back after %.1f s", role, inst.url, since(inst.lapsed))
                    inst.lapsed = 0.0
                if record.draining != inst.draining:
                    log.warning("%s server %s is %s", role, inst.url, "draining" if record.draining else "serving")
                    inst.draining = record.draining
                inst.identity = identity_of(record)
        for (role, url), record in sorted(wanted.items()):
            if problem := url_problem(url):
                if url not in self._unusable:  # said once: the record stays until its announcer fixes it
                    self._unusable.add(url)
                    log.warning("%s record in the registry not taken: %s", role, problem)
                continue
            inst = self.pools[role].join(url, identity_of(record))
            inst.draining = record.draining
            self.metrics.track(inst)
            back = f", back with {len(inst.streams)} running streams" if inst.streams else ""
            log.warning("%s server %s joined from the registry (capacity %d%s)", role, url, record.capacity, back)

    def _lapse_kept(self, inst: Instance) -> bool:
        """Whether a server whose record is gone stays in rotation for now (LAPSE_GRACE_S)."""
        if inst.draining or not inst.healthy:
            return False
        if not inst.lapsed:
            inst.lapsed = time.monotonic()
            log.warning(
                "%s server %s: its record lapsed; it stays while it answers health probes, for at most %g s",
                inst.role,
                inst.url,
                LAPSE_GRACE_S,
            )
        return since(inst.lapsed) < LAPSE_GRACE_S

    async def read_members(self) -> None:
        """One read of the registry into the pools; a registry that cannot be read leaves them as they were."""
        assert self.members is not None
        try:
            records = await asyncio.to_thread(self.members.servers)
        except KVBridgeError as exc:
            self._unreadable(exc)
            return
        if self._unread_since is not None:
            log.warning("read the servers in %s again, after %.1f s", self.members.url, since(self._unread_since))
            self._unread_since = None
        self.sync(records)
        self.membership_rounds += 1

    def _unreadable(self, exc: KVBridgeError) -> None:
        """Say that the registry cannot be read: at once, then every REGISTRY_UNREAD_SAID_S while it lasts.

        It is read every REGISTRY_INTERVAL_S: a registry down for an hour was 7,200 lines."""
        assert self.members is not None
        now = time.monotonic()
        if self._unread_since is None:
            self._unread_since = now
        elif now - self._unread_said < REGISTRY_UNREAD_SAID_S:
            return
        self._unread_said = now
        lasted = f"for {now - self._unread_since:.0f} s" if now > self._unread_since else "(first try)"
        log.warning(
            "could not read the servers in %s %s; the pools stay as they are (said again every %g s while it "
            "lasts): %s",
            self.members.url,
            lasted,
            REGISTRY_UNREAD_SAID_S,
            exc,
        )

    # -- health --------------------------------------------------------------------------------

    async def pick(self, role: str, *, exclude: Sequence[Instance] = ()) -> Instance:
        """The next serving server of `role` but `exclude` (`Pool.pick`); where none is left, those taken out first.

        A server taken out stays out until the next health round (`health_interval`) finds it back, while requests
        that find none fail in microseconds: a chaos run that killed one of two prefill servers just as the other
        came back had 39 requests answered 503 in the 0.12 s before that round. `exclude` counts as none left too:
        the servers that already failed this request (one shutting down, answering 500, while the other was back
        from a restart the health loop had not seen yet: four clients answered 500 in another run)."""
        pool = self.pools[role]
        try:
            return pool.pick(exclude=exclude)
        except NoInstance:
            if not await self.revive(pool, exclude=exclude):
                raise
        return pool.pick(exclude=exclude)

    async def revive(self, pool: Pool, *, exclude: Sequence[Instance] = ()) -> bool:
        """Whether a server of `pool` but `exclude` serves; where none does, those taken out are probed first.

        One probe of them for every request that waits meanwhile, and none within `REVIVE_INTERVAL_S` of the last."""

        def serving() -> bool:
            return any(i.serving and i not in exclude for i in pool.instances)

        if serving():
            return True
        task = self._reviving.get(pool.role)
        if task is None:
            down = [i for i in pool.instances if not i.healthy and not i.draining and not i.cordoned]
            if not down or time.monotonic() - self._revived.get(pool.role, float("-inf")) < REVIVE_INTERVAL_S:
                return serving()
            task = self._reviving[pool.role] = asyncio.ensure_future(self._revive(pool.role, down))
        await asyncio.shield(task)
        return serving()

    async def _revive(self, role: str, down: list[Instance]) -> None:
        try:
            await asyncio.gather(*(self.probe(i, timeout=REVIVE_TIMEOUT_S) for i in down))
        finally:
            self._revived[role] = time.monotonic()
            del self._reviving[role]
        back = [i.url for i in down if i.serving]
        log.info("no %s server left to try: %d taken out probed at once, back: %s", role, len(down), back or "none")

    async def probe(self, inst: Instance, *, timeout: float | None = None) -> None:
        # A server that refuses connections or answers an error is down now. One that is only slow
        # to answer /health is busy (a loaded vLLM can take seconds), and taking it out would shift
        # all its traffic onto the others; it is down after SLOW_PROBES slow answers in a row.
        why, timeout = "", timeout or PROBE_TIMEOUT_S
        try:
            try:
                resp = await self.client.get(f"{inst.url}/health", timeout=timeout)
            except httpx.TimeoutException:
                raise
            except httpx.TransportError as exc:
                # Once more at once: a server that is gone refuses again in microseconds, while a connection that
                # dropped (DROPPED), or a connect the kernel failed, may not say it is: on a box starved for seconds one
                # round could take out every idle server at once, with no HTTP answer.
                log.info("%s server %s: health probe failed (%s): once more", inst.role, inst.url, type(exc).__name__)
                resp = await self.client.get(f"{inst.url}/health", timeout=timeout)
            ok, inst.slow_probes = resp.status_code == 200, 0
            why = f" ({resp.status_code})"
        except httpx.TimeoutException:
            inst.slow_probes += 1
            ok = inst.healthy and inst.slow_probes < SLOW_PROBES
            why = f" ({inst.slow_probes} slow probes in a row)"
        except httpx.HTTPError as exc:
            ok, why = False, f" ({described(exc)})"
        except Exception as exc:  # noqa: BLE001
            # The HTTP stack's own bugs (an exception it raises on a socket closed under it) are a failed
            # probe, not the end of health checks.
            log.warning("%s server %s: health probe failed (%s)", inst.role, inst.url, described(exc))
            ok = False
        if ok != inst.healthy:
            log.warning("%s server %s is %s", inst.role, inst.url, "back" if ok else f"down: taken out{why}")
        inst.healthy = ok

    async def _probe_in(self, slots: asyncio.Semaphore, inst: Instance) -> None:
        async with slots:
            await self.probe(inst)

    async def health_loop(self, after_probes: Callable[[], None]) -> None:
        """Probe every instance each `health_interval` for the proxy's lifetime; `after_probes` after each round.

        A round that fails is logged and the next one runs: a dead loop would keep every server taken out since then out
        for good."""
        while True:
            try:
                slots = asyncio.Semaphore(PROBES_IN_FLIGHT)
                await asyncio.gather(*(self._probe_in(slots, i) for p in self.pools.values() for i in p.instances))
                self.health_rounds += 1
                after_probes()
                if self.rebalance is not None:
                    await self.rebalance_round(self.rebalance)
                if self.warm_up:
                    self._warm_pairs()
            except Exception:
                log.exception("health check round failed; the next one runs in %.1fs", self.health_interval)
            await asyncio.sleep(self.health_interval)

    async def membership_loop(self) -> None:
        """Read the registry every `REGISTRY_INTERVAL_S` (or `health_interval`, if shorter), apart from health rounds.

        A health round probes every server and grows with the deployment (seconds at a thousand servers on 2 busy
        cores): a join read in the same loop waited for it (docs/measurements/scale.md)."""
        interval = min(self.health_interval, REGISTRY_INTERVAL_S)
        while True:
            try:
                await self.read_members()
            except Exception:  # as in the health loop: a dead loop would follow the registry no more
                log.exception("registry round failed; the next one runs in %.1fs", interval)
            await asyncio.sleep(interval)

    async def rebalance_round(self, policy: Policy) -> None:
        """Read every serving decode's KV cache usage and move the streams the policy picks (rebalance.py)."""

        async def usage(inst: Instance) -> tuple[Instance, float | None]:
            try:
                resp = await self.client.get(f"{inst.url}/metrics", timeout=PROBE_TIMEOUT_S)
                return inst, kv_usage(resp.text) if resp.status_code == 200 else None
            except (httpx.HTTPError, ValueError) as exc:
                log.info("could not read %s/metrics for rebalancing: %s", inst.url, exc)
                return inst, None

        serving = [i for i in self.pools["decode"].instances if i.serving]
        read = await asyncio.gather(*(usage(i) for i in serving))
        streams, target = policy.plan({inst: value for inst, value in read if value is not None})
        for stream in streams:
            stream.request_cut("rebalancing", prefer=target)

    def _warm_pairs(self) -> None:
        """Start warming every pair of healthy servers not warmed since both were last up."""
        for p in self.pools["prefill"].instances:
            for d in self.pools["decode"].instances:
                pair = (p.url, d.url)
                if not p.healthy:  # it may come back restarted, with another side channel
                    self.side_channels.pop(p.url, None)
                if not (p.healthy and d.healthy):
                    self.warm.discard(pair)  # a server that was down may have restarted: first contact again
                elif p.draining or d.draining or p.cordoned or d.cordoned:
                    continue
                elif pair not in self.warm and pair not in self.warming:
                    self.warming[pair] = asyncio.create_task(self.warm_pair(p, d))

    async def warm_pair(self, prefill: Instance, decode: Instance) -> bool:
        """One one-token request through the pair, so its first contact is not paid by a client's request."""
        pair = (prefill.url, decode.url)
        headers = {"X-Request-Id": f"kvbridge-warm-up-{uuid.uuid4().hex[:12]}"}
        offered: KVTransferParams | None = None
        try:
            models = await self.client.get(f"{prefill.url}/v1/models", timeout=PROBE_TIMEOUT_S)
            models.raise_for_status()
            body: dict[str, Any] = {"model": models.json()["data"][0]["id"], "prompt": "kvbridge", "max_tokens": 1}
            first = await self.client.post(f"{prefill.url}/v1/completions", json=prefill_body(body), headers=headers)
            first.raise_for_status()
            params = first.json().get("kv_transfer_params")
            if params:
                offered = decoded = KVTransferParams.from_dict(params)
                self.learn(prefill.url, decoded)  # layer-wise: where its side channel is
                body["kv_transfer_params"] = attrs.evolve(decoded, kvbridge_timing=None).to_dict()
            begun = time.perf_counter()
            answer = await self.client.post(f"{decode.url}/v1/completions", json=body, headers=headers)
            answer.raise_for_status()
            if offered is not None:  # it pulled: its answer says whether it keeps what it pulls (a moved stream's)
                with contextlib.suppress(ValueError, ConfigError, AttributeError):
                    decode.heard(KVTransferParams.from_dict(answer.json().get("kv_transfer_params")))
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, ConfigError) as exc:
            log.warning("warming %s -> %s failed (its first request pays first contact): %s", *pair, exc)
            if offered is not None:  # else the prefill holds the warm-up's blocks until its lease ends
                await self.release_lease(offered, f"warm-up failed: {exc}")
            return False
        finally:
            self.warming.pop(pair, None)
        self.warm.add(pair)
        log.info("warmed %s -> %s (decode %.1f ms)", *pair, (time.perf_counter() - begun) * 1e3)
        return True

    def take_out(self, inst: Instance, why: str) -> None:
        log.warning("%s server %s %s: taken out", inst.role, inst.url, why)
        inst.healthy = False
        self.metrics.failovers.labels(inst.role).inc()

    def learn(self, prefill_url: str, params: KVTransferParams) -> None:
        """Keep where a prefill server's side channel is: to release its leases, and for layer-wise requests to it.

        Each answer says it again: a prefill that restarted (another engine id, maybe another port) is followed."""
        if None in (params.remote_engine_id, params.remote_host, params.remote_port):
            return
        contact = KVTransferParams(
            remote_engine_id=params.remote_engine_id,
            remote_host=params.remote_host,
            remote_port=params.remote_port,
            tp_size=params.tp_size,
            pcp_size=params.pcp_size,
            dcp_size=params.dcp_size,
            pp_size=params.pp_size,
            dp_size=params.dp_size,
        )
        known = self.side_channels.get(prefill_url)
        self.side_channels[prefill_url] = contact
        if self.transfer != "layerwise" or known == contact:
            return
        if contact.dp_size > 1:
            log.warning("prefill server %s runs DP %d: its requests stay in pull mode", prefill_url, contact.dp_size)
            return
        log.info(
            "prefill server %s: engine %s, side channel %s:%s, layer-wise from now on%s",
            prefill_url,
            params.remote_engine_id,
            params.remote_host,
            params.remote_port,
            "" if known is None else f" (it was engine {known.remote_engine_id}: restarted)",
        )

    def identity(self, prefill_url: str) -> KVTransferParams | None:
        """A prefill server's side channel, for a layer-wise request to it; None: not known yet, or not layer-wise.

        None too where the engine runs several DP ranks: the proxy cannot know which one will hold a request before it
        answers."""
        contact = self.side_channels.get(prefill_url)
        return contact if self.transfer == "layerwise" and contact is not None and contact.dp_size == 1 else None
