"""What `kvbridge bench --engine vllm --load` reads beside the serve bench: noise, thread CPU, kvbridge's histograms.

- `--noise cpu=N[,group=own|bench]`: N busy Python processes (a spin loop), running only while a round is
  measured (stopped with SIGSTOP between rounds), killed by PID at the end. `group=own` (the default) is a
  neighbour's job: the N share one session of their own, so one scheduling group (Linux's autogroup; a container's
  or a systemd service's cgroup is one too), and the kernel shares the CPUs between it and the bench's group first.
  `group=bench`: N more processes in the bench's session, on the prefill's and decode's hosts in turn, their threads
  queued beside the servers' (docs/measurements/stalls.md, "Scheduling groups").
- CPU of kvbridge's own threads: /proc/<pid>/task/<tid>/schedstat (on-CPU nanoseconds; stat's utime + stime
  in 10 ms ticks where the kernel keeps no schedstat) of every process in a server's process group, for the
  threads whose OS name starts with `kvbridge`: kvbridge names its threads in the OS (`kvbridge.base.threadname`),
  and the native threads a transport starts from them or under `kvbridge-mc-io` (Mooncake's) carry those names.
- Each CPU's time by state (/proc/stat): user and system, and what no thread's figure holds, interrupts, softirqs
  (the network stack's receive work) and steal (the hypervisor running another VM on it).
- kvbridge's histograms: every `kvbridge_*` histogram series in a server's /metrics, summed over label sets;
  a round's share is the difference of two scrapes, read as count, exact mean (from `_sum`), p50/p99
  (interpolated in the bucket, as Prometheus' histogram_quantile) and max (the upper bound of the highest
  bucket that received an observation).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvbridge_tools.harness.hosts import OWN_GROUP

NOISE_MARK = "kvbridge-bench-noise"
# a spin loop that takes one core while it runs; the mark names it in `ps` and lets a test find it by PID
HOG = f"# {NOISE_MARK}\nwhile True:\n    pass\n"
# `group=own`: a session leader that forks argv[1] spinning children, says their PIDs, and at the end of its stdin
# (the bench closed it, or died) kills and reaps them. A child that outlives it (the leader SIGKILLed) dies with it:
# PR_SET_PDEATHSIG. The PIDs are said only once every child has armed that: the bench stops them (SIGSTOP) as soon
# as it reads them, and one stopped before it armed would outlive a SIGKILLed leader, stopped for good.
HOG_GROUP = f"""# {NOISE_MARK}
import ctypes, os, signal, sys
children, leader = [], os.getpid()
armed_r, armed_w = os.pipe()
for _ in range(int(sys.argv[1])):
    pid = os.fork()
    if pid == 0:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != leader:  # (it died before the line above)
            os._exit(0)
        os.write(armed_w, b".")
        os.close(armed_r)
        os.close(armed_w)
        while True:
            pass
    children.append(pid)
os.close(armed_w)
armed = 0
while armed < len(children):
    got = os.read(armed_r, len(children) - armed)
    if not got:  # (every child that could say so has: one died before it armed)
        sys.exit("a noise child died before it was armed to die with its leader")
    armed += len(got)
os.close(armed_r)
print(*children, flush=True)
sys.stdin.read()
for pid in children:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)
"""
GROUPS = ("own", "bench")
THREAD_PREFIX = "kvbridge"
# One tiny-model vLLM server here (API server, engine core with the model and its 1 GiB KV cache), as resident
# (docs/vllm.md), and a little more for what else starts beside it.
SERVER_GIB = 2.5
MEMORY_MARGIN_GIB = 2.0
# a neighbour's job of more busy processes than this measures the kernel's scheduler, not kvbridge (and forks that many)
MAX_NOISE_CPU = 64


@attrs.frozen
class Noise:
    """What `--noise` asks for: `cpu` busy processes, in a scheduling group of their own or the bench's (`group`)."""

    cpu: int = 0
    group: str = "own"


def parse_noise(text: str) -> Noise:
    """`cpu=N` (1 to MAX_NOISE_CPU busy processes), and `group=own` (default) or `group=bench`, each once."""
    fields: dict[str, Any] = {}
    hint = f"write cpu=N (1 to {MAX_NOISE_CPU} busy processes), optionally with ,group=own or ,group=bench"
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        value = value.strip()
        try:
            if not sep:
                raise ValueError("expected KEY=VALUE")
            if key in fields:
                raise ValueError(f"{key} is given twice")
            if key == "cpu":
                if not value.isdigit() or not 1 <= int(value) <= MAX_NOISE_CPU:
                    raise ValueError(f"cpu={value!r} is not a whole number of processes from 1 to {MAX_NOISE_CPU}")
                fields["cpu"] = int(value)
            elif key == "group":
                if value not in GROUPS:
                    raise ValueError(f"group={value!r} is neither {' nor '.join(GROUPS)}")
                fields["group"] = value
            else:
                raise ValueError(f"unknown key {key!r}")
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"--noise {text!r}: {e}; {hint}") from None
    if "cpu" not in fields:
        raise argparse.ArgumentTypeError(f"--noise {text!r}: no cpu=N asked for; {hint}")
    return Noise(**fields)


class NoiseProcs:
    """The busy processes of `--noise`, on `hosts` (None: here). Stopped until `resume`.

    `group=bench`: one process each, placed on `hosts` in turn. `group=own`: one session leader on the first host
    (a spin loop loads the CPUs of every namespace host alike) whose children spin; `pids` are the spinning ones."""

    def __init__(self, noise: Noise, hosts: Sequence[Any]) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.where: list[str] = []
        self.group = noise.group
        self._pids: list[int] = []
        try:
            if noise.group == "own":
                self._start_group(noise.cpu, hosts[0])
            else:
                for i in range(noise.cpu):
                    host = hosts[i % len(hosts)]
                    # `ip netns exec` execs in place: the PID is the spinning Python's
                    argv = [sys.executable, "-c", HOG]
                    self.procs.append(
                        self._popen(argv, host, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, **OWN_GROUP)
                    )
                    self._pids.append(self.procs[-1].pid)
                    self.where.append(_host_name(host))
            self.pause()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _popen(argv: list[str], host: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen(host.command(argv) if host is not None else argv, stderr=subprocess.DEVNULL, **kwargs)

    def _start_group(self, cpu: int, host: Any) -> None:
        leader = self._popen(
            [sys.executable, "-c", HOG_GROUP, str(cpu)],
            host,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # the session, so the scheduling group, of a neighbour's job
        )
        self.procs.append(leader)
        assert leader.stdout is not None
        line = leader.stdout.readline()  # (its children are forked, armed and spinning by then)
        self._pids = [int(pid) for pid in line.split()]
        if len(self._pids) != cpu:
            raise RuntimeError(f"the noise's group leader started {len(self._pids)} of {cpu} busy processes")
        self.where = [_host_name(host)] * cpu

    def described(self) -> dict[str, Any]:
        """What `--json` says of them."""
        return {
            "cpu": len(self._pids),
            "group": self.group,
            "pids": self.pids,
            "hosts": self.where,
            "running": "while each round runs",
        }

    @property
    def pids(self) -> list[int]:
        """The spinning processes."""
        return list(self._pids)

    def _signal(self, sig: int) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def cpu_seconds(self) -> float:
        return sum(process_cpu(pid) for pid in self.pids)

    def close(self) -> None:
        """SIGKILL every spinning one by PID (a stopped process dies of it too) and reap it.

        A group's leader reaps its children once its stdin is closed, then exits."""
        self._signal(signal.SIGKILL)
        for p in self.procs:
            if p.stdin is not None:
                with contextlib.suppress(OSError):
                    p.stdin.close()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=30)
            if p.stdout is not None:
                p.stdout.close()


def _host_name(host: Any) -> str:
    return host.name if host is not None else "local"


def _stat_times(path: Path) -> tuple[str, int]:
    """(comm, utime + stime in ticks) of a /proc stat file."""
    text = path.read_text()
    head, _, rest = text.rpartition(")")
    fields = rest.split()
    return head.split("(", 1)[1], int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of one process (0 when it is gone)."""
    with contextlib.suppress(OSError, IndexError, ValueError):
        return _stat_times(Path(f"/proc/{pid}/stat"))[1] / os.sysconf("SC_CLK_TCK")
    return 0.0


# a pool's worker number (`kvbridge-pull_0`), or what the 15-byte cut left of it
_SUFFIX = re.compile(r"_\d*$")


# schedstat's three fields (Documentation/scheduler/sched-stats.rst), as `process_thread_cpu` reads them
SCHEDSTAT = ("ran", "waited", "slices")


def _schedstat(task: Path) -> tuple[float, float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one, times it was put on a CPU) of one thread.

    schedstat's where the kernel keeps it; else stat's ticks, and no waits or slices."""
    try:
        ran, waited, slices = (task / "schedstat").read_text().split()[:3]
        return int(ran) / 1e9, int(waited) / 1e9, float(slices)
    except (OSError, IndexError, ValueError):
        return _stat_times(task / "stat")[1] / os.sysconf("SC_CLK_TCK"), 0.0, 0.0


def thread_cpu(pids: Iterable[int], prefix: str = THREAD_PREFIX) -> dict[str, float]:
    """CPU seconds of the live threads of `pids` whose OS name starts with `prefix`, summed by kind.

    Kinds as `process_schedstat` names them, over all of `pids`. A thread that ended between two readings takes its
    time with it: a difference of two readings is a lower bound.
    """
    return own_threads(process_schedstat(pids), prefix)


def process_schedstat(pids: Iterable[int]) -> dict[str, dict[str, float]]:
    """Each `SCHEDSTAT` field of every live thread of `pids`, summed by `<process name>/<thread kind>`.

    A thread's kind is its OS name's first two dash-separated words: a pool's workers (`kvbridge-pull_0`, `_1`, ...)
    under `kvbridge-pull`, every side channel's `kvbridge-ctl-*` under `kvbridge-ctl`. `ran`, seconds on a CPU;
    `waited`, seconds runnable but not run instead (a CPU taken by another thread or process); `slices`, the times
    each was put on a CPU (one wait, many preemptions: many). Names are the OS's (`comm`): vLLM's engine core is
    `VLLM::EngineCor`, its API server `python3`; threads neither kvbridge nor a native library named carry their
    process's name."""
    out: dict[str, dict[str, float]] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            process = Path(f"/proc/{pid}/comm").read_text().strip()
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    name = (task / "comm").read_text().strip()
                    key = f"{process}/{_SUFFIX.sub('', '-'.join(name.split('-')[:2]))}"
                    summed = out.setdefault(key, dict.fromkeys(SCHEDSTAT, 0.0))
                    for read, value in zip(SCHEDSTAT, _schedstat(task), strict=True):
                        summed[read] += value
    return out


def own_threads(stats: Mapping[str, Mapping[str, float]], prefix: str = THREAD_PREFIX) -> dict[str, float]:
    """CPU seconds of the thread kinds of a `process_schedstat` reading that start with `prefix`, over its processes."""
    out: dict[str, float] = {}
    for key, fields in stats.items():
        kind = key.partition("/")[2]
        if kind.startswith(prefix):
            out[kind] = out.get(kind, 0.0) + fields["ran"]
    return out


def process_thread_cpu(pids: Iterable[int], *, read: str = "ran") -> dict[str, float]:
    """One field (`read`, of `SCHEDSTAT`) of `process_schedstat`: CPU seconds by default."""
    return {key: fields[read] for key, fields in process_schedstat(pids).items()}


# /proc/stat's per-CPU columns, in order (man 5 proc); guest time is counted in user already
CPU_STATES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_states() -> dict[str, dict[str, float]]:
    """Seconds each CPU of the machine spent in each state (`CPU_STATES`), from /proc/stat, by `cpuN`.

    What no thread's schedstat holds: interrupts and softirqs (the network stack's receive work among them, done
    on whichever CPU it lands), and steal (time the hypervisor gave this VM's CPU to another)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, dict[str, float]] = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu":
            out[name] = {state: int(v) / tick for state, v in zip(CPU_STATES, fields, strict=False)}
    return out


def minus(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """after - before, name by name (what grew only)."""
    return {k: round(v - before.get(k, 0.0), 4) for k, v in after.items() if v - before.get(k, 0.0) > 0}


_SAMPLE = re.compile(r"^(kvbridge_\w+?)_(bucket|sum|count)(\{[^}]*\})?\s+(\S+)$")
_LE = re.compile(r'le="([^"]+)"')


@attrs.define
class Histogram:
    """One histogram series summed over its label sets: cumulative bucket counts by upper bound, sum, count."""

    buckets: dict[float, float] = attrs.field(factory=dict)
    sum: float = 0.0
    count: float = 0.0

    def minus(self, before: Histogram | None) -> Histogram:
        if before is None:
            return Histogram(dict(self.buckets), self.sum, self.count)
        return Histogram(
            {le: n - before.buckets.get(le, 0.0) for le, n in self.buckets.items()},
            self.sum - before.sum,
            self.count - before.count,
        )

    def plus(self, other: Histogram) -> Histogram:
        """Both histograms' observations, bucket by bucket (one series of one server: the same bounds)."""
        bounds = self.buckets.keys() | other.buckets.keys()
        return Histogram(
            {le: self.buckets.get(le, 0.0) + other.buckets.get(le, 0.0) for le in bounds},
            self.sum + other.sum,
            self.count + other.count,
        )

    def quantile(self, q: float) -> float | None:
        """Seconds at quantile q, interpolated in its bucket (None when empty or past the last finite bound)."""
        if self.count <= 0:
            return None
        rank, lower, below = q * self.count, 0.0, 0.0
        for le in sorted(self.buckets):
            n = self.buckets[le]
            if n >= rank:
                if le == float("inf"):
                    return None
                return lower + (le - lower) * ((rank - below) / (n - below) if n > below else 1.0)
            lower, below = le, n
        return None

    def max_bound(self) -> float | None:
        """The upper bound of the bucket holding the largest observation (inf past the last finite bound)."""
        if self.count <= 0:
            return None
        for le in sorted(self.buckets):
            if self.buckets[le] >= self.count:
                return le
        return None

    def summary(self) -> dict[str, Any]:
        """Count and milliseconds: exact mean; p50, p99 interpolated; max as its bucket's bound (None: > 30 s)."""

        def ms(v: float | None) -> float | None:
            return None if v is None or v == float("inf") else round(v * 1e3, 2)

        return {
            "count": int(round(self.count)),
            "mean_ms": round(self.sum / self.count * 1e3, 2) if self.count > 0 else None,
            "p50_ms": ms(self.quantile(0.5)),
            "p99_ms": ms(self.quantile(0.99)),
            "max_ms": ms(self.max_bound()),
        }


def histograms(text: str) -> dict[str, Histogram]:
    """The `kvbridge_*` histogram series of a Prometheus text page, each summed over its label sets."""
    out: dict[str, Histogram] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        name, part, labels, value = m.groups()
        try:
            v = float(value)
        except ValueError:
            continue
        h = out.setdefault(name, Histogram())
        if part == "bucket":
            le = _LE.search(labels or "")
            if le:
                bound = float(le.group(1))  # "+Inf" reads as inf
                h.buckets[bound] = h.buckets.get(bound, 0.0) + v
        elif part == "sum":
            h.sum += v
        else:
            h.count += v
    return {name: h for name, h in out.items() if h.buckets}


_STEPS = re.compile(r"^vllm:iteration_tokens_total_(count|sum)(\{[^}]*\})?\s+(\S+)$")


def engine_steps(text: str) -> tuple[float, float]:
    """vLLM's engine steps that computed tokens, and the tokens they computed, from its Prometheus text page."""
    steps = tokens = 0.0
    for line in text.splitlines():
        m = _STEPS.match(line.strip())
        if m:
            if m.group(1) == "count":
                steps += float(m.group(3))
            else:
                tokens += float(m.group(3))
    return steps, tokens


def memory_available_gib() -> float:
    """MemAvailable of /proc/meminfo, GiB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def fits_resident(servers: int) -> bool:
    """Whether `servers` tiny-model vLLM servers can all be up at once in the memory free now."""
    return memory_available_gib() >= servers * SERVER_GIB + MEMORY_MARGIN_GIB
