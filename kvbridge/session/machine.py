"""The states one decode pull goes through, whole-request or layer by layer, and their record. See docs/internals.md."""

from __future__ import annotations

import enum
import logging
import threading
import time

from kvbridge.base import watchdog
from kvbridge.base.errors import LoadError

log = logging.getLogger(__name__)


class PullState(enum.Enum):
    RESOLVING = "resolving"
    LEASED = "leased"
    READING = "reading"
    LANDING = "landing"
    CONFIRMING = "confirming"
    DONE = "done"
    FENCED = "fenced"
    FAILED = "failed"


TERMINAL = frozenset({PullState.DONE, PullState.FENCED, PullState.FAILED})
_ORDER = (PullState.RESOLVING, PullState.LEASED, PullState.READING, PullState.LANDING, PullState.CONFIRMING)
# Forward along the order, to the next state only (a rank-less pull skips nothing: its states are instant).
_NEXT = {a: b for a, b in zip(_ORDER, (*_ORDER[1:], PullState.DONE))}
STATE_MARKS = tuple(f"at_{s.value}_ms" for s in PullState)


class PullMachine:
    """One pull's state; `to` moves it forward, `end` ends it; both log at debug and stamp the change."""

    def __init__(self, request_id: str, kind: str) -> None:
        self.request_id = request_id
        self.kind = kind  # "pull" or "layerwise", for the log
        self.state = PullState.RESOLVING
        self.begun = time.perf_counter()
        self.at: dict[PullState, float] = {PullState.RESOLVING: self.begun}
        self.error: BaseException | None = None
        # what the reads moved (and the resubmissions they needed) and how long the BeginPulls waited for prefill's
        # offers, for the engine's metrics
        self.nbytes = self.descriptors = self.retries = 0
        self.offer_wait_ms = 0.0
        self.parts: dict[str, float] = {}  # ms of the side channel's steps: contact_ms, begin_ms
        self.read_first = False  # reading began before the BeginPulls were answered (`to(..., leasing=True)`)
        # busy() on progress (and each side-channel answer on this thread); forgotten at its end
        self.beat = watchdog.watch(f"pull of {request_id} ({kind})", this_thread=True)
        self._lock = threading.Lock()  # the transport's thread may end a pull the caller's thread began
        log.debug("request %s (%s): %s", request_id, kind, self.state.value)

    def to(self, state: PullState, *, leasing: bool = False) -> None:
        """Move to the next state; raises RuntimeError on a transition the diagram has not (a bug).

        `leasing`: resolving -> reading, the leases asked for while the read runs (a read first)."""
        with self._lock:
            skip = leasing and self.state is PullState.RESOLVING and state is PullState.READING
            if (_NEXT.get(self.state) is not state and not skip) or state in TERMINAL:
                raise RuntimeError(f"request {self.request_id}: no transition {self.state.value} -> {state.value}")
            self.read_first = self.read_first or skip
            self._enter(state)

    def end(self, error: BaseException | None) -> PullState:
        """End the pull: done from confirming when `error` is None, else fenced or failed.

        Fenced: a lease that did not hold (`LoadError`). A second end is ignored (the first outcome stands)."""
        with self._lock:
            if self.state in TERMINAL:
                return self.state
            if error is None:
                if self.state is not PullState.CONFIRMING:
                    raise RuntimeError(f"request {self.request_id}: done from {self.state.value}")
                state = PullState.DONE
            else:
                state = PullState.FENCED if isinstance(error, LoadError) else PullState.FAILED
            self.error = error
            self._enter(state)
            return state

    def _enter(self, state: PullState) -> None:
        self.at[state] = time.perf_counter()
        self.beat.busy()
        if state in TERMINAL:
            watchdog.WATCHDOG.forget(self.beat)
        log.debug(
            "request %s (%s): %s -> %s%s",
            self.request_id,
            self.kind,
            self.state.value,
            state.value,
            f" ({self.error})" if state in (PullState.FENCED, PullState.FAILED) else "",
        )
        self.state = state

    def ms(self, a: PullState, b: PullState) -> float:
        """Milliseconds from entering `a` to entering `b` (0 when either was not entered)."""
        return max(0.0, (self.at[b] - self.at[a]) * 1e3) if a in self.at and b in self.at else 0.0

    def marks(self) -> dict[str, float]:
        """When each state was entered, milliseconds since the pull began (`at_<state>_ms`)."""
        return {f"at_{s.value}_ms": round((t - self.begun) * 1e3, 3) for s, t in self.at.items()}
