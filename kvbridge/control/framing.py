"""What both ends of the side channel share: frame building and decoding, addresses, this process's card."""

from __future__ import annotations

import ipaddress
import time
from typing import TypeVar

from kvbridge.base import wire
from kvbridge.base.secret import is_loopback
from kvbridge.control.auth import new_nonce
from kvbridge.control.messages import MAX_CARD_HOSTS, MAX_FIELDS, MAX_ID_BYTES, Frame, PeerCard
from kvbridge.transport import netguard

MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # a layout of thousands of regions fits; nothing legitimate is larger
MISADDRESSED = "misaddressed"  # the Refused kind for a request that names another rank
CARD_S = 120.0  # how long a PeerCard this rank signs is valid
Address = tuple[str, int]

T = TypeVar("T")


def decode_small(data: bytes, cls: type[T], max_bytes: int) -> T:
    """A Frame or a request body: only a few fields, short strings and bytes (see MAX_FIELDS)."""
    return wire.decode(data, cls, max_bytes=max_bytes, max_items=MAX_FIELDS, max_str=MAX_ID_BYTES)


def engine_of(name: str) -> str:
    """The engine of a side channel's name, `engine_id/rank`."""
    return name.rpartition("/")[0]


def new_frame(kind: str, sender: str, body: bytes, reply_to: bytes = b"", receiver: str = "") -> Frame:
    return Frame(
        kind=kind, sender=sender, nonce=new_nonce(), ts=time.time(), body=body, reply_to=reply_to, receiver=receiver
    )


def ipv6(host: str) -> bool:
    """ZeroMQ's IPv6 on for an IPv6 address or `*` (both families); a name stays IPv4 (`localhost` must not be ::1)."""
    return ":" in host or host == "*"


def bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host  # as a ZeroMQ endpoint names it


def own_card(name: str) -> PeerCard:
    """This process's card as rank `name`: its guarded transports' addresses, valid for `CARD_S`."""
    return PeerCard(name, netguard.transport_hosts()[:MAX_CARD_HOSTS], time.time() + CARD_S)


def same_host(claimed: str, source: str | None) -> bool:
    """Is `claimed` (a notify host) the `source` host a request came from? Both loopback counts as the same."""
    if source is None:
        return False
    if is_loopback(claimed) and is_loopback(source):
        return True
    try:
        return ipaddress.ip_address(claimed.strip("[]")) == ipaddress.ip_address(source.strip("[]"))
    except ValueError:
        return False
