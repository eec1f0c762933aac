"""The wire encoding refuses anything that is not the expected, versioned kvbridge value."""

from __future__ import annotations

import pickle

import msgpack
import numpy as np
import pytest

from kvbridge.base import wire
from kvbridge.base.block_ids import BlockIds
from kvbridge.base.errors import ProtocolError, described
from kvbridge.base.types import EndpointInfo, MemoryKind, MemoryRegion
from kvbridge.control.messages import LeaseState, LeaseStatus

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
        (msgpack.packb({"v": wire.WIRE_VERSION, "t": "MemoryRegion", "d": {}}), "expected a EndpointInfo"),
        (msgpack.packb({"v": wire.WIRE_VERSION, "t": "EndpointInfo", "d": {"backend": "x"}}), "malformed EndpointInfo"),
        (
            msgpack.packb({"v": wire.WIRE_VERSION, "t": "EndpointInfo", "d": {**wire.to_dict(INFO), "evil": 1}}),
            "malformed",
        ),
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


def test_strings_are_strict_and_str_enums_still_structure() -> None:
    import attrs

    @attrs.frozen
    class Named:
        name: str
        state: LeaseState = LeaseState.UNKNOWN

    assert wire.from_dict({"name": "a", "state": "active"}, Named) == Named("a", LeaseState.ACTIVE)
    for bad in ([1, 2], {"a": 1}, 5):  # str() of them used to pass, as a 12 MB string for a 4 MiB list
        with pytest.raises(ProtocolError, match="expected a string"):
            wire.from_dict({"name": bad}, Named)


def test_decode_bounds_containers_and_strings_for_small_types() -> None:
    status = LeaseStatus("r" * 100, LeaseState.ACTIVE, True, 7, list(range(1000)))  # 1000 blocks: bytes, not items
    data = wire.encode(status)
    assert wire.decode(data, LeaseStatus, max_items=16, max_str=200) == status
    with pytest.raises(ProtocolError, match="max_str_len"):
        wire.decode(data, LeaseStatus, max_items=16, max_str=50)
    listed = msgpack.packb({"v": wire.WIRE_VERSION, "t": "LeaseStatus", "d": {"request_id": [0] * 100}})
    with pytest.raises(ProtocolError, match="max_array_len"):
        wire.decode(listed, LeaseStatus, max_items=16)


# -- block ids ---------------------------------------------------------------------------------------


def test_block_ids_travel_packed_and_come_back_equal() -> None:
    ids = list(range(10_000, 0, -3))
    status = LeaseStatus("r", LeaseState.ACTIVE, True, 7, ids)
    data = wire.encode(status)
    assert ids[0].to_bytes(8, "little") in data  # packed: 8 bytes per id, little-endian
    back = wire.decode(data, LeaseStatus)
    assert back == status and back.blocks == tuple(ids) and back.blocks == BlockIds(ids)
    assert not np.asarray(back.blocks).flags.writeable  # a view, and nobody writes through it


@pytest.mark.parametrize(
    "blocks, match",
    [
        ([1, 2, 3], "expected bytes"),  # the unpacked form of wire version 1
        (b"\x01" * 7, "8 bytes each"),
        ((-1).to_bytes(8, "little", signed=True), "in \\[0, 2\\*\\*63\\)"),
    ],
)
def test_malformed_packed_block_ids_are_protocol_errors(blocks: object, match: str) -> None:
    d = {**wire.to_dict(LeaseStatus("r", LeaseState.ACTIVE)), "blocks": blocks}
    data = msgpack.packb({"v": wire.WIRE_VERSION, "t": "LeaseStatus", "d": d}, use_bin_type=True)
    with pytest.raises(ProtocolError, match=match):
        wire.decode(data, LeaseStatus)


@pytest.mark.parametrize("bad", [[1.5], ["3"], [-2], [1 << 64], np.array([1.0]), np.zeros((2, 2), dtype=np.int64)])
def test_block_ids_refuse_what_is_not_a_block_id(bad: object) -> None:
    with pytest.raises(ValueError, match="block ids"):
        BlockIds(bad)  # type: ignore[arg-type]


def test_block_ids_are_an_immutable_sequence() -> None:
    source = np.array([5, 9, 2], dtype=np.int64)
    ids = BlockIds(source)
    source[0] = 99  # the caller's array stays the caller's
    assert ids == (5, 9, 2) and ids == [5, 9, 2] and ids != (5, 9) and list(ids) == [5, 9, 2]
    assert ids[1] == 9 and ids[1:] == (9, 2) and ids + (4,) == (5, 9, 2, 4) and len(ids) == 3
    assert hash(ids) == hash(BlockIds([5, 9, 2])) == hash((5, 9, 2)) and {(5, 9, 2): 1}[ids] == 1
    with pytest.raises(ValueError):
        ids.array[0] = 1
    back = pickle.loads(pickle.dumps(ids))  # vLLM pickles connector metadata for its workers
    assert back == ids and not back.array.flags.writeable


def test_an_error_is_described_by_its_type_and_its_message_only_where_it_has_one() -> None:
    # httpx's transport errors and a bare TimeoutError carry no message: a log line then still names something
    assert described(TimeoutError()) == "TimeoutError"
    assert described(ValueError("bad port 'x'")) == "ValueError: bad port 'x'"
