"""A real PD deployment on this machine: prefill and decode vLLM servers, a colocated one, and `kvbridge proxy`.

P prefill and D decode servers run KVBridgeConnector over Mooncake TCP; one colocated server gives the reference
output; `kvbridge proxy` is in front.

With a `registry` (redis, for the elastic faults), every prefill and decode server announces itself there and the
proxy routes to what is announced (`--registry`, docs/elastic.md): servers can then join (`scale_out`) and be
drained for good (`drain`, SIGTERM to the API server), each drain checked in the server's own log.

With `hosts` (`kvbridge_tools.harness.hosts.Hosts` named by `host_names`), each prefill and decode server
runs on a host of its own and the proxy and the colocated server on the "proxy" host, every
listener on its host's address; whoever talks to them runs on the proxy host (`Host.entered`).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from kvbridge.base.errors import ConfigError
from kvbridge.base.secret import admin_token
from kvbridge_tools.chaos.server_metrics import counts_by, kvbridge_counters
from kvbridge_tools.harness.ports import free_port
from kvbridge_tools.harness.vllm_server import (
    Server,
    connector_config,
    start_proxy,
    start_vllm,
    wait_healthy,
)

if TYPE_CHECKING:
    from kvbridge_tools.harness.hosts import Host, Hosts

log = logging.getLogger(__name__)
# what each rank of a kvbridge vLLM engine logs as it closes (kvbridge.session.prefill_side)
_CLOSING = re.compile(r"closing with (\d+) leases held \((\d+) blocks\)")
ROLES = {"kv_producer": "prefill", "kv_consumer": "decode"}


@attrs.define
class Drained:
    """A server drained for good: SIGTERM to its API server, then its exit, awaited within `bound_s`."""

    server: Server
    role: str
    fault: str
    bound_s: float
    started: float = attrs.field(factory=time.monotonic)  # reset at its SIGTERM
    exit: int | None = None  # None: still running, or killed at the bound
    seconds: float | None = None  # from its SIGTERM to its API server's exit
    leases: int = -1  # what its ranks logged as they closed (-1: no closing line)
    blocks: int = -1
    engine_killed: bool = False  # vLLM's API server force-killed its engine core at --shutdown-timeout

    @property
    def clean(self) -> bool:
        """It exited with status 0 by itself within the bound, every rank holding no lease."""
        return self.exit == 0 and self.leases == 0 and self.blocks == 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "url": self.server.url,
            "role": self.role,
            "fault": self.fault,
            "exit": self.exit,
            "seconds": None if self.seconds is None else round(self.seconds, 1),
            "leases_at_close": self.leases,
            "blocks_at_close": self.blocks,
            "engine_killed": self.engine_killed,
        }


@attrs.define
class Joined:
    """A server started mid-run that announced itself and that the proxy took into its pool."""

    server: Server
    role: str
    fault: str  # scale-out, or the drain fault it replaces a server for


MOVES_S = 60.0  # how long an operator waits for the proxy to move a drained decode's streams before stopping it
TEARDOWN_S = 10  # vLLM's --shutdown-timeout for a server that is not announced: it drains nothing


@attrs.define
class Deployment:
    model: Path
    logs: Path
    prefills: int = 2
    decodes: int = 2
    max_model_len: int = 1024
    executor: str = "uni"  # where each server runs its model (`start_vllm`)
    lease_s: float = 30.0
    pull_timeout_s: float = 30.0
    fault_injection: dict[str, Any] | None = None
    backend: str = "mooncake"  # the transport by name (Mooncake's over TCP)
    transfer: str = "pull"  # or layerwise: every server and the proxy in that mode
    hosts: Hosts | None = None
    registry: str | None = None  # redis://...: every server announces itself, the proxy follows it
    drain_grace_s: float = 3.0
    registry_ttl_s: float = 6.0
    live_moves: bool = False  # the proxy moves a draining decode's streams to another decode (--live-moves)
    # with hosts and a registry: a host for the registry, and `spares` hosts kept for the servers that join
    elastic: bool = False
    spares: int = 0
    prefill: list[Server] = attrs.field(factory=list)
    decode: list[Server] = attrs.field(factory=list)
    colocated: Server | None = None
    proxy: Server | None = None
    restarts: int = 0
    _configs: dict[int, dict[str, Any]] = attrs.field(factory=dict)
    _lives: int = 0
    _lock: threading.Lock = attrs.field(factory=threading.Lock)
    _restarting: set[int] = attrs.field(factory=set)
    _secret: str = attrs.field(factory=lambda: secrets.token_hex(16))
    _retired: list[dict[str, float]] = attrs.field(factory=list)  # kvbridge counters of killed servers
    _placed: dict[int, Host | None] = attrs.field(factory=dict)  # port -> the host its server runs on
    drained: list[Drained] = attrs.field(factory=list)
    joined: list[Joined] = attrs.field(factory=list)
    _pending: set[str] = attrs.field(factory=set)  # threads of joins and drains not done yet
    _free: list[str] = attrs.field(factory=list)  # spare hosts no server has taken yet

    def host_names(self) -> dict[str, list[str]]:
        """The hosts a `Hosts` for this deployment must have, by role."""
        names = {
            "prefill": [f"prefill{i}" for i in range(self.prefills)],
            "decode": [f"decode{i}" for i in range(self.decodes)],
            "proxy": ["proxy"],
        }
        if self.elastic:
            names.update(registry=["registry"], spare=[f"spare{i}" for i in range(self.spares)])
        return names

    def _host(self, name: str) -> Host | None:
        return None if self.hosts is None else self.hosts[name]

    def _config(self, role: str, url: str | None = None) -> dict[str, Any]:
        extra: dict[str, Any] = {"lease_s": self.lease_s, "pull_timeout_s": self.pull_timeout_s}
        if self.transfer != "pull":
            extra["transfer"] = self.transfer
        if self.registry is not None and url is not None:
            extra.update(
                registry=self.registry,
                advertise_url=url,
                drain_grace_s=self.drain_grace_s,
                registry_ttl_s=self.registry_ttl_s,
            )
        if role == "kv_consumer" and self.fault_injection:
            extra["fault_injection"] = self.fault_injection
        # A failed load is recomputed: a transport fault then costs time, never the request.
        policy = "recompute" if role == "kv_consumer" else None
        return connector_config(role, backend=self.backend, load_failure_policy=policy, **extra)

    @property
    def shutdown_timeout_s(self) -> int:
        """vLLM's --shutdown-timeout for an announced server: it drains through the grace and a lease."""
        return int(self.drain_grace_s + self.lease_s + 10)

    def _start_role(self, role: str, host: Host | None = None) -> Server:
        """Start a server of `role` (kv_producer, kv_consumer), announced when there is a registry."""
        port = free_port()
        url = f"http://{host.address if host else '127.0.0.1'}:{port}"
        return self._start(self._config(role, url), port=port, host=host)

    def _start(self, config: dict[str, Any] | None, port: int | None = None, host: Host | None = None) -> Server:
        self._lives += 1
        announced = config is not None and "registry" in config.get("kv_connector_extra_config", {})
        server = start_vllm(
            self.model,
            kv_transfer_config=config,
            max_model_len=self.max_model_len,
            executor=self.executor,
            port=port,
            log_dir=self.logs / f"life-{self._lives}",
            env={"KVBRIDGE_SECRET": self._secret},
            host=host,
            # vLLM's default of 0 force-kills the engine core at any SIGTERM, the teardown's too: a few seconds let
            # an unannounced server (the colocated reference among them) end its engine core itself
            extra_args=["--shutdown-timeout", str(self.shutdown_timeout_s if announced else TEARDOWN_S)],
        )  # the secret never in the config: vLLM logs that
        self._configs[server.port] = config or {}
        self._placed[server.port] = host
        return server

    def start(self, timeout: float = 900.0) -> None:
        names = self.host_names()
        self._free = list(names.get("spare", [])) if self.hosts is not None else []
        self.prefill = [self._start_role("kv_producer", self._host(n)) for n in names["prefill"]]
        self.decode = [self._start_role("kv_consumer", self._host(n)) for n in names["decode"]]
        self.colocated = self._start(None, host=self._host("proxy"))
        wait_healthy(self.servers(), timeout=timeout)
        announced = self.registry is not None  # then the proxy finds every server in the registry
        self.proxy = start_proxy(
            [] if announced else [s.url for s in self.prefill],
            [] if announced else [s.url for s in self.decode],
            log_dir=self.logs,
            health_interval=1.0,
            expose_internals=True,  # the runner reads which decode served a request (x-kvbridge-decode)
            host=self._host("proxy"),
            # it aborts the lease of a request no decode took, instead of waiting lease_s; it checks records' MACs
            secret=self._secret,
            registry=self.registry,
            live_moves=self.live_moves,
            transfer=self.transfer,
        )
        if announced:
            self.wait_routed([*self.prefill, *self.decode], timeout=timeout)

    def routed(self) -> tuple[set[str], set[str]]:
        """The servers the proxy routes to now (not draining), and those of them warmed with some peer."""
        import httpx

        assert self.proxy is not None
        state = httpx.get(f"{self.proxy.url}/instances", timeout=10, trust_env=False).json()
        serving = {i["url"] for role in ("prefill", "decode") for i in state[role] if not i.get("draining")}
        return serving, {url for pair in state["warmed"] for url in pair}

    def wait_routed(self, servers: list[Server], timeout: float) -> None:
        """Wait until the proxy routes to each of `servers` and has warmed a pair with it."""
        import httpx

        deadline = time.monotonic() + timeout
        want = {s.url for s in servers}
        while True:
            assert self.proxy is not None
            if not self.proxy.alive():
                raise ConfigError(f"the proxy exited with {self.proxy.proc.returncode}; {self.proxy.failure_report()}")
            try:
                serving, warmed = self.routed()
                if want <= serving & warmed:
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise ConfigError(f"the proxy does not route to {sorted(want)} after {timeout}s (from the registry)")
            time.sleep(0.5)

    def servers(self) -> list[Server]:
        """The vLLM servers (not the proxy) as they are now."""
        return [*self.prefill, *self.decode, *([self.colocated] if self.colocated else [])]

    def by_url(self, url: str) -> Server | None:
        return next((s for s in self.servers() if s.url == url), None)

    def kill_and_restart(self, server: Server) -> bool:
        """SIGKILL `server` now and start it again on the same ports in the background.

        Returns False (the fault is then not injected) unless another server of its role serves: at most one per
        role is down (restarting, or drained and not replaced yet), so the proxy always has one to fail over to, as
        a deployment sized for one failure does.
        """
        group = self.prefill if server in self.prefill else self.decode
        with self._lock:
            if server not in group or not self._others_serve(server, group):
                return False
            self._restarting.add(server.port)
        self._retired.append(kvbridge_counters(server))  # its counters end with it
        server.kill()
        log.warning("chaos: SIGKILL %s (pid %d)", server.url, server.pid)  # after the kill: the log's timeline is true
        threading.Thread(target=self._restart, args=(server,), daemon=True, name=f"restart-{server.port}").start()
        return True

    def _restart(self, old: Server) -> None:
        try:
            new = self._start(self._configs[old.port], port=old.port, host=self._placed[old.port])
            for group in (self.prefill, self.decode):
                if old in group:
                    group[group.index(old)] = new
            wait_healthy([new], timeout=600)
            self.restarts += 1
            log.warning("chaos: %s is back (pid %d)", new.url, new.pid)
        except Exception:
            log.exception("chaos: restarting %s failed", old.url)
        finally:
            with self._lock:
                self._restarting.discard(old.port)

    def restarting(self) -> bool:
        with self._lock:
            return bool(self._restarting)

    def _serving(self, group: list[Server]) -> list[Server]:
        """The servers of `group` that serve: alive and not restarting (held under _lock)."""
        return [s for s in group if s.alive() and s.port not in self._restarting]

    def _others_serve(self, server: Server, group: list[Server]) -> bool:
        """`server` serves, and so does another server of its group (held under _lock)."""
        serving = self._serving(group)
        return server in serving and len(serving) >= 2

    def wait_spare(self, role: str, timeout: float, quiet_s: float = 10.0) -> bool:
        """Wait (bounded) until two servers of `role` ("prefill" or "decode") serve; False if they did not.

        A kill or a drain then finds another server to fail over to (`_others_serve`), where it would be skipped.
        Gives up early once nothing has been on its way for `quiet_s` (no restart, join or replacement under way:
        after a scale-in with no scale-out left, no second server comes, however long the wait)."""
        deadline = time.monotonic() + timeout
        quiet_since: float | None = None
        while True:
            with self._lock:
                serving = self._serving(self.prefill if role == "prefill" else self.decode)
            if len(serving) >= 2:
                return True
            now = time.monotonic()
            quiet_since = None if self.settling() else (quiet_since or now)
            if now >= deadline or (quiet_since is not None and now - quiet_since >= quiet_s):
                return False
            time.sleep(0.5)

    def settling(self) -> bool:
        """A restart, a join or a drain is still under way."""
        with self._lock:
            return bool(self._restarting or self._pending)

    def joining(self) -> bool:
        """A server started mid-run is not routed to yet."""
        with self._lock:
            return any(name.startswith("join-") for name in self._pending)

    def _background(self, name: str, target: Any, *args: Any) -> None:
        with self._lock:
            self._pending.add(name)

        def run() -> None:
            try:
                target(*args)
            except Exception:
                log.exception("chaos: %s failed", name)
            finally:
                with self._lock:
                    self._pending.discard(name)

        threading.Thread(target=run, daemon=True, name=name).start()

    def scale_out(self, role: str, fault: str = "scale-out") -> None:
        """Start a new server of `role` that announces itself; it joins its group once the proxy routes to it."""
        assert self.registry is not None, "servers join through a registry"
        self._background(f"join-{role}-{len(self.joined)}-{time.monotonic():.3f}", self._join, role, fault)

    def _join(self, role: str, fault: str) -> None:
        host = None
        if self.hosts is not None:
            with self._lock:
                if not self._free:
                    log.error("chaos: %s: no spare host left for a %s server to join on", fault, ROLES[role])
                    return
                host = self.hosts[self._free.pop(0)]
        server = self._start_role(role, host)
        log.warning("chaos: %s: %s server %s starting (pid %d)", fault, ROLES[role], server.url, server.pid)
        try:
            wait_healthy([server], timeout=600)
            self.wait_routed([server], timeout=300)
        except Exception:
            server.stop()
            raise
        with self._lock:
            (self.prefill if role == "kv_producer" else self.decode).append(server)
            self.joined.append(Joined(server, ROLES[role], fault))
        log.warning("chaos: %s: %s joined through the registry and is routed to", fault, server.url)

    def drain(self, server: Server, fault: str, *, replace: bool) -> bool:
        """SIGTERM `server`'s API server, as a rolling upgrade or a scale-in does; it leaves the deployment for good.

        It marks its record draining, the proxy stops routing to it, it finishes what it runs and keeps its leases
        until DONE, then exits by itself: awaited (SIGKILLed past the bound) and checked in its log. `replace`
        starts a new server of its role that joins through the registry. False (not injected) unless another server
        of its role serves.
        """
        assert self.registry is not None, "a drained server leaves through the registry"
        role = "kv_producer" if server in self.prefill else "kv_consumer"
        group = self.prefill if role == "kv_producer" else self.decode
        with self._lock:
            if server not in group or not self._others_serve(server, group):
                return False
            group.remove(server)
            drained = Drained(server, ROLES[role], fault, bound_s=self.shutdown_timeout_s + 60)
            self.drained.append(drained)
        at_proxy = fault == "drain-decode" and self.live_moves
        if at_proxy:
            # A rolling upgrade: the operator drains the decode at the proxy, which moves its streams (pre-copied
            # while they run on), and stops it once they left. (A SIGTERM alone moves them too, once the proxy reads
            # the record: tests/e2e/test_vllm_elastic.py.)
            self._drain_at_proxy(server)
        self._background(f"drain-{server.port}", self._stop_drained, drained, fault, at_proxy)
        if replace:
            self.scale_out(role, fault)
        return True

    def _stop_drained(self, drained: Drained, fault: str, at_proxy: bool) -> None:
        server = drained.server
        if at_proxy:  # bounded: a stream the proxy could not move finishes on it, which the drain waits for
            deadline = time.monotonic() + MOVES_S
            while self._streams_on(server) and time.monotonic() < deadline:
                time.sleep(0.2)
        log.warning("chaos: %s: SIGTERM %s (pid %d)", fault, server.url, server.pid)
        self._retired.append(kvbridge_counters(server))
        drained.started = time.monotonic()  # its exit is timed from the SIGTERM
        os.kill(server.pid, signal.SIGTERM)  # the API server only: vLLM passes it to its engine (docs/elastic.md)
        self._await_exit(drained)

    def _streams_on(self, server: Server) -> int:
        """The streams the proxy relays from `server` now (what an operator's drain moves)."""
        import httpx

        assert self.proxy is not None
        try:
            state = httpx.get(f"{self.proxy.url}/instances", timeout=10, trust_env=False).json()
        except (httpx.HTTPError, ValueError):
            return 0
        return sum(i.get("streams", 0) for i in state.get("decode", []) if i.get("url") == server.url)

    def _await_exit(self, drained: Drained) -> None:
        server = drained.server
        try:
            drained.exit = server.proc.wait(timeout=drained.bound_s)
            drained.seconds = time.monotonic() - drained.started
        except subprocess.TimeoutExpired:  # it did not exit by itself
            log.error("chaos: drained %s did not exit within %.0fs; killing it", server.url, drained.bound_s)
        server.stop()  # what its group left (the engine core, shared memory, its TMPDIR)
        text = server.log_path.read_text(errors="replace")
        drained.engine_killed = "force killing remaining process EngineCore" in text
        lines = _CLOSING.findall(text)
        if lines:
            drained.leases = sum(int(n) for n, _ in lines)
            drained.blocks = sum(int(b) for _, b in lines)
        log.warning(
            "chaos: drained %s exited with %s after %.1fs, %d lease(s) (%d blocks) held at close",
            server.url,
            drained.exit,
            drained.seconds or -1.0,
            drained.leases,
            drained.blocks,
        )

    def _drain_at_proxy(self, server: Server) -> None:
        import httpx

        assert self.proxy is not None
        auth = {"Authorization": f"Bearer {admin_token(self._secret)}"}
        try:
            r = httpx.post(
                f"{self.proxy.url}/admin/drain", json={"server": server.url}, headers=auth, timeout=10, trust_env=False
            )
            log.warning("chaos: drained %s at the proxy: %d %s", server.url, r.status_code, r.text[:200])
        except httpx.HTTPError as exc:
            log.error("chaos: cannot drain %s at the proxy: %s", server.url, exc)

    def proxy_counts(self, name: str, label: str) -> dict[str, float] | None:
        """A counter of the proxy's /metrics by the value of one label; None when it exports no such counter."""
        assert self.proxy is not None
        return counts_by(self.proxy, name, label)

    def counter(self, name: str) -> float:
        """A kvbridge counter summed over every decode and prefill server, the killed lives included."""
        lives = [*self._retired, *(kvbridge_counters(s) for s in [*self.prefill, *self.decode])]
        return sum(c.get(name, 0.0) for c in lives)

    def log_files(self) -> list[Path]:
        return sorted(self.logs.rglob("vllm-*.log"))

    def stop(self) -> None:
        drained = [d.server for d in self.drained if d.server.alive()]
        for s in [*([self.proxy] if self.proxy else []), *self.servers(), *drained]:
            try:
                s.stop()
            except Exception:
                log.exception("chaos: stopping %s failed", s.url)

    def __attrs_post_init__(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
