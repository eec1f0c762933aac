"""Where the time goes: the slow line, and a stall watchdog that dumps every thread's stack. See docs/internals.md."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Mapping
from pathlib import Path

import attrs

from kvbridge.base.native_stacks import native_stacks
from kvbridge.base.options import option, parse
from kvbridge.base.threadname import NamedThread, name_of, python_names, thread_ids

log = logging.getLogger(__name__)
ENV = {
    "slow_ms": "KVBRIDGE_SLOW_MS",
    "stall_s": "KVBRIDGE_STALL_S",
    "stall_dir": "KVBRIDGE_STALL_DIR",
    "native_stacks": "KVBRIDGE_STALL_NATIVE",
}


@attrs.frozen
class WatchOptions:
    slow_ms: float = option(250.0, "a side-channel request or handover whose parts add up to this logs one line", min=0)
    stall_s: float = option(1.0, "a serving loop or pull busy this long without progress dumps every stack", min=0.01)
    stall_dir: str | None = option(None, "a directory that gets a file per stall (besides the log)")
    native_stacks: bool = option(
        True, "a dump also has each thread's native stack, read by eu-stack where it is installed (stops it 10-110 ms)"
    )


def options() -> WatchOptions:
    """The options the environment sets now."""
    given = {k: os.environ[v] for k, v in ENV.items() if os.environ.get(v)}
    for k, value in given.items():  # each alone first: an error names the one variable that is wrong
        parse(WatchOptions, {k: value}, what=f"{ENV[k]}={value!r}")
    return parse(WatchOptions, given, what="the environment")


SLOW_MS = options().slow_ms  # read once: checked on every request


def slow(logger: logging.Logger, what: str, parts: Mapping[str, float]) -> None:
    """One line when `parts` (ms) add up to SLOW_MS or more: `slow WHAT: TOTAL ms (part ms, ...)`."""
    total = sum(parts.values())
    if total >= SLOW_MS:
        logger.warning("slow %s: %.1f ms (%s)", what, total, ", ".join(f"{k} {v:.1f}" for k, v in parts.items()))


class Beat:
    """What a watched loop or pull updates; `since` None: idle (waiting, not stalled). Made on the thread it watches."""

    __slots__ = ("__weakref__", "dumped", "name", "since", "tid")

    def __init__(self, name: str) -> None:
        self.name = name
        self.tid = threading.get_native_id()  # its thread's CPU time and run-queue wait go in a dump
        self.since: float | None = time.monotonic()
        self.dumped: float | None = None  # the `since` of the stall already dumped

    def busy(self) -> float:
        self.since = now = time.monotonic()
        return now

    def idle(self) -> None:
        self.since = None


# Thread ids to (ns on a CPU, ns runnable but waiting for one): Linux's per-thread schedstat.
Schedstat = dict[int, tuple[int, int]]
HISTORY_S = 120.0  # how far back a dump can account for a stall's CPU time


def schedstats() -> Schedstat:
    """This process's threads: time each ran, and time each waited on a run queue (empty without /proc schedstat)."""
    out: Schedstat = {}
    for tid in thread_ids():
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ran, waited, _ = f.read().split()
            out[tid] = (int(ran), int(waited))
        except (OSError, ValueError):  # the thread ended meanwhile, or a kernel without schedstats
            continue
    return out


def box_cpu() -> tuple[float, ...]:
    """The host's CPU seconds so far (all CPUs): (busy, idle, stolen by the hypervisor); () without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return ()
    user, nice, system, idle, iowait, irq, softirq, steal = fields + [0] * (8 - len(fields))
    hz = os.sysconf("SC_CLK_TCK")
    return ((user + nice + system + irq + softirq) / hz, (idle + iowait) / hz, steal / hz)


# Process ids to (name, CPU seconds so far, all its threads): every process this one can see in /proc.
Processes = dict[int, tuple[str, float]]
OTHERS_SHOWN = 5  # a dump names this many of the processes that ran most meanwhile


def processes() -> Processes:
    """Every process in /proc: its name and CPU seconds so far (`stat`'s utime + stime, in clock ticks)."""
    hz = os.sysconf("SC_CLK_TCK")
    out: Processes = {}
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return out
    for pid in entries:
        try:
            with open(f"/proc/{pid}/stat") as f:
                text = f.read()
            fields = text[text.rindex(")") + 2 :].split()
            out[int(pid)] = (text[text.index("(") + 1 : text.rindex(")")], (int(fields[11]) + int(fields[12])) / hz)
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    return out


def sched_group(pid: int) -> str:
    """The groups the kernel shares CPUs between before it shares them between threads.

    The process's cgroup (each systemd service, each container) and, where `kernel.sched_autogroup_enabled` is 1,
    its autogroup (each session)."""
    parts = []
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
        # cgroup v2's one line, or v1's cpu controller
        cpu = [ln.split(":", 2)[2] for ln in lines if ln.split(":", 2)[1] in ("", "cpu", "cpu,cpuacct", "cpuacct,cpu")]
        if cpu:
            parts.append(f"cgroup {cpu[0]}")
    except (OSError, IndexError):
        pass
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            autogroups = f.read().strip() == "1"
        if autogroups:
            with open(f"/proc/{pid}/autogroup") as f:
                parts.append(f.read().split()[0].lstrip("/"))
    except (OSError, IndexError):
        pass
    return ", ".join(parts) or "group not known"


def others(before: Processes, after: Processes, window_s: float) -> str:
    """The processes that ran most between two looks, each with its scheduling group: who had the CPUs."""
    ran = sorted(
        ((cpu - before[pid][1], pid, name) for pid, (name, cpu) in after.items() if pid in before),
        reverse=True,
    )[:OTHERS_SHOWN]
    shown = [f"{name} (pid {pid}; {sched_group(pid)}) {cpu:.2f} s" for cpu, pid, name in ran if cpu > 0]
    mine = sched_group(os.getpid())
    return f"Processes that ran most in the last {window_s:.1f} s of it (CPU seconds; this one's group: {mine}): " + (
        ", ".join(shown) or "none measurably"
    )


def account(
    stalled: list[Beat],
    before: Schedstat,
    after: Schedstat,
    window_s: float,
    box: tuple[tuple[float, ...], tuple[float, ...]] = ((), ()),
) -> str:
    """Where the stalled threads' seconds went, with the process's busiest threads.

    On a CPU, waiting for one (the box's CPUs taken), or neither (blocked on a lock, I/O or a sleep, or stopped)."""
    if not after:
        return "CPU time: not known (no /proc schedstat on this system)"
    if window_s <= 0:
        return "CPU time: not known (no look before this one to count from)"
    names = python_names()
    delta = {
        tid: ((ran - before.get(tid, (0, 0))[0]) / 1e9, (waited - before.get(tid, (0, 0))[1]) / 1e9)
        for tid, (ran, waited) in after.items()
    }
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    ran_all, waited_all = sum(d[0] for d in delta.values()), sum(d[1] for d in delta.values())
    lines = [
        f"CPU time over the last {window_s:.1f} s: this process's {len(after)} threads ran {ran_all:.2f} s and waited "
        f"{waited_all:.2f} s for a CPU; load average {load} on {os.cpu_count()} CPUs"
    ]
    if box[0] and box[1]:  # what the host's CPUs did meanwhile: a VM's vCPUs not run by its hypervisor are stolen
        busy, idle, stolen = (b - a for a, b in zip(*box, strict=True))
        lines[0] += f"; the host's CPUs were busy {busy:.2f} s, idle {idle:.2f} s, stolen {stolen:.2f} s"
    for beat in stalled:
        ran, waited = delta.get(beat.tid, (0.0, 0.0))
        if ran + waited < window_s / 2:
            verdict = "neither running nor runnable most of the time: blocked (a lock, I/O, a sleep) or stopped"
        elif ran >= waited:
            verdict = "busy on a CPU (a long computation, or a loop that does not yield)"
        else:
            verdict = "runnable but not run: the CPUs were taken by other threads or processes"
        lines.append(
            f"  {beat.name} (thread {name_of(beat.tid, names)}): ran {ran:.2f} s, waited {waited:.2f} s: {verdict}"
        )
    busiest = sorted(delta.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[:5]
    lines += [
        f"  busiest: {name_of(tid, names)} ran {ran:.2f} s, waited {waited:.2f} s"
        for tid, (ran, waited) in busiest
        if ran + waited >= 0.01
    ]
    return "\n".join(lines)


def kernel_view() -> str:
    """Every thread of this process as the kernel sees it: state, the kernel function it waits in, its syscall.

    The only view of a thread with no Python stack (a transport's C++ I/O thread): blocked in `sk_wait_data` or
    `do_epoll_wait`, or running (`R`, no wait channel)."""
    names = python_names()
    lines = ["Every thread as the kernel sees it (state; wait channel; syscall number, or running):"]
    tids = thread_ids()
    if not tids:
        return lines[0] + " not known (no /proc on this system)"
    for tid in tids:
        task = Path(f"/proc/self/task/{tid}")
        try:
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            wchan = (task / "wchan").read_text().strip()
            call = (task / "syscall").read_text().split()[0]
        except (OSError, IndexError):  # ended meanwhile, or a kernel that does not say
            continue
        kind = "" if tid in names else ", native"
        lines.append(f"  {name_of(tid, names)} ({tid}{kind}): {state}; {wchan if wchan != '0' else '-'}; {call}")
    return "\n".join(lines)


class Watchdog:
    """The process's one watcher thread, started with the first beat (again in a forked child)."""

    def __init__(self, stall_s: float, *, native: bool = True) -> None:
        self.stall_s = stall_s
        self.native = native  # each thread's native stack in a dump, too (`native_stacks`)
        self.stalls = 0  # dumps so far
        self.checked = 0.0  # monotonic time of the last look
        # (monotonic time, schedstats, box_cpu) at each look: what a dump subtracts from now
        self._samples: deque[tuple[float, Schedstat, tuple[float, ...]]] = deque(
            maxlen=min(1000, max(2, int(HISTORY_S * 2 / stall_s)))
        )
        # every process's CPU at the first look that found a beat stalled half the time: what a dump counts others from
        self._others: tuple[float, Processes] | None = None
        self._pid = os.getpid()
        self._beats: weakref.WeakSet[Beat] = weakref.WeakSet()  # a pull dropped without its end is gone too
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, name: str) -> Beat:
        beat = Beat(name)
        with self._lock:
            self._beats.add(beat)
            if self._thread is None or not self._thread.is_alive():
                if self._pid != os.getpid():  # a forked child: its threads are not its parent's
                    self._samples.clear()
                    self._pid = os.getpid()
                self._sample()  # what a stall found at the first look counts from
                self._thread = NamedThread(target=self._run, name="kvbridge-watchdog", daemon=True)
                self._thread.start()
        return beat

    def forget(self, beat: Beat) -> None:
        with self._lock:
            self._beats.discard(beat)

    def _run(self) -> None:
        while True:
            time.sleep(self.stall_s / 2)  # the watchdog's own period: a beat is never waited on
            try:
                self.check()
            except Exception:  # the watchdog must outlive a failed dump (a full disk)
                log.exception("stall watchdog failed")

    def check(self) -> None:
        """Dump once for the beats stalled now that were not dumped for this stall."""
        with self._lock:
            beats = list(self._beats)
        # A look samples only while a beat is busy: reading every thread's counters costs an engine process (tens of
        # threads) about a millisecond of its GIL, which an idle look would take from the engine's steps for nothing.
        if not any(b.since is not None for b in beats):
            self.checked = time.monotonic()
            return
        # Sampled before any beat is marked dumped (one who waits on that moves on).
        now, stats, box = self._sample()
        stalled: list[tuple[Beat, float]] = []
        suspect = False
        for b in beats:
            since = b.since
            if since is not None and b.dumped != since:
                if now - since >= self.stall_s:
                    b.dumped = since
                    stalled.append((b, since))
                suspect = suspect or now - since >= self.stall_s / 2
        # Every process's counters only where a stall is likely: reading /proc whole costs a few milliseconds.
        if suspect and self._others is None:
            self._others = (now, processes())
        if stalled:
            self.stalls += 1
            then, before, box_before = self._window_start(min(since for _, since in stalled), now)
            accounting = account([b for b, _ in stalled], before, stats, now - then, (box_before, box))
            if self._others is not None and self._others[0] < now:
                accounting += "\n" + others(self._others[1], processes(), time.monotonic() - self._others[0])
            self._dump(stalled, now, accounting)
        if not suspect or stalled:
            self._others = None
        self.checked = now

    def _window_start(self, began: float, now: float) -> tuple[float, Schedstat, tuple[float, ...]]:
        """The sample a stall's accounting counts from.

        The last look at or before it began, when that look was recent; after an idle spell (no samples), the first
        look that saw it busy; the oldest kept, for a stall longer than the history."""
        before = next((s for s in reversed(self._samples) if s[0] <= began), None)
        if before is not None and before[0] >= began - self.stall_s:
            return before
        after = next((s for s in self._samples if began < s[0] < now), None)
        return after or before or self._samples[0]

    def _sample(self) -> tuple[float, Schedstat, tuple[float, ...]]:
        """Every thread's CPU counters and the host's, kept for a later dump.

        The clock is read right after the counters: a look that itself waited for a CPU between the two would give
        them a window too short."""
        stats, box = schedstats(), box_cpu()
        sample = (time.monotonic(), stats, box)
        self._samples.append(sample)
        return sample

    def _dump(self, stalled: list[tuple[Beat, float]], now: float, accounting: str) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        what = ", ".join(f"{b.name} ({now - since:.1f} s)" for b, since in stalled)
        head = f"kvbridge stall in pid {os.getpid()}: no progress in {what}; every thread's stack:"
        stacks = [
            f"Thread {names.get(ident, '?')} ({ident}):\n{''.join(traceback.format_stack(frame))}"
            for ident, frame in sys._current_frames().items()
        ]
        parts = [head, accounting, kernel_view(), *stacks]
        if self.native:
            by_tid = python_names()
            parts.append(native_stacks(lambda tid: name_of(tid, by_tid)))
        text = "\n".join(parts)
        log.warning("%s", text)
        where = options().stall_dir
        if where:
            path = Path(where, f"stall-{os.getpid()}-{self.stalls}-{time.strftime('%H%M%S')}.txt")
            path.parent.mkdir(parents=True, exist_ok=True)
            # Whole or absent: whoever watches the folder (an operator's tail, a test) never reads half a dump.
            partial = path.with_name(f".{path.name}.partial")
            partial.write_text(text + "\n")
            os.replace(partial, path)
            log.warning("stall stacks written to %s", path)


WATCHDOG = Watchdog(options().stall_s, native=options().native_stacks)
_local = threading.local()


def watch(name: str, *, this_thread: bool = False) -> Beat:
    """A beat of this process's watchdog, busy from now (`WATCHDOG.forget` it when done, or drop it).

    `this_thread`: the calling thread's beat from now on, for `progress()`."""
    beat = WATCHDOG.watch(name)
    if this_thread:
        # weak: a pull dropped without its end must leave the watch with its last owner, not stay armed by its
        # thread's later `progress()` calls (false stalls named for a pull long gone)
        _local.beat = weakref.ref(beat)
    return beat


def progress() -> None:
    """The calling thread's beat (if any) moved on."""
    ref = getattr(_local, "beat", None)
    beat = ref() if ref is not None else None
    if beat is not None:
        beat.busy()
