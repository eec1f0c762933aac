"""Start real vLLM OpenAI servers on 127.0.0.1 for tests and benches, and stop them by PID.

Each server runs `python -m vllm.entrypoints.openai.api_server` in its own process group, so
stopping it also stops the engine-core process it spawned. Start-up is polled on `/health`
against a deadline; a server that exits or misses the deadline raises with its log tail.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from kvbridge.base.errors import ConfigError
from kvbridge_tools.harness.hosts import OWN_GROUP
from kvbridge_tools.harness.ports import free_port
from kvbridge_tools.harness.proc import stop_all_threads

if TYPE_CHECKING:
    from kvbridge_tools.harness.hosts import Host

log = logging.getLogger(__name__)

# Loopback only; small CPU KV cache; no accelerator.
BASE_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # cores are shared with other processes here
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
EXECUTORS = ("mp", "uni")
# the processes that run a server's model (vLLM's process titles, as /proc/<pid>/comm cuts them to 15 bytes)
ENGINE_TITLES = ("VLLM::EngineCor", "VLLM::Worker")
# A vLLM server still starting this long after its SIGTERM gets one more (`Server._term_again`).
LOST_TERM_S = 1.0


def add_executor_argument(group: Any) -> None:
    """`--executor` for a CLI that starts vLLM servers (an argparse parser or argument group)."""
    group.add_argument(
        "--executor",
        choices=EXECUTORS,
        default="uni",
        help="where each vLLM server runs its model: uni, in its engine-core process (what vLLM runs for "
        "one GPU); mp, in a worker process beside it (vLLM's choice on CPU, whose two processes spin-wait "
        "for each other on shared memory and so take cores from the prompt's compute on a small machine) "
        "(default uni)",
    )


@attrs.define(eq=False)
class Server:
    """One running HTTP server process (a vLLM server or `kvbridge proxy`) that we started."""

    port: int
    proc: subprocess.Popen
    log_path: Path
    tmp_dir: Path | None = None  # its TMPDIR (vLLM's vllm_dist_* files), removed when it ends
    address: str = "127.0.0.1"  # where it listens: a `kvbridge_tools.harness.hosts` host's address when on one
    engine_nice: int = 0  # its model's processes run this much below its API server, once healthy (`start_vllm`)
    starting: bool = False  # a vLLM server not yet seen healthy (`wait_healthy`): it may lose a SIGTERM (`_term_again`)

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def failure_report(self, lines: int = 40) -> str:
        """The log's error lines (the root cause is often far above the tail), then its tail."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return f"(no log at {self.log_path})"
        errors = [line for line in text if _ERROR_LINE.search(line)][:lines]
        stalls = [str(p) for p in sorted(self.log_path.parent.glob(f"stalls-{self.port}/stall-*.txt"))]
        tail = ["stall dumps (every thread's stack, kvbridge.base.watchdog):", *stalls] if stalls else []
        return "\n".join(["error lines:", *errors, f"last {lines} lines:", *text[-lines:], *tail])

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus metrics, summed over labels: {"vllm:kv_cache_usage_perc": 0.0, ...}."""
        return parse_metrics(_get(f"{self.url}/metrics").text)

    def kv_usage(self) -> float:
        """The share of its KV cache blocks in use (vLLM's `kv_cache_usage_perc`; nan before it reports)."""
        return self.metrics().get("vllm:kv_cache_usage_perc", float("nan"))

    def wait_kv_usage(self, at_most: float, timeout: float) -> float:
        """Poll `kv_usage` until it is `at_most` or `timeout` seconds pass; the last value read."""
        deadline = time.monotonic() + timeout
        while True:
            now = self.kv_usage()
            if now <= at_most or time.monotonic() > deadline:
                return now
            time.sleep(0.5)

    def engine_pids(self) -> list[int]:
        """The processes that run the model (vLLM's engine core, or its workers), not the API server."""
        pids = []
        for pid in _group_members(self.proc.pid):
            with contextlib.suppress(OSError):  # (it ended meanwhile)
                if Path(f"/proc/{pid}/comm").read_text().startswith(ENGINE_TITLES):
                    pids.append(pid)
        return pids

    @contextlib.contextmanager
    def engine_stopped(self) -> Iterator[None]:
        """Every thread of the engine processes stopped (SIGSTOP) inside the block; the API server goes on."""
        pids = self.engine_pids()
        if not pids:
            raise RuntimeError(f"server on port {self.port}: no engine process to stop\n{self.failure_report()}")
        try:
            for pid in pids:
                stop_all_threads(pid)
            yield
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    def lower_engine_priority(self) -> int:
        """Every thread of the processes that run the model `engine_nice` below the API server: how many were set.

        The API server and its engine core are separate processes; only the engine's (the step's compute, and the
        connector's threads in it) go below. Raising a nice value needs no privilege."""
        threads = 0
        nice = min(19, os.getpriority(os.PRIO_PROCESS, self.proc.pid) + self.engine_nice)
        for pid in self.engine_pids():
            try:
                for task in Path(f"/proc/{pid}/task").iterdir():
                    os.setpriority(os.PRIO_PROCESS, int(task.name), nice)
                    threads += 1
            except (OSError, ValueError):  # it ended meanwhile
                continue
        if not threads:
            log.warning("server on port %d: no engine process found to run at nice %d", self.port, nice)
        return threads

    def kill(self) -> None:
        """SIGKILL the server and its engine processes, as a crash would."""
        self._end(signal.SIGKILL, timeout=30.0)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the server's process group, then SIGKILL it if it does not exit in time."""
        self._end(signal.SIGTERM, timeout)

    def _end(self, sig: int, timeout: float) -> None:
        # vLLM leaves POSIX shared memory behind when killed, and some even on SIGTERM (the CPU
        # TP ring buffers); /dev/shm keeps it until reboot. What the group maps now is removed
        # once the whole group is gone. Semaphores (sem.mp-*) that no process maps any more are
        # known only to the group's multiprocessing resource trackers: they are spared the signal
        # and unlink what their processes registered once those are gone, as after a real crash.
        members = _group_members(self.proc.pid)
        mapped = _shared_memory_of(members)
        trackers = {pid for pid in members if _is_resource_tracker(pid)}
        if self.alive():
            for pid in members:
                if pid not in trackers:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
            try:
                if sig == signal.SIGTERM and self.starting:
                    self._term_again(timeout)
                else:
                    self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("server on port %d ignored signal %d for %.0fs; killing it", self.port, sig, timeout)
        # The engine core may outlive its parent for a moment; its group is ours to end.
        for pid in _group_members(self.proc.pid):
            if pid not in trackers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            # a process SIGKILL does not end is held by the kernel: say where, not only that
            raise RuntimeError(
                f"server on port {self.port} (pid {self.proc.pid}) still alive 30s after SIGKILL; its group as the "
                f"kernel sees it:\n{_kernel_states(_group_members(self.proc.pid) or [self.proc.pid])}"
            ) from None
        deadline = time.monotonic() + 10  # a tracker exits once every process it served is gone
        while set(_group_members(self.proc.pid)) & trackers and time.monotonic() < deadline:
            time.sleep(0.05)
        self._signal(signal.SIGKILL)
        _wait_group_gone(self.proc.pid, timeout=30)
        for path in mapped:
            path.unlink(missing_ok=True)
        if self.tmp_dir is not None:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def _term_again(self, timeout: float) -> None:
        """Wait for the SIGTERM sent; a starting server still alive after LOST_TERM_S gets one more.

        TimeoutExpired once `timeout` passes. vLLM 0.32 loses a SIGTERM that lands in its engine handshake: its handler
        raises KeyboardInterrupt there, `zmq_socket_ctx` (vllm/utils/network_utils.py) catches it, and the API server
        goes on to wait for the engine's ready message, up to VLLM_ENGINE_READY_TIMEOUT_S (600 s). The second SIGTERM
        lands in that wait and ends it. Only one more: a third would land in the shutdown that the second began (its
        engine core, still starting, takes up to 5 s to be killed there) and cut its clean-up short."""
        try:
            self.proc.wait(timeout=min(LOST_TERM_S, timeout))
            return
        except subprocess.TimeoutExpired:
            if timeout <= LOST_TERM_S:
                raise
        log.info("vLLM server on port %d, still starting, lost its SIGTERM: sending it again", self.port)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=timeout - LOST_TERM_S)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # the group this server leads (OWN_GROUP)
        except ProcessLookupError:
            pass


_ERROR_LINE = re.compile(r"Error|Exception|Traceback|EADDRINUSE|Address already in use|Killed|CRITICAL")


def _group_members(pgid: int) -> list[int]:
    """PIDs of the live processes in process group `pgid` (from /proc)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(stat.parent.name))
    return members


def _kernel_states(pids: Sequence[int]) -> str:
    """Each process's name, state, wait channel and kernel stack (root reads the stack), one block each."""
    lines = []
    for pid in pids:
        proc = Path(f"/proc/{pid}")
        try:
            stat = (proc / "stat").read_text()
            wchan = (proc / "wchan").read_text().strip()
        except OSError:
            lines.append(f"pid {pid}: gone")
            continue
        name, state = stat[stat.index("(") + 1 : stat.rindex(")")], stat.rsplit(")", 1)[1].split()[0]
        try:
            stack = (proc / "stack").read_text().strip().replace("\n", " <- ")
        except OSError:
            stack = "not readable"
        waits = wchan if wchan not in ("", "0") else "-"
        lines.append(f"pid {pid} ({name}): state {state}, waiting in {waits}; kernel stack: {stack}")
    return "\n".join(lines)


def _is_resource_tracker(pid: int) -> bool:
    try:
        return b"resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _shared_memory_of(pids: Sequence[int]) -> set[Path]:
    """The /dev/shm files these processes have mapped."""
    found: set[Path] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
            if len(fields) == 6 and fields[5].startswith("/dev/shm/") and not fields[5].endswith(" (deleted)"):
                found.add(Path(fields[5]))
    return found


def _wait_group_gone(pgid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _group_members(pgid):
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes of group {pgid} still alive {timeout}s after SIGKILL")
        time.sleep(0.05)


# Mooncake's no-progress deadline for test servers sharing a small box (several vLLM servers and pytest
# on two cores), where a server's transport thread can go unscheduled past the default 2 s and a healthy
# pull would fail (docs/measurements/stalls.md). Tests of the deadline itself
# (test_mooncake_stall, the chaos run) keep the default.
LOADED_HOST_DEADLINE_S = 10.0


def connector_config(
    role: str,
    *,
    backend: str = "mooncake",
    load_failure_policy: str | None = None,
    deadline_s: float | None = None,
    **options: Any,
) -> dict[str, Any]:
    """A `--kv-transfer-config` for KVBridgeConnector as `role` (kv_producer, kv_consumer).

    It names `backend` (Mooncake over TCP by default) on a free side-channel port, plus connector `options`
    (`lease_s`, `transfer`, ...). `deadline_s` sets Mooncake's `transfer_deadline`.
    """
    transport = {"protocol": "tcp"} if backend.lower() == "mooncake" else {}
    if deadline_s is not None and backend.lower() == "mooncake":
        transport["backend_options"] = {"transfer_deadline": deadline_s}
    extra = {"migration_backend": backend, **transport, "side_channel_port": free_port(), **options}
    config: dict[str, Any] = {"kv_connector": "KVBridgeConnector", "kv_role": role, "kv_connector_extra_config": extra}
    if load_failure_policy is not None:
        config["kv_load_failure_policy"] = load_failure_policy
    return config


@attrs.define
class Completions:
    """Greedy completions of `model` from any server that serves it (vLLM or the proxy).

    They compare servers token for token. Close `http` when done.
    """

    model: str
    max_tokens: int = 8
    http: Any = attrs.field(factory=lambda: _client(180.0))

    def body(self, text: str, **extra: Any) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": text,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            **extra,
        }

    def answer(self, server: Server, text: str, *, report: Sequence[Server] = (), **extra: Any) -> dict[str, Any]:
        """The completion's JSON; a non-200 answer raises with the logs of `server` and `report`."""
        r = self.http.post(f"{server.url}/v1/completions", json=self.body(text, **extra))
        if r.status_code != 200:
            raise AssertionError(f"{server.url} answered {r.status_code}: {r.text}\n{failure_reports(server, *report)}")
        return r.json()

    def token_ids(self, server: Server, text: str, **extra: Any) -> list[int]:
        """The completion's token ids."""
        ids = self.answer(server, text, **extra)["choices"][0]["token_ids"]
        if ids is None:  # an AssertionError as for a bad status: what tests of these servers catch and report
            raise AssertionError(f"{server.url} returned no token ids (is return_token_ids supported?)")
        return ids


def failure_reports(*servers: Server) -> str:
    """What to read when an assertion about these servers fails: each log's error lines and tail."""
    return "\n".join(f"--- {s.log_path.name}\n{s.failure_report()}" for s in servers)


def _client(timeout: float) -> Any:
    import httpx

    return httpx.Client(timeout=timeout, trust_env=False)


def start_vllm(
    model: str | Path,
    *,
    kv_transfer_config: Mapping[str, Any] | None = None,
    max_model_len: int = 1024,
    block_size: int = 32,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    port: int | None = None,
    log_dir: str | Path | None = None,
    python: str = sys.executable,
    executor: str = "mp",
    host: Host | None = None,
    engine_nice: int = 0,
) -> Server:
    """Launch a server (without waiting for it); call `wait_healthy` next.

    `host` (a `kvbridge_tools.harness.hosts.Host`) runs it there, listening on the host's address (its
    side channel and transport too, through VLLM_HOST_IP); by default on 127.0.0.1 here.

    `executor` is where the model runs (TP 1): "mp", in a worker process beside the engine core (what
    vLLM's CPU platform picks), or "uni", in the engine core's own process (what vLLM runs for one GPU).

    `engine_nice` > 0: once healthy, the processes that run its model run that much below its API server (and
    below the proxy and the other front-end processes), the way vLLM's CPU backend keeps cores free of its compute
    for the front end (`VLLM_CPU_NUM_OF_RESERVED_CPU`) where a box has too few cores to keep any.
    """
    if executor not in EXECUTORS:
        raise ConfigError(f"executor {executor!r}: pick one of {', '.join(EXECUTORS)}")
    port = port or free_port()
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="kvbridge-vllm-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"vllm-{port}.log"
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        host.address if host else "127.0.0.1",
        "--port",
        str(port),
        "--enforce-eager",
        "--dtype",
        "float32",
        "--block-size",
        str(block_size),
        "--max-model-len",
        str(max_model_len),
        "--seed",
        "0",
        *extra_args,
    ]
    if kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(dict(kv_transfer_config))]
    full_env = dict(os.environ)
    full_env.setdefault("VLLM_LOGGING_LEVEL", "INFO")  # the caller's level wins (DEBUG shows each pull's timings)
    full_env.update(BASE_ENV)
    if host is not None:
        full_env.update(host_env(host))
    if executor == "uni":
        # The CPU platform swaps "uni" for "mp" unless V1 multiprocessing is off; the API server and the
        # engine core stay separate processes either way.
        full_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # the stall watchdog's dumps (every thread's stack, once per stall) beside the log
    full_env.setdefault("KVBRIDGE_STALL_DIR", str(log_dir / f"stalls-{port}"))
    full_env.update(env or {})
    # Its own TMPDIR: what it leaves there (vLLM's /tmp/vllm_dist_* init files) goes when it ends.
    tmp_dir = Path(tempfile.mkdtemp(prefix=f"kvbridge-vllm-{port}-tmp-"))
    full_env["TMPDIR"] = str(tmp_dir)
    with open(log_path, "wb") as out:
        argv = host.command(cmd) if host else cmd
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=full_env, **OWN_GROUP)
    log.info("started vLLM on port %d (pid %d), log %s", port, proc.pid, log_path)
    address = host.address if host else "127.0.0.1"
    return Server(port, proc, log_path, tmp_dir, address, engine_nice, starting=True)


def host_env(host: Host) -> dict[str, str]:
    """A server on a namespace host binds its address and reaches the other hosts without a proxy."""
    no_proxy = f"{BASE_ENV['NO_PROXY']},{host.address.rsplit('.', 1)[0]}.0/24"
    return {"VLLM_HOST_IP": host.address, "NO_PROXY": no_proxy, "no_proxy": no_proxy}


def start_proxy(
    prefill: Sequence[str],
    decode: Sequence[str],
    *,
    port: int | None = None,
    log_dir: str | Path | None = None,
    health_interval: float = 1.0,
    transfer: str = "pull",
    timeout: float = 120.0,
    host: Host | None = None,
    expose_internals: bool = False,
    secret: str | None = None,
    registry: str | None = None,
    live_moves: bool = False,
    options: Sequence[str] = (),
) -> Server:
    """Launch `kvbridge proxy` in front of these servers; return once it has warmed every pair.

    With a `registry`, whose servers it also routes to, it returns once the proxy answers: the caller waits for
    what it needs. `expose_internals`: its answers name the servers by URL (`--expose-internals`). `secret`: the
    servers' shared secret, so the proxy can abort a lease on prefill's side channel when no decode took the request.
    `live_moves`: it moves a draining decode's streams to another decode (`--live-moves`). `options`: more of
    `kvbridge proxy`'s options.

    The proxy's warm-up is one real handover through each prefill/decode pair (its first contact),
    so whoever counts a decode server's transfers starts after it. A proxy that does not get there
    is stopped, and the error carries its log.
    """
    port = port or free_port()
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="kvbridge-proxy-"))
    log_path = log_dir / f"proxy-{port}.log"
    cmd = [
        sys.executable,
        "-m",
        "kvbridge",
        "-v",
        "proxy",
        "--host",
        host.address if host else "127.0.0.1",
        "--port",
        str(port),
        "--health-interval",
        str(health_interval),
        "--transfer",
        transfer,
        *(["--prefill", *prefill] if prefill else []),
        *(["--decode", *decode] if decode else []),
        *(["--registry", registry] if registry else []),
        *(["--expose-internals"] if expose_internals else []),
        *(["--live-moves"] if live_moves else []),
        *options,
    ]
    env = dict(os.environ)
    env.update({k: BASE_ENV[k] for k in ("NO_PROXY", "no_proxy")})
    if host is not None:
        env.update({k: v for k, v in host_env(host).items() if k != "VLLM_HOST_IP"})
    if secret is not None:
        env["KVBRIDGE_SECRET"] = secret
    env.setdefault("KVBRIDGE_STALL_DIR", str(log_dir / f"stalls-{port}"))  # as a vLLM server's (start_vllm)
    with open(log_path, "wb") as out:
        argv = host.command(cmd) if host else cmd
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, **OWN_GROUP)
    proxy = Server(port=port, proc=proc, log_path=log_path, address=host.address if host else "127.0.0.1")
    try:
        if registry is None:  # with one, it may have no server yet: /instances answering is enough
            wait_healthy([proxy], timeout=min(60.0, timeout))
        _wait_warmed(proxy, pairs=len(prefill) * len(decode), timeout=timeout)
    except BaseException:
        proxy.stop()
        raise
    return proxy


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format to {name: value summed over its label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def _get(url: str, timeout: float = 10.0) -> Any:
    import httpx

    return httpx.get(url, timeout=timeout, trust_env=False)


def wait_healthy(servers: Sequence[Server], timeout: float = 600.0) -> None:
    """Poll each server's /health until it answers 200; raise with its log if it dies or times out.

    A healthy server with an `engine_nice` has its engine's priority lowered then (`Server.lower_engine_priority`)."""
    import httpx

    deadline = time.monotonic() + timeout
    pending = list(servers)
    while pending:
        for server in list(pending):
            if not server.alive():
                raise ConfigError(
                    f"vLLM server on port {server.port} exited with {server.proc.returncode} during start-up; "
                    f"{server.failure_report()}"
                )
            try:
                if _get(f"{server.url}/health", timeout=2.0).status_code == 200:
                    pending.remove(server)
                    server.starting = False
                    if server.engine_nice:
                        server.lower_engine_priority()
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            raise ConfigError(
                f"vLLM server on port {pending[0].port} not healthy after {timeout}s; {pending[0].failure_report()}"
            )
        if pending:
            time.sleep(0.5)


def _wait_warmed(proxy: Server, pairs: int, timeout: float) -> None:
    """Wait until `proxy` has sent its warm-up request through `pairs` prefill/decode pairs."""
    deadline = time.monotonic() + timeout
    while True:
        if not proxy.alive():
            raise ConfigError(f"the proxy exited with {proxy.proc.returncode}; {proxy.failure_report()}")
        with contextlib.suppress(Exception):  # a proxy that is still starting answers nothing yet
            if len(_get(f"{proxy.url}/instances").json()["warmed"]) >= pairs:
                return
        if time.monotonic() > deadline:
            raise ConfigError(
                f"the proxy did not warm {pairs} prefill/decode pair(s) in {timeout}s; {proxy.failure_report()}"
            )
        time.sleep(0.2)
