"""The side channel over real ZeroMQ sockets on 127.0.0.1: readiness, leases, abort, auth."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from control_helpers import rank_info, wait_for

from kvbridge.base import wire
from kvbridge.base.errors import ConfigError, LoadError, PeerGone, ProtocolError, TransferTimeout
from kvbridge.base.watchdog import WATCHDOG
from kvbridge.control import ControlClient, ControlServer, LeaseState, Ledger
from kvbridge.control.auth import Authenticator
from kvbridge.control.channel import local_server
from kvbridge.control.client import ClientPool
from kvbridge.control.framing import new_frame
from kvbridge.control.messages import (
    Ack,
    BeginPull,
    Frame,
    GetInfo,
    LeaseStatus,
    Offer,
    Refused,
    RegisteredMemory,
    StreamStatus,
)
from kvbridge.session.early_offers import EarlyOffers
from kvbridge_tools.harness.ports import free_port
from kvbridge_tools.harness.proc import stop_all_threads

SECRET = "0123456789abcdef0123456789abcdef"


class Prefill:
    """A prefill rank's side channel with a ledger that records releases."""

    def __init__(self, *, secret: str | None = None, timeout_s: float = 60.0, ready: bool = True) -> None:
        self.released: list[tuple[str, LeaseState]] = []
        self.skew = 0.0  # added to the ledger's clock: a lease expires when a test says, not when the box gets to it
        self.ledger = Ledger(
            lambda lease, why: self.released.append((lease.request_id, why)),
            timeout_s=timeout_s,
            clock=lambda: time.monotonic() + self.skew,
        )
        self.server = ControlServer("prefill", 0, ledger=self.ledger, secret=secret, poll_interval_s=0.01)
        if ready:
            self.server.register(rank_info(), meta={"role": "prefill"})

    def client(self, **kw: object) -> ControlClient:
        return ControlClient(*self.server.address, sender="decode/0", **kw)  # type: ignore[arg-type]


@pytest.fixture
def closing() -> Iterator[list]:
    things: list = []
    yield things
    for t in reversed(things):
        if isinstance(t, subprocess.Popen):
            t.kill()
            t.wait()
        else:
            (t.server if isinstance(t, Prefill) else t).close()


def test_get_info_returns_registered_memory(closing: list) -> None:
    p = Prefill()
    c = p.client()
    closing += [p, c]
    assert c.get_info() == rank_info()  # the agent's RankInfo, typed, through the wire
    reply = c.registered_memory()
    assert (reply.engine_id, reply.rank, reply.ready, reply.meta) == ("prefill", 0, True, {"role": "prefill"})
    with pytest.raises(ConfigError, match="cannot serve the RankInfo"):
        p.server.register(rank_info("decode", 3))


def test_pull_before_ready_waits_bounded_then_fails_clearly(closing: list) -> None:
    p = Prefill(ready=False)
    c = p.client()
    closing += [p, c]
    p.ledger.offer("r1", [1], expected_pulls=1)
    with pytest.raises(TransferTimeout, match="has not registered its KV cache"):
        c.get_info(wait_s=0.2)
    with pytest.raises(TransferTimeout, match="not registered"):
        c.begin_pull("r1", "decode/0", wait_s=0.2)
    assert p.released == [], "a refused pull must not count as a DONE"


def test_pull_waits_for_a_peer_that_becomes_ready(closing: list) -> None:
    p = Prefill(ready=False)
    c = p.client()
    closing += [p, c]
    p.ledger.offer("r1", [1], expected_pulls=1)
    # The KV cache appears later (say, after a profiling run); the waiting pull then proceeds.
    registrar = threading.Timer(0.2, p.server.register, args=(rank_info(endpoint=b"E"),))
    registrar.start()
    try:
        status = c.begin_pull("r1", "decode/0", wait_s=30)
    finally:
        registrar.join()
    assert status.valid and status.blocks == (1,)
    assert c.get_info().endpoint == b"E"


def test_lease_pull_waits_for_an_offer_that_trails_the_params(closing: list) -> None:
    p = Prefill()
    c = p.client()
    closing += [p, c]
    with pytest.raises(LoadError, match="unknown"):
        c.begin_pull("late", "decode/0", wait_s=0.1)
    # The prefill worker offers a moment after the proxy already handed the params to decode.
    offerer = threading.Timer(0.2, p.ledger.offer, args=("late", [4], 1))
    offerer.start()
    try:
        status = c.begin_pull("late", "decode/0", wait_s=30)
    finally:
        offerer.join()
    assert status.valid and status.blocks == (4,)


def test_done_over_the_channel_releases_at_the_last_and_duplicates_are_harmless(closing: list) -> None:
    p = Prefill()
    c = p.client()
    closing += [p, c]
    p.ledger.offer("r1", [1, 2], expected_pulls=2)
    epoch = c.begin_pull("r1", "decode/0").epoch
    c.done("r1", "decode/0", epoch)
    c.done("r1", "decode/0", epoch)
    assert p.released == []
    assert c.done("r1", "decode/1", epoch).released
    assert c.done("r1", "decode/1", epoch).valid  # duplicate after the release
    assert p.released == [("r1", LeaseState.RELEASED)]
    with pytest.raises(LoadError, match="recompute"):
        c.done("r1", "decode/7", epoch)


def test_lease_expiry_by_the_server_reaper_then_done_is_a_load_error(closing: list) -> None:
    p = Prefill(timeout_s=0.2)
    c = p.client()
    closing += [p, c]
    p.ledger.offer("r1", [1], expected_pulls=1)
    epoch = c.begin_pull("r1", "decode/0").epoch
    wait_for(lambda: p.released == [("r1", LeaseState.EXPIRED)], what="lease expiry")
    assert c.query_lease("r1", epoch).state is LeaseState.EXPIRED
    with pytest.raises(LoadError, match="expired"):
        c.done("r1", "decode/0", epoch)
    with pytest.raises(LoadError, match="no active lease"):
        c.begin_pull("r1", "decode/1")


def test_abort_from_prefill_reaches_the_decode_rank(closing: list) -> None:
    p = Prefill()
    aborted: list[tuple[str, str, str]] = []
    decode = ControlServer("decode", 0, on_abort=lambda *a: aborted.append(a))
    c = p.client()
    closing += [p, decode, c]
    p.ledger.offer("r1", [1], expected_pulls=1)
    epoch = c.begin_pull("r1", "decode/0", notify=decode.address).epoch
    assert p.server.abort("r1", reason="client went away") == 1
    wait_for(lambda: aborted == [("r1", "prefill/0", "client went away")], what="abort at decode")
    assert p.released == [], "decode/0 began a pull: its read may still run"
    with pytest.raises(LoadError, match="aborted"):
        c.done("r1", "decode/0", epoch)
    assert p.released == [("r1", LeaseState.ABORTED)], "its DONE ended the read"


def test_abort_from_decode_frees_the_prefill_blocks_and_says_who_and_why(
    closing: list, caplog: pytest.LogCaptureFixture
) -> None:
    p = Prefill()
    decode = ControlServer("decode", 0)
    closing += [p, decode]
    p.ledger.offer("r1", [1], expected_pulls=2)
    with caplog.at_level(logging.INFO, logger="kvbridge.control"):
        assert decode.abort("r1", reason="stopped", peers=[p.server.address]) == 1
        wait_for(lambda: p.released == [("r1", LeaseState.ABORTED)], what="abort at prefill")
    # the prefill's log names the rank that ended the lease and its reason, not only the release
    assert any("request r1 aborted by decode/0: stopped" in r.getMessage() for r in caplog.records), caplog.text


def test_abort_to_a_vanished_peer_is_logged_not_raised(closing: list) -> None:
    decode = ControlServer("decode", 0, notify_timeout_s=0.2)
    gone = ControlServer("gone", 0)
    addr = gone.address
    gone.close()
    closing.append(decode)
    assert decode.abort("r1", peers=[addr]) == 1
    decode.close()  # drops the notification still waiting for its answer; must not raise


def test_aborts_queued_for_dead_peers_delay_neither_a_live_peer_nor_close(closing: list) -> None:
    # Each notification to a dead peer waits notify_timeout_s for its answer. They went through one FIFO of
    # two threads, so a live peer queued behind ten of them heard of its abort after five timeouts, and
    # close() waited for all of them.
    told: list[str] = []
    live = ControlServer("decode", 0, on_abort=lambda rid, _origin, _why: told.append(rid))
    prefill = ControlServer("prefill", 0, notify_timeout_s=1.0)
    closing += [live, prefill]
    dead = [("127.0.0.1", free_port(span=1)) for _ in range(3)]
    for i in range(10):
        prefill.abort(f"old{i}", peers=dead)
    began = time.monotonic()
    prefill.abort("live", peers=[live.address])
    wait_for(lambda: told == ["live"], timeout=10, what="the live peer to hear of its abort")
    assert time.monotonic() - began < 0.9, "the live peer waited behind the dead ones"
    began = time.monotonic()
    prefill.close()
    assert time.monotonic() - began < 1.5, "close() waited for the notifications to dead peers"


def test_auth_peer_without_the_secret_is_refused(closing: list) -> None:
    p = Prefill(secret=SECRET)
    plain, wrong = p.client(), p.client(secret="another-secret-of-32-bytes-long!")
    closing += [p, plain, wrong]
    with pytest.raises(ProtocolError, match="requires the shared secret"):
        plain.get_info()
    with pytest.raises(ProtocolError, match="bad MAC"):
        wrong.get_info()
    good = p.client(secret=SECRET)
    closing.append(good)
    assert good.get_info() == rank_info()


def test_auth_client_refuses_an_unauthenticated_server(closing: list) -> None:
    p = Prefill()  # no secret
    c = p.client(secret=SECRET)
    closing += [p, c]
    with pytest.raises(ProtocolError, match="unauthenticated"):
        c.get_info()


def test_auth_replayed_and_stale_frames_are_refused(closing: list) -> None:
    p = Prefill(secret=SECRET)
    closing.append(p)
    auth = Authenticator(SECRET)
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect("tcp://{}:{}".format(*p.server.address))
    try:

        def ask(frame: Frame) -> object:
            sock.send(wire.encode(frame))
            reply = wire.decode(sock.recv(), Frame)
            return wire.decode(reply.body, Refused if reply.kind == "Refused" else RegisteredMemory)

        fresh = auth.seal(new_frame("GetInfo", "decode/0", wire.encode(GetInfo())))
        assert ask(fresh).ready
        replayed = ask(fresh)
        assert isinstance(replayed, Refused) and "replayed" in replayed.message
        stale = auth.seal(
            Frame(
                kind="GetInfo", sender="decode/0", nonce=b"n" * 16, ts=time.time() - 3600, body=wire.encode(GetInfo())
            )
        )
        refused = ask(stale)
        assert isinstance(refused, Refused) and "window" in refused.message
    finally:
        sock.close()


def test_auth_short_secret_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        ControlServer("x", 0, secret="short")


@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_a_side_channel_on_ipv6_loopback_serves_an_authenticated_peer(closing: list, host: str) -> None:
    """ZeroMQ speaks IPv4 unless a socket is told otherwise: without IPV6, binding [::1] fails (no such device)."""
    ledger = Ledger(lambda lease, why: None, timeout_s=60)
    server = ControlServer("prefill", 0, ledger=ledger, host=host, secret=SECRET)
    closing.append(server)
    server.register(rank_info())
    ledger.offer("r6", [1, 2], expected_pulls=1)
    assert server.address[0] == host and server._sock.getsockopt(zmq.IPV6) == 1
    client = ControlClient(host, server.address[1], secret=SECRET, sender="decode/0", timeout_s=10)
    closing.append(client)
    assert client.get_info() == rank_info() and client.url == f"tcp://[::1]:{server.address[1]}"
    assert client.begin_pull("r6", "decode/0", blocks=[1]).valid
    v4 = ControlServer("prefill", 1, host="127.0.0.1")  # an IPv4 address or a name keeps ZeroMQ's default
    closing.append(v4)
    assert v4._sock.getsockopt(zmq.IPV6) == 0


def test_bind_conflict_is_a_clear_error(closing: list) -> None:
    first = ControlServer("a", 0)
    closing.append(first)
    with pytest.raises(ConfigError, match="cannot bind"):
        ControlServer("b", 0, port=first.address[1])


def test_client_times_out_on_a_silent_address(closing: list) -> None:
    gone = ControlServer("gone", 0)
    addr = gone.address
    gone.close()
    c = ControlClient(*addr, timeout_s=0.2)
    closing.append(c)
    with pytest.raises(TransferTimeout, match="did not answer GetInfo"):
        c.get_info()


# A registered rank's side channel in a process of its own, on 127.0.0.1; it prints its port.
SERVE = (
    "import time; from control_helpers import rank_info; from kvbridge.control import ControlServer; "
    "s = ControlServer('prefill', 0); s.register(rank_info()); print(s.address[1], flush=True); time.sleep(600)"
)


def test_a_request_to_a_rank_whose_process_died_fails_at_once_and_a_stopped_one_times_out(closing: list) -> None:
    # A killed rank's connection closes and each reconnection is refused; ZeroMQ hides both from a REQ socket, so a
    # BeginPull to a SIGKILLed prefill waited its whole timeout (5.1 s in a chaos run) before the pull could fail.
    def serve() -> tuple[subprocess.Popen, int]:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}  # control_helpers
        proc = subprocess.Popen([sys.executable, "-c", SERVE], stdout=subprocess.PIPE, text=True, env=env)
        closing.append(proc)  # killed by its PID below (and by the fixture where the test fails first)
        assert proc.stdout is not None
        return proc, int(proc.stdout.readline())

    killed, port = serve()
    pooled = ControlClient("127.0.0.1", port, timeout_s=30.0)
    closing.append(pooled)
    assert pooled.get_info().rank == 0  # answered: its socket is connected and pooled
    # A slow answer (the rank stopped for a moment) has its connection watched, and its socket goes back to the pool:
    # the next slow request on it is watched again.
    stop_all_threads(killed.pid)
    resume = threading.Timer(1.0, killed.send_signal, args=(signal.SIGCONT,))
    resume.start()
    assert pooled.get_info().rank == 0
    resume.join()
    killed.kill()
    killed.wait()
    began = time.monotonic()
    with pytest.raises(PeerGone, match="before it answered GetInfo: nothing serves there now"):
        pooled.get_info()
    assert time.monotonic() - began < 10.0, "the request waited for its 30 s timeout"
    assert pooled.silent  # what the pull's release path reads: the rank did not answer
    fresh = ControlClient("127.0.0.1", port, timeout_s=30.0)  # never connected: refused
    closing.append(fresh)
    with pytest.raises(PeerGone, match="refused the connection .*, or the address is wrong"):
        fresh.get_info()

    # A stopped rank keeps its connection: nothing tells a stalled peer from a slow one but the timeout.
    stopped, port = serve()
    client = ControlClient("127.0.0.1", port, timeout_s=1.0)
    closing.append(client)
    assert client.get_info().rank == 0
    stop_all_threads(stopped.pid)  # every thread stopped, not merely signalled: a loaded box may still run one
    try:
        with pytest.raises(TransferTimeout, match="did not answer GetInfo within 1.0s"):
            client.get_info()
    finally:
        stopped.send_signal(signal.SIGCONT)


def test_a_begin_pull_called_off_stops_waiting_for_a_peer_that_never_answers(closing: list) -> None:
    # A stopped prefill engine takes the BeginPull (its kernel and ZeroMQ's I/O thread do) and never answers; the
    # decode that dropped the request calls its wait off instead of sitting out the control timeout.
    mute = zmq.Context.instance().socket(zmq.REP)
    mute.setsockopt(zmq.LINGER, 0)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    closing.append(mute)
    c = ControlClient("127.0.0.1", port, sender="decode/0", receiver="prefill/0", timeout_s=10.0)
    closing.append(c)
    cancelled = threading.Event()
    raised: list[BaseException] = []

    def begin() -> None:
        try:
            c.begin_pull("r1", "decode/0", wait_s=10.0, cancelled=cancelled)
        except BaseException as exc:
            raised.append(exc)

    t = threading.Thread(target=begin)
    t.start()
    assert mute.poll(10_000, zmq.POLLIN), "the BeginPull never reached the peer"
    cancelled.set()
    t.join(timeout=30)
    assert not t.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], LoadError), raised
    assert raised[0].cause == "cancelled" and "called off" in str(raised[0])
    assert c.silent  # a release owed to it waits until it answers


def test_begin_pull_before_the_offer_is_held_and_answered_when_it_lands(closing: list) -> None:
    # The decode's BeginPull can arrive before the prefill engine's step offers the request: the server
    # holds it and answers as the offer lands, so the client sends one request and never polls.
    p = Prefill()
    c = p.client()
    closing += [p, c]
    replies: list = []
    asker = threading.Thread(target=lambda: replies.append(c.request(BeginPull("r1", "decode/0", wait_ms=30_000))))
    asker.start()
    wait_for(lambda: p.server._held.nparked == 1, what="the BeginPull to be held")
    assert replies == [], "no answer before the offer"
    p.ledger.offer("r1", [4, 5], expected_pulls=1)  # the engine step's offer, from another thread
    asker.join(timeout=30)
    [status] = replies
    assert isinstance(status, LeaseStatus) and status.valid and status.blocks == (4, 5)
    assert status.waited_ms > 0 and p.server._held.nparked == 0
    # Through the client API the wait is reported too, and the lease works as before.
    assert c.done("r1", "decode/0", status.epoch).released


def test_held_begin_pulls_are_looked_at_when_their_offer_lands_not_on_every_message(
    closing: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Many decodes waiting on one prefill's offers at once: each message the server answered looked at every held
    # BeginPull (a lease lookup each), a cost of messages x held, which grows with the square of the decodes waiting.
    p = Prefill()
    closing.append(p)
    looks: list[str] = []
    state = p.ledger.state
    monkeypatch.setattr(p.ledger, "state", lambda rid: looks.append(rid) or state(rid))
    clients = [p.client(timeout_s=60) for _ in range(8)]  # held until the test offers: no deadline to race
    closing += clients
    replies: list = []
    askers = [
        threading.Thread(
            target=lambda c=c, i=i: replies.append(c.request(BeginPull(f"r{i}", "decode/0", wait_ms=30_000)))
        )
        for i, c in enumerate(clients)
    ]
    for t in askers:
        t.start()
    wait_for(lambda: p.server._held.nparked == 8, what="the BeginPulls to be held")
    looks.clear()
    other = p.client()
    closing.append(other)
    for _ in range(20):  # messages about nothing held
        other.get_info()
    assert looks == [], "no held BeginPull is looked at for a message that is not its offer"
    p.ledger.offer("r3", [1], expected_pulls=1)
    wait_for(lambda: len(replies) == 1, what="the offered request's BeginPull to be answered")
    assert set(looks) == {"r3"} and p.server._held.nparked == 7
    for i in range(8):
        if i != 3:
            p.ledger.offer(f"r{i}", [1], expected_pulls=1)
    for t in askers:
        t.join(timeout=30)
    assert len(replies) == 8 and all(r.valid for r in replies) and p.server._held.nparked == 0


def test_begin_pull_held_for_an_offer_that_never_comes_answers_unknown(closing: list) -> None:
    p = Prefill()
    c = p.client()
    closing += [p, c]
    status = c.request(BeginPull("never", "decode/0", wait_ms=50))
    assert isinstance(status, LeaseStatus) and status.state is LeaseState.UNKNOWN and not status.valid
    assert status.waited_ms >= 50 and p.server._held.nparked == 0
    with pytest.raises(LoadError, match="no active lease"):
        c.begin_pull("never", "decode/0", wait_s=0.3)


def test_offer_message_needs_an_accepting_rank_this_host_and_the_secret(closing: list) -> None:
    p = Prefill(secret=SECRET)
    good = p.client(secret=SECRET)
    closing += [p, good]
    offer = Offer("r1", (1, 2), "o-1")
    refused = good.request(offer)
    assert isinstance(refused, Refused) and refused.kind == "offers_in_step"  # off unless the engine turns it on
    assert p.server.take_offer(offer) == refused, "by a call in the same process: refused alike"
    p.server.accept_offers = True
    stranger = p.client()  # no secret
    closing.append(stranger)
    with pytest.raises(ProtocolError, match="without authenticating it.*unauthenticated"):
        stranger.request(offer)  # an unsigned refusal: a failure, never a reply
    sealed = Authenticator(SECRET).seal(
        new_frame("Offer", "prefill/scheduler", wire.encode(offer), receiver="prefill/0")
    )
    remote = wire.decode(p.server.handle(wire.encode(sealed), peer_host="10.9.8.7"), Frame)
    assert remote.kind == "Refused" and "this host" in wire.decode(remote.body, Refused).message
    assert p.ledger.active == [], "no refused offer holds blocks"
    assert good.request(offer) == Ack()
    assert good.request(offer) == Ack()  # the step's offer of the same request: the same lease
    assert p.ledger.active == ["r1"] and p.ledger.query("r1").blocks == (1, 2)


def test_a_held_query_stream_is_looked_at_again_only_when_woken(closing: list) -> None:
    # Composing a stream's status costs the prefill's process (its GIL) each time: a held QueryStream is
    # looked at again when its request is woken (a step saved, the lease aborted) or its wait runs out,
    # not on every message or tick of the serving loop.
    p = Prefill()
    c, other = p.client(), p.client()
    closing += [p, c, other]
    p.ledger.offer("r1", [4, 5], expected_pulls=1)
    calls: list[str] = []

    def streams(rid: str, epoch: int) -> StreamStatus:
        calls.append(rid)
        return StreamStatus(p.ledger.query(rid, epoch), 64, (16,), 2)

    p.server.streams = streams
    replies: list = []
    asker = threading.Thread(target=lambda: replies.append(c.query_stream("r1", seen=2, wait_s=30)))
    asker.start()
    wait_for(lambda: p.server._held.nparked == 1, what="the QueryStream to be held")
    held = len(calls)
    for _ in range(5):  # other requests, and several of the loop's 50 ms ticks
        assert other.query_lease("r1").valid
        time.sleep(0.06)
    assert len(calls) == held and replies == [], "an unwoken held query is not looked at"
    p.server.wake("r2")  # another request's progress
    time.sleep(0.06)
    assert len(calls) == held and replies == []
    began = time.monotonic()
    p.server.abort("r1", reason="test")  # the lease ends: the reader hears of it now, not in 30 s
    asker.join(timeout=30)
    [status] = replies
    assert not status.lease.valid and time.monotonic() - began < 5


def test_query_stream_is_held_until_the_stream_changes(closing: list) -> None:
    # Layer-wise decode long-polls prefill's progress: a QueryStream at the version it has is held until
    # a layer is saved (the producer wakes the server), so it sees each layer at once without busy polling.
    p = Prefill()
    c = p.client()
    closing += [p, c]
    version = {"r1": 3}
    p.ledger.offer("r1", [4, 5], expected_pulls=1)

    def streams(rid: str, epoch: int) -> StreamStatus:
        return StreamStatus(p.ledger.query(rid, epoch), 64, (version.get(rid, 0) * 16,), version.get(rid, 0))

    p.server.streams = streams
    at_once = c.query_stream("r1", seen=0, wait_s=30)
    assert at_once.version == 3 and at_once.held_ms == 0  # another version: answered at once
    replies: list = []
    asker = threading.Thread(target=lambda: replies.append(c.query_stream("r1", seen=3, wait_s=30)))
    asker.start()
    wait_for(lambda: p.server._held.nparked == 1, what="the QueryStream to be held")
    assert replies == [], "no answer while the stream stays at the version the reader has"
    version["r1"] = 4  # a layer saved
    p.server.wake("r1")
    asker.join(timeout=30)
    [status] = replies
    assert status.version == 4 and status.ready == (64,) and p.server._held.nparked == 0
    assert status.held_ms > 0, "a held answer says so: prefill was still computing when it was asked"
    # Unchanged, it is answered when its wait runs out; with its lease gone, at once.
    began = time.monotonic()
    assert c.query_stream("r1", seen=4, wait_s=0.2).version == 4 and time.monotonic() - began >= 0.2
    p.ledger.abort("r1")
    began = time.monotonic()
    assert not c.query_stream("r1", seen=4, wait_s=30).lease.valid and time.monotonic() - began < 10


def _timeslices(thread: threading.Thread) -> int:
    """How often the kernel ran `thread` so far (Linux schedstat)."""
    with open(f"/proc/self/task/{thread.native_id}/schedstat") as f:
        return int(f.read().split()[2])


def test_side_channel_sleeps_until_something_is_due(closing: list) -> None:
    # On a prefill rank each wake-up of the serving loop takes the engine's GIL from its compute: the loop
    # wakes for messages, wake-ups and deadlines only, not on a fixed tick.
    released: list[str] = []
    ledger = Ledger(lambda lease, _why: released.append(lease.request_id), timeout_s=0.8)
    server = ControlServer("prefill", 0, ledger=ledger)  # the default poll interval
    closing.append(server)
    server.register(rank_info())
    thread = server._thread
    before = _timeslices(thread)
    time.sleep(0.5)  # idle: nothing held, no lease
    assert _timeslices(thread) - before <= 3, "an idle side channel kept waking up"
    # A lease's deadline is still met without any message: the loop sleeps until it (at most poll_interval_s).
    c = ControlClient(*server.address, sender="decode/0")
    closing.append(c)
    ledger.offer("r1", [1], expected_pulls=1)
    epoch = c.begin_pull("r1", "decode/0").epoch  # a message: the loop now knows the deadline
    wait_for(lambda: released == ["r1"], timeout=10, what="the lease expiring at its deadline")
    assert c.query_lease("r1", epoch).state is LeaseState.EXPIRED
    # close() wakes the sleeping loop rather than waiting for its poll interval
    server.close()
    assert not thread.is_alive()


def _parked_consistent(server: ControlServer) -> bool:
    return server._held.nparked == sum(len(held) for held in server._held.parked.values())


def test_a_failing_streams_answer_refuses_the_held_query_and_leases_still_expire(closing: list) -> None:
    # The engine's `streams` raising for a held QueryStream cost the serving loop every round (before it
    # reaped), so no lease on the rank ever expired: it must cost that query a Refused, nothing more.
    p = Prefill(timeout_s=0.5)
    c = p.client(timeout_s=2)
    closing += [p, c]
    p.ledger.offer("s", [1], expected_pulls=1, timeout_s=60)
    p.ledger.offer("other", [2], expected_pulls=1)  # expires in 0.5 s
    broken = threading.Event()

    def streams(rid: str, epoch: int) -> StreamStatus:
        if broken.is_set():
            raise RuntimeError("engine bug")
        return StreamStatus(p.ledger.query(rid, epoch), version=1)

    p.server.streams = streams
    errors: list[str] = []

    def ask() -> None:
        try:
            c.query_stream("s", seen=1, wait_s=5)
        except (ProtocolError, TransferTimeout) as exc:
            errors.append(str(exc))

    asker = threading.Thread(target=ask)
    asker.start()
    wait_for(lambda: p.server._held.nparked == 1, what="the QueryStream to be held")
    broken.set()
    p.server.wake("s")  # the engine says the stream moved; its answer then raises
    asker.join(timeout=15)
    assert len(errors) == 1 and "internal" in errors[0] and "engine bug" in errors[0], errors
    assert p.server._held.nparked == 0 and p.server._held.parked == {}
    wait_for(lambda: ("other", LeaseState.EXPIRED) in p.released, timeout=10, what="the other lease to expire")


def test_a_failure_part_way_through_held_requests_answers_none_twice(closing: list, monkeypatch) -> None:
    p = Prefill()
    clients = [p.client(timeout_s=1), p.client(timeout_s=1)]
    closing += [p, *clients]
    p.ledger.offer("s", [1], expected_pulls=1)
    version = [1]
    p.server.streams = lambda rid, epoch: StreamStatus(p.ledger.query(rid, epoch), version=version[0])
    sent: list[int] = []
    send = p.server._held._send

    def flaky_send(parts: list[bytes]) -> None:
        sent.append(len(parts))
        if len(sent) == 1:
            raise RuntimeError("send failed")
        send(parts)

    replies: list = []

    def ask(c: ControlClient) -> None:
        try:
            # the one whose reply fails waits out wait_s and its 1 s timeout: short, as the wake comes at once
            replies.append(c.query_stream("s", seen=1, wait_s=4))
        except TransferTimeout:
            replies.append(None)  # the one whose reply failed to go out

    askers = [threading.Thread(target=ask, args=(c,)) for c in clients]
    for a in askers:
        a.start()
    wait_for(lambda: p.server._held.nparked == 2, what="both QueryStreams to be held")
    monkeypatch.setattr(p.server._held, "_send", flaky_send)
    version[0] = 2  # the stream moved
    p.server.wake("s")
    wait_for(lambda: len(sent) >= 1, what="the failed send")
    for _ in range(5):  # a few rounds of the loop: nothing answered twice, the count kept right
        time.sleep(0.02)
        assert _parked_consistent(p.server)
    p.server.wake("s")
    for a in askers:
        a.join(timeout=30)
    assert sorted(r is None for r in replies) == [False, True] and len(sent) == 2
    assert p.server._held.nparked == 0 and p.server._held.parked == {}


def test_a_held_query_stream_hears_at_once_that_the_server_ended_its_lease(closing: list) -> None:
    # Only an abort woke held QueryStreams: one whose lease a DONE released, or whose lease expired, was
    # answered when its wait ran out (here 30 s), not when the lease ended.
    p = Prefill()
    c, other = p.client(), p.client()
    closing += [p, c, other]
    p.server.streams = lambda rid, epoch: StreamStatus(p.ledger.query(rid, epoch))
    released = p.ledger.offer("released", [1], expected_pulls=1)
    p.ledger.offer("expires", [2], expected_pulls=1)

    def expire() -> None:  # the server's reaper ends it at its deadline, which the clock now passed
        p.skew += 120

    for rid, end in (("released", lambda: other.done("released", "decode/0", released.epoch)), ("expires", expire)):
        replies: list[StreamStatus] = []
        asker = threading.Thread(target=lambda rid=rid, out=replies: out.append(c.query_stream(rid, seen=0, wait_s=30)))
        asker.start()
        wait_for(lambda: p.server._held.nparked == 1, what=f"the QueryStream for {rid} to be held")
        began = time.monotonic()
        end()
        asker.join(timeout=40)
        [status] = replies
        assert not status.lease.valid and time.monotonic() - began < 5, (rid, status)


def test_the_most_blocks_a_message_may_list_fit_in_a_message() -> None:
    from kvbridge.control.framing import MAX_MESSAGE_BYTES
    from kvbridge.control.messages import MAX_BLOCKS, MAX_ID_CHARS

    status = LeaseStatus("r" * MAX_ID_CHARS, LeaseState.ACTIVE, True, 1, range(MAX_BLOCKS))
    framed = wire.encode(new_frame("LeaseStatus", "p" * MAX_ID_CHARS, wire.encode(status), b"n" * 64))
    assert len(framed) <= MAX_MESSAGE_BYTES


def test_messages_over_the_size_limit_are_refused_naming_their_size_not_timed_out(closing: list) -> None:
    # A request or reply over max_message_bytes was dropped by the receiving socket: the client waited out
    # its timeout and blamed the peer ("check that the engine rank is running").
    limit = 64 * 1024
    released: list = []
    ledger = Ledger(lambda lease, why: released.append(lease.request_id))
    server = ControlServer("prefill", 0, ledger=ledger, max_message_bytes=limit, poll_interval_s=0.05)
    c = ControlClient(*server.address, sender="decode/0", timeout_s=5, max_message_bytes=limit)
    closing += [server, c]
    server.register(rank_info())
    ledger.offer("big", range(20_000), expected_pulls=1)  # 160 KB packed
    began = time.monotonic()
    with pytest.raises(ProtocolError, match=r"BeginPull .* bytes encoded, over the 65536-byte limit"):
        c.begin_pull("big", "decode/0", blocks=range(20_000))
    with pytest.raises(ProtocolError, match=r"too_large.*LeaseStatus reply .* bytes encoded, over .*65536-byte limit"):
        c.query_lease("big")
    assert time.monotonic() - began < 2, "refused at once, not after the client's timeout"
    ledger.offer("small", [1], expected_pulls=1)
    assert c.query_lease("small").valid, "the server still serves"


def test_abort_notifier_goes_on_after_it_could_not_open_a_socket(closing: list) -> None:
    """The abort notifier goes on after a ZMQError opening its socket (here: its context's socket limit, reached).

    The error escaped the peer's drain thread and left its queue without one: every later abort for that peer
    queued for ever.
    """
    from kvbridge.control.client import ClientPool
    from kvbridge.control.messages import Abort
    from kvbridge.control.notifier import Notifier

    told: list[str] = []
    decode = ControlServer("decode", 0, on_abort=lambda rid, _origin, _why: told.append(rid))
    closing.append(decode)
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 1)
    hog = ctx.socket(zmq.REQ)  # the context's one socket
    notifier = Notifier("prefill/0", ClientPool(timeout_s=5, context=ctx))
    try:
        notifier.send(decode.address, Abort("r1", "prefill/0", "lost"))
        wait_for(lambda: not notifier._queues, what="the failed notification's thread to end")
        # ZeroMQ frees the closed socket's slot on its reaper thread, a moment after close() returns: a send
        # made before that fails the same way and is dropped (logged), so send again once each has ended.
        hog.close()

        def delivered() -> bool:
            if "r2" not in told and not notifier._queues:
                notifier.send(decode.address, Abort("r2", "prefill/0", "told"))
            return "r2" in told

        wait_for(delivered, what="a later abort to reach the peer")
        assert set(told) == {"r2"}, "the abort that could not be sent is not delivered later"
    finally:
        notifier.close(1.0)
        hog.close()
        ctx.term()


def _stall_dumps(where: Path, naming: str) -> list[str]:
    texts = [p.read_text() for p in where.glob("stall-*.txt")]
    return [t for t in texts if naming in t.splitlines()[0]]


def test_a_handler_that_blocks_gets_every_stack_dumped_once_and_its_time_logged(
    closing: list, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KVBRIDGE_STALL_DIR", str(tmp_path))
    release = threading.Event()
    timed: list[tuple[str, float, float, float]] = []

    def stuck_in_the_abort_handler(_rid: str, _origin: str, _why: str) -> None:
        release.wait(30)

    server = ControlServer("stuck", 0, on_abort=stuck_in_the_abort_handler, timed=lambda *t: timed.append(t))
    first, behind = ControlClient(*server.address, timeout_s=30), ControlClient(*server.address, timeout_s=30)
    closing += [server, first, behind]
    first.request(GetInfo())  # each learns the rank's name now, so the one request below is all it sends
    behind.request(GetInfo())
    aborting = threading.Thread(target=first.abort, args=("r1",))
    aborting.start()
    wait_for(lambda: _stall_dumps(tmp_path, "stuck/0"), what="the serving loop's stall to be dumped")
    asking = threading.Thread(target=behind.request, args=(GetInfo(),))  # queued behind the blocked handler
    asking.start()
    looked = WATCHDOG.checked  # the stall goes on through two more of the watchdog's looks: still one dump
    wait_for(lambda: WATCHDOG.checked > looked + WATCHDOG.stall_s, what="the watchdog to look twice more")
    release.set()
    aborting.join(30)
    asking.join(30)
    # A request's times are taken once its reply is sent: the client can have the reply a moment before they are.
    wait_for(lambda: [t[0] for t in timed][-2:] == ["Abort", "GetInfo"], what=lambda: f"the GetInfo's times: {timed}")
    (dump,) = _stall_dumps(tmp_path, "stuck/0")
    assert "side channel stuck/0 (serving loop)" in dump and "Thread kvbridge-ctl-stuck/0" in dump
    assert "in stuck_in_the_abort_handler" in dump and "release.wait(30)" in dump, "the blocking frame is named"
    logged = [r.getMessage() for r in caplog.records if r.name == "kvbridge.base.watchdog"]
    assert sum("kvbridge stall" in m and "stuck/0" in m for m in logged) == 1, logged
    ((_, _, wait, handler),) = [t for t in timed if t[0] == "Abort"]
    assert handler >= WATCHDOG.stall_s > wait, "blocked for the whole stall, in the handler"
    (queued, *_) = timed[-1][1:]
    assert timed[-1][0] == "GetInfo" and queued >= handler, "the GetInfo waited behind the blocked handler"
    (slow,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("slow Abort")]
    assert "side channel stuck/0" in slow and "(queued " in slow and ", handler " in slow


def test_early_offers_reach_a_rank_of_this_process_by_a_call_as_a_message_would(closing: list) -> None:
    # A scheduler sharing its process with its ranks (vLLM's uni executor) offers by a call into the rank's ledger:
    # taken before make() returns, with no thread; refused as the Offer message would be (not ready: skipped; a rank
    # that offers in the engine step only: early offers stop); a closed rank is reached by a message again.
    waiting = Prefill(ready=False)
    closing.append(waiting)
    offers = EarlyOffers([waiting.server.address], early=True, clients=ClientPool(sender="prefill/scheduler"))
    try:
        offers.make("r1", [1, 2])
        assert waiting.ledger.active == [] and offers.early, "a rank not ready yet skips it and stays asked"
        waiting.server.register(rank_info(), accept_offers=True)
        offer = offers.make("r2", [3, 4])
        assert waiting.ledger.active == ["r2"] and waiting.ledger.query("r2").blocks == (3, 4)
        assert waiting.ledger.offer("r2", (3, 4), offer_id=offer.offer_id).request_id == "r2"  # the step's: one lease
        assert not [t.name for t in threading.enumerate() if t.name.startswith("kvbridge-offer")]
        waiting.server.accept_offers = False
        offers.make("r3", [5])
        assert waiting.ledger.active == ["r2"] and not offers.early, "offered in the step only: no early offers"
        assert local_server(*waiting.server.address) is waiting.server
        waiting.server.close()
        assert local_server(*waiting.server.address) is None
    finally:
        offers.close()
