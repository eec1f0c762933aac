"""Optional shared-secret authentication of side-channel frames: HMAC-SHA256, replay guard. See docs/internals.md."""

from __future__ import annotations

import hashlib
import heapq
import hmac
import math
import os
import threading
import time
from collections.abc import Callable

import attrs

from kvbridge.base import wire
from kvbridge.base.errors import ConfigError, ProtocolError
from kvbridge.base.secret import SIDE_CHANNEL, derive
from kvbridge.control.messages import Frame

NONCE_BYTES = 16


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


class Authenticator:
    """Signs outgoing frames and checks incoming ones against one shared secret."""

    def __init__(
        self,
        secret: str | bytes | None,
        *,
        window_s: float = 30.0,
        max_nonces: int = 200_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if isinstance(secret, str):
            secret = secret.encode()
        if secret is not None and len(secret) < 16:
            raise ConfigError(
                "the side-channel secret must be at least 16 bytes; generate one with `openssl rand -hex 32`"
            )
        self._key = derive(secret, SIDE_CHANNEL)  # the side channel's own key (docs/security.md)
        self.window_s = window_s
        self._max_nonces = max_nonces
        self._clock = clock
        # The nonces inside the window, each kept until its frame's timestamp + window (after that a replay is
        # refused on its timestamp alone), trimmed in that order, not in arrival order: a peer whose clock runs
        # ahead must not keep everyone's nonces behind its own for twice the window.
        self._seen: set[bytes] = set()
        self._expiry: list[tuple[float, bytes]] = []  # a heap of (when it may be forgotten, nonce)
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def _mac(self, frame: Frame) -> bytes:
        assert self._key is not None
        return hmac.new(self._key, wire.encode(attrs.evolve(frame, mac=b"")), hashlib.sha256).digest()

    def seal(self, frame: Frame) -> Frame:
        """The frame with its MAC (unchanged without a secret)."""
        return attrs.evolve(frame, mac=self._mac(frame)) if self.enabled else frame

    def check(self, frame: Frame, *, expect_reply_to: bytes | None = None) -> None:
        """Raise ProtocolError unless the frame is authentic, fresh and not seen before."""
        if expect_reply_to is not None and frame.reply_to != expect_reply_to:
            raise ProtocolError("reply does not answer the request that was sent (stale or forged reply)")
        if not self.enabled:
            return
        if not frame.mac:
            raise ProtocolError(
                f"unauthenticated {frame.kind!r} from {frame.sender!r}: this side channel requires the shared "
                "secret; configure the same secret on both engines"
            )
        if not hmac.compare_digest(frame.mac, self._mac(frame)):
            raise ProtocolError(f"bad MAC on {frame.kind!r} from {frame.sender!r}: the peer uses another secret")
        now = self._clock()
        if not math.isfinite(frame.ts) or abs(now - frame.ts) > self.window_s:
            raise ProtocolError(
                f"{frame.kind!r} from {frame.sender!r} is timestamped {frame.ts:.3f}, now is {now:.3f}: outside the "
                f"{self.window_s}s window (a replay, or clocks out of sync: synchronize them with NTP)"
            )
        if not NONCE_BYTES // 2 <= len(frame.nonce) <= 4 * NONCE_BYTES:
            raise ProtocolError(f"nonce of {len(frame.nonce)} bytes from {frame.sender!r}")
        with self._lock:
            while self._expiry and self._expiry[0][0] < now:
                self._seen.discard(heapq.heappop(self._expiry)[1])
            if frame.nonce in self._seen:
                raise ProtocolError(f"replayed {frame.kind!r} from {frame.sender!r} (nonce seen before): refused")
            if len(self._seen) >= self._max_nonces:
                # Forgetting a nonce inside the window would open a replay: refuse instead.
                raise ProtocolError("too many messages inside the replay window; retry shortly")
            self._seen.add(frame.nonce)
            heapq.heappush(self._expiry, (frame.ts + self.window_s, frame.nonce))
