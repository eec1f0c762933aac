"""Plugin options: each plugin declares them once, as attrs classes; the registry checks them. See docs/internals.md."""

from __future__ import annotations

import difflib
import math
import os
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from kvbridge.base.errors import ConfigError

_DOC = "kvbridge_doc"


def option(default: Any, doc: str, *, min: float | None = None, max: float | None = None) -> Any:  # noqa: A002
    """One declared option: its default, what it does, and a number's bounds. See docs/internals.md."""
    bounds = {"min": min, "max": max}
    if min is not None or max is not None:
        doc += f" ({_bounds_text(min, max)})"
    return attrs.field(
        default=default,
        kw_only=True,
        validator=within(min, max) if min is not None or max is not None else None,
        metadata={_DOC: doc, **{f"kvbridge_{k}": v for k, v in bounds.items() if v is not None}},
    )


def _bounds_text(low: float | None, high: float | None, *, above: bool = False) -> str:
    if above:  # (low given)
        return f"above {_num(low)}" + ("" if high is None else f" and at most {_num(high)}")
    if low is not None and high is not None:
        return f"from {_num(low)} to {_num(high)}"
    return f"at least {_num(low)}" if low is not None else f"at most {_num(high)}"


def _num(x: float | None) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def within(low: float | None, high: float | None, *, above: bool = False) -> Any:
    """An attrs validator: a finite number from `low` (above it, with `above`) to `high`; None and other types pass.

    The type is `parse`'s to check. NaN and infinity are refused: they make a wait or lease that never ends."""

    def check(_instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            return
        under = low is not None and (value <= low if above else value < low)
        if not math.isfinite(value) or under or (high is not None and value > high):
            raise ConfigError(f"option {attribute.name} must be {_bounds_text(low, high, above=above)}, got {value!r}")

    return check


@attrs.frozen
class NoOptions:
    """For a plugin that takes no options."""


@attrs.frozen
class BackendOptions:
    """Options every transport accepts (the base class reads them)."""

    workers: int = option(4, "threads that run this transport's blocking calls", min=1, max=1024)


@attrs.frozen
class OptionInfo:
    """One declared option, as `kvbridge plugins NAME` lists it."""

    name: str
    type: str
    default: Any
    doc: str


def _hints(schema: type) -> dict[str, Any]:
    # Resolved from the declaring module, so `from __future__ import annotations` is fine.
    return typing.get_type_hints(schema)


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def describe(schema: type) -> list[OptionInfo]:
    """The options a schema declares, in declaration order."""
    hints = _hints(schema)
    return [
        OptionInfo(
            name=f.name, type=_type_name(hints.get(f.name, Any)), default=f.default, doc=f.metadata.get(_DOC, "")
        )
        for f in attrs.fields(schema)
    ]


def unknown_names(given: Iterable[str], valid: Iterable[str], *, what: str) -> None:
    """Raise ConfigError for the first name in `given` that is not in `valid`, with a did-you-mean."""
    valid = list(valid)
    for name in given:
        if name in valid:
            continue
        close = difflib.get_close_matches(name, valid, n=1)
        guess = f" (did you mean {close[0]!r}?)" if close else ""
        listed = ", ".join(valid) if valid else "none"
        raise ConfigError(f"{what} has no option {name!r}{guess}; valid options: {listed}")


def parse(schema: type, given: Mapping[str, Any], *, what: str) -> Any:
    """An instance of `schema` from `given`, each value converted to its declared type. See docs/internals.md."""
    if isinstance(given, schema):
        return given
    unknown_names(given, [f.name for f in attrs.fields(schema)], what=what)
    hints = _hints(schema)
    # errors name the option and the type given, never the value: it may be a secret
    values = {
        name: _coerce(value, hints.get(name, Any), f"option {name} of {what} (given a {type(value).__name__})")
        for name, value in given.items()
    }
    try:
        return schema(**values)
    except ConfigError as exc:  # a bound: name the plugin too
        raise ConfigError(f"{what}: {exc}") from None


def as_dict(options: Any) -> dict[str, Any]:
    return attrs.asdict(options, recurse=False)


def checked(schema: type, values: Mapping[str, Any]) -> Any:
    """An instance of `schema` from values `parse` already checked, as a dict. See docs/internals.md."""
    names = {f.name for f in attrs.fields(schema)}
    return schema(**{k: v for k, v in values.items() if k in names})


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_flag(name: str, default: bool = False, *, env: Mapping[str, str] | None = None) -> bool:
    """An on/off variable of `env` (the environment): 1/true/yes/on or 0/false/no/off in any case, else `default`.

    Unset or empty is `default`. Any other value is refused, not read as either (`=0` meaning on surprises)."""
    env = os.environ if env is None else env
    value = env.get(name, "").strip().lower()
    if not value:
        return default
    if value not in _TRUE | _FALSE:
        raise ConfigError(f"{name}={env[name]!r}: set it to 1 (or true, yes, on) or 0 (or false, no, off)")
    return value in _TRUE


def _coerce(value: Any, tp: Any, where: str) -> Any:
    if tp is Any:
        return value
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where} must be {_type_name(tp)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{where} must be a bool (true/false)")
    if tp in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{where} must be {tp.__name__}")
        try:
            number = float(value) if tp is float else _int(value)
        except (ValueError, OverflowError):  # OverflowError: int("inf"), int(1e400)
            raise ConfigError(f"{where} must be {tp.__name__}") from None
        if not math.isfinite(number):  # NaN never expires and never compares; infinity overflows a timer
            raise ConfigError(f"{where} must be a finite number, not NaN or infinity")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string")
        return value
    if tp is bytes:
        if not isinstance(value, (bytes, bytearray)):
            raise ConfigError(f"{where} must be bytes")
        return bytes(value)
    if typing.get_origin(tp) in (dict, Mapping) and not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a mapping (a JSON object)")
    return value


def _int(value: int | float | str) -> int:
    if isinstance(value, int):
        return value
    number = float(value)
    if not number.is_integer():
        raise ValueError(value)
    return int(number)
