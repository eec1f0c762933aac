"""What a plugin's hooks return: a typed spec for each transport and each device it provides. See docs/internals.md."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from kvbridge.base.errors import ConfigError
from kvbridge.base.options import BackendOptions, NoOptions, describe
from kvbridge.base.types import BackendCapabilities, MemoryKind

if TYPE_CHECKING:
    from kvbridge.base.types import BackendConfig
    from kvbridge.device.contract import Device
    from kvbridge.transport.contract import MigrationBackend


def _name(spec: Any, _attr: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"a {type(spec).__name__} needs a non-empty string name, got {value!r}")


def _callable(spec: Any, attr: attrs.Attribute, value: Any) -> None:
    if not callable(value):
        raise ConfigError(f"{_what(spec)} declares {attr.name}={value!r}; it must be callable")


_optional_callable = attrs.validators.optional(_callable)


def _options(base: type, text: str) -> Callable[[Any, attrs.Attribute, Any], None]:
    def check(spec: Any, _attr: attrs.Attribute, value: Any) -> None:
        if not (isinstance(value, type) and attrs.has(value) and issubclass(value, base)):
            raise ConfigError(f"{_what(spec)} declares options={value!r}; it must be {text}")
        describe(value)  # an annotation that cannot be resolved fails here, naming the plugin, not at use

    return check


def _what(spec: Any) -> str:
    return f"{'transport' if isinstance(spec, BackendSpec) else 'device'} {spec.name!r}"


def _capabilities(spec: Any, _attr: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, BackendCapabilities):
        raise ConfigError(f"{_what(spec)} declares capabilities={value!r}; it must be a kvbridge.BackendCapabilities")


def _memory_kind(value: Any) -> MemoryKind:
    try:
        return MemoryKind(value)
    except ValueError:
        kinds = ", ".join(k.value for k in MemoryKind)
        raise ConfigError(f"memory_kind={value!r} is not one of {kinds}") from None


@attrs.frozen
class BackendSpec:
    """One transport a plugin provides: returned (in a list) from `kvbridge_backends()`. See docs/internals.md."""

    name: str = attrs.field(validator=_name)
    factory: Callable[[BackendConfig, Any], MigrationBackend] = attrs.field(validator=_callable)
    capabilities: BackendCapabilities = attrs.field(validator=_capabilities)
    options: type = attrs.field(
        default=BackendOptions, validator=_options(BackendOptions, "a subclass of kvbridge.BackendOptions")
    )
    probe: Callable[[], str | None] | None = attrs.field(default=None, validator=_optional_callable)
    install_hint: str = ""
    hardware: Callable[[], bool] | None = attrs.field(default=None, validator=_optional_callable)


@attrs.frozen
class DeviceSpec:
    """One device a plugin provides: returned (in a list) from `kvbridge_devices()`. See docs/internals.md."""

    name: str = attrs.field(validator=_name)
    factory: Callable[[Any], Device] = attrs.field(validator=_callable)
    memory_kind: MemoryKind = attrs.field(converter=_memory_kind)
    options: type = attrs.field(default=NoOptions, validator=_options(object, "an attrs class"))
    probe: Callable[[], str | None] | None = attrs.field(default=None, validator=_optional_callable)
    install_hint: str = ""
    hardware: Callable[[], bool] | None = attrs.field(default=None, validator=_optional_callable)
