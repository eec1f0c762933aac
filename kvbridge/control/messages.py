"""Side-channel messages: versioned attrs classes, carried inside an authenticated `Frame`. See docs/internals.md."""

from __future__ import annotations

import enum
from typing import Any

import attrs

from kvbridge.agent.kv_agent import RankInfo
from kvbridge.base.block_ids import BlockIds

MAX_ID_CHARS = 512  # request ids, engine ids, rank names: generous, but bounded
# A request's blocks in one message: 2 MiB packed (8 bytes each), so a BeginPull, Offer or LeaseStatus of the
# most blocks fits in the side channel's 4 MiB messages (channel.MAX_MESSAGE_BYTES) with room for its other
# fields. 262 144 blocks are 4M tokens at vLLM's 16 tokens per block.
MAX_BLOCKS = 1 << 18
MAX_PULLS = 1 << 16  # decode ranks reading one prefill rank: far above any parallel config
MAX_EPOCH = (1 << 63) - 1
MAX_WAIT_MS = 600_000
# msgpack's bounds for a Frame and a request body: a few fields, ids (MAX_ID_CHARS characters of up to 4 UTF-8
# bytes) and block ids packed as bytes. Garbage from a peer, authenticated or not, is refused by the decoder
# before any of it is built (building a large list holds the serving thread). Replies are decoded without them:
# a layout or a stream's per-layer counts are long arrays.
MAX_FIELDS = 16
MAX_ID_BYTES = 4 * MAX_ID_CHARS


def _bounded_str(_inst: object, attr: attrs.Attribute, value: str) -> None:
    if len(value) > MAX_ID_CHARS:
        raise ValueError(f"{attr.name} is {len(value)} characters long; at most {MAX_ID_CHARS} are allowed")


def _bounded_blocks(_inst: object, attr: attrs.Attribute, value: BlockIds) -> None:
    if len(value) > MAX_BLOCKS:  # each id was checked by BlockIds
        raise ValueError(f"{attr.name} lists {len(value)} blocks; at most {MAX_BLOCKS} are allowed")


def _blocks(**kwargs: Any) -> Any:
    """A field of block ids: `BlockIds` (packed on the wire), bounded to MAX_BLOCKS."""
    return attrs.field(converter=BlockIds, validator=_bounded_blocks, **kwargs)


def _bounded_counts(_inst: object, attr: attrs.Attribute, value: tuple[int, ...]) -> None:
    if len(value) > MAX_BLOCKS:
        raise ValueError(f"{attr.name} lists {len(value)} values; at most {MAX_BLOCKS} are allowed")
    if not all(isinstance(v, int) and 0 <= v <= MAX_EPOCH for v in value):
        raise ValueError(f"{attr.name} must list integers in [0, 2**63)")


def _int_in(low: int, high: int) -> Any:
    """An int in [low, high]: a count or epoch off the wire never reaches arithmetic unbounded."""

    def check(_inst: object, attr: attrs.Attribute, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ValueError(f"{attr.name} must be an integer in [{low}, {high}], got {value!r:.40}")

    return check


def _id() -> str:
    return attrs.field(validator=[attrs.validators.instance_of(str), _bounded_str])


@attrs.frozen
class Frame:
    """What travels on the socket: one message, who sent it, and its authentication."""

    kind: str = attrs.field(validator=[attrs.validators.instance_of(str), _bounded_str])
    sender: str = attrs.field(validator=[attrs.validators.instance_of(str), _bounded_str])
    nonce: bytes = attrs.field(validator=attrs.validators.instance_of(bytes))
    ts: float = attrs.field(validator=attrs.validators.instance_of(float))
    body: bytes = attrs.field(validator=attrs.validators.instance_of(bytes))
    reply_to: bytes = attrs.field(default=b"", validator=attrs.validators.instance_of(bytes))
    mac: bytes = attrs.field(default=b"", validator=attrs.validators.instance_of(bytes))
    # The rank a request is for (its `engine_id/rank`), covered by the MAC: a frame recorded on its way to one
    # rank is refused by another that shares the secret. "" on a GetInfo (how a client learns the name) and
    # on replies. Wire compatibility: the field has no version bump of its own, since the side channel needs the
    # same kvbridge on both sides anyway. A frame from an older kvbridge decodes with "" and is refused for every
    # kind but GetInfo (it could be replayed to any rank); a newer frame is refused by an older decoder (an
    # unknown field). Either way the refusal says which.
    receiver: str = attrs.field(default="", validator=[attrs.validators.instance_of(str), _bounded_str])


class LeaseState(str, enum.Enum):
    """Where a lease is in its life. Only ACTIVE blocks may be read."""

    ACTIVE = "active"
    RELEASED = "released"  # every expected DONE arrived
    EXPIRED = "expired"  # the timeout passed first; the blocks may already be reused
    ABORTED = "aborted"
    UNKNOWN = "unknown"  # never offered here, or forgotten long ago


MAX_CARD_HOSTS = 16
MAX_CARD_S = 600.0  # a card valid longer is refused: a recorded one must not admit its hosts for long


def _card_hosts(_inst: object, attr: attrs.Attribute, value: tuple[str, ...]) -> None:
    if len(value) > MAX_CARD_HOSTS or not all(isinstance(h, str) and len(h) <= 64 for h in value):
        raise ValueError(f"{attr.name} must list at most {MAX_CARD_HOSTS} addresses")


@attrs.frozen
class PeerCard:
    """A rank's word about itself, inside a signed frame it sent: the addresses its transport reaches peers from.

    A peer admits `hosts` to its guarded listeners (`kvbridge.transport.netguard`) only from a card whose `name` (the
    rank's `engine_id/rank`) is the frame's sender and which has not `expires`d (wall-clock seconds): never the
    TCP source of a message, which a replay or a relay chooses."""

    name: str = _id()
    hosts: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_card_hosts)
    expires: float = attrs.field(default=0.0, validator=attrs.validators.instance_of(float))


# -- requests ---------------------------------------------------------------------------------


@attrs.frozen
class GetInfo:
    """Ask a rank for its registered memory (`RegisteredMemory`) and readiness."""


@attrs.frozen
class BeginPull:
    """Decode rank `decode_rank` will read `blocks` of `request_id`; `notify_*`: its channel. See docs/internals.md."""

    request_id: str = _id()
    decode_rank: str = _id()
    notify_host: str = attrs.field(default="", validator=_bounded_str)
    notify_port: int = attrs.field(default=0, validator=_int_in(0, 65535))
    expected_pulls: int = attrs.field(default=0, validator=_int_in(0, MAX_PULLS))  # 0: not stated
    blocks: BlockIds = _blocks(default=BlockIds())
    # How long the server may hold the answer while the request is not offered yet (0: answer at once).
    wait_ms: int = attrs.field(default=0, validator=_int_in(0, MAX_WAIT_MS))
    # The decode rank's transport addresses, admitted by the prefill rank while the lease lasts.
    card: PeerCard | None = None


@attrs.frozen
class Offer:
    """The engine's scheduler offers `request_id`'s finished `blocks` to this rank's ledger. See docs/internals.md."""

    request_id: str = _id()  # the lease's id (a moved decode request's: the proxy's move id)
    blocks: BlockIds = _blocks()
    offer_id: str = _id()
    # the engine's id of the request, reported finished sending when the lease ends; "" when it is request_id
    engine_request_id: str = attrs.field(default="", validator=[attrs.validators.instance_of(str), _bounded_str])


@attrs.frozen
class Done:
    """Decode rank `decode_rank` finished reading `request_id` under lease `epoch` (0: none). See docs/internals.md."""

    request_id: str = _id()
    decode_rank: str = _id()
    epoch: int = attrs.field(default=0, validator=_int_in(0, MAX_EPOCH))
    expected_pulls: int = attrs.field(default=0, validator=_int_in(0, MAX_PULLS))


@attrs.frozen
class QueryLease:
    """Whether the lease on `request_id` (with `epoch`, if not 0) is still valid."""

    request_id: str = _id()
    epoch: int = attrs.field(default=0, validator=_int_in(0, MAX_EPOCH))


@attrs.frozen
class QueryStream:
    """How far has prefill computed `request_id` (layer-wise)? Answered with a `StreamStatus`. See docs/internals.md."""

    request_id: str = _id()
    epoch: int = attrs.field(default=0, validator=_int_in(0, MAX_EPOCH))
    seen: int = attrs.field(default=0, validator=_int_in(0, MAX_EPOCH))
    wait_ms: int = attrs.field(default=0, validator=_int_in(0, MAX_WAIT_MS))


@attrs.frozen
class Abort:
    """`request_id` was aborted by `origin`; the receiver frees what it holds for it."""

    request_id: str = _id()
    origin: str = attrs.field(default="", validator=_bounded_str)
    reason: str = attrs.field(default="", validator=_bounded_str)


# -- replies ----------------------------------------------------------------------------------


@attrs.frozen
class RegisteredMemory:
    """A rank's registered memory: the agent's `RankInfo` (parallel config, KV layout, transport endpoint).

    None until the rank is ready. `meta` carries free-form strings for adapters."""

    engine_id: str = _id()
    rank: int = attrs.field(validator=attrs.validators.instance_of(int))
    ready: bool = attrs.field(validator=attrs.validators.instance_of(bool))
    info: RankInfo | None = None
    meta: dict[str, str] = attrs.field(factory=dict)
    card: PeerCard | None = None  # the rank's transport addresses, admitted by the asker


@attrs.frozen
class LeaseStatus:
    """A lease as the prefill ledger sees it. `valid` is the fencing answer for the asker's read."""

    request_id: str = _id()
    state: LeaseState = attrs.field(converter=LeaseState)
    valid: bool = False
    epoch: int = 0
    blocks: BlockIds = _blocks(default=BlockIds())
    remaining_s: float = 0.0
    released: bool = False  # this message caused the release
    waited_ms: float = 0.0  # how long the server held a BeginPull for the request's offer
    # The prefill rank keeps the blocks for every decode rank that began a pull until its DONE, or for
    # `remaining_s`, whatever else happens to the lease: a read that ended within that time read intact
    # bytes, whether or not its DONE has been answered yet.
    reads_held: bool = False
    # A valid answer's reader stays admitted to this rank's transport listeners at least this long from the answer
    # (the lease ends no sooner, and the admission's grace follows it): a reader asking again within that time may
    # start its read before the answer, and use it only once the answer says its lease held.
    admitted_s: float = 0.0
    # The digest of the RankInfo the rank serves now (`RankInfo.digest`), on a valid BeginPull's answer: a reader that
    # holds an older one (the rank's process restarted under the same engine id) must not read with it.
    info_digest: str = attrs.field(default="", validator=[attrs.validators.instance_of(str), _bounded_str])


# A stream's version when it starts: a reader that asks with this `seen` is held until the prefill first
# wakes its readers (the first step's layers saved), instead of being answered at once with nothing ready.
STREAM_FIRST_VERSION = 1


@attrs.frozen
class StreamStatus:
    """A streamed request on a prefill rank. See docs/internals.md."""

    lease: LeaseStatus
    tokens: int = attrs.field(default=0, validator=_int_in(0, MAX_EPOCH))
    ready: tuple[int, ...] = attrs.field(default=(), converter=tuple, validator=_bounded_counts)
    # grows whenever the prefill wakes its readers (a step's layers saved); a QueryStream is held while it stays
    version: int = attrs.field(default=0, validator=_int_in(0, MAX_EPOCH))
    # the QueryStream was held (the stream had not moved when it arrived), this long: the prefill was still
    # computing when the query was sent, so a reader knows its reads until then overlapped the compute
    held_ms: float = 0.0


@attrs.frozen
class Ack:
    """A request was taken into account."""

    ok: bool = True


@attrs.frozen
class Refused:
    """The server would not act on a request; `kind` says why ("protocol", "not_ready", "no_ledger")."""

    kind: str = _id()
    message: str = attrs.field(default="", validator=attrs.validators.instance_of(str))


REQUESTS: dict[str, type] = {c.__name__: c for c in (GetInfo, BeginPull, Offer, Done, QueryLease, QueryStream, Abort)}
REPLIES: dict[str, type] = {c.__name__: c for c in (RegisteredMemory, LeaseStatus, StreamStatus, Ack, Refused)}
