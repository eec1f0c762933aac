"""A vLLM server's place in the registry: announced while it runs, drained on SIGTERM/order. See docs/internals.md."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvbridge.base.errors import ConfigError
from kvbridge.control.discovery import ServerRecord, open_registry
from kvbridge.control.membership import Announcer, SigtermDrain

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from kvbridge.adapters.vllm.scheduler import SchedulerSide

log = logging.getLogger(__name__)

ROLE_OF = {"kv_producer": "prefill", "kv_consumer": "decode"}


class Membership:
    """The announcer of one engine, and the SIGTERM and drain-order hook that drains it."""

    def __init__(self, vllm_config: VllmConfig, scheduler: SchedulerSide, capacity: int) -> None:
        settings = scheduler.settings
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
        registry = open_registry(settings.registry, secret=settings.secret)
        if registry is None:
            raise ConfigError(f'"registry": {settings.registry!r} is no registry; use redis://HOST:PORT or etcd://')
        # the side channel is in the record so that a decode can pull what the proxy moves off this server
        record = ServerRecord(
            scheduler.engine_id,
            role,
            settings.advertise_url,
            expires=0.0,
            capacity=capacity,
            side_host=settings.host,
            side_port=scheduler.side_channel_port,
            tp_size=scheduler.tp_size,
            pp_size=scheduler.pp_size,
            dp_size=scheduler.dp_size,
        )
        self.announcer = Announcer(registry, record, ttl_s=settings.registry_ttl_s)
        needed = settings.drain_grace_s + settings.lease_s
        # a prefill holds its finished requests' leases, a decode those of the streams moved off it
        if getattr(vllm_config, "shutdown_timeout", 0) < needed:
            log.warning(
                "vLLM's --shutdown-timeout is %s s: a SIGTERM ends this %s server before the leases it holds "
                "end; set --shutdown-timeout %d (drain_grace_s + lease_s) to drain it gracefully",
                getattr(vllm_config, "shutdown_timeout", 0),
                role,
                int(needed) + 1,
            )
        if role == "decode" and not vllm_config.cache_config.enable_prefix_caching:
            log.warning(
                "this decode server runs without prefix caching: a stream moved here (a drain, a rebalance) computes "
                "its whole context again, as the KV it pulls is kept in the prefix cache; serve it with prefix "
                "caching on (vLLM's default: drop --no-enable-prefix-caching)"
            )
        # vLLM's engine core installed its SIGTERM handler: the drain runs first, then hands the signal to it
        self.drain = SigtermDrain(self.announcer, grace_s=settings.drain_grace_s, then="vLLM shuts down")
        scheduler.holding.draining = self.drain.draining  # the drain then says what it waits for

    def close(self) -> None:
        self.drain.close()
        self.announcer.close()
