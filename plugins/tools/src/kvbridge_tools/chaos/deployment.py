"""A real PD deployment on this machine: prefill and decode vLLM servers, a colocated one, and `kvbridge proxy`.

P prefill and D decode servers run KVBridgeConnector over Mooncake TCP; one colocated server gives the reference
output; `kvbridge proxy` is in front.

With `hosts` (`kvbridge_tools.harness.hosts.Hosts` named by `host_names`), each prefill and decode server
runs on a host of its own and the proxy and the colocated server on the "proxy" host, every
listener on its host's address; whoever talks to them runs on the proxy host (`Host.entered`).
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

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
_BLOCKS = re.compile(r'num_gpu_blocks="(\d+)"')


@attrs.define
class Deployment:
    model: Path
    logs: Path
    prefills: int = 2
    decodes: int = 2
    max_model_len: int = 1024
    lease_s: float = 30.0
    pull_timeout_s: float = 30.0
    fault_injection: dict[str, Any] | None = None
    hosts: Hosts | None = None
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

    def host_names(self) -> dict[str, list[str]]:
        """The hosts a `Hosts` for this deployment must have, by role."""
        return {
            "prefill": [f"prefill{i}" for i in range(self.prefills)],
            "decode": [f"decode{i}" for i in range(self.decodes)],
            "proxy": ["proxy"],
        }

    def _host(self, name: str) -> Host | None:
        return None if self.hosts is None else self.hosts[name]

    def _config(self, role: str) -> dict[str, Any]:
        extra: dict[str, Any] = {"lease_s": self.lease_s, "pull_timeout_s": self.pull_timeout_s}
        if role == "kv_consumer" and self.fault_injection:
            extra["fault_injection"] = self.fault_injection
        # A failed load is recomputed: a transport fault then costs time, never the request.
        policy = "recompute" if role == "kv_consumer" else None
        return connector_config(role, load_failure_policy=policy, **extra)

    def _start(self, config: dict[str, Any] | None, port: int | None = None, host: Host | None = None) -> Server:
        self._lives += 1
        server = start_vllm(
            self.model,
            kv_transfer_config=config,
            max_model_len=self.max_model_len,
            port=port,
            log_dir=self.logs / f"life-{self._lives}",
            env={"KVBRIDGE_SECRET": self._secret},
            host=host,
        )  # never in the config: vLLM logs that
        self._configs[server.port] = config or {}
        self._placed[server.port] = host
        return server

    def start(self, timeout: float = 900.0) -> None:
        names = self.host_names()
        self.prefill = [self._start(self._config("kv_producer"), host=self._host(n)) for n in names["prefill"]]
        self.decode = [self._start(self._config("kv_consumer"), host=self._host(n)) for n in names["decode"]]
        self.colocated = self._start(None, host=self._host("proxy"))
        wait_healthy(self.servers(), timeout=timeout)
        self.proxy = start_proxy(
            [s.url for s in self.prefill],
            [s.url for s in self.decode],
            log_dir=self.logs,
            health_interval=1.0,
            expose_internals=True,  # the runner reads which decode served a request (x-kvbridge-decode)
            host=self._host("proxy"),
            secret=self._secret,  # it aborts the lease of a request no decode took, instead of waiting lease_s
        )

    def servers(self) -> list[Server]:
        """The vLLM servers (not the proxy) as they are now."""
        return [*self.prefill, *self.decode, *([self.colocated] if self.colocated else [])]

    def by_url(self, url: str) -> Server | None:
        return next((s for s in self.servers() if s.url == url), None)

    def kill_and_restart(self, server: Server) -> bool:
        """SIGKILL `server` now and start it again on the same ports in the background.

        Returns False (the fault is then not injected) while another server of its role is down: at most one per
        role is, so the proxy always has one to fail over to, as a deployment sized for one failure does.
        """
        group = self.prefill if server in self.prefill else self.decode
        with self._lock:
            if not server.alive() or any(s.port in self._restarting for s in group):
                return False
            self._restarting.add(server.port)
        log.warning("chaos: SIGKILL %s (pid %d)", server.url, server.pid)
        self._retired.append(self.kvbridge_counters(server))  # its counters end with it
        server.kill()
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

    def blocks_in_use(self, server: Server) -> float:
        """KV blocks the server holds now, read from its own metrics (usage x its block count).

        It is -1 when the server cannot be read (then nothing proves it holds none).
        """
        import httpx

        try:
            text = httpx.get(f"{server.url}/metrics", timeout=10, trust_env=False).text
        except httpx.HTTPError as exc:
            log.error("chaos: cannot read %s/metrics: %s", server.url, exc)
            return -1.0
        usage = sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:kv_cache_usage_perc")
        )
        m = _BLOCKS.search(text)
        return round(usage * int(m.group(1)), 1) if m else usage

    def kvbridge_counters(self, server: Server) -> dict[str, float]:
        """The server's kvbridge_* series from its /metrics, summed over labels ({} when unreadable)."""
        import httpx

        from kvbridge_tools.harness.vllm_server import parse_metrics

        try:
            text = httpx.get(f"{server.url}/metrics", timeout=10, trust_env=False).text
        except httpx.HTTPError as exc:
            log.error("chaos: cannot read %s/metrics: %s", server.url, exc)
            return {}
        return {k: v for k, v in parse_metrics(text).items() if k.startswith("kvbridge_")}

    def counter(self, name: str) -> float:
        """A kvbridge counter summed over every decode and prefill server, the killed lives included."""
        lives = [*self._retired, *(self.kvbridge_counters(s) for s in [*self.prefill, *self.decode])]
        return sum(c.get(name, 0.0) for c in lives)

    def log_files(self) -> list[Path]:
        return sorted(self.logs.rglob("vllm-*.log"))

    def stop(self) -> None:
        for s in [*([self.proxy] if self.proxy else []), *self.servers()]:
            try:
                s.stop()
            except Exception:
                log.exception("chaos: stopping %s failed", s.url)

    def __attrs_post_init__(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
