"""What the load bench reads beside vLLM's serve bench (`kvbridge_tools.bench.load_probes`), on real processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge_tools.bench.load_probes import (
    CPU_STATES,
    NOISE_MARK,
    Noise,
    NoiseProcs,
    cpu_states,
    engine_steps,
    histograms,
    process_thread_cpu,
    thread_cpu,
)
from kvbridge_tools.harness.fixtures import wait_for

PAGE = """\
# TYPE kvbridge_control_seconds histogram
kvbridge_control_seconds_bucket{engine="0",le="0.005",peer="a",transport="mooncake"} 1.0
kvbridge_control_seconds_bucket{engine="0",le="0.01",peer="a",transport="mooncake"} 3.0
kvbridge_control_seconds_bucket{engine="0",le="+Inf",peer="a",transport="mooncake"} 3.0
kvbridge_control_seconds_count{engine="0",peer="a",transport="mooncake"} 3.0
kvbridge_control_seconds_sum{engine="0",peer="a",transport="mooncake"} 0.021
kvbridge_control_seconds_bucket{engine="0",le="0.005",peer="b",transport="mooncake"} 1.0
kvbridge_control_seconds_bucket{engine="0",le="0.01",peer="b",transport="mooncake"} 1.0
kvbridge_control_seconds_bucket{engine="0",le="+Inf",peer="b",transport="mooncake"} 1.0
kvbridge_control_seconds_count{engine="0",peer="b",transport="mooncake"} 1.0
kvbridge_control_seconds_sum{engine="0",peer="b",transport="mooncake"} 0.003
kvbridge_transfer_bytes_total{engine="0",peer="a",transport="mooncake"} 4096.0
vllm:e2e_request_latency_seconds_bucket{le="0.3"} 7.0
"""


def test_histograms_sum_label_sets_and_a_round_is_a_difference() -> None:
    (name,) = histograms(PAGE)  # counters and vLLM's own series are not kvbridge histograms
    assert name == "kvbridge_control_seconds"
    now = histograms(PAGE)[name]
    assert now.buckets == {0.005: 2.0, 0.01: 4.0, float("inf"): 4.0} and now.count == 4.0
    assert now.summary() == {"count": 4, "mean_ms": 6.0, "p50_ms": 5.0, "p99_ms": 9.9, "max_ms": 10.0}
    before = histograms(
        PAGE.replace('0.01",peer="a",transport="mooncake"} 3.0', '0.01",peer="a",transport="mooncake"} 1.0')
    )
    assert now.minus(before[name]).buckets[0.01] == 2.0
    empty = now.minus(now).summary()
    assert empty == {"count": 0, "mean_ms": None, "p50_ms": None, "p99_ms": None, "max_ms": None}


def test_engine_steps_are_vllms_iterations_summed_over_its_engines() -> None:
    page = PAGE + (
        'vllm:iteration_tokens_total_count{engine="0",model_name="m"} 12.0\n'
        'vllm:iteration_tokens_total_sum{engine="0",model_name="m"} 345.0\n'
        'vllm:iteration_tokens_total_count{engine="1",model_name="m"} 3.0\n'
        'vllm:iteration_tokens_total_sum{engine="1",model_name="m"} 5.0\n'
        'vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="m"} 2.0\n'
    )
    assert engine_steps(page) == (15.0, 350.0)
    assert engine_steps(PAGE) == (0.0, 0.0)


def test_kvbridge_threads_are_named_in_the_os_and_their_cpu_is_read() -> None:
    # kvbridge's threads as the library starts them: a NamedThread, a pool named in the OS by its initializer
    probe = (
        "import sys, threading, time\n"
        "from concurrent.futures import ThreadPoolExecutor\n"
        "from kvbridge.base.threadname import NamedThread, name_in_os\n"
        "def work():\n"
        "    t = time.thread_time()\n"
        "    while time.thread_time() - t < 0.05: pass\n"  # 50 ms of this thread's own CPU
        "    sys.stdin.readline()\n"
        "pool = ThreadPoolExecutor(1, thread_name_prefix='kvbridge-pull', initializer=name_in_os)\n"
        "NamedThread(target=work, name='kvbridge-ctl-prefill', daemon=True).start()\n"
        "threading.Thread(target=work, name='other', daemon=True).start()\n"
        "pool.submit(work)\n"
        "time.sleep(0)\n"
        "print('started', flush=True)\n"
        "sys.stdin.readline()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", probe], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"started\n"
        process = Path(f"/proc/{proc.pid}/comm").read_text().strip()

        def spun() -> bool:
            # each worker blocks on stdin once it has spun its 50 ms; "other" counts under the process's name (in CI
            # it was read still spinning, 37 ms in, when only the named two were waited for)
            kinds = thread_cpu([proc.pid])
            other = process_thread_cpu([proc.pid]).get(f"{process}/{process}", 0.0)
            return len(kinds) == 2 and min(kinds.values()) >= 0.05 and other >= 0.05

        wait_for(spun, timeout=60, what="the probe's three threads to spin 50 ms each")
        names = {(p / "comm").read_text().strip() for p in Path(f"/proc/{proc.pid}/task").iterdir()}
        assert {"kvbridge-ctl-pr", "kvbridge-pull_0"} <= names  # 15 bytes, as the kernel keeps them
        assert not {n for n in names if n.startswith("other")}
        cpu = thread_cpu([proc.pid])
        assert set(cpu) == {"kvbridge-ctl", "kvbridge-pull"}  # by kind: a pool's workers under one name
        assert min(cpu.values()) > 0
        # every thread under its process's name; one the OS knows by no name of its own ("other") by the process's
        every = process_thread_cpu([proc.pid])
        assert set(every) == {f"{process}/kvbridge-ctl", f"{process}/kvbridge-pull", f"{process}/{process}"}
        assert every[f"{process}/{process}"] >= 0.05 and sum(every.values()) > sum(cpu.values())
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("group", ["own", "bench"])
def test_noise_runs_only_when_resumed_and_is_killed_by_pid(group: str) -> None:
    noise = NoiseProcs(Noise(cpu=2, group=group), [None])
    try:
        pids = noise.pids
        assert len(pids) == 2 and noise.where == ["local", "local"]
        before = noise.cpu_seconds()
        noise.resume()
        while noise.cpu_seconds() == before:  # it spins once resumed
            pass
        noise.pause()
        for pid in pids:  # (its command line reads empty until its exec is through)
            while not Path(f"/proc/{pid}/cmdline").read_bytes():
                noise.resume()
            assert NOISE_MARK.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
        noise.pause()
        # own: one session, so one scheduling group, of their own (a neighbour's job); bench: the bench's session
        sessions = {os.getsid(pid) for pid in pids}
        assert sessions == ({noise.procs[0].pid} if group == "own" else {os.getsid(0)})
    finally:
        noise.close()
    for p in noise.procs:
        assert p.returncode == (0 if group == "own" else -9)  # reaped: the leader its children, then exits
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or NOISE_MARK.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()


# Run as a child subreaper (PR_SET_CHILD_SUBREAPER): the orphans come to it, and it reaps them (this box's init does
# not reap). Its first line: the spinning PIDs; its last: "reaped" once both died of their leader's death.
ORPHANS = """
import ctypes, os
ctypes.CDLL(None, use_errno=True).prctl(36, 1)
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
from kvbridge_tools.bench.load_probes import Noise, NoiseProcs
noise = NoiseProcs(Noise(cpu=2), [None])
print(*noise.pids, flush=True)
noise.procs[0].kill()
noise.procs[0].wait()
for pid in noise.pids:
    os.waitpid(pid, 0)
print("reaped", flush=True)
"""


def test_a_noise_group_dies_with_its_leader() -> None:
    """A bench killed outright leaves no spinning process: the leader's children die with it (PR_SET_PDEATHSIG).

    On one CPU the leader runs ahead of the children it forks: one stopped (`pause`) before it armed PDEATHSIG
    would outlive the leader, stopped for good, and the wait for it below would not end."""
    proc = subprocess.Popen([sys.executable, "-c", ORPHANS], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    pids = [int(pid) for pid in proc.stdout.readline().split()]
    try:
        proc.wait(timeout=60)  # (what it writes fits in a pipe)
        # the rest through the same reader: `communicate` reads the pipe itself, past what `readline` buffered, and
        # lost "reaped" where the script had printed it before this process read the first line (a loaded box)
        out, err = proc.stdout.read(), proc.stderr.read()
        said = f"exit {proc.returncode}, out {out!r}, err {err[-2000:]!r}"
        assert len(pids) == 2 and out.split() == ["reaped"] and proc.returncode == 0, said
    finally:
        for pid in pids:  # (only where they outlived their leader: the test failed)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()


def spinner(cpu: int, seconds: float) -> str:
    """A Python program that pins itself to `cpu` and spins until it has had `seconds` of its own CPU time."""
    return (
        "import os, time\n"
        f"os.sched_setaffinity(0, {{{cpu}}})\n"
        "t = time.thread_time()\n"
        f"while time.thread_time() - t < {seconds}: pass\n"
    )


def test_the_time_threads_wait_for_a_cpu_is_read_apart_from_the_time_they_run() -> None:
    # two processes that each spin 0.2 s of their own CPU time on one shared CPU: each waits while the other runs
    spin = spinner(min(os.sched_getaffinity(0)), 0.2) + "print('spun', flush=True)\ninput()\n"
    procs = [
        subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in "ab"
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline() == b"spun\n"
        pids = [p.pid for p in procs]
        ran, waited = process_thread_cpu(pids), process_thread_cpu(pids, read="waited")
        assert set(waited) == set(ran) and sum(ran.values()) >= 0.4, (ran, waited)
        assert sum(waited.values()) >= 0.1 and waited != ran, f"two spinners on one CPU waited {waited} for it"
        # each spinner was taken off its CPU for the other and put back: at least twice each
        slices = process_thread_cpu(pids, read="slices")
        assert set(slices) == set(ran) and min(slices.values()) >= 2 and slices != ran, slices
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_each_cpus_time_by_state_grows_where_a_pinned_process_spins() -> None:
    # a process pinned to one CPU spins 0.3 s of its own time: that CPU's user + system grow by about as much
    cpu = max(os.sched_getaffinity(0))
    spin = spinner(cpu, 0.3)
    before = cpu_states()
    assert f"cpu{cpu}" in before and set(before[f"cpu{cpu}"]) == set(CPU_STATES), before
    subprocess.run([sys.executable, "-c", spin], check=True, timeout=60)
    after = cpu_states()
    busy = sum(after[f"cpu{cpu}"][k] - before[f"cpu{cpu}"][k] for k in ("user", "nice", "system"))
    assert busy >= 0.25, (before[f"cpu{cpu}"], after[f"cpu{cpu}"])
    assert all(after[c][k] >= before[c][k] for c in before for k in CPU_STATES)  # counters only grow
