"""Plugin discovery and the registry of transports and devices.

Built-ins are registered first through the same hooks as third-party plugins, then every
entry point in the ``kvbridge`` group. Two environment variables, read when the registry is
first built (never at import), choose which entry-point plugins load:

- ``KVBRIDGE_PLUGINS``: comma-separated allow-list of entry point names; empty loads none.
- ``KVBRIDGE_BLOCK_PLUGINS``: comma-separated names never to load.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Any

import attrs
import pluggy

from kvbridge import hookspecs
from kvbridge.backend import MigrationBackend
from kvbridge.device import Device
from kvbridge.errors import (
    ConfigError,
    KVBridgeError,
    PluginAPIMismatch,
    PluginError,
    PluginNotFound,
    PluginUnavailable,
)
from kvbridge.options import NoOptions, OptionInfo, TransportOptions, as_dict, describe, parse, unknown_names
from kvbridge.types import BackendCapabilities, BackendConfig, MemoryKind, PluginInfo

log = logging.getLogger(__name__)

PLUGIN_API_VERSION = 1
ENTRY_POINT_GROUP = "kvbridge"
ALLOW_ENV = "KVBRIDGE_PLUGINS"
BLOCK_ENV = "KVBRIDGE_BLOCK_PLUGINS"
# the plugins kvbridge ships (plugins/ in its repository), by the name each registers
OWN_DISTRIBUTIONS = {
    "mooncake": "kvbridge-mooncake",
    "nixl": "kvbridge-nixl",
    "cuda": "kvbridge-cuda",
    "npu": "kvbridge-ascend",
    "mlu": "kvbridge-mlu",
}


@attrs.define
class Registration:
    """One transport or device a plugin registered, with its lazy factory."""

    kind: str
    name: str
    factory: Callable[..., Any]
    probe: Callable[[], str | None] | None
    install_hint: str
    distribution: str
    version: str
    capabilities: BackendCapabilities | None = None
    memory_kind: MemoryKind | None = None
    hardware: Callable[[], bool] | None = None
    options: type = NoOptions
    _reason: str | None = attrs.field(default=None, init=False)
    _probed: bool = attrs.field(default=False, init=False)

    def unavailable_reason(self) -> str | None:
        """Why this cannot run here, or None. Probed once; a probe that raises is a reason too."""
        if not self._probed:
            try:
                reason = self.probe() if self.probe else None
                if reason is not None and not (isinstance(reason, str) and reason):
                    # "" would read as available in one place and not in another
                    reason = f"its availability check returned {reason!r}, not a reason or None"
                self._reason = reason
            except Exception as exc:  # a probe must not take the registry down; its failure is the reason
                self._reason = f"availability check failed: {type(exc).__name__}: {exc}"
            self._probed = True
        return self._reason

    def _hardware_here(self) -> bool | None:
        if self.hardware is None:
            return None
        try:
            return bool(self.hardware())
        except Exception:  # an unanswerable check is "unknown", never a crash of the listing
            log.debug("hardware check of %s %s raised", self.kind, self.name, exc_info=True)
            return None

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """Around the factory: an error that is not kvbridge's names the plugin and its distribution
        (a vendor runtime's RuntimeError alone does not say which plugin raised it)."""
        try:
            yield
        except KVBridgeError:
            raise
        except Exception as exc:
            raise PluginError(
                f"{self.kind} {self.name!r} from {self.distribution} {self.version} failed to start: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def option_infos(self) -> list[OptionInfo]:
        """The options this plugin declares."""
        return describe(self.options)

    def parse_options(self, config: BackendConfig) -> BackendConfig:
        """`config` with its options checked against the declared class and completed with defaults."""
        what = f"{self.kind} {self.name!r}"
        # create_backend's own settings are named too: `protocl=` is a typo of `protocol`, not an option
        settings = [f.name for f in attrs.fields(BackendConfig) if f.name != "options"]
        unknown_names(config.options, settings + [f.name for f in attrs.fields(self.options)], what=what)
        return attrs.evolve(config, options=as_dict(parse(self.options, config.options, what=what)))

    def info(self) -> PluginInfo:
        reason = self.unavailable_reason()
        detail: dict[str, object] = {}
        if self.capabilities is not None:
            detail = {
                "protocols": list(self.capabilities.protocols),
                "memory": sorted(k.value for k in self.capabilities.memory_kinds),
            }
        elif self.memory_kind is not None:
            detail = {"memory": self.memory_kind.value}
        return PluginInfo(
            kind=self.kind,
            name=self.name,
            available=reason is None,
            reason=reason or "",
            hint=self.install_hint if reason else "",
            hardware_here=self._hardware_here(),
            distribution=self.distribution,
            version=self.version,
            detail=detail,
        )


def _csv(value: str | None) -> set[str] | None:
    if value is None:
        return None
    return {v.strip().lower() for v in value.split(",") if v.strip()}


class PluginRegistry:
    """Loads plugins once and answers lookups by case-insensitive name."""

    def __init__(self, *, entry_points: bool = True) -> None:
        self.pm = pluggy.PluginManager("kvbridge")
        self.pm.add_hookspecs(hookspecs)
        self._sources: dict[str, tuple[str, str]] = {}  # plugin name -> (distribution, version)
        self.backends: dict[str, Registration] = {}
        self.devices: dict[str, Registration] = {}
        self.refused: list[PluginInfo] = []
        self.skipped: list[str] = []  # entry points ALLOW_ENV/BLOCK_ENV kept from loading
        self._devices_made: dict[str, Device] = {}
        self._lock = threading.Lock()

        from kvbridge import builtins

        self._add_plugin(builtins, "builtin", "kvbridge", _version("kvbridge"))
        if entry_points:
            self._load_entry_points()
        self._collect()

    def _load_entry_points(self) -> None:
        allow = _csv(os.environ.get(ALLOW_ENV))
        block = _csv(os.environ.get(BLOCK_ENV)) or set()
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist else "?"
            version = ep.dist.version if ep.dist else "?"
            if ep.name.lower() in block or (allow is not None and ep.name.lower() not in allow):
                log.debug("plugin %s skipped by %s/%s", ep.name, ALLOW_ENV, BLOCK_ENV)
                self.skipped.append(ep.name)
                continue
            if ep.name in self._sources:
                first, _ = self._sources[ep.name]
                self._refuse(
                    ep.name,
                    dist,
                    version,
                    f"its entry point name {ep.name!r} is taken by {first}",
                    f"report it to {dist}: its entry point in the {ENTRY_POINT_GROUP!r} group needs a name of its own",
                )
                continue
            try:
                plugin = ep.load()
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # SystemExit too: a plugin must not end the process that lists it
                self._refuse(
                    ep.name, dist, version, f"import failed: {type(exc).__name__}: {exc}", _import_hint(exc, dist)
                )
                continue
            api = getattr(plugin, "KVBRIDGE_PLUGIN_API", None)
            if api != PLUGIN_API_VERSION:
                self._refuse(
                    ep.name,
                    dist,
                    version,
                    f"built for kvbridge plugin API {api!r}, this kvbridge {_version('kvbridge')} speaks "
                    f"{PLUGIN_API_VERSION}",
                    f"install a {dist} release made for plugin API {PLUGIN_API_VERSION}, or a kvbridge that matches it",
                )
                continue
            self._add_plugin(plugin, ep.name, dist, version)

    def _add_plugin(self, plugin: object, name: str, dist: str, version: str) -> None:
        try:
            self.pm.register(plugin, name=name)
        except Exception as exc:  # a hook with a wrong signature, or a name clash: this plugin only
            self._refuse(
                name,
                dist,
                version,
                f"registration failed: {type(exc).__name__}: {exc}",
                f"report it to {dist}, or uninstall it: pip uninstall {dist}",
            )
            return
        try:
            # Plugins already registered were checked, so anything pending belongs to this one.
            self.pm.check_pending()
            odd = [
                impl.function.__name__
                for caller in self.pm.get_hookcallers(plugin) or []
                for impl in caller.get_hookimpls()
                if impl.plugin_name == name and (impl.wrapper or impl.hookwrapper)
            ]
            if odd:  # the registry calls each hook itself, so a wrapper would register nothing, silently
                raise pluggy.PluginValidationError(plugin, f"hook wrappers are not supported: {', '.join(odd)}")
        except pluggy.PluginValidationError as exc:  # a misspelt hook name would otherwise do nothing, silently
            self.pm.unregister(name=name)
            self._refuse(
                name,
                dist,
                version,
                f"{exc}; kvbridge hooks are {', '.join(_hook_names())}",
                f"report it to {dist}, or uninstall it: pip uninstall {dist}",
            )
            return
        self._sources[name] = (dist, version)

    def _refuse(self, name: str, dist: str, version: str, reason: str, hint: str) -> None:
        log.warning("kvbridge plugin %s (%s %s) refused: %s", name, dist, version, reason)
        self.refused.append(
            PluginInfo(
                kind="plugin", name=name, available=False, reason=reason, hint=hint, distribution=dist, version=version
            )
        )

    def _collect(self) -> None:
        # Plugin by plugin in load order, so the built-ins claim their names first whatever a plugin's
        # tryfirst/trylast says; each hook gets a `register` bound to its plugin, so every registration
        # knows its distribution. A plugin's registrations are kept only if all its hooks succeed.
        hooks = (
            (self.pm.hook.kvbridge_register_backends, self.backends, "backend"),
            (self.pm.hook.kvbridge_register_devices, self.devices, "device"),
        )
        impls = {hook.name: {i.plugin_name: i for i in hook.get_hookimpls()} for hook, _, _ in hooks}
        for plugin_name, (dist, version) in self._sources.items():
            staged: list[tuple[dict[str, Registration], Registration]] = []
            try:
                for hook, table, kind in hooks:
                    impl = impls[hook.name].get(plugin_name)
                    if impl is not None:
                        impl.function(register=self._registrar(staged, table, kind, dist, version))
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # one broken plugin must not hide the others; it is listed
                self._refuse(
                    plugin_name,
                    dist,
                    version,
                    f"{hook.name} raised {type(exc).__name__}: {exc}",
                    f"report it to {dist}",
                )
                continue
            for table, entry in staged:
                first = table.get(entry.name)
                if first is None:
                    table[entry.name] = entry
                    continue
                # listed as a problem of the plugin (`kvbridge plugins`, `doctor`); its other names still work
                self._refuse(
                    plugin_name,
                    dist,
                    version,
                    f"its {entry.kind} {entry.name!r} is not used: {first.distribution} registered that name first",
                    f"uninstall one of them (pip uninstall {dist}), or report the clash to {dist}",
                )

    def _registrar(
        self,
        staged: list[tuple[dict[str, Registration], Registration]],
        table: dict[str, Registration],
        kind: str,
        dist: str,
        version: str,
    ) -> Callable[..., None]:
        def register(
            name: str,
            factory: Callable[..., Any],
            *,
            capabilities: BackendCapabilities | None = None,
            memory_kind: MemoryKind | str | None = None,
            probe: Callable[[], str | None] | None = None,
            install_hint: str = "",
            hardware: Callable[[], bool] | None = None,
            options: type | None = None,
        ) -> None:
            key = name.lower()
            if kind == "backend" and capabilities is None:
                raise ConfigError(f"backend {name!r} must declare its capabilities")
            if kind == "device" and memory_kind is None:
                raise ConfigError(f"device {name!r} must declare its memory_kind")
            if options is None:
                options = TransportOptions if kind == "backend" else NoOptions
            if not attrs.has(options) or (kind == "backend" and not issubclass(options, TransportOptions)):
                base = "a subclass of kvbridge.TransportOptions" if kind == "backend" else "an attrs class"
                raise ConfigError(f"{kind} {name!r} declares options={options!r}; it must be {base}")
            if not callable(factory):
                raise ConfigError(f"{kind} {name!r} declares factory={factory!r}; it must be callable")
            describe(options)  # an annotation that cannot be resolved fails here, naming the plugin, not at use
            staged.append(
                (
                    table,
                    Registration(
                        kind=kind,
                        name=key,
                        factory=factory,
                        probe=probe,
                        install_hint=install_hint,
                        distribution=dist,
                        version=version,
                        capabilities=capabilities,
                        memory_kind=MemoryKind(memory_kind) if memory_kind is not None else None,
                        hardware=hardware,
                        options=options,
                    ),
                )
            )

        return register

    # -- lookups --------------------------------------------------------------------------

    def _lookup(self, table: dict[str, Registration], kind: str, name: str) -> Registration:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"a {kind} name must be a non-empty string, got {name!r}")
        entry = table.get(name.lower())
        if entry is None:
            for refused in self.refused:
                if refused.name.lower() == name.lower():
                    raise PluginAPIMismatch(
                        f"plugin {refused.name!r} from {refused.distribution} was refused: "
                        f"{refused.reason}. Fix: {refused.hint}"
                    )
            raise PluginNotFound(kind, name, table, self._not_found_hint(table, name))
        return entry

    def _not_found_hint(self, table: dict[str, Registration], name: str) -> str:
        close = difflib.get_close_matches(name.lower(), list(table), n=1)
        if close:
            return f"Did you mean {close[0]!r}?"
        if self.skipped:
            return (
                f"{ALLOW_ENV}/{BLOCK_ENV} kept these plugins from loading: {', '.join(self.skipped)}; "
                "change them, or install the plugin that provides it"
            )
        if name.lower() in OWN_DISTRIBUTIONS:  # only kvbridge's own: a guessed package name could be anyone's
            return f"Install it: pip install {OWN_DISTRIBUTIONS[name.lower()]}"
        return ""

    def backend_entry(self, name: str) -> Registration:
        return self._lookup(self.backends, "backend", name)

    def device_entry(self, name: str) -> Registration:
        return self._lookup(self.devices, "device", name)

    def create_backend(self, name: str, config: BackendConfig) -> MigrationBackend:
        entry = self.backend_entry(name)
        config = entry.parse_options(config)  # before the probe: a typo is reported even where it can't run
        reason = entry.unavailable_reason()
        if reason:
            raise PluginUnavailable("backend", entry.name, reason, entry.install_hint)
        with entry.starting():
            return entry.factory(config)

    def device(self, name: str) -> Device:
        entry = self.device_entry(name)
        with self._lock:
            if entry.name not in self._devices_made:
                reason = entry.unavailable_reason()
                if reason:
                    raise PluginUnavailable("device", entry.name, reason, entry.install_hint)
                with entry.starting():
                    self._devices_made[entry.name] = entry.factory()
            return self._devices_made[entry.name]


def _import_hint(exc: BaseException, dist: str) -> str:
    if isinstance(exc, ModuleNotFoundError) and exc.name and not exc.name.startswith(dist.replace("-", "_")):
        return f"{dist} needs the module {exc.name!r}: install {dist} with its dependencies (pip install {dist})"
    if isinstance(exc, ImportError):
        return f"reinstall it: pip install --force-reinstall {dist}"
    return f"report it to {dist}, or uninstall it: pip uninstall {dist}"


def _hook_names() -> list[str]:
    return sorted(n for n in dir(hookspecs) if n.startswith("kvbridge_"))


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "0+unknown"


_registry: PluginRegistry | None = None
_registry_lock = threading.Lock()


def registry() -> PluginRegistry:
    """The process-wide registry, built on first use."""
    global _registry
    with _registry_lock:
        if _registry is None:
            _registry = PluginRegistry()
        return _registry


def reset_plugins() -> None:
    """Forget loaded plugins so the next lookup rediscovers them (tests, after pip install)."""
    global _registry
    with _registry_lock:
        _registry = None


def list_backends() -> list[PluginInfo]:
    """Every registered transport: name, available, reason, distribution, version."""
    return [e.info() for e in registry().backends.values()]


def list_devices() -> list[PluginInfo]:
    """Every registered device: name, available, reason, distribution, version."""
    return [e.info() for e in registry().devices.values()]


def refused_plugins() -> list[PluginInfo]:
    """Plugins found but not loaded (wrong API version, import failure), with the reason."""
    return list(registry().refused)


def plugin_options(name: str) -> list[tuple[PluginInfo, list[OptionInfo]]]:
    """Every transport and device registered under `name`, each with the options it declares."""
    reg = registry()
    found = [(e.info(), e.option_infos()) for table in (reg.backends, reg.devices) if (e := table.get(name.lower()))]
    if not found:
        reg.backend_entry(name)  # raises PluginNotFound (or why the plugin was refused)
    return found


def create_backend(
    name: str,
    *,
    protocol: str | None = None,
    hostname: str | None = None,
    metadata_server: str | None = None,
    device_name: str = "",
    **options: Any,
) -> MigrationBackend:
    """An initialized transport, chosen by case-insensitive name (`Mooncake`, `tcp`, ...)."""
    config = BackendConfig(
        protocol=protocol,
        hostname=hostname or "127.0.0.1",
        metadata_server=metadata_server,
        device_name=device_name,
        options=dict(options),
    )
    return registry().create_backend(name, config)


def get_device(name: str) -> Device:
    """The device plugin for `cpu`, `cuda`, `npu`, `mlu`, ... (one instance per process)."""
    return registry().device(name)


def device_for_memory(kind: MemoryKind | str) -> Device:
    """The device plugin whose memory is of this kind (the first registered; `cpu` for host memory).

    Transports use it to ask how to register a region (`Device.location`); tensors find their plugin
    by device type in `kvbridge.regions`.
    """
    kind = MemoryKind(kind)
    reg = registry()
    name = next((e.name for e in reg.devices.values() if e.memory_kind == kind), None)
    if name is None:
        raise ConfigError(f"no device plugin registers {kind.value} memory; `kvbridge plugins` lists the devices")
    return reg.device(name)
