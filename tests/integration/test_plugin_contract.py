"""The plugin contract: hooks return typed specs, options are parsed once, a plugin of API 1 is refused."""

from __future__ import annotations

import types
from collections.abc import Iterator

import attrs
import numpy as np
import pytest

import kvbridge
from kvbridge.base import options
from kvbridge.base.errors import ConfigError
from kvbridge.plugin.registry import PluginRegistry
from kvbridge.transport.loopback import LoopbackBackend

API3 = """
import attrs
import kvbridge
from kvbridge.device.cpu import CpuDevice
from kvbridge.transport.loopback import LoopbackBackend, LoopbackOptions

KVBRIDGE_PLUGIN_API = 3


@attrs.frozen
class DepthOptions(LoopbackOptions):  # what the backend it extends reads, and its own
    depth: int = kvbridge.option(1, "descriptors in flight", min=1, max=64)


class DeepBackend(LoopbackBackend):
    name = "deep"

    def __init__(self, config, options):
        super().__init__(config, options)
        self.depth = options.depth  # typed and checked already: no parse here


@attrs.frozen
class PageOptions:
    page: int = kvbridge.option(4096, "page size", min=1)


class PagedDevice(CpuDevice):
    def __init__(self, options):
        self.page = options.page


@kvbridge.hookimpl
def kvbridge_backends():
    return [kvbridge.BackendSpec("Deep", DeepBackend, LoopbackBackend.capabilities, options=DepthOptions)]


@kvbridge.hookimpl
def kvbridge_devices():
    return [kvbridge.DeviceSpec("paged", PagedDevice, "dram", options=PageOptions)]
"""

# What a plugin made for another plugin API is told to do, whatever its hooks.
PORT = "to port it, implement kvbridge_backends, kvbridge_commands, kvbridge_devices as docs/plugins.md describes them"


def module(name: str, source: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    exec(compile(source, f"<{name}>", "exec"), mod.__dict__)
    return mod


@pytest.fixture
def reg() -> Iterator[PluginRegistry]:
    yield PluginRegistry(entry_points=False)


def refusal(reg: PluginRegistry, name: str) -> kvbridge.PluginInfo:
    [info] = [r for r in reg.refused if r.name == name]
    return info


def test_an_api_3_factory_gets_its_options_typed_and_checked(reg: PluginRegistry) -> None:
    reg.add_plugin(module("deep", API3), "deep", "kvbridge-deep", "2.0")
    assert not reg.refused
    backend = reg.create_backend("deep", kvbridge.BackendConfig(options={"depth": "8", "workers": "2"}))
    try:
        assert backend.depth == 8 and type(backend.options).__name__ == "DepthOptions"  # type: ignore[attr-defined]
        assert backend.options.workers == 2
        assert reg.backend_entry("DEEP").distribution == "kvbridge-deep"
    finally:
        backend.close()
    with pytest.raises(ConfigError, match="backend 'deep': option depth must be from 1 to 64, got 65"):
        reg.create_backend("deep", kvbridge.BackendConfig(options={"depth": 65}))
    assert reg.device("paged").page == 4096  # type: ignore[attr-defined]
    assert reg.device_entry("paged").memory_kind == kvbridge.MemoryKind.DRAM


@pytest.mark.parametrize("api", [1, 2, 4, None])
def test_a_plugin_of_another_api_is_refused_with_what_to_change(reg: PluginRegistry, api: int | None) -> None:
    source = API3.replace("KVBRIDGE_PLUGIN_API = 3", "" if api is None else f"KVBRIDGE_PLUGIN_API = {api}")
    reg.add_plugin(module("old", source), "old", "kvbridge-old", "1.0")
    info = refusal(reg, "old")
    assert f"built for kvbridge plugin API {api!r}" in info.reason and "speaks 3" in info.reason
    assert "install a kvbridge-old release made for plugin API 3" in info.hint and PORT in info.hint
    # nothing of it was called: its names stay free
    assert "deep" not in reg.backends and "paged" not in reg.devices
    with pytest.raises(kvbridge.PluginAPIMismatch, match="plugin 'old' from kvbridge-old was refused"):
        reg.create_backend("old", kvbridge.BackendConfig())


def test_each_option_value_is_parsed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    nested: list[bool] = []
    coerce = options._coerce

    def counted(value: object, tp: object, where: str) -> object:
        if not nested:  # an Optional's converts itself again per alternative: one conversion all the same
            calls.append(value)
        nested.append(True)
        try:
            return coerce(value, tp, where)
        finally:
            nested.pop()

    monkeypatch.setattr(options, "_coerce", counted)
    for name, given in (("tcp", {"connect_timeout": "2.5"}), ("loopback", {"max_batch": "4"})):
        calls.clear()
        backend = kvbridge.create_backend(name, **given)
        try:
            buf = np.zeros(64, dtype=np.uint8)
            buf[32:] = 7
            backend.register_memory(buf)
            peer = backend.connect(backend.endpoint_info())
            addr = buf.ctypes.data
            backend.transfer(peer, [(addr, addr + 32, 32)], "read").wait(30)  # runs on the worker threads
            assert (buf == 7).all()
            assert calls == list(given.values()), f"{name}: each given value converted once"
        finally:
            backend.close()


def test_an_api_3_plugin_with_a_hook_kvbridge_does_not_have_is_refused_with_the_hooks_it_has(
    reg: PluginRegistry,
) -> None:
    reg.add_plugin(module("half", API3.replace("def kvbridge_backends", "def kvbridge_transfers")), "half", "d", "1")
    info = refusal(reg, "half")
    assert "unknown hook 'kvbridge_transfers'" in info.reason
    assert "kvbridge hooks are kvbridge_backends, kvbridge_commands, kvbridge_devices" in info.reason
    assert "deep" not in reg.backends and "paged" not in reg.devices  # refused as a whole


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("return None", "kvbridge_backends returned None"),
        ("return {'tcp2': 1}", "kvbridge_backends() must return a list of kvbridge.BackendSpec, got {'tcp2': 1}"),
        (
            "return [kvbridge.DeviceSpec('x', CpuDevice, 'dram')]",
            "kvbridge_backends() must return a list of kvbridge.BackendSpec",
        ),
        (
            "return [kvbridge.BackendSpec('x', LoopbackBackend, LoopbackBackend.capabilities, options=dict)]",
            "transport 'x' declares options=<class 'dict'>; it must be a subclass of kvbridge.BackendOptions",
        ),
        ("return [kvbridge.BackendSpec('x', 'LoopbackBackend', None)]", "transport 'x' declares factory="),
    ],
)
def test_a_hook_that_returns_something_else_than_specs_is_refused_with_the_reason(
    reg: PluginRegistry, body: str, expected: str
) -> None:
    source = f"""
import kvbridge
from kvbridge.device.cpu import CpuDevice
from kvbridge.transport.loopback import LoopbackBackend

KVBRIDGE_PLUGIN_API = 3


@kvbridge.hookimpl
def kvbridge_devices():
    return [kvbridge.DeviceSpec("kept-only-if-all-succeed", CpuDevice, "dram")]


@kvbridge.hookimpl
def kvbridge_backends():
    {body}
"""
    reg.add_plugin(module("odd", source), "odd", "kvbridge-odd", "1")
    assert expected in refusal(reg, "odd").reason
    assert "kept-only-if-all-succeed" not in reg.devices  # nothing of a refused plugin is kept


def test_a_hook_wrapper_is_refused(reg: PluginRegistry) -> None:
    source = """
import kvbridge

KVBRIDGE_PLUGIN_API = 3


@kvbridge.hookimpl(wrapper=True)
def kvbridge_backends():
    return (yield)
"""
    reg.add_plugin(module("wraps", source), "wraps", "kvbridge-wraps", "1")
    assert "historic incompatible with yield/wrapper/hookwrapper" in refusal(reg, "wraps").reason


def test_specs_check_what_they_are_given() -> None:
    caps = LoopbackBackend.capabilities
    with pytest.raises(ConfigError, match="non-empty string name"):
        kvbridge.BackendSpec("", LoopbackBackend, caps)
    with pytest.raises(ConfigError, match="capabilities=.*kvbridge.BackendCapabilities"):
        kvbridge.BackendSpec("x", LoopbackBackend, {"protocols": ["tcp"]})
    with pytest.raises(ConfigError, match="memory_kind='hbm' is not one of dram, vram, npu, mlu"):
        kvbridge.DeviceSpec("x", object, "hbm")
    with pytest.raises(ConfigError, match="probe=3; it must be callable"):
        kvbridge.DeviceSpec("x", object, "dram", probe=3)

    @attrs.frozen
    class Unresolvable:
        size: NoSuchType = kvbridge.option(1, "a size")  # type: ignore[name-defined]  # noqa: F821

    with pytest.raises(NameError):  # an annotation that cannot be resolved fails at the spec, not at use
        kvbridge.DeviceSpec("x", object, "dram", options=Unresolvable)
