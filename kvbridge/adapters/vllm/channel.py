"""The side channel between decode and prefill workers: a rank's `RankInfo`, and DONE for a request.

Each prefill TP rank answers on a ZMQ ROUTER socket. Requests are two frames, a kind and a
kvbridge wire message; replies are one wire message. Nothing is unpickled.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import attrs
import zmq

from kvbridge import wire
from kvbridge.agent import RankInfo
from kvbridge.errors import ConfigError, PeerGone, ProtocolError

log = logging.getLogger(__name__)


@attrs.frozen
class InfoRequest:
    engine_id: str  # the engine the caller expects to reach: a stale address is caught here


@attrs.frozen
class Done:
    """A decode rank finished with a request's blocks (pulled them, or needs none of them)."""

    request_id: str
    decode_rank: int
    expected: int  # how many decode ranks read this prefill rank for the request (0: nobody does)
    pulled: bool


@attrs.frozen
class DoneAck:
    """`ok` False: the lease had expired, so what was read may be reused blocks (a load error)."""

    ok: bool
    reason: str = ""


class SideChannelServer:
    """Serves `RankInfo` and takes `Done` on tcp://host:port until closed."""

    def __init__(self, host: str, port: int, info: RankInfo, on_done: Callable[[Done], DoneAck]) -> None:
        self.info = info
        self._on_done = on_done
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self._sock.close()
            self._ctx.term()
            raise ConfigError(
                f"KVBridgeConnector side channel cannot listen on {host}:{port} ({exc}); give each server "
                "on this host its own kv_connector_extra_config.side_channel_port"
            ) from None
        self.address = f"{host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"kvbridge-side-{port}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._sock.recv_multipart()
            ident, body = frames[0], frames[1:]
            try:
                reply = self._answer(body)
            except ProtocolError as exc:
                log.warning("side channel %s: refused a message: %s", self.address, exc)
                reply = wire.encode(DoneAck(ok=False, reason=str(exc)))
            self._sock.send_multipart([ident, b"", reply])

    def _answer(self, body: list[bytes]) -> bytes:
        if len(body) != 3 or body[0] != b"":
            raise ProtocolError("expected an empty delimiter, a kind and a message")
        kind, payload = body[1], body[2]
        if kind == b"info":
            req = wire.decode(payload, InfoRequest)
            if req.engine_id != self.info.engine_id:
                raise ProtocolError(f"asked for engine {req.engine_id}, this is {self.info.engine_id}")
            return wire.encode(self.info)
        if kind == b"done":
            return wire.encode(self._on_done(wire.decode(payload, Done)))
        raise ProtocolError(f"unknown side-channel message kind {kind[:32]!r}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()
        self._ctx.term()


class SideChannelClient:
    """Calls prefill ranks' side channels; one short-lived REQ socket per call, bounded by a timeout."""

    def __init__(self, timeout_s: float = 10.0) -> None:
        self._ctx = zmq.Context()
        self._timeout_ms = int(timeout_s * 1000)

    def _call(self, address: str, kind: bytes, payload: bytes) -> bytes:
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, self._timeout_ms)
        sock.setsockopt(zmq.SNDTIMEO, self._timeout_ms)
        try:
            sock.connect(f"tcp://{address}")
            sock.send_multipart([kind, payload])
            return sock.recv()
        except zmq.Again:
            raise PeerGone(
                f"prefill side channel {address} did not answer within {self._timeout_ms / 1000}s; "
                "is the prefill server alive?",
                peer=address,
                cause="timeout",
            ) from None
        finally:
            sock.close()

    def info(self, address: str, engine_id: str) -> RankInfo:
        reply = self._call(address, b"info", wire.encode(InfoRequest(engine_id)))
        try:
            return wire.decode(reply, RankInfo)
        except ProtocolError:
            ack = wire.decode(reply, DoneAck)
            raise ProtocolError(f"prefill side channel {address} refused: {ack.reason}") from None

    def done(self, address: str, done: Done) -> DoneAck:
        return wire.decode(self._call(address, b"done", wire.encode(done)), DoneAck)

    def close(self) -> None:
        self._ctx.term()
