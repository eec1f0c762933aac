"""A vLLM server's place in the registry (docs/elastic.md): announced while it runs, draining on SIGTERM.

With `registry` and `advertise_url` in kv_connector_extra_config, the connector's scheduler side (in the
engine core process) keeps the server's `ServerRecord` alive (`kvbridge.control.membership.Announcer`).
SIGTERM first marks the record draining, so the proxy sends the server nothing new, and after
`drain_grace_s` (the proxy's registry reads are that far apart at most) hands the signal to vLLM, which
with `--shutdown-timeout` above `drain_grace_s + lease_s` keeps stepping until no finished request holds
blocks: every lease DONE or expired. The record is withdrawn when the connector shuts down.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvbridge.adapters.vllm.settings import Settings
from kvbridge.control.discovery import ServerRecord, open_registry
from kvbridge.control.membership import Announcer
from kvbridge.errors import ConfigError, KVBridgeError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)

ROLE_OF = {"kv_producer": "prefill", "kv_consumer": "decode"}


class Membership:
    """The announcer of one engine, and the SIGTERM hook that drains it."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str, settings: Settings, capacity: int) -> None:
        assert settings.registry is not None
        config = vllm_config.kv_transfer_config
        role = settings.server_role or ROLE_OF.get(str(getattr(config, "kv_role", "")))
        if role is None:
            raise ConfigError(
                'a kv_both server in a registry needs "server_role": "prefill" or "decode" in kv_connector_extra_config'
            )
        if not settings.advertise_url:
            raise ConfigError(
                'a server in a registry needs "advertise_url" in kv_connector_extra_config: the http://HOST:PORT '
                "the proxy reaches its OpenAI API at"
            )
        self.grace_s = settings.drain_grace_s
        registry = open_registry(settings.registry, secret=settings.secret)
        if registry is None:
            raise ConfigError(f'"registry": {settings.registry!r} is no registry; use redis://HOST:PORT or etcd://')
        record = ServerRecord(engine_id, role, settings.advertise_url, expires=0.0, capacity=capacity)
        self.announcer = Announcer(registry, record, ttl_s=settings.registry_ttl_s)
        self._draining = threading.Event()
        self._closed = threading.Event()
        needed = settings.drain_grace_s + settings.lease_s
        # a prefill holds its finished requests' leases, a decode those of the streams migrated off it
        if getattr(vllm_config, "shutdown_timeout", 0) < needed:
            log.warning(
                "vLLM's --shutdown-timeout is %s s: a SIGTERM ends this %s server before the leases it holds "
                "end; set --shutdown-timeout %d (drain_grace_s + lease_s) to drain it gracefully",
                getattr(vllm_config, "shutdown_timeout", 0),
                role,
                int(needed) + 1,
            )
        self._hook_sigterm()

    def draining(self) -> bool:
        """Whether SIGTERM marked this server draining."""
        return self._draining.is_set()

    def _hook_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("the connector starts off the main thread: SIGTERM does not mark this server draining")
            return
        previous = signal.getsignal(signal.SIGTERM)
        if not callable(previous):  # not vLLM's engine core: nothing to hand the signal to after the grace
            log.warning("SIGTERM has no handler to pass on: it does not mark this server draining")
            return

        def on_sigterm(signum: int, frame: Any) -> None:
            if self._draining.is_set():  # a second SIGTERM: no more grace
                previous(signum, frame)
                return
            self._draining.set()
            threading.Thread(target=self._drain, args=(previous, signum), name="kvbridge-drain", daemon=True).start()

        signal.signal(signal.SIGTERM, on_sigterm)

    def _drain(self, previous: Callable[[int, Any], Any], signum: int) -> None:
        """Mark the record draining, give the proxy `grace_s` to see it, then let vLLM shut down (it drains)."""
        try:
            self.announcer.drain()
        except KVBridgeError as exc:
            log.warning("could not mark this server draining in the registry: %s", exc)
        self._closed.wait(self.grace_s)
        log.info("draining: vLLM shuts down once no finished request holds blocks")
        previous(signum, None)  # vLLM's handler only records the request and wakes its loop: safe on a thread

    def close(self) -> None:
        self._closed.set()
        self.announcer.close()
