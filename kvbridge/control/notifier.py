"""Abort notifications a side channel sends its peers, each peer from a queue and a thread of its own."""

from __future__ import annotations

import collections
import logging
import threading
import time

from kvbridge.base.errors import KVBridgeError, PeerGone, TransferTimeout
from kvbridge.base.threadname import NamedThread
from kvbridge.control.client import ClientPool
from kvbridge.control.framing import Address
from kvbridge.control.messages import Abort

# The side channel's one logger, whichever of its modules logs: one name for operators' filters.
log = logging.getLogger("kvbridge.control.channel")

MAX_NOTIFIED_PEERS = 256  # peers with abort notifications pending at once (a thread each); beyond, the leases expire


class Notifier:
    """Sends abort notifications, each peer from a queue and a thread of its own.

    A peer that is gone costs each of its notifications the notify timeout, and only its own queue waits for that. After
    a timeout the peer's queued notifications are dropped (they would wait as long; the leases they end expire)."""

    def __init__(self, name: str, clients: ClientPool) -> None:
        self.name = name
        self._clients = clients
        self._lock = threading.Lock()
        # peer -> notifications not sent yet; a peer is listed while its thread runs (send() starts one if not)
        self._queues: dict[Address, collections.deque[Abort]] = {}
        self._threads: set[threading.Thread] = set()
        self._closed = False

    def send(self, addr: Address, msg: Abort) -> None:
        with self._lock:
            if self._closed:
                return
            queue = self._queues.get(addr)
            if queue is not None:
                queue.append(msg)
                return
            if len(self._queues) >= MAX_NOTIFIED_PEERS:
                log.warning(
                    "%s: %d peers have abort notifications pending; not telling %s:%d about %s (its lease expires)",
                    self.name,
                    len(self._queues),
                    *addr,
                    msg.request_id,
                )
                return
            self._queues[addr] = collections.deque([msg])
            thread = NamedThread(
                target=self._drain, args=(addr,), name=f"kvbridge-abort-{self.name}-{addr[0]}:{addr[1]}", daemon=True
            )
            self._threads.add(thread)
        thread.start()

    def _drain(self, addr: Address) -> None:
        ended = False
        try:
            while True:
                with self._lock:
                    queue = self._queues[addr]
                    if not queue:
                        del self._queues[addr]  # under the lock: send() starts a new thread from now on
                        ended = True
                        return
                    msg = queue.popleft()
                try:
                    self._clients.get(*addr).abort(msg.request_id, origin=msg.origin, reason=msg.reason)
                except (TransferTimeout, PeerGone) as exc:  # silent or gone: the rest queued for it would be too
                    with self._lock:
                        dropped = len(queue)
                        queue.clear()
                    log.warning(
                        "%s could not tell %s:%d about abort of %s%s: %s",
                        self.name,
                        *addr,
                        msg.request_id,
                        f" (nor of {dropped} more queued for it)" if dropped else "",
                        exc,
                    )
                except KVBridgeError as exc:
                    log.warning("%s could not tell %s:%d about abort of %s: %s", self.name, *addr, msg.request_id, exc)
                except Exception:  # a bug costs this notification, not the peer's queue its thread
                    log.exception("%s: telling %s:%d about abort of %s failed", self.name, *addr, msg.request_id)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())
                # Ended any other way (its thread killed by an error not caught above): without its thread the
                # queue would only grow. Dropped instead, so the next notification starts a thread again.
                left = None if ended else self._queues.pop(addr, None)
            if left:
                log.warning(
                    "%s dropped %d abort notifications for %s:%d; their leases expire", self.name, len(left), *addr
                )

    def close(self, grace_s: float) -> None:
        """Take no more; give what is pending `grace_s` to go out, then drop it.

        A send in flight ends by itself, within the notify timeout."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        deadline = time.monotonic() + grace_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            dropped = sum(len(q) for q in self._queues.values())
            for queue in self._queues.values():
                queue.clear()
        if dropped:
            log.warning("%s closed with %d abort notifications not sent; their leases expire", self.name, dropped)
        self._clients.close()
