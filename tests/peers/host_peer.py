"""One engine's worth of kvbridge on a namespace host, or a stranger or a relay beside it.

Driven through `kvbridge_tools.harness.proc`. `serve` puts a patterned buffer behind a transport and a
side channel with a lease ledger, as a prefill rank does (`offer` offers a request); `pull` is a decode
rank (its own transport and side channel) that authenticates on that side channel, begins a pull of an
offered request and reads the buffer (`finish` says DONE); the `stranger_*` calls are someone on another
host holding no secret who knows the endpoint (an observer saw it on the wire) and uses the transport's
own library directly, plain sockets, or replays the side-channel frames it recorded (`recorded`: what
the prefill's side channel received and sent); `relay` forwards TCP to a side channel.
"""

from __future__ import annotations

import base64
import hashlib
import socket
import threading
import time
from typing import Any

import numpy as np

import kvbridge
from kvbridge.base import wire
from kvbridge.base.types import EndpointInfo
from kvbridge.control import ControlClient, ControlServer, Ledger
from kvbridge.plan.layout import vllm_layout
from kvbridge.plan.presets import PRESETS
from kvbridge.plan.topology import ParallelConfig
from kvbridge.transport import netguard
from kvbridge_tools.harness.proc import serve

state: dict[str, Any] = {}


def _digest(buf: np.ndarray) -> str:
    return hashlib.sha256(buf.tobytes()).hexdigest()


def serve_buffer(
    backend: str, hostname: str, size: int, seed: int, options: dict[str, Any], secret: str | None
) -> dict[str, Any]:
    """A patterned buffer registered with `backend`, its endpoint served on an authenticated side channel."""
    from kvbridge.agent.kv_agent import RankInfo

    buf = np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8)
    be = kvbridge.create_backend(backend, hostname=hostname, **options)
    be.register_memory(buf)
    model = PRESETS["tiny-gqa"]
    layout = vllm_layout(model, 8, [buf.ctypes.data] * model.layers, 4)
    ledger = Ledger(lambda _lease, _why: None)
    server = ControlServer(
        "prefill", 0, ledger=ledger, host=hostname, secret=secret, insecure=options.get("insecure", False)
    )
    server.register(RankInfo("prefill", 0, ParallelConfig(), layout, be.endpoint_info()))
    _record(server)
    state.update(buf=buf, backend=be, server=server, ledger=ledger)
    guard = getattr(be, "guard", None)
    return {
        "endpoint": be.endpoint_info().hex(),
        "endpoint_address": be.endpoint().address,
        "base": buf.ctypes.data,
        "digest": _digest(buf),
        "side_channel": list(server.address),
        # the guarded listeners a library opened; kvbridge's own tcp transport listens on its endpoint's port
        "ports": list(guard.state().ports) if guard else [int(be.endpoint().address.rsplit(":", 1)[1])],
    }


def _record(server: ControlServer) -> None:
    """Keep every frame the side channel receives and every reply it sends, as an observer on the wire would."""
    frames: list[bytes] = []
    dispatcher = server._dispatcher  # what answers and signs each request (kvbridge.control.dispatch)
    answer, seal = dispatcher.answer, dispatcher.seal

    def recording_answer(payload: bytes, peer_host: str | None, **kwargs: Any) -> Any:
        frames.append(payload)
        return answer(payload, peer_host, **kwargs)

    def recording_seal(reply_to: bytes | None, reply: Any) -> bytes:
        data = seal(reply_to, reply)
        frames.append(data)
        return data

    dispatcher.answer, dispatcher.seal = recording_answer, recording_seal  # type: ignore[method-assign]
    state["recorded"] = frames


def recorded() -> list[str]:
    return [f.hex() for f in state["recorded"]]


def offer(request_id: str) -> None:
    state["ledger"].offer(request_id, [0, 1, 2, 3], expected_pulls=1)


def digest() -> str:
    return _digest(state["buf"])


def pull(
    backend: str,
    hostname: str,
    host: str,
    port: int,
    secret: str | None,
    options: dict[str, Any],
    request_id: str = "",
) -> dict[str, Any]:
    """A decode rank: authenticate on the side channel at host:port, begin a pull of `request_id`, read the buffer.

    It reads the whole buffer the endpoint names. Its transport and its side channel stay up (`finish` says DONE)."""
    be = kvbridge.create_backend(backend, hostname=hostname, **options)
    client = ControlClient(host, port, secret=secret, timeout_s=10, sender="decode/0")
    info = client.get_info(wait_s=10)
    if request_id:
        client.begin_pull(request_id, "decode/0", blocks=[0, 1, 2, 3], expected_pulls=1, wait_s=10)
    ep = wire.decode(info.endpoint, EndpointInfo)
    region = ep.regions[0]
    out = np.zeros(region.length, dtype=np.uint8)
    be.register_memory(out)
    peer = be.connect(info.endpoint)
    be.transfer(peer, [(out.ctypes.data, region.addr, region.length)], "read").wait(30)
    server = ControlServer("decode", 0, host=hostname, secret=secret, insecure=options.get("insecure", False))
    state.update(buf=out, backend=be, server=server, client=client)
    return {"digest": _digest(out), "endpoint": be.endpoint_info().hex(), "side_channel": list(server.address)}


def finish(request_id: str) -> None:
    state["client"].done(request_id, "decode/0", expected_pulls=1, check=False)


def admitted() -> list[str]:
    return [str(a) for a in netguard.ADMISSION.hosts()]


def wait_unadmitted(host: str, within: float) -> bool:
    """Wait until `host` is no longer admitted here (its last lease ended, then the grace); whether it is not."""
    return netguard.ADMISSION.wait_until(lambda hosts: host not in map(str, hosts), within)


def stranger_replay(frames: list[str], targets: list[list[Any]]) -> list[str]:
    """Send every recorded frame, as it was, to every side channel in `targets`; the kinds of what came back."""
    import zmq

    from kvbridge.control.messages import Frame

    answers = []
    ctx = zmq.Context.instance()
    for host, port in targets:
        for frame in frames:
            sock = ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 5000)
            sock.connect(f"tcp://{host}:{port}")
            try:
                sock.send(bytes.fromhex(frame))
                answers.append(wire.decode(sock.recv(), Frame).kind)
            except zmq.Again:
                answers.append("unanswered")
            finally:
                sock.close()
    return answers


def relay(listen: str, host: str, port: int) -> int:
    """Forward TCP connections made to `listen`:<port> to host:port (a relay); the port."""
    server = socket.create_server((listen, 0))

    def pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:  # the other direction closed both
            pass
        finally:
            a.close()
            b.close()

    def accept() -> None:
        while True:
            conn, _ = server.accept()
            upstream = socket.create_connection((host, port))
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=pipe, args=(a, b), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    state["relay"] = server
    return int(server.getsockname()[1])


def stranger_side_channel(host: str, port: int) -> str:
    """Ask the side channel for the layout and endpoint without the secret; what came back."""
    client = ControlClient(host, port, secret=None, timeout_s=5)
    try:
        return repr(client.get_info())
    except Exception as exc:  # noqa: BLE001 - the refusal is the answer
        return f"{type(exc).__name__}: {exc}"
    finally:
        client.close()


def stranger_dial(host: str, ports: list[int], connect_timeout: float) -> dict[str, str]:
    """Plain TCP connects to each port: 'connected' or why not."""
    out = {}
    for port in ports:
        try:
            with socket.create_connection((host, port), timeout=connect_timeout):
                out[str(port)] = "connected"
        except OSError as exc:
            out[str(port)] = type(exc).__name__
    return out


def stranger_idle(host: str, port: int, count: int) -> int:
    """Open `count` connections to host:port and leave them idle (never authenticating); how many opened."""
    held = state.setdefault("idle", [])
    for _ in range(count):
        held.append(socket.create_connection((host, port), timeout=10))
    return len(held)


def stranger_release() -> None:
    for s in state.pop("idle", []):
        s.close()


def tcp_handshake_begin(host: str, port: int) -> None:
    """Connect to kvbridge's tcp transport and read its challenge: a handshake in flight."""
    from kvbridge.transport import tcp

    s = socket.create_connection((host, port), timeout=10)
    state["handshake"] = (s, tcp._recv_frame(s, tcp._MAX_AUTH_FRAME)["challenge"])


def tcp_handshake_finish(secret: str) -> bool:
    """Answer the challenge with the secret; whether the server accepted and proved the key back."""
    import hmac

    from kvbridge.transport import tcp

    s, challenge = state.pop("handshake")
    key, mine = tcp._secret_key(secret.encode()), b"m" * 16
    try:
        tcp._send_frame(s, {"mac": tcp._mac(key, b"client", challenge), "challenge": mine})
        reply = tcp._recv_frame(s, tcp._MAX_AUTH_FRAME)
    finally:
        s.close()
    return bool(reply.get("ok")) and hmac.compare_digest(reply["mac"], tcp._mac(key, b"server", challenge, mine))


def stranger_library(
    backend: str, hostname: str, endpoint: str, op: str, size: int, address: str | None = None
) -> dict[str, Any]:
    """Read or write the endpoint's first region with the transport's own library, holding no secret.

    `address` replaces the endpoint's (a Mooncake engine on 127.0.0.1 reached at its host's address).

    Returns {"rc": the library's result (0: it says the transfer worked), "digest": of what was read}.
    """
    ep = wire.decode(bytes.fromhex(endpoint), EndpointInfo)
    region = ep.regions[0]
    local = np.full(size, 0x5A, dtype=np.uint8)
    begun = time.monotonic()
    if backend == "mooncake":
        from mooncake.engine import TransferEngine

        engine = TransferEngine()
        assert engine.initialize(hostname, "P2PHANDSHAKE", "tcp", "") == 0
        assert engine.register_memory(local.ctypes.data, local.nbytes) == 0
        call = engine.transfer_sync_read if op == "read" else engine.transfer_sync_write
        rc = call(address or ep.address, local.ctypes.data, region.addr, size)
    elif backend == "nixl":
        from kvbridge_nixl.spec import nixl_api

        api = nixl_api()
        agent = api.nixl_agent("stranger", api.nixl_agent_config(backends=["UCX"]))
        agent.register_memory(agent.get_reg_descs([(local.ctypes.data, local.nbytes, 0, "")], "DRAM"))
        rc = -1
        try:
            remote = agent.add_remote_agent(base64.b64decode(ep.extra["nixl_agent_metadata"]))
            src = agent.get_xfer_descs([(local.ctypes.data, size, 0)], "DRAM")
            dst = agent.get_xfer_descs([(region.addr, size, 0)], "DRAM")
            handle = agent.initialize_xfer("READ" if op == "read" else "WRITE", src, dst, remote)
            agent.transfer(handle)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                status = agent.check_xfer_state(handle)
                if status in ("DONE", "ERR"):
                    rc = 0 if status == "DONE" else -1
                    break
                time.sleep(0.01)
        except Exception as exc:  # noqa: BLE001 - NIXL's refusal is the answer
            rc = f"{type(exc).__name__}: {exc}"
    else:  # kvbridge's tcp transport, as a client holding no secret
        be = kvbridge.create_backend("tcp", hostname=hostname, insecure=True)
        be.register_memory(local)
        try:
            peer = be.connect(bytes.fromhex(endpoint))
            be.transfer(peer, [(local.ctypes.data, region.addr, size)], op).wait(15)
            rc = 0
        except Exception as exc:  # noqa: BLE001 - the refusal is the answer
            rc = f"{type(exc).__name__}: {exc}"
    untouched = bool((local == 0x5A).all())  # nothing landed: 0 bytes read
    return {"rc": rc, "digest": _digest(local), "untouched": untouched, "seconds": round(time.monotonic() - begun, 1)}


def close() -> None:
    state.pop("server").close()
    state.pop("backend").close()
    if "client" in state:
        state.pop("client").close()


if __name__ == "__main__":
    serve(
        {
            "serve_buffer": serve_buffer,
            "digest": digest,
            "pull": pull,
            "finish": finish,
            "offer": offer,
            "recorded": recorded,
            "admitted": admitted,
            "wait_unadmitted": wait_unadmitted,
            "stranger_replay": stranger_replay,
            "relay": relay,
            "stranger_side_channel": stranger_side_channel,
            "stranger_dial": stranger_dial,
            "stranger_library": stranger_library,
            "stranger_idle": stranger_idle,
            "stranger_release": stranger_release,
            "tcp_handshake_begin": tcp_handshake_begin,
            "tcp_handshake_finish": tcp_handshake_finish,
            "close": close,
        }
    )
