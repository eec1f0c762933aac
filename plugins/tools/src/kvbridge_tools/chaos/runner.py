"""Play requests through the proxy with faults, compare each answer with the colocated server's."""

from __future__ import annotations

import contextlib
import json
import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs

from kvbridge.session import timeline
from kvbridge_tools.chaos.deployment import Deployment
from kvbridge_tools.chaos.faults import ALL_RUN, not_injected, scaling, schedule
from kvbridge_tools.chaos.network import NetworkFaults
from kvbridge_tools.chaos.report import (
    DIFFERENT,
    DROPPED,
    FAILED,
    HUNG,
    MATCHED,
    UNCLEAR,
    Outcome,
    Report,
    lost_decodes,
    moves,
    slow_pulls,
    timings,
)
from kvbridge_tools.chaos.server_metrics import blocks_in_use, holding
from kvbridge_tools.harness.tiny_model import random_prompt

log = logging.getLogger(__name__)
HANDOVER_PHASES = ("control_ms", "transfer_ms", "done_ms")  # the handover (docs/chaos.md)
FAILED_MARKS = ("at_failed_ms", "at_fenced_ms")  # a failed pull's handover: until it gave up


@attrs.frozen
class Workload:
    """What `kvbridge chaos` sends: how many requests, how many at once, which faults, and its seed."""

    requests: int
    concurrency: int
    faults: list[str]
    max_tokens: int = 16
    hang_s: float = 180.0
    idle_gaps: int = 3
    gap_range: tuple[float, float] = (5.0, 90.0)
    seed: int = 0


def lengths(workload: Workload, max_model_len: int) -> list[int]:
    """From a few tokens to near max_model_len, spread log-uniformly (short prompts are the common case)."""
    rng = random.Random(workload.seed)
    top = max_model_len - workload.max_tokens - 2
    return [max(1, min(top, int(2 ** rng.uniform(1, (top).bit_length())))) for _ in range(workload.requests)]


# A kill or a drain is skipped unless another server of its role serves (Deployment.kill_and_restart, .drain): its
# request is sent once one does (a restarted server back, a drained one's replacement routed to), waiting at most this,
# and no longer than 10 s once nothing is on its way (Deployment.wait_spare).
ROLE_OF_FAULT = {
    "kill-prefill": "prefill",
    "drain-prefill": "prefill",
    "kill-decode": "decode",
    "drain-decode": "decode",
}
SPARE_WAIT_S = 300.0

# A drain-decode victim streams as many tokens as the model length leaves after a short prompt: long enough to be
# running when its decode is drained, so that the proxy moves it (--live-moves) rather than it finishing first.
MOVED_PROMPT = 64


class Runner:
    def __init__(
        self,
        dep: Deployment,
        workload: Workload,
        progress: Callable[[int], None] = lambda _n: None,
        network: NetworkFaults | None = None,
    ) -> None:
        import httpx

        self.dep, self.workload, self.progress, self.network = dep, workload, progress, network
        self.http = httpx.Client(timeout=httpx.Timeout(workload.hang_s, connect=10), trust_env=False)
        self.model = str(dep.model)
        self.injected: dict[str, int] = {}
        self._scale_outs = 0
        self._scaling: list[threading.Thread] = []  # scale-ins under way
        self.served: set[str] = set()  # the servers the proxy's answers named (x-kvbridge-prefill, -decode)
        self._lock = threading.Lock()

    def _count(self, fault: str) -> None:
        with self._lock:
            self.injected[fault] = self.injected.get(fault, 0) + 1

    def _served(self, headers: Any) -> str:
        prefill, decode = headers.get("x-kvbridge-prefill", "?"), headers.get("x-kvbridge-decode", "?")
        with self._lock:
            self.served.update((prefill, decode))
        return f"{prefill} -> {decode}"

    def scale(self, event: str) -> None:
        """Play a scale-out or scale-in between requests; before a scale-in (or a "join"), wait for servers starting."""
        dep = self.dep
        if event in ("scale-in", "join"):
            deadline = time.monotonic() + 900
            while dep.joining() and time.monotonic() < deadline:
                time.sleep(1)  # requests in flight go on; the next waits for the join
        if event == "scale-out":
            # decode first, then prefill; the count is taken when the proxy routes to it (Deployment.joined)
            role = "kv_consumer" if self._scale_outs % 2 == 0 else "kv_producer"
            self._scale_outs += 1
            dep.scale_out(role)
        elif event == "scale-in":
            thread = threading.Thread(target=self._scale_in, daemon=True, name=f"scale-in-{len(self._scaling)}")
            self._scaling.append(thread)
            thread.start()

    def _scale_in(self) -> None:
        """Drain a scaled-out server once it took traffic (bounded), else one of the role with the most servers."""
        dep = self.dep
        extras = [j.server for j in dep.joined if j.fault == "scale-out"]
        extras = [s for s in extras if s in dep.prefill or s in dep.decode]
        deadline = time.monotonic() + 120
        while extras and not any(s.url in self.served for s in extras) and time.monotonic() < deadline:
            time.sleep(0.5)  # the requests sent meanwhile reach it
        candidates = sorted(extras, key=lambda s: s.url not in self.served)
        # drain() refuses one unless another server of its role serves
        candidates += sorted(
            [*dep.prefill, *dep.decode], key=lambda s: -len(dep.prefill if s in dep.prefill else dep.decode)
        )
        if any(dep.drain(s, "scale-in", replace=False) for s in candidates):
            self._count("scale-in")

    def _moved_tokens(self) -> int:
        return max(self.workload.max_tokens, self.dep.max_model_len - MOVED_PROMPT - 2)

    def body(self, text: str, stream: bool, fault: str = "") -> dict:
        return {
            "model": self.model,
            "prompt": text,
            "max_tokens": self._moved_tokens() if fault == "drain-decode" else self.workload.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        }

    def expected(self, texts: list[str], faults: dict[int, str]) -> list[str]:
        assert self.dep.colocated is not None
        url = f"{self.dep.colocated.url}/v1/completions"

        def one(i: int) -> str:
            r = self.http.post(url, json=self.body(texts[i], False, faults.get(i, "")))
            r.raise_for_status()
            return r.json()["choices"][0]["text"]

        with ThreadPoolExecutor(self.workload.concurrency) as pool:
            return list(pool.map(one, range(len(texts))))

    def one(self, i: int, text: str, want: str, fault: str) -> Outcome:
        """Play request `i` (with its fault) and say how it ended."""
        role = ROLE_OF_FAULT.get(fault)
        if role is not None and not self.dep.wait_spare(role, SPARE_WAIT_S):
            log.warning("chaos: request %d: no second %s server serving or on its way for its %s", i, role, fault)
        t0 = time.monotonic()
        return attrs.evolve(self._play(i, text, want, fault, t0), sent_at=t0)

    def _play(self, i: int, text: str, want: str, fault: str, t0: float) -> Outcome:
        import httpx

        assert self.dep.proxy is not None
        url = f"{self.dep.proxy.url}/v1/completions"
        ttft = None
        n = len(text)
        if fault == "abort":
            try:  # gives up well before the first token could come
                self.http.post(url, json=self.body(text, True), timeout=httpx.Timeout(0.05, connect=10))
            except httpx.TimeoutException:
                pass
            self._count(fault)
            return Outcome(i, DROPPED, fault, prompt_tokens=n)
        if not fault and i % 2:
            # Every other clean request is answered whole: only such an answer carries the decode's pull
            # phases (a stream's headers leave before the pull is reported), so these measure the handover.
            return self.whole(i, text, want, url)
        if fault == "kill-prefill":
            victim = random.Random(i).choice(self.dep.prefill)
            threading.Timer(0.05, lambda: self.dep.kill_and_restart(victim) and self._count(fault)).start()
        if fault == "drain-prefill":
            victim = random.Random(i).choice(self.dep.prefill)
            threading.Timer(0.05, lambda: self.dep.drain(victim, fault, replace=True) and self._count(fault)).start()
        chunks: list[str] = []
        try:
            # One id through proxy and servers, so a request the report names can be found in their logs.
            headers = {"X-Request-Id": self.request_id(i)}
            with self.http.stream("POST", url, json=self.body(text, True, fault), headers=headers) as r:
                served = self._served(r.headers)
                if r.status_code != 200:
                    reason = r.read().decode(errors="replace").strip()
                    return Outcome(i, FAILED if reason else UNCLEAR, fault, r.status_code, reason, prompt_tokens=n)
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        break
                    if not line.startswith("data: "):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        reason = json.dumps(event["error"])[:300]
                        return Outcome(i, FAILED, fault, 200, reason, ttft, n)
                    if ttft is None:
                        ttft = time.monotonic() - t0
                        if fault == "disconnect":
                            self._count(fault)
                            return Outcome(i, DROPPED, fault, ttft_s=ttft, prompt_tokens=n)
                        if fault == "kill-decode":
                            victim = self.dep.by_url(r.headers.get("x-kvbridge-decode", ""))
                            if victim is not None and self.dep.kill_and_restart(victim):
                                self._count(fault)
                        if fault == "drain-decode":  # while this stream runs on it
                            victim = self.dep.by_url(r.headers.get("x-kvbridge-decode", ""))
                            if victim is not None and self.dep.drain(victim, fault, replace=True):
                                self._count(fault)
                    chunks.append(event["choices"][0]["text"])
                else:
                    return Outcome(i, FAILED, fault, 200, "stream ended without [DONE]", ttft, n)
        except httpx.TimeoutException as exc:
            return Outcome(i, HUNG, fault, None, f"no answer within {self.workload.hang_s}s: {exc!r}", ttft, n)
        except httpx.HTTPError as exc:
            return Outcome(i, FAILED, fault, None, f"connection lost: {exc!r}", ttft, n)
        got = "".join(chunks)
        return Outcome(
            i,
            MATCHED if got == want else DIFFERENT,
            fault,
            200,
            ""
            if got == want
            else f"{headers['X-Request-Id']} ({served}, {fault or 'no fault'}): got {got!r}, colocated {want!r}",
            ttft,
            n,
        )

    def request_id(self, i: int) -> str:
        """The `x-request-id` request `i` is sent with: one id through the proxy and the servers' logs."""
        return f"chaos-{self.workload.seed}-{i}"

    def whole(self, i: int, text: str, want: str, url: str) -> Outcome:
        """A non-streamed request: its answer, and its handover from the `x-kvbridge-timing` header."""
        import httpx

        n = len(text)
        request_id = self.request_id(i)
        try:
            r = self.http.post(url, json=self.body(text, False), headers={"X-Request-Id": request_id})
        except httpx.TimeoutException as exc:
            return Outcome(i, HUNG, "", None, f"no answer within {self.workload.hang_s}s: {exc!r}", prompt_tokens=n)
        except httpx.HTTPError as exc:
            return Outcome(i, FAILED, "", None, f"connection lost: {exc!r}", prompt_tokens=n)
        if r.status_code != 200:
            reason = r.text.strip()
            return Outcome(i, FAILED if reason else UNCLEAR, "", r.status_code, reason, prompt_tokens=n)
        handover = None
        with contextlib.suppress(ValueError):
            told = timeline.parse(r.headers.get(timeline.HEADER, ""))
            ended = [told.marks[m] for m in FAILED_MARKS if m in told.marks]
            if any(p in told.phases for p in HANDOVER_PHASES):
                handover = sum(told.phases.get(p, 0.0) for p in HANDOVER_PHASES) / 1e3
            elif ended:  # a pull that failed (its request recomputed) reports no phases, only when it gave up
                handover = max(ended) / 1e3
        try:
            got = r.json()["choices"][0]["text"]
        except (ValueError, KeyError, IndexError, TypeError):
            return Outcome(i, FAILED, "", 200, f"unusable answer: {r.text[:200]}", prompt_tokens=n, handover_s=handover)
        served = self._served(r.headers)
        reason = "" if got == want else f"{request_id} ({served}, whole answer): got {got!r}, colocated {want!r}"
        kind = MATCHED if got == want else DIFFERENT
        return Outcome(i, kind, "", 200, reason, prompt_tokens=n, handover_s=handover)

    def run(self) -> Report:
        workload, dep = self.workload, self.dep
        t0 = time.monotonic()
        faults = schedule(workload.faults, workload.requests, seed=workload.seed)
        sizes = lengths(workload, dep.max_model_len)
        sizes = [min(n, MOVED_PROMPT) if faults.get(i) == "drain-decode" else n for i, n in enumerate(sizes)]
        texts = [random_prompt(n, workload.seed * 100_003 + i) for i, n in enumerate(sizes)]
        wants = self.expected(texts, faults)
        scales = scaling(workload.faults, workload.requests)
        rng = random.Random(workload.seed + 1)
        gaps_at = set()
        if "idle-gap" in workload.faults and workload.idle_gaps:
            gaps_at = {workload.requests * (k + 1) // (workload.idle_gaps + 1) for k in range(workload.idle_gaps)}
        outcomes: list[Outcome] = []
        if self.network is not None:
            self.network.start()
        with contextlib.ExitStack() as stack, ThreadPoolExecutor(workload.concurrency) as pool:
            if self.network is not None:
                stack.callback(self.network.stop)  # healed before the drain, also when a request raised
            pending = []
            for i, text in enumerate(texts):
                if i in gaps_at:  # drain, then leave the engines idle: the gap is the fault
                    outcomes += [f.result() for f in pending]
                    pending = []
                    gap = rng.uniform(*workload.gap_range)
                    log.info("chaos: idle gap of %.1fs before request %d", gap, i)
                    time.sleep(gap)
                    self._count("idle-gap")
                if i in scales:
                    self.scale(scales[i])
                pending.append(pool.submit(self.one, i, text, wants[i], faults.get(i, "")))
                pending[-1].add_done_callback(lambda _f: self.progress(1))
                if len(pending) > workload.concurrency * 4:  # bounded queue: the gaps then fall where planned
                    outcomes.append(pending.pop(0).result())
            outcomes += [f.result() for f in pending]
        for thread in self._scaling:
            thread.join(timeout=180)  # each waits at most 120 s before its drain
        injected = dict(self.injected)
        if self.network is not None:
            injected.update(self.network.counts())
        report = Report(outcomes=sorted(outcomes, key=lambda o: o.index), faults_injected=injected)
        if self.network is not None:
            report.network = self.network.as_dict()
        self.drain(report)
        report.not_injected = not_injected(workload.faults, report.faults_injected)
        if report.not_injected:
            log.warning("chaos: asked for, never injected: %s", ", ".join(report.not_injected))
        report.elapsed_s = time.monotonic() - t0
        return report

    def drain(self, report: Report) -> None:
        """Wait (bounded) for restarts and leases to settle, then read what every server still holds."""
        dep = self.dep
        deadline = time.monotonic() + dep.lease_s + 120 + (dep.shutdown_timeout_s + 60 if dep.registry else 0)
        while dep.settling() and time.monotonic() < deadline:
            time.sleep(1)  # a restarted or joining server reports only once it is up; a drained one once it exited
        held: dict[str, float] = {}
        while time.monotonic() < deadline:
            held = {s.url: blocks_in_use(s) for s in dep.servers()}
            if not any(held.values()):
                break
            time.sleep(1)
        report.blocks_held = held
        for server in dep.servers():
            if held.get(server.url):
                report.holding[server.url] = why = holding(server)
                log.warning("chaos: %s still holds %g blocks: %s", server.url, held[server.url], why)
        for d in dep.drained:  # what its ranks logged holding as they closed (-1: no closing line, or still up)
            report.blocks_held[f"{d.server.url} (drained)"] = float(d.blocks)
        proxy_log = dep.proxy.log_path.read_text(errors="replace") if dep.proxy and dep.proxy.log_path.exists() else ""
        during = self.network.during if self.network is not None else (lambda _start, _end: [])
        server_logs = (p.read_text(errors="replace") for p in sorted(dep.logs.rglob("vllm-*.log")))
        pulls = slow_pulls(proxy_log, server_logs) if proxy_log else None
        all_run = [f for f in self.workload.faults if f in ALL_RUN]
        lost = lost_decodes(proxy_log)
        report.slowest_ttft = report.slowest(self.request_id, timings(proxy_log), during, pulls, all_run, lost)
        if dep.live_moves:  # streams the proxy moved off a draining decode, by outcome, and each moved request's moves
            report.live_moves = dep.proxy_counts("kvbridge_proxy_live_moves_total", "outcome")
            if proxy_log:
                report.moves = moves(proxy_log)
                report.name_moves(self.request_id)
        report.drained = [d.as_dict() for d in dep.drained]
        report.drains_unclean = sum(1 for d in dep.drained if not d.clean)
        report.joined = [
            {"url": j.server.url, "role": j.role, "fault": j.fault, "took_traffic": j.server.url in self.served}
            for j in dep.joined
        ]
        for j in dep.joined:
            if j.fault == "scale-out":
                report.faults_injected["scale-out"] = report.faults_injected.get("scale-out", 0) + 1
        report.restarts = dep.restarts
        report.stalls = [str(p) for p in sorted(dep.logs.rglob("stall-*.txt"))]  # beside each server's log
        for path in dep.log_files():
            report.leases_expired += path.read_text(errors="replace").count(" expired with ")
        report.retries = int(dep.counter("kvbridge_transfer_retries_total"))
        report.pulls_failed = int(dep.counter("kvbridge_transfer_failures_total"))
