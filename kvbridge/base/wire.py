"""The one place where kvbridge values become bytes and back. See docs/internals.md."""

from __future__ import annotations

import enum
import numbers
from typing import Any, TypeVar

import cattrs
import msgpack

from kvbridge.base.block_ids import BlockIds
from kvbridge.base.errors import ProtocolError, described

WIRE_VERSION = 2  # 2: block ids packed (BlockIds)
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

T = TypeVar("T")

converter = cattrs.Converter(forbid_extra_keys=True)
converter.register_unstructure_hook(enum.Enum, lambda e: e.value)
converter.register_unstructure_hook(frozenset, lambda s: sorted(converter.unstructure(x) for x in s))


def _strict_bytes(value: Any, _cls: type) -> bytes:
    # cattrs' default is bytes(value): bytes(10**9) from a peer would allocate a gigabyte.
    if not isinstance(value, (bytes, bytearray)):
        raise TypeError(f"expected bytes, got {type(value).__name__}")
    return bytes(value)


converter.register_structure_hook(bytes, _strict_bytes)
# Block ids travel packed: decoding a 10 000-block lease is a buffer view, not 10 000 Python ints.
converter.register_unstructure_hook(BlockIds, BlockIds.to_bytes)
converter.register_structure_hook(BlockIds, lambda value, _cls: BlockIds.from_bytes(_strict_bytes(value, bytes)))


def _strict_bool(value: Any, _cls: type) -> bool:
    # cattrs' default is bool(value), which reads the string "false" as True.
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"expected true or false, got {value!r}")


converter.register_structure_hook(bool, _strict_bool)


def _strict_str(value: Any, cls: type) -> str:
    # cattrs' default is str(value): a peer's list would become a string larger than itself before a length check saw
    # it, and a number or a list passed for a host name would be taken as one.
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value if cls is str else cls(value)  # a str enum, as cattrs builds it


converter.register_structure_hook(str, _strict_str)


def _strict_int(value: Any, cls: type) -> int:
    # cattrs' default is int(value): true became port 1, "80" and 2.7 became numbers.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"expected an integer, got {value!r:.40}")
    return int(value) if cls is int else cls(value)  # an int enum, as cattrs builds it


converter.register_structure_hook(int, _strict_int)


def to_dict(obj: Any) -> Any:
    """Plain dict/list/scalar form of an attrs value (what JSON or msgpack carries)."""
    return converter.unstructure(obj)


def from_dict(data: Any, cls: type[T], *, passthrough: tuple[type[Exception], ...] = ()) -> T:
    """Build `cls` from its plain form; raises ProtocolError naming the bad field. See docs/internals.md."""
    try:
        return converter.structure(data, cls)
    except (cattrs.BaseValidationError, ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
        own = _first_of(exc, passthrough) if passthrough else None
        if own is not None:
            raise own from None
        if isinstance(exc, cattrs.BaseValidationError):
            detail = "; ".join(cattrs.transform_error(exc, format_exception=lambda exc, _type: described(exc)))
        else:
            detail = str(exc)
        raise ProtocolError(f"malformed {cls.__name__}: {detail}") from None


def _first_of(exc: BaseException, kinds: tuple[type[Exception], ...]) -> BaseException | None:
    if isinstance(exc, kinds):
        return exc
    for inner in getattr(exc, "exceptions", ()):  # cattrs groups the errors it found per field
        found = _first_of(inner, kinds)
        if found is not None:
            return found
    return None


def encode(obj: Any) -> bytes:
    """Serialize an attrs value with its type name and the wire version."""
    return msgpack.packb({"v": WIRE_VERSION, "t": type(obj).__name__, "d": to_dict(obj)}, use_bin_type=True)


def decode(
    data: bytes,
    cls: type[T],
    *,
    max_bytes: int = MAX_MESSAGE_BYTES,
    max_items: int | None = None,
    max_str: int | None = None,
) -> T:
    """Parse bytes made by `encode` into `cls`, refusing anything else with a ProtocolError. See docs/internals.md."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"expected bytes for {cls.__name__}, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise ProtocolError(f"{cls.__name__} message of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        envelope = msgpack.unpackb(
            bytes(data),
            raw=False,
            strict_map_key=True,
            max_bin_len=max_bytes,
            max_str_len=max_bytes if max_str is None else max_str,
            max_array_len=max_bytes if max_items is None else max_items,
            max_map_len=max_bytes if max_items is None else max_items,
            max_ext_len=0,  # kvbridge sends no msgpack extension types
        )
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(f"undecodable {cls.__name__} message: {exc}") from None
    if not isinstance(envelope, dict) or set(envelope) != {"v", "t", "d"}:
        raise ProtocolError(f"not a kvbridge {cls.__name__} message (missing version/type envelope)")
    if envelope["v"] != WIRE_VERSION:
        raise ProtocolError(
            f"{cls.__name__} message has wire version {envelope['v']!r}, this kvbridge speaks {WIRE_VERSION}; "
            "run the same kvbridge version on both sides"
        )
    if envelope["t"] != cls.__name__:
        raise ProtocolError(f"expected a {cls.__name__} message, got {envelope['t']!r}")
    return from_dict(envelope["d"], cls)
