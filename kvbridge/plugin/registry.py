"""Plugin discovery and the registry of transports and devices. See docs/internals.md."""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from importlib import metadata
from typing import Any

import attrs
import pluggy

from kvbridge.base.errors import (
    ConfigError,
    KVBridgeError,
    PluginAPIMismatch,
    PluginError,
    PluginNotFound,
    PluginUnavailable,
    described,
)
from kvbridge.base.options import OptionInfo, as_dict, describe, parse, unknown_names
from kvbridge.base.types import BackendCapabilities, BackendConfig, MemoryKind, PluginInfo
from kvbridge.device.contract import Device
from kvbridge.plugin import hookspecs
from kvbridge.plugin.specs import BackendSpec, DeviceSpec
from kvbridge.transport.contract import MigrationBackend
from kvbridge.transport.faults import FaultRates, FaultyBackend

log = logging.getLogger(__name__)

PLUGIN_API_VERSION = 3  # the plugin API a plugin module declares (KVBRIDGE_PLUGIN_API); any other is refused
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
# kvbridge's own distributions that add only subcommands (`kvbridge proxy`, `bench`, ...): ALLOW_ENV/BLOCK_ENV choose
# which transports and devices load, and never took these commands away.
COMMAND_DISTRIBUTIONS = {"kvbridge-proxy", "kvbridge-tools"}


@attrs.define
class Registration:
    """A transport or device in the registry: its plugin's spec, where it came from, its probe's answer (asked once)."""

    kind: str  # "backend" or "device"
    spec: BackendSpec | DeviceSpec
    distribution: str
    version: str
    _reason: str | None = attrs.field(default=None, init=False)
    _probed: bool = attrs.field(default=False, init=False)

    @property
    def name(self) -> str:
        return self.spec.name.lower()

    @property
    def options(self) -> type:
        return self.spec.options

    @property
    def install_hint(self) -> str:
        return self.spec.install_hint

    @property
    def capabilities(self) -> BackendCapabilities | None:
        return self.spec.capabilities if isinstance(self.spec, BackendSpec) else None

    @property
    def memory_kind(self) -> MemoryKind | None:
        return self.spec.memory_kind if isinstance(self.spec, DeviceSpec) else None

    def unavailable_reason(self) -> str | None:
        """Why this cannot run here, or None. Probed once; a probe that raises is a reason too."""
        if not self._probed:
            try:
                reason = self.spec.probe() if self.spec.probe else None
                if reason is not None and not (isinstance(reason, str) and reason):
                    # "" would read as available in one place and not in another
                    reason = f"its availability check returned {reason!r}, not a reason or None"
                self._reason = reason
            except Exception as exc:  # a probe must not take the registry down; its failure is the reason
                self._reason = f"availability check failed: {described(exc)}"
            self._probed = True
        return self._reason

    def _hardware_here(self) -> bool | None:
        if self.spec.hardware is None:
            return None
        try:
            return bool(self.spec.hardware())
        except Exception:  # an unanswerable check is "unknown", never a crash of the listing
            log.debug("hardware check of %s %s raised", self.kind, self.name, exc_info=True)
            return None

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """Around the factory: an error that is not kvbridge's names the plugin and its distribution.

        A vendor runtime's RuntimeError alone does not say which plugin raised it."""
        try:
            yield
        except KVBridgeError:
            raise
        except Exception as exc:
            raise PluginError(
                f"{self.kind} {self.name!r} from {self.distribution} {self.version} failed to start: {described(exc)}"
            ) from exc

    def option_infos(self) -> list[OptionInfo]:
        """The options this plugin declares."""
        return describe(self.options)

    def parse_options(self, given: Mapping[str, Any]) -> Any:
        """`given` as an instance of the spec's options class, every value converted and checked.

        The one place kvbridge parses a plugin's options (the factory gets the instance)."""
        what = f"{self.kind} {self.name!r}"
        # create_backend's own settings are named too: `protocl=` is a typo of `protocol`, not an option
        settings = [f.name for f in attrs.fields(BackendConfig) if f.name != "options" and self.kind == "backend"]
        unknown_names(given, settings + [f.name for f in attrs.fields(self.options)], what=what)
        return parse(self.options, given, what=what)

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


@attrs.define
class _Loading:
    """The plugin pluggy is registering (and so calling the hooks of), and what they returned so far."""

    specs: list[BackendSpec | DeviceSpec] = attrs.field(factory=list)
    commands: dict[str, str] = attrs.field(factory=dict)
    answered: set[str] = attrs.field(factory=set)  # hooks that returned something (None is not passed on)


@attrs.frozen
class Command:
    """A subcommand a plugin adds to the `kvbridge` CLI (`kvbridge_commands`): its module, and whose it is."""

    name: str
    module: str
    distribution: str
    version: str


class _PluginManager(pluggy.PluginManager):
    """pluggy's manager, holding back what `load_setuptools_entrypoints` loads until the registry admits it.

    pluggy registers a plugin as soon as it imports it and records its distribution only afterwards; the
    registry admits it (`PluginRegistry.add_plugin`) once its distribution is known, so that a refusal (a
    plugin API it does not speak, a hook that raised, a name taken) names the distribution, and before
    pluggy calls any hook of a plugin it refuses.
    """

    def register(self, plugin: object, name: str | None = None) -> str | None:
        return name  # held: PluginRegistry._load_entry_points admits it from list_plugin_distinfo()

    def admit(self, plugin: object, name: str) -> None:
        pluggy.PluginManager.register(self, plugin, name=name)


def _normalized(project: str) -> str:
    """A distribution's name as packaging compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", project).lower()


def _csv(value: str | None) -> set[str] | None:
    if value is None:
        return None
    return {v.strip().lower() for v in value.split(",") if v.strip()}


class PluginRegistry:
    """Loads plugins once and answers lookups by case-insensitive name."""

    def __init__(self, *, entry_points: bool = True) -> None:
        self.pm = _PluginManager(ENTRY_POINT_GROUP)
        self.pm.add_hookspecs(hookspecs)
        self._sources: dict[str, tuple[str, str]] = {}  # plugin name -> (distribution, version)
        self.backends: dict[str, Registration] = {}
        self.devices: dict[str, Registration] = {}
        self.refused: list[PluginInfo] = []
        self.commands: dict[str, Command] = {}  # by name, in the order plugins registered them
        self.skipped: list[str] = []  # entry points ALLOW_ENV/BLOCK_ENV kept from loading
        self._devices_made: dict[str, Device] = {}
        self._lock = threading.Lock()
        self._loading: _Loading | None = None
        # The hooks are historic: pluggy calls each plugin's implementations as it registers the plugin, so
        # what comes back is known to be that plugin's, and the built-ins claim their names first whatever a
        # plugin's tryfirst/trylast says.
        hook = self.pm.hook
        hook.kvbridge_backends.call_historic(result_callback=self._answer("kvbridge_backends", BackendSpec))
        hook.kvbridge_devices.call_historic(result_callback=self._answer("kvbridge_devices", DeviceSpec))
        hook.kvbridge_commands.call_historic(result_callback=self._take_commands)

        from kvbridge.plugin import builtins

        self.add_plugin(builtins, "builtin", "kvbridge", _version("kvbridge"))
        if entry_points:
            self._load_entry_points()

    def _load_entry_points(self) -> None:
        allow = _csv(os.environ.get(ALLOW_ENV))
        block = _csv(os.environ.get(BLOCK_ENV)) or set()
        found = metadata.entry_points(group=ENTRY_POINT_GROUP)
        for ep in found:
            commands_only = ep.dist is not None and ep.dist.name in COMMAND_DISTRIBUTIONS
            if not commands_only and (ep.name.lower() in block or (allow is not None and ep.name.lower() not in allow)):
                log.debug("plugin %s skipped by %s/%s", ep.name, ALLOW_ENV, BLOCK_ENV)
                self.pm.set_blocked(ep.name)
                self.skipped.append(ep.name)
        # One name at a time: pluggy's loading stops at the first plugin that fails to import, and one broken
        # plugin must not hide the others (it is listed, with the error). Within a name it still stops: a second
        # distribution of a name whose first fails to import is not tried.
        for name in dict.fromkeys(ep.name for ep in found):
            if self.pm.is_blocked(name):
                continue
            if self.pm.has_plugin(name):  # taken by a built-in: pluggy would skip it without a word
                for ep in found.select(name=name):
                    self._taken_by(name, *_dist(ep))
                continue
            held = len(self.pm.list_plugin_distinfo())
            try:
                self.pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=name)
                failed = None
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # SystemExit too: a plugin must not end the process that lists it
                failed = exc
            loaded = self.pm.list_plugin_distinfo()[held:]
            seen: set[str] = set()
            for plugin, dist in loaded:  # two distributions of one name: pluggy loads both, the first is kept
                # One distribution found twice on the path (an editable install's metadata in site-packages and
                # its build's egg-info beside its sources) is one plugin: importlib.metadata.entry_points() keeps
                # the first of each distribution too, pluggy's loader reads every copy.
                if _normalized(dist.project_name) in seen:
                    continue
                seen.add(_normalized(dist.project_name))
                if name in self._sources:
                    self._taken_by(name, dist.project_name, dist.version)
                else:
                    self.add_plugin(plugin, name, dist.project_name, dist.version)
            if failed is not None:
                loaded_dists = {dist.project_name for _, dist in loaded}
                ep = next((e for e in found if e.name == name and _dist(e)[0] not in loaded_dists), None)
                dist, version = _dist(ep) if ep is not None else ("?", "?")
                if name in self._sources:
                    self._taken_by(name, dist, version)
                else:
                    reason = f"import failed: {described(failed)}"
                    self._refuse(name, dist, version, reason, _import_hint(failed, dist))

    def _taken_by(self, name: str, dist: str, version: str) -> None:
        first, _ = self._sources[name]
        self._refuse(
            name,
            dist,
            version,
            f"its entry point name {name!r} is taken by {first}",
            f"report it to {dist}: its entry point in the {ENTRY_POINT_GROUP!r} group needs a name of its own",
        )

    def add_plugin(self, plugin: object, name: str, dist: str, version: str) -> None:
        """Register `plugin` (a module or object with kvbridge hooks) with pluggy. See docs/internals.md."""
        # Checked before pluggy registers it: pluggy would call the hooks of a plugin made for another API.
        api = getattr(plugin, "KVBRIDGE_PLUGIN_API", None)
        if api != PLUGIN_API_VERSION:
            self._refuse(
                name,
                dist,
                version,
                f"built for kvbridge plugin API {api!r}, this kvbridge {_version('kvbridge')} speaks "
                f"{PLUGIN_API_VERSION}",
                f"install a {dist} release made for plugin API {PLUGIN_API_VERSION}, or a kvbridge that matches it; "
                f"to port it, implement {', '.join(hookspecs.HOOKS)} as docs/plugins.md describes them",
            )
            return
        self._loading = loading = _Loading()
        try:
            self.pm.admit(plugin, name)
            # Plugins already registered were checked, so anything pending belongs to this one.
            self.pm.check_pending()
            problem = self._contract_problem({c.name for c in self.pm.get_hookcallers(plugin) or []}, loading)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # one broken plugin must not hide the others; it is listed
            problem = self._failure(exc, dist)
        finally:
            self._loading = None
        if problem is not None:
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            self._refuse(name, dist, version, *problem)
            return
        self._sources[name] = (dist, version)
        for spec in loading.specs:
            kind, table = ("backend", self.backends) if isinstance(spec, BackendSpec) else ("device", self.devices)
            entry = Registration(kind=kind, spec=spec, distribution=dist, version=version)
            first = table.get(entry.name)
            if first is None:
                table[entry.name] = entry
                continue
            # listed as a problem of the plugin (`kvbridge plugins`, `doctor`); its other names still work
            self._refuse(
                name,
                dist,
                version,
                f"its {kind} {entry.name!r} is not used: {first.distribution} registered that name first",
                f"uninstall one of them (pip uninstall {dist}), or report the clash to {dist}",
            )
        for command, module in loading.commands.items():
            if command in self.commands:
                log.warning("kvbridge_commands: a second %r subcommand (%s, from %s) is ignored", command, module, dist)
                continue
            self.commands[command] = Command(command, module, dist, version)  # the CLI's own are kept there

    @staticmethod
    def _contract_problem(implemented: set[str], loading: _Loading) -> tuple[str, str] | None:
        """Why the hooks a plugin implements did not answer as the plugin API says (reason, what to change)."""
        silent = sorted(h for h in implemented if h in hookspecs.HOOKS and h not in loading.answered)
        if silent:
            what = (
                "a dict of subcommand names to modules"
                if silent == ["kvbridge_commands"]
                else ("a list of kvbridge.BackendSpec / kvbridge.DeviceSpec")
            )
            return f"{', '.join(silent)} returned None", f"return {what} from it (an empty one for none)"
        return None

    @staticmethod
    def _failure(exc: BaseException, dist: str) -> tuple[str, str]:
        """Reason and hint for a plugin that pluggy refused or whose hook raised."""
        if isinstance(exc, pluggy.PluginValidationError):  # a misspelt hook, a wrong argument, a wrapper
            return (
                f"{exc}; kvbridge hooks are {', '.join(hookspecs.HOOKS)}",
                f"report it to {dist}, or uninstall it: pip uninstall {dist}",
            )
        return f"a hook raised {described(exc)}", f"report it to {dist}"

    def _answer(self, hook: str, cls: type) -> Callable[[Any], None]:
        def take(specs: Any) -> None:
            assert self._loading is not None, "pluggy calls historic hooks while a plugin registers"
            if not isinstance(specs, (list, tuple)) or not all(isinstance(s, cls) for s in specs):
                raise ConfigError(f"{hook}() must return a list of kvbridge.{cls.__name__}, got {specs!r}")
            self._loading.answered.add(hook)
            self._loading.specs.extend(specs)

        return take

    def _take_commands(self, commands: Any) -> None:
        assert self._loading is not None, "pluggy calls historic hooks while a plugin registers"
        if not isinstance(commands, Mapping) or not all(
            isinstance(k, str) and k and isinstance(v, str) and v for k, v in commands.items()
        ):
            raise ConfigError(
                f"kvbridge_commands() must return a dict of subcommand names to modules, got {commands!r}"
            )
        self._loading.answered.add("kvbridge_commands")
        self._loading.commands.update(commands)

    def _refuse(self, name: str, dist: str, version: str, reason: str, hint: str) -> None:
        log.warning("kvbridge plugin %s (%s %s) refused: %s", name, dist, version, reason)
        self.refused.append(
            PluginInfo(
                kind="plugin", name=name, available=False, reason=reason, hint=hint, distribution=dist, version=version
            )
        )

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
        options = entry.parse_options(config.options)  # before the probe: a typo is reported even where it can't run
        reason = entry.unavailable_reason()
        if reason:
            raise PluginUnavailable("backend", entry.name, reason, entry.install_hint)
        with entry.starting():
            # config.options: the same values as a dict, for a backend that reads them there
            return entry.spec.factory(attrs.evolve(config, options=as_dict(options)), options)

    def device(self, name: str) -> Device:
        entry = self.device_entry(name)
        with self._lock:
            if entry.name not in self._devices_made:
                reason = entry.unavailable_reason()
                if reason:
                    raise PluginUnavailable("device", entry.name, reason, entry.install_hint)
                options = entry.parse_options({})  # nothing passes a device options yet: its defaults
                with entry.starting():
                    self._devices_made[entry.name] = entry.spec.factory(options)
            return self._devices_made[entry.name]


def _import_hint(exc: BaseException, dist: str) -> str:
    if isinstance(exc, ModuleNotFoundError) and exc.name and not exc.name.startswith(dist.replace("-", "_")):
        return f"{dist} needs the module {exc.name!r}: install {dist} with its dependencies (pip install {dist})"
    if isinstance(exc, ImportError):
        return f"reinstall it: pip install --force-reinstall {dist}"
    return f"report it to {dist}, or uninstall it: pip uninstall {dist}"


def _dist(ep: metadata.EntryPoint) -> tuple[str, str]:
    return (ep.dist.name, ep.dist.version) if ep.dist else ("?", "?")


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
    fault_injection: Mapping[str, Any] | None = None,
    **options: Any,
) -> MigrationBackend:
    """An initialized transport, chosen by case-insensitive name (`Mooncake`, `tcp`, ...). See docs/internals.md."""
    rates = None if fault_injection is None else FaultRates.parse(fault_injection)  # checked before it starts
    config = BackendConfig(
        protocol=protocol,
        hostname=hostname or "127.0.0.1",
        metadata_server=metadata_server,
        device_name=device_name,
        options=dict(options),
    )
    backend = registry().create_backend(name, config)
    return backend if rates is None else FaultyBackend(backend, rates)


def get_device(name: str) -> Device:
    """The device plugin for `cpu`, `cuda`, `npu`, `mlu`, ... (one instance per process)."""
    return registry().device(name)


def device_for_memory(kind: MemoryKind | str) -> Device:
    """The device plugin whose memory is of this kind (first registered; `cpu` for host). See docs/internals.md."""
    kind = MemoryKind(kind)
    reg = registry()
    name = next((e.name for e in reg.devices.values() if e.memory_kind == kind), None)
    if name is None:
        raise ConfigError(f"no device plugin registers {kind.value} memory; `kvbridge plugins` lists the devices")
    return reg.device(name)
