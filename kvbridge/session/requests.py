"""`RequestParams`: one request's `kv_transfer_params` as an engine's scheduler reads them. See docs/internals.md."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import attrs

from kvbridge.base.errors import ConfigError
from kvbridge.control.messages import MAX_ID_CHARS
from kvbridge.control.params import KVTransferParams
from kvbridge.session.lending import LENT_LAG, precopied

log = logging.getLogger(__name__)


def move_of(params: Any) -> str | None:
    """The move id a decode request is marked with (the proxy may move it), or None."""
    if not isinstance(params, Mapping) or params.get("do_remote_decode"):
        return None
    move = params.get("kvbridge_move_id")
    if not isinstance(move, str) or not move or precopied(move) is not None:
        return None  # a pre-copy's own request is never moved, nor lent from
    return move


@attrs.define
class RequestParams:
    """A request's params decoded once, when its engine first shows it; what changes while it runs changes here.

    The engine's own dict stays as it came: a prefill request the engine cannot stream is served in pull mode, and
    a decode request pulls once (also after a preemption), both said here."""

    given: bool = False  # a dict that is not empty (and decodes, where it asks for a transfer)
    decoded: KVTransferParams | None = None  # where they ask for a transfer (do_remote_prefill, do_remote_decode)
    layerwise: bool = False  # transfer_mode "layerwise"
    move_id: str | None = None  # a decode request the proxy may move (`move_of`)
    remote_decode: bool = False  # prefill: a decode pulls the finished request's blocks
    # decode: still to pull, until its pull is built or its params turn out to name nothing to pull from
    remote_prefill: bool = False
    pull: KVTransferParams | None = None  # what it pulls (`to_pull`), worked out on first need
    # prefill in pull mode: the lease id the proxy chose (`transfer_id`), so it can release a lease whose answer it
    # never read (its client left); None: the engine's request id
    lease_id: str | None = None

    @classmethod
    def read(cls, request_id: str, params: Any) -> RequestParams | None:
        """The entry of a request's `kv_transfer_params` as they came (none or empty ones: an empty entry).

        None, logged, where they are no JSON object or, asking for a transfer, do not decode: the engine then drops
        them and serves the request as a colocated server would, so nothing a client sends raises in its scheduler."""
        if params is not None and not isinstance(params, Mapping):
            return cls._refused(request_id, f"kv_transfer_params must be a JSON object, got {type(params).__name__}")
        if not params:
            return cls()
        decoded = None
        if params.get("do_remote_prefill") or params.get("do_remote_decode"):
            try:
                decoded = KVTransferParams.from_dict(params)
            except ConfigError as exc:
                return cls._refused(request_id, str(exc))
        return cls(
            given=True,
            decoded=decoded,
            layerwise=params.get("transfer_mode") == "layerwise",
            move_id=move_of(params),
            remote_decode=decoded is not None and decoded.do_remote_decode,
            remote_prefill=decoded is not None and decoded.do_remote_prefill,
            lease_id=cls._lease_id(request_id, decoded),
        )

    @staticmethod
    def _lease_id(request_id: str, decoded: KVTransferParams | None) -> str | None:
        """A pull-mode prefill request's `transfer_id`, where it can key a lease (else None: logged, not refused)."""
        if decoded is None or not decoded.do_remote_decode or decoded.transfer_mode == "layerwise":
            return None
        tid = decoded.transfer_id
        if tid is not None and not (0 < len(tid) <= MAX_ID_CHARS):
            log.warning("request %s: its transfer_id is empty or over %d characters; unused", request_id, MAX_ID_CHARS)
            return None
        return tid

    @staticmethod
    def _refused(request_id: str, problem: str) -> None:
        log.error(
            "request %s: %s; served as a colocated server would, the params ignored (the proxy sets them: "
            "kvbridge proxy, or vLLM's P/D proxies)",
            request_id,
            problem,
        )

    def served_pulled(self) -> None:
        """The engine cannot stream this request: it is served in pull mode (also the pull it may ask for)."""
        assert self.decoded is not None
        self.layerwise = False
        self.decoded = attrs.evolve(self.decoded, transfer_mode="pull")

    def to_pull(self, block_size: int) -> KVTransferParams:
        """What a `do_remote_prefill` request pulls; ConfigError where its params name nothing to pull from."""
        assert self.decoded is not None
        decoded = self.decoded.move_resolved()
        decoded.require_remote()
        if precopied(decoded.kvbridge_move_id or "") is not None:
            # a pre-copy reads the whole blocks the source's workers surely lend: the proxy saw N tokens, so the step
            # that sampled the last one ran, and with it the news of the blocks computed two steps before it (N - 3
            # tokens; kvbridge.adapters.vllm.marked); the reader computes the rest
            whole = max(0, int(decoded.remote_num_tokens or 0) - LENT_LAG) // block_size * block_size
            decoded = attrs.evolve(decoded, remote_num_tokens=whole)
        return decoded
