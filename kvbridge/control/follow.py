"""A followed `QueryStream`: a reader of a layer-wise stream hears of every change without asking again.

A long poll (`QueryStream` with `wait_ms`) costs the prefill rank two wake-ups of its side channel per
step: one when the poll arrives and is held, one when the step's layers are saved and it is answered.
In the prefill's own process each wake-up takes the engine's GIL from its compute (docs/vllm.md,
"Measured"). Followed, the request stays held after each answer, so a step costs the answer only.

ROUTER answers a DEALER peer as often as it likes, so a follower has a DEALER socket of its own. The
server marks each answer after which it holds the request again (`StreamStatus.followed`); it ends a
follow with an answer whose lease is not valid, one where every layer holds the whole prompt, or one
after `wait_ms` without change. The follower asks again after an answer that ended the follow while more
is to come (a rank too old to follow answers every request once, unmarked: it is then a long poll).
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

import zmq

from kvbridge import wire
from kvbridge.control.messages import QueryStream, Refused, StreamStatus
from kvbridge.errors import PeerGone, ProtocolError, TransferTimeout

if TYPE_CHECKING:
    from kvbridge.control.channel import ControlClient

# nonces of this follower's latest requests whose answers are still taken (a replaced follow may
# still answer once or twice before the rank sees the request that replaced it)
_NONCES_KEPT = 4


class StreamFollower:
    """Follows one stream on one prefill rank. Not thread-safe: one reader thread uses it."""

    def __init__(self, client: ControlClient, request_id: str, epoch: int, *, seen: int, wait_s: float) -> None:
        self.client = client
        self.request_id = request_id
        self.epoch = epoch
        self.seen = seen
        self.wait_s = wait_s
        self._nonces: collections.deque[bytes] = collections.deque(maxlen=_NONCES_KEPT)
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, client.max_message_bytes + 1024)
        self._sock.connect(client.url)
        self.ask()

    def ask(self) -> None:
        """(Re)start the follow from the version this follower has."""
        msg = QueryStream(self.request_id, self.epoch, self.seen, int(self.wait_s * 1000), follow=True)
        frame = self.client.seal(msg)
        self._nonces.append(frame.nonce)
        try:
            self._sock.send(wire.encode(frame), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # zmq.Again: nothing connected and the queue full; a stopped peer
            raise PeerGone(
                f"side channel {self.client.url} failed on QueryStream: {exc}", peer=self.client.url, cause=str(exc)
            ) from None

    def next(self) -> StreamStatus:
        """The newest answer, waiting for one up to the client's timeout plus `wait_s`; asks again when the
        answer ended the follow without the stream being done. Raises TransferTimeout on silence."""
        timeout_s = self.client.timeout_s + self.wait_s
        if not self._sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise TransferTimeout(
                f"side channel {self.client.url} did not answer QueryStream within {timeout_s}s; check that the "
                "engine rank is running and its side-channel address is right",
                peer=self.client.url,
                cause="timeout",
            )
        status: StreamStatus | None = None
        while self._sock.poll(0, zmq.POLLIN):  # every answer queued: the newest counts
            reply = self.client.open(self._sock.recv(), "QueryStream", self._nonces)
            if isinstance(reply, Refused):
                raise ProtocolError(
                    f"side channel {self.client.url} refused QueryStream ({reply.kind}): {reply.message}"
                )
            if not isinstance(reply, StreamStatus):
                raise ProtocolError(f"side channel {self.client.url} answered QueryStream with {type(reply).__name__}")
            if status is None or reply.version >= status.version or not reply.lease.valid:
                status = reply
        assert status is not None
        self.seen = status.version
        if status.streaming and not status.followed:
            # The rank ended the follow (its wait ran out without a change) or cannot follow: ask again.
            self.ask()
        return status

    def close(self) -> None:
        self._sock.close(linger=0)

    def __enter__(self) -> StreamFollower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
