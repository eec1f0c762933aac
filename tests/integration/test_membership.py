"""Elastic membership: records expire and are signed, the proxy follows joins, leaves and drains, orders drain.

With real redis and etcd (started on free ports, stopped by PID) and a real proxy on 127.0.0.1 in front of
small real HTTP upstreams (docs/elastic.md). With real vLLM servers: tests/e2e/test_vllm_elastic.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from control_helpers import wait_for

from kvbridge.base import wire
from kvbridge.base.errors import ConfigError
from kvbridge.control import RankRecord, open_registry
from kvbridge.control.discovery import ORDERS, DrainOrder, ServerRecord
from kvbridge.control.membership import Announcer
from kvbridge_proxy import app as proxy
from kvbridge_proxy import membership as proxy_membership
from kvbridge_proxy.members import StaticMembers, open_members
from kvbridge_tools.harness.pd_servers import Serving, Upstream

SECRET = secrets.token_hex(16)
OTHER = secrets.token_hex(16)


@pytest.fixture(params=["redis", "etcd"])
def store(request: pytest.FixtureRequest) -> Iterator[str]:
    """A store's URL, emptied of server records after the test."""
    url = request.getfixturevalue(f"{request.param}_url")
    yield url
    reg = open_registry(url)
    for server_id in IDS:
        reg.withdraw(server_id)
        reg._delete(f"{ORDERS}{server_id}")
    reg.close()


IDS = ("good", "forged", "unsigned", "stale", "once", "srv", "d1", "d2")  # every server id these tests write


def _record(server_id: str, role: str = "decode", url: str = "http://127.0.0.1:1", **kw: object) -> ServerRecord:
    return ServerRecord(server_id, role, url, expires=time.time() + 600, **kw)  # type: ignore[arg-type]


def test_records_are_signed_and_a_forged_or_unsigned_one_is_ignored_and_logged(
    store: str, caplog: pytest.LogCaptureFixture
) -> None:
    ours, forger, plain = (open_registry(store, secret=s) for s in (SECRET, OTHER, None))
    try:
        ours.announce(_record("good"), ttl_s=60)
        forger.announce(_record("forged"), ttl_s=60)
        plain.announce(_record("unsigned"), ttl_s=60)
        with caplog.at_level(logging.WARNING, logger="kvbridge.control.discovery"):
            assert [r.server_id for r in ours.servers()] == ["good"]
        assert "kvbridge/servers/forged" in caplog.text and "MAC is bad" in caplog.text
        assert "kvbridge/servers/unsigned" in caplog.text and "carries no MAC" in caplog.text
        # a record edited in the store (draining -> serving, another URL) no longer matches its MAC
        assert ours.servers()[0].mac and ours.servers()[0].state == "serving"
        # rank records too
        forger.publish(RankRecord("eng", 0, "127.0.0.1", 9, ready=True))
        ours.publish(RankRecord("eng", 1, "127.0.0.1", 10, ready=True))
        assert ours.lookup("eng", 0) is None and [r.rank for r in ours.ranks("eng")] == [1]
        assert plain.lookup("eng", 0) is not None  # no secret: a trusted network, everything taken
        ours.remove("eng", 0)
        ours.remove("eng", 1)
    finally:
        for reg in (ours, forger, plain):
            reg.close()


ANNOUNCER_ALONE = """
import logging, os, signal, sys, threading, time
from kvbridge.control import open_registry
from kvbridge.control.discovery import ServerRecord
from kvbridge.control.membership import Announcer

logging.basicConfig(level=logging.INFO)
record = ServerRecord("srv", "decode", "http://127.0.0.1:1", expires=0.0)
announcer = Announcer(open_registry(sys.argv[1], secret=sys.argv[2]), record, ttl_s=1.5)
first = announcer.record.expires
while announcer.record.expires == first:  # its renewal loop runs: its next renewal is due within 0.5 s
    time.sleep(0.01)
renewing = next(t for t in threading.enumerate() if t.name.startswith("kvbridge-announce"))

def in_its_wait():  # back in the wait between renewals: the renewal call (the store's round trip) returned
    frame, names = sys._current_frames().get(renewing.ident), []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return names[:3] == ["wait", "wait", "_loop"]

deadline = time.monotonic() + 10
while not in_its_wait() and time.monotonic() < deadline:
    time.sleep(0.001)
print("stopping", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)  # the whole process, while its renewal waits: not inside the store's call
time.sleep(30)
"""


def test_an_announcer_not_run_on_time_says_its_record_was_renewed_late(store: str, tmp_path: Path) -> None:
    """Issue 42: a server not run for longer than its renewal period (SIGSTOP, as a starved host) logs it.

    With how long its record had left, so that a lapse the proxy saw has its cause in the server's log."""
    script = tmp_path / "announcer.py"
    script.write_text(ANNOUNCER_ALONE)
    proc = subprocess.Popen(
        [sys.executable, str(script), store, SECRET], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert proc.stdout is not None
        while proc.stdout.readline().strip() != "stopping":  # after the log lines before it (a dead child: EOF, "")
            assert proc.poll() is None
        # It stops itself while its renewal waits. A stop that lands inside the renewal's call to the store is not a
        # late renewal but a stalled one, which the stall watchdog reports instead.
        wait_for(lambda: Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T", what="stop")
        time.sleep(1.0)  # renewals every 0.5 s: this one comes 1 s late
        os.kill(proc.pid, signal.SIGCONT)
        lines = []
        deadline = time.monotonic() + 30
        while not any("renewed" in line for line in lines) and time.monotonic() < deadline:
            lines.append(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
    [late] = [line for line in lines if "renewed" in line]
    assert re.search(r"server srv: its record renewed \d+\.\d s late, -?\d+\.\d s before it would have lapsed", late), (
        late
    )


def test_a_record_no_longer_renewed_expires_in_the_store_and_a_stale_one_is_ignored_on_read(store: str) -> None:
    reg = open_registry(store, secret=SECRET)
    try:
        reg.announce(_record("once"), ttl_s=1)  # announced once, then the server died
        reg.announce(ServerRecord("stale", "decode", "http://127.0.0.1:2", expires=time.time() - 1), ttl_s=600)
        assert [r.server_id for r in reg.servers()] == ["once"]  # the stale one is kept by the store, not used
        wait_for(lambda: not reg.servers(), timeout=30, what="the unrenewed record to expire")
    finally:
        reg.close()


def test_announcer_renews_drains_and_withdraws(store: str) -> None:
    reg = open_registry(store, secret=SECRET)
    announcer = Announcer(open_registry(store, secret=SECRET), _record("srv", role="prefill"), ttl_s=1.5)
    try:
        first = reg.servers()
        assert [(r.server_id, r.role, r.state) for r in first] == [("srv", "prefill", "serving")]
        # renewed: a later expiry, so it outlives its first TTL
        wait_for(lambda: reg.servers() and reg.servers()[0].expires > first[0].expires, what="a renewal")
        wait_for(lambda: time.time() > first[0].expires + 0.5, what="the first TTL to pass")
        assert [r.server_id for r in reg.servers()] == ["srv"]
        announcer.drain()
        assert reg.servers()[0].draining
    finally:
        announcer.close()
        announcer.close()  # idempotent
    assert reg.servers() == []
    reg.close()


def test_static_file_and_bad_urls(tmp_path: Path) -> None:
    path = tmp_path / "servers.json"
    path.write_text(
        json.dumps(
            [{"role": "decode", "url": "http://a:1/"}, {"role": "prefill", "url": "http://b:2", "state": "draining"}]
        )
    )
    members = open_members(f"file://{path}")
    assert isinstance(members, StaticMembers)
    assert [(r.role, r.url, r.draining) for r in members.servers()] == [
        ("decode", "http://a:1/", False),
        ("prefill", "http://b:2", True),
    ]
    path.write_text(json.dumps([{"role": "colocated", "url": "http://a:1"}]))
    with pytest.raises(ConfigError, match="entry 0"):
        members.servers()
    with pytest.raises(ConfigError, match="no registry"):
        open_members("p2p")
    with pytest.raises(ConfigError, match="registry_ttl_s"):
        Announcer(open_members(str(path)), _record("x"), ttl_s=0.1)  # type: ignore[arg-type]


class RunningProxy(Serving):
    """`kvbridge proxy` with a registry, its health loop running (uvicorn runs its lifespan)."""

    def __init__(self, prefill: list[str], decode: list[str], registry: str) -> None:
        self.app = proxy.create_app(
            prefill, decode, health_interval=0.05, registry=registry, expose_internals=True, warm_up=False
        )
        super().__init__(self.app)

    def instances(self) -> dict:
        return httpx.get(f"{self.url}/instances", timeout=10).json()

    def next_rounds(self, n: int = 2) -> None:
        """Wait until the proxy has read the registry `n` more times: what was written before is seen."""
        start = self.instances()["registry_rounds"]
        wait_for(lambda: self.instances()["registry_rounds"] >= start + n, what="registry reads")

    def urls(self, role: str) -> list[tuple[str, bool]]:
        return [(i["url"], i["draining"]) for i in self.instances()[role]]

    def complete(self) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/completions", json={"model": "tiny", "prompt": "hi"}, timeout=30)


def test_proxy_follows_joins_drains_leaves_and_ignores_forged_records(
    store: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KVBRIDGE_SECRET", SECRET)
    with (
        Upstream("prefill") as prefill,
        Upstream("decode") as d1,
        Upstream("decode") as d2,
        Upstream("decode") as forged_target,
        RunningProxy([prefill.url], [], store) as px,
        caplog.at_level(logging.WARNING),
    ):
        px.next_rounds()
        assert px.urls("decode") == [] and px.complete().status_code == 503  # nothing to decode yet
        a1 = Announcer(open_registry(store, secret=SECRET), _record("d1", url=d1.url, capacity=64), ttl_s=30)
        a2 = Announcer(open_registry(store, secret=SECRET), _record("d2", url=d2.url), ttl_s=30)
        forger = open_registry(store, secret=OTHER)
        forger.announce(_record("forged", url=forged_target.url), ttl_s=60)
        try:
            px.next_rounds()
            assert sorted(px.urls("decode")) == sorted([(d1.url, False), (d2.url, False)])  # joined, not forged
            assert "MAC is bad" in caplog.text
            served = {px.complete().headers["x-kvbridge-decode"] for _ in range(4)}
            assert served == {d1.url, d2.url} and not forged_target.bodies
            a1.drain()
            px.next_rounds()
            assert (d1.url, True) in px.urls("decode")
            before = len(d1.bodies)
            assert {px.complete().headers["x-kvbridge-decode"] for _ in range(4)} == {d2.url}
            assert len(d1.bodies) == before  # a draining server gets nothing new
            a1.close()  # left
            px.next_rounds()
            assert px.urls("decode") == [(d2.url, False)]
            # a server that stops renewing: its record expires; it is kept while it answers health probes (its
            # announcer may only be late), and drops out once it does not (a crash)
            a2._stop.set()  # the renewal thread ends; nothing withdraws the record
            reg = open_registry(store, secret=SECRET)
            reg.announce(a2.record, ttl_s=1)
            reg.close()
            wait_for(lambda: "its record lapsed" in caplog.text, timeout=30, what="the record to lapse")
            assert px.urls("decode") == [(d2.url, False)]
            assert px.complete().headers["x-kvbridge-decode"] == d2.url  # routed to as before
            d2.__exit__()  # the crash: it refuses connections
            wait_for(lambda: px.urls("decode") == [], timeout=30, what="the silent server to drop out")
            assert px.complete().status_code == 503
            assert px.urls("prefill") == [(prefill.url, False)]  # the static one stays
        finally:
            a1.close()
            a2.close()
            forger.close()


def test_a_healthy_server_whose_record_lapsed_stays_for_the_grace_and_one_renewed_late_stays_on(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A record that lapses while its server answers health probes (its announcer was late) does not take it out yet.

    Renewed within LAPSE_GRACE_S, the server simply stays; not renewed, it leaves once the grace is over."""
    monkeypatch.setenv("KVBRIDGE_SECRET", SECRET)
    monkeypatch.setattr(proxy_membership, "LAPSE_GRACE_S", 60.0)
    with (
        Upstream("prefill") as prefill,
        Upstream("decode") as d1,
        RunningProxy([prefill.url], [], redis_url) as px,
        caplog.at_level(logging.WARNING),
    ):
        reg = open_registry(redis_url, secret=SECRET)
        try:
            record = _record("d1", url=d1.url)
            reg.announce(record, ttl_s=1)
            wait_for(lambda: px.urls("decode") == [(d1.url, False)], timeout=30, what="the join")
            wait_for(lambda: "its record lapsed" in caplog.text, timeout=30, what="the lapse")
            reg.announce(record, ttl_s=60)  # renewed late
            wait_for(lambda: "its record is back" in caplog.text, timeout=30, what="the record back")
            assert px.urls("decode") == [(d1.url, False)]
            monkeypatch.setattr(proxy_membership, "LAPSE_GRACE_S", 1.0)
            reg.withdraw("d1")
            wait_for(lambda: px.urls("decode") == [], timeout=30, what="the grace to end")
        finally:
            reg.withdraw("d1")
            reg.close()
    said = [(r.created, r.getMessage()) for r in caplog.records if d1.url in r.getMessage()]
    lapsed = [t for t, m in said if "its record lapsed" in m]
    out = [t for t, m in said if "left the registry" in m]
    assert not any("joined" in m for _, m in said[1:]), said  # it never left before the end
    assert len(lapsed) == 2 and len(out) == 1 and out[0] - lapsed[1] >= 1.0, said


def test_a_join_is_seen_while_a_health_round_is_still_probing(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that joins is routed to while a health round still waits on a slow server's /health.

    The registry is read apart from the health rounds, which grow with the deployment (a round probes every server)."""
    monkeypatch.setenv("KVBRIDGE_SECRET", SECRET)
    monkeypatch.setattr(proxy_membership, "PROBE_TIMEOUT_S", 60.0)  # the slow probe outlasts the test
    with (
        socket.create_server(("127.0.0.1", 0)) as silent,  # takes connections, never answers
        Upstream("decode") as joining,
        RunningProxy([f"http://127.0.0.1:{silent.getsockname()[1]}"], [], redis_url) as px,
    ):
        silent.settimeout(30)
        probe, _ = silent.accept()  # the first health round is probing it, and waits for an answer
        announcer = Announcer(open_registry(redis_url, secret=SECRET), _record("d1", url=joining.url), ttl_s=30)
        try:
            wait_for(lambda: px.urls("decode") == [(joining.url, False)], timeout=30, what="the join")
            assert px.instances()["health_rounds"] == 0  # the first round is still waiting on the slow probe
        finally:
            announcer.close()
            probe.close()


def test_proxy_without_servers_or_registry_is_refused() -> None:
    with pytest.raises(ConfigError, match="--registry"):
        proxy.create_app([], ["http://127.0.0.1:1"])


def test_an_ignored_record_is_warned_of_once(redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    ours, forger = open_registry(redis_url, secret=SECRET), open_registry(redis_url, secret=OTHER)
    try:
        forger.announce(_record("forged"), ttl_s=60)
        with caplog.at_level(logging.WARNING, logger="kvbridge.control.discovery"):
            for _ in range(3):  # the proxy reads every round
                assert ours.servers() == []
        assert caplog.text.count("kvbridge/servers/forged") == 1
    finally:
        forger.withdraw("forged")
        ours.close()
        forger.close()


def _rounds(announcer: Announcer, n: int = 2) -> None:
    """Wait until `announcer` has renewed `n` more times: an order written before has been looked for."""
    for _ in range(n):
        last = announcer.record.expires
        wait_for(lambda last=last: announcer.record.expires > last, what="a renewal round")


def test_a_drain_order_reaches_its_server_only_and_a_forged_unsigned_or_stale_one_is_ignored_and_logged(
    store: str, caplog: pytest.LogCaptureFixture
) -> None:
    ordered: list[str] = []
    announcers = [
        Announcer(open_registry(store, secret=SECRET), _record(i, url=f"http://127.0.0.1:{n}"), ttl_s=1.5)
        for n, i in ((1, "srv"), (2, "d1"))
    ]
    for a in announcers:
        a.on_order = lambda a=a: (ordered.append(a.record.server_id), a.drain())  # what SigtermDrain starts with
    ours, forger, plain = (open_registry(store, secret=s) for s in (SECRET, OTHER, None))
    stale = ours.sealer.seal(DrainOrder("srv", expires=time.time() - 1))  # signed, but past its expiry
    try:
        with caplog.at_level(logging.WARNING, logger="kvbridge.control.discovery"):
            for write, why in [
                (lambda: forger.order_drain("srv", 60), "MAC is bad"),
                (lambda: plain.order_drain("srv", 60), "carries no MAC"),
                (lambda: ours._put(f"{ORDERS}srv", wire.encode(stale), 60), "has expired"),
            ]:
                caplog.clear()
                write()
                _rounds(announcers[0])
                assert ordered == [] and f"DrainOrder at {ORDERS}srv" in caplog.text and why in caplog.text
                ours._delete(f"{ORDERS}srv")
        out = _kvbridge("drain", "http://127.0.0.1:1", "--registry", store, "--json", secret=SECRET)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == [
            {"server_id": "srv", "role": "decode", "url": "http://127.0.0.1:1", "state": "draining"}
        ]
        _rounds(announcers[1])
        assert ordered == ["srv"] and not announcers[1].record.draining  # the other server was not ordered
        assert ours._get(f"{ORDERS}srv") is None  # taken: a server restarted under that id is not drained by it
    finally:
        for reg in (*announcers, ours, forger, plain):
            reg.close()


def test_a_drain_order_is_taken_once_and_written_back_drains_neither_its_server_nor_a_restarted_one(
    store: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An order names its server's run (`incarnation`, random per `Announcer`): a copy of a taken one is ignored."""
    ordered: list[str] = []
    ours = open_registry(store, secret=SECRET)
    first = Announcer(open_registry(store, secret=SECRET), _record("srv"), ttl_s=1.5)
    first.on_order = lambda: ordered.append("first")
    restarted: Announcer | None = None
    try:
        order = ours.order_drain("srv", 60, first.record.incarnation)
        wait_for(lambda: ordered == ["first"], what="the order to be taken")
        assert ours._get(f"{ORDERS}srv") is None
        with caplog.at_level(logging.WARNING, logger="kvbridge.control.discovery"):
            ours._put(f"{ORDERS}srv", wire.encode(order), 60)  # the taken order, written back
            _rounds(first)
            assert ordered == ["first"], "the same run took an order twice"
            first.close()
            restarted = Announcer(open_registry(store, secret=SECRET), _record("srv"), ttl_s=1.5)
            restarted.on_order = lambda: ordered.append("restarted")
            assert restarted.record.incarnation != order.incarnation
            _rounds(restarted)
        assert ordered == ["first"] and "it is for another run" in caplog.text
        ours.order_drain("srv", 60, restarted.record.incarnation)  # an order for this run is taken
        wait_for(lambda: ordered == ["first", "restarted"], what="the restarted server's own order")
    finally:
        for a in (first, restarted, ours):
            if a is not None:
                a.close()


def _kvbridge(*args: str, secret: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVBRIDGE_SECRET")}
    env.update({"KVBRIDGE_SECRET": secret} if secret else {})
    return subprocess.run(
        [sys.executable, "-m", "kvbridge", *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_kvbridge_drain_lists_servers_and_refuses_an_unknown_one_or_an_unsigned_order_for_a_signed_one(
    store: str,
) -> None:
    reg = open_registry(store, secret=SECRET)
    reg.announce(_record("srv", role="prefill"), ttl_s=60)
    try:
        listed = _kvbridge("drain", "--list", "--registry", store, "--json", secret=SECRET)
        assert [(r["server_id"], r["state"]) for r in json.loads(listed.stdout)] == [("srv", "serving")], listed
        unknown = _kvbridge("drain", "nope", "--registry", store, secret=SECRET)
        assert unknown.returncode == 2 and "no server 'nope'" in unknown.stderr and "srv (prefill" in unknown.stderr
        assert "Traceback" not in unknown.stderr
        unsigned = _kvbridge("drain", "srv", "--registry", store, secret=None)
        assert (
            unsigned.returncode == 2 and "record is signed" in unsigned.stderr and "KVBRIDGE_SECRET" in unsigned.stderr
        )
        assert reg._get(f"{ORDERS}srv") is None  # nothing written
        # an order no server takes: the command says so once it expires
        silent = _kvbridge("drain", "srv", "--registry", store, "--ttl", "1", secret=SECRET)
        assert silent.returncode == 1 and "did not start draining" in silent.stderr
    finally:
        reg.close()


# Its handlers only record the signal. A threading.Event set in a signal handler takes the Event's lock, which the main
# thread holds for a moment in each of its own waits on that Event: a signal handled in that moment hangs the process
# for good. A CI run's "server" hung so, its engine drained and its SIGTERM sent (its main thread polled
# `got.wait(0.05)`).
ENGINE_TREE = """
import logging, multiprocessing, signal, sys, time
from kvbridge.control import open_registry
from kvbridge.control.discovery import ServerRecord
from kvbridge.control.membership import Announcer, SigtermDrain

def wait(flag, seconds):
    deadline = time.monotonic() + seconds
    while not flag and time.monotonic() < deadline:
        time.sleep(0.02)

def engine(url, secret, up):
    logging.basicConfig(level=logging.INFO)
    stopped = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopped.append(signum))  # as vLLM's: records it, the loop ends
    record = ServerRecord("srv", "prefill", "http://127.0.0.1:1", expires=0.0)
    # renewed every 2 s: a renewal 1-3 s late on a loaded box (the watchdog's dumps show such beats) lapsed a 1.5 s
    # record between the test's look and its drain order
    announcer = Announcer(open_registry(url, secret=secret), record, ttl_s=6.0)
    drain = SigtermDrain(announcer, grace_s=0.5)
    print("engine up", flush=True)
    open(up, "w").close()  # its SIGTERM handler is the drain's from now on
    wait(stopped, 120)
    drain.close()
    announcer.close()
    print("engine stopped:", bool(stopped), flush=True)

if __name__ == "__main__":
    got = []
    signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    child = multiprocessing.get_context("spawn").Process(target=engine, args=sys.argv[1:])
    child.start()
    while not got and child.is_alive():
        time.sleep(0.05)
    print("server got SIGTERM:", bool(got), flush=True)
    child.terminate()  # as vLLM's API server stops its engine core
    child.join(60)
    print("engine exit code:", child.exitcode, flush=True)
"""


@pytest.mark.parametrize("how", ["kvbridge drain", "SIGTERM"])
def test_an_engine_drains_on_an_order_as_on_its_server_s_sigterm(store: str, tmp_path: Path, how: str) -> None:
    """Ordered, or its server sent SIGTERM, an engine marks itself draining and, after the grace, stops.

    The engine is a multiprocessing child of its server, as vLLM's engine core is of its API server: an order ends with
    the engine sending its server SIGTERM, which the server passes back, as an operator's SIGTERM is passed."""
    script = tmp_path / "tree.py"
    script.write_text(ENGINE_TREE)
    reg = open_registry(store, secret=SECRET)
    up = tmp_path / "engine-up"
    argv = [sys.executable, str(script), store, SECRET, str(up)]
    # a session of its own: a failed run's engine, orphaned, is killed with its group below
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        # up, not only announced: a SIGTERM before the drain's handler was the engine's own, which does not drain
        wait_for(up.exists, what="the engine up")
        assert [r.server_id for r in reg.servers()] == ["srv"]
        if how == "SIGTERM":
            proc.send_signal(signal.SIGTERM)  # to the server, as systemd or Kubernetes would
        else:
            out = _kvbridge("drain", "srv", "--registry", store, secret=SECRET)
            assert out.returncode == 0 and "draining" in out.stdout, out.stderr
        output, _ = proc.communicate(timeout=60)
        assert reg.servers() == []  # withdrawn as the engine stopped
    finally:
        if proc.poll() != 0:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reg.close()
    assert proc.returncode == 0, output
    assert ("ordered to drain" in output) == (how == "kvbridge drain"), output
    steps = ["is draining", "draining: the engine shuts down", "engine stopped: True", "engine exit code: 0"]
    if how == "kvbridge drain":  # the engine's SIGTERM reached the server only after the grace
        steps.insert(2, "server got SIGTERM: True")
    assert "server got SIGTERM: True" in output and all(step in output for step in steps), output
    assert [output.index(step) for step in steps] == sorted(output.index(step) for step in steps), output
