"""The test-harness helpers that every server-starting test relies on: ports and process cleanup."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvbridge_tools.harness.ports import ephemeral_start, free_port
from kvbridge_tools.harness.tiny_model import build_tiny_llama
from kvbridge_tools.harness.vllm_server import Server, _group_members, start_vllm


def test_free_ports_are_below_the_ephemeral_range_distinct_and_bindable() -> None:
    top = ephemeral_start()
    bases = [free_port(span=4) for _ in range(50)]
    runs = [range(b, b + 4) for b in bases]
    for run in runs:
        assert run.stop <= top, f"{run} reaches into the ephemeral range starting at {top}"
        for port in run:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
    taken = [p for run in runs for p in run]
    assert len(taken) == len(set(taken)), "a port was handed out twice"


def test_free_port_skips_a_port_that_is_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    # Steer the draw onto a listening port first; the next draw must not return it.
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", free_port(span=1)))
        busy.listen()
        held = busy.getsockname()[1]
        draws = iter([held, held + 100])
        from kvbridge_tools.harness import ports

        # Only this test's draws count: a port an earlier test was handed (held + 100 among them, about one
        # time in ten over the whole suite) would be skipped for that reason instead.
        monkeypatch.setattr(ports, "_given", [])
        monkeypatch.setattr(ports._rng, "randrange", lambda *_: next(draws))
        assert free_port(span=1) == held + 100


def test_ephemeral_start_reads_the_kernel_setting(tmp_path: Path) -> None:
    setting = tmp_path / "ip_local_port_range"
    setting.write_text("40000\t60999\n")
    assert ephemeral_start(setting) == 40000
    assert ephemeral_start(tmp_path / "missing") == 32768


def _group(tmp_path: Path, script: str, *, words: int, engine_nice: int = 0) -> Server:
    """`script` run as a server's process group (a session of its own), once its output has `words` words.

    Its processes write each line with one os.write: with PYTHONUNBUFFERED set (as it is where CI runs), print
    writes each piece apart (strace: "title", " ", "pid", "\\n"), and two children's pieces once interleaved into
    fewer words than awaited."""
    log, main = tmp_path / "group.log", tmp_path / "group.py"
    main.write_text(script)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(main)], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    server = Server(port=0, proc=proc, log_path=log, engine_nice=engine_nice)
    deadline = time.monotonic() + 30
    try:
        while len(log.read_text().split()) < words:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
    except BaseException:
        server.stop(timeout=5)
        raise
    return server


@pytest.mark.parametrize("end", ["kill", "stop"])
@pytest.mark.parametrize("mapped", [True, False])
def test_ending_a_server_ends_its_group_and_removes_its_shared_memory(tmp_path: Path, end: str, mapped: bool) -> None:
    # A parent and a child that share a POSIX shared-memory segment, as vLLM's processes do. Unmapped,
    # only the group's multiprocessing resource tracker knows it (as the sem.mp-* semaphores vLLM's
    # processes leave behind): the tracker is spared the kill and removes it.
    script = textwrap.dedent(f"""
        import multiprocessing as mp, os, sys, time
        from multiprocessing import shared_memory
        def child(name):
            seg = shared_memory.SharedMemory(name=name)
            if not {mapped}:
                seg.close()
            os.write(1, b"child-ready\\n")
            time.sleep(600)
        if __name__ == "__main__":
            seg = shared_memory.SharedMemory(create=True, size=1 << 20)
            p = mp.get_context("fork" if {mapped} else "spawn").Process(target=child, args=(seg.name,))
            p.start()
            if not {mapped}:
                seg.close()
            os.write(1, f"{{seg.name}} {{p.pid}}\\n".encode())
            time.sleep(600)
    """)
    server = _group(tmp_path, script, words=3)
    log, proc = server.log_path, server.proc
    try:
        name, child_pid = [w for w in log.read_text().split() if w != "child-ready"]
        segment = Path("/dev/shm") / name
        assert segment.exists()
        assert {proc.pid, int(child_pid)} <= set(_group_members(proc.pid))
        getattr(server, end)()
        assert _group_members(proc.pid) == []
        assert not segment.exists(), f"{segment} leaked after {end}"
    finally:
        server.stop(timeout=5)


def test_an_engine_below_its_front_end_is_every_thread_of_its_engine_processes_and_nothing_else(
    tmp_path: Path,
) -> None:
    """`Server.lower_engine_priority` sets every thread of the engine core `engine_nice` below the API server.

    The API server and the group's other processes keep its priority."""
    script = textwrap.dedent("""
        import multiprocessing as mp, os, sys, threading, time
        def run(title):
            with open("/proc/self/comm", "w") as comm:  # as vLLM's setproctitle names its engine core
                comm.write(title)
            threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
            os.write(1, f"{title} {os.getpid()}\\n".encode())
            time.sleep(600)
        if __name__ == "__main__":
            ctx = mp.get_context("fork")
            for title in ("VLLM::EngineCore", "tokenizer"):
                ctx.Process(target=run, args=(title,)).start()
            time.sleep(600)
    """)
    server = _group(tmp_path, script, words=4, engine_nice=7)
    log, proc = server.log_path, server.proc
    try:
        pids = dict(zip(*[iter(log.read_text().split())] * 2))
        engine, other = int(pids["VLLM::EngineCore"]), int(pids["tokenizer"])

        def nice_of(pid: int) -> dict[int, int]:
            return {
                int(t.name): os.getpriority(os.PRIO_PROCESS, int(t.name)) for t in Path(f"/proc/{pid}/task").iterdir()
            }

        base = os.getpriority(os.PRIO_PROCESS, proc.pid)
        assert server.lower_engine_priority() == len(nice_of(engine)) == 2
        assert set(nice_of(engine).values()) == {min(19, base + 7)}
        assert set(nice_of(other).values()) == {base} and set(nice_of(proc.pid).values()) == {base}
    finally:
        server.stop(timeout=5)


@pytest.mark.slow
def test_a_vllm_server_stopped_while_its_engine_starts_ends_without_sigkill(tmp_path: Path) -> None:
    """A SIGTERM that lands in vLLM's engine handshake is lost: `stop` sends it again (`Server._term_again`).

    Until then every bench or test stopped in a server's start-up (a Ctrl-C, a failure beside it) waited `stop`'s
    whole 30 s and then SIGKILLed the server: its API server waited up to 600 s for an engine core the signal had
    ended. The stop here comes once the engine core has named itself, which is in its handshake."""
    server = start_vllm(build_tiny_llama(tmp_path / "model"), log_dir=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not server.engine_pids():
            assert server.alive() and time.monotonic() < deadline, server.failure_report()
            time.sleep(0.05)
        server.stop(timeout=60)
        assert server.proc.returncode != -signal.SIGKILL, f"SIGKILLed while starting\n{server.failure_report()}"
        assert _group_members(server.pid) == []
    finally:
        server.kill()


def test_failure_report_shows_the_root_cause_far_above_the_tail(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    lines = ["INFO starting"] + ["OSError: [Errno 98] Address already in use"] + [f"INFO line {i}" for i in range(500)]
    log.write_text("\n".join(lines))
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    report = Server(port=0, proc=proc, log_path=log).failure_report(lines=10)
    assert "Address already in use" in report
    assert "INFO line 499" in report and "INFO line 400" not in report


@pytest.mark.parametrize("backend", ["mooncake", "nixl", "tcp"])
def test_connector_config_is_what_the_connector_accepts(backend: str) -> None:
    from kvbridge.adapters.vllm.settings import Settings
    from kvbridge_tools.harness.vllm_server import connector_config

    config = connector_config("kv_consumer", backend=backend, load_failure_policy="recompute", lease_s=7)
    assert (config["kv_connector"], config["kv_role"], config["kv_load_failure_policy"]) == (
        "KVBridgeConnector",
        "kv_consumer",
        "recompute",
    )
    settings = Settings.from_extra_config(config["kv_connector_extra_config"])
    assert settings.migration_backend.lower() == backend and settings.lease_s == 7.0
    assert settings.protocol == ("tcp" if backend == "mooncake" else None)
    assert "kv_load_failure_policy" not in connector_config("kv_producer")


def test_a_bench_model_is_the_one_given_or_a_tiny_one_with_the_positions_asked(tmp_path: Path) -> None:
    """A bench's model: --model-dir, else the tiny model with the positions its lengths need.

    The vLLM benches built the tiny model with 2,048 positions whatever --lengths asked (vLLM then refused to start
    with a longer max_model_len), and the live-moves bench ignored --model-dir."""
    import json

    from kvbridge_tools.harness.tiny_model import given_or_tiny

    assert given_or_tiny("/models/mine", tmp_path, 100_000) == Path("/models/mine")
    for tokens, positions in ((100, 2048), (9000, 9000)):
        model = given_or_tiny(None, tmp_path / str(tokens), tokens)
        assert json.loads((model / "config.json").read_text())["max_position_embeddings"] == positions


def test_a_bench_run_whose_server_stalled_keeps_its_logs_and_a_quiet_one_keeps_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A stall dump written under a bench's temporary logs went with them: the stall's evidence was lost.

    (A chaos run that passed removed its logs with three stall dumps its report still listed.)"""
    import logging
    import shutil
    import tempfile

    from kvbridge.base.watchdog import Watchdog
    from kvbridge_tools.harness.fixtures import wait_for
    from kvbridge_tools.harness.run_logs import bench_logs

    def kept() -> set[Path]:
        return set(Path(tempfile.gettempdir()).glob("kvbridge-stalled-run-*"))

    before = kept()
    with bench_logs(None, tmp_path / "quiet") as logs:
        (logs / "server.log").write_text("served")
    assert kept() == before, "a run with no stall keeps nothing"
    with caplog.at_level(logging.WARNING), bench_logs(None, tmp_path / "stalled") as logs:
        (logs / "server.log").write_text("served, then stalled")
        monkeypatch.setenv("KVBRIDGE_STALL_DIR", str(logs / "stalls-8200"))  # as start_vllm sets a server's
        dog = Watchdog(0.2, native=False)
        beat = dog.watch("a handler that blocks")  # and never comes back to its loop: no beat
        wait_for(lambda: list((logs / "stalls-8200").glob("stall-*.txt")), timeout=20, what="the stall's dump")
        dog.forget(beat)
    [home] = kept() - before
    try:
        [dump] = home.glob("stalls-8200/stall-*.txt")
        assert "a handler that blocks" in dump.read_text()
        assert (home / "server.log").read_text() == "served, then stalled", "the logs it is read beside"
        assert any(str(home) in r.getMessage() and "stall dump" in r.getMessage() for r in caplog.records)
    finally:
        shutil.rmtree(home)
