"""The wire encoding refuses anything that is not the expected, versioned kvbridge value."""

from __future__ import annotations

import msgpack
import pytest

from kvbridge import wire
from kvbridge.errors import ProtocolError
from kvbridge.types import EndpointInfo, MemoryKind, MemoryRegion

INFO = EndpointInfo(
    "mooncake",
    "tcp",
    "127.0.0.1:1234",
    (MemoryRegion(4096, 8192), MemoryRegion(1 << 20, 4096, MemoryKind.VRAM, 3)),
    {"k": "v"},
)


def test_round_trip() -> None:
    assert wire.decode(wire.encode(INFO), EndpointInfo) == INFO


@pytest.mark.parametrize(
    "data, match",
    [
        (b"\xc1garbage", "undecodable"),
        (msgpack.packb([1, 2, 3]), "missing version"),
        (msgpack.packb({"v": 99, "t": "EndpointInfo", "d": {}}), "wire version 99"),
        (msgpack.packb({"v": 1, "t": "MemoryRegion", "d": {}}), "expected a EndpointInfo"),
        (msgpack.packb({"v": 1, "t": "EndpointInfo", "d": {"backend": "x"}}), "malformed EndpointInfo"),
        (msgpack.packb({"v": 1, "t": "EndpointInfo", "d": {**wire.to_dict(INFO), "evil": 1}}), "malformed"),
    ],
)
def test_bad_messages_are_protocol_errors(data: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        wire.decode(data, EndpointInfo)


def test_size_bound() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        wire.decode(wire.encode(INFO), EndpointInfo, max_bytes=10)


def test_a_region_with_a_negative_length_is_refused() -> None:
    bad = wire.to_dict(INFO)
    bad["regions"][0]["length"] = -1
    with pytest.raises(ProtocolError, match="positive length"):
        wire.from_dict(bad, EndpointInfo)


def test_booleans_are_strict() -> None:
    import attrs

    @attrs.frozen
    class Flag:
        on: bool

    assert wire.from_dict({"on": True}, Flag).on is True
    assert wire.from_dict({"on": 0}, Flag).on is False
    with pytest.raises(ProtocolError, match="expected true or false"):
        wire.from_dict({"on": "false"}, Flag)
