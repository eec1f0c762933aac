"""Start `vllm-router` (vLLM's Rust load balancer, PyPI `vllm-router`) in prefill/decode mode, and stop it by PID.

Its P/D mode (`--vllm-pd-disaggregation`) sends the prefill server the request with `max_tokens: 1`
and `kv_transfer_params: {"do_remote_decode": true, ...}` (the other NIXL keys null), then the decode
server the client's request with the prefill answer's `kv_transfer_params` as they came, both under one
`X-Request-Id` it makes. That is the flow `kvbridge proxy` speaks, so KVBridgeConnector servers work
behind it unchanged. `kv_connector="mooncake"` is its flow for vLLM's MooncakeConnector instead: it asks
each prefill server's bootstrap server (the port given beside its URL) for its engine id.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvbridge.base.errors import ConfigError
from kvbridge_tools.harness.hosts import OWN_GROUP
from kvbridge_tools.harness.ports import free_port
from kvbridge_tools.harness.vllm_server import BASE_ENV, Server, host_env, wait_healthy

if TYPE_CHECKING:
    from kvbridge_tools.harness.hosts import Host

log = logging.getLogger(__name__)
CONNECTORS = ("nixl", "mooncake")


def router_command() -> str:
    """The `vllm-router` executable beside this Python, or on PATH; a clear error when neither."""
    here = Path(sys.executable).with_name("vllm-router")
    found = str(here) if here.exists() else shutil.which("vllm-router")
    if found is None:
        raise ConfigError("vllm-router is not installed: pip install -c constraints.txt vllm-router")
    return found


def start_vllm_router(
    prefill: Sequence[str],
    decode: Sequence[str],
    *,
    kv_connector: str = "nixl",
    bootstrap_ports: Sequence[int] | None = None,
    log_dir: str | Path | None = None,
    timeout: float = 120.0,
    host: Host | None = None,
) -> Server:
    """Launch vllm-router in P/D mode in front of these servers (round robin); return once it answers /health.

    Retries are off, so a request that fails is counted as failed, not sent again. `bootstrap_ports`
    (one per prefill URL) are the MooncakeConnector bootstrap servers `kv_connector="mooncake"` needs. `host`
    (a `kvbridge_tools.harness.hosts.Host`) runs it there, listening on the host's address."""
    if kv_connector not in CONNECTORS:
        raise ConfigError(f"kv_connector {kv_connector!r}: pick one of {', '.join(CONNECTORS)}")
    if bootstrap_ports is not None and len(bootstrap_ports) != len(prefill):
        raise ConfigError(f"{len(bootstrap_ports)} bootstrap ports for {len(prefill)} prefill servers: give one each")
    port = free_port()
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="kvbridge-vllm-router-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"vllm-router-{port}.log"
    address = host.address if host else "127.0.0.1"
    cmd = [router_command(), "--host", address, "--port", str(port), "--vllm-pd-disaggregation"]
    cmd += ["--policy", "round_robin", "--kv-connector", kv_connector, "--disable-retries"]
    for i, url in enumerate(prefill):
        cmd += ["--prefill", url, *([str(bootstrap_ports[i])] if bootstrap_ports is not None else [])]
    for url in decode:
        cmd += ["--decode", url]
    env = dict(os.environ)
    env.update({k: BASE_ENV[k] for k in ("NO_PROXY", "no_proxy")})
    if host is not None:
        env.update({k: v for k, v in host_env(host).items() if k != "VLLM_HOST_IP"})
    with open(log_path, "wb") as out:
        argv = host.command(cmd) if host else cmd
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, **OWN_GROUP)
    log.info("started vllm-router on %s:%d (pid %d), log %s", address, port, proc.pid, log_path)
    router = Server(port=port, proc=proc, log_path=log_path, address=address)
    try:
        wait_healthy([router], timeout=timeout)
    except BaseException:
        router.stop()
        raise
    return router
