"""A broken plugin installed beside good ones is reported and skipped, never fatal to the others."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_plugins import PLUGIN_MODULE, install_dist

RAISES = "raise RuntimeError('plugin bug: config file missing')\n"

MISSPELT = """
import kvbridge
from kvbridge.transport.loopback import LoopbackBackend

KVBRIDGE_PLUGIN_API = 3


@kvbridge.hookimpl
def kvbridge_backend():  # the hook is kvbridge_backends
    return [kvbridge.BackendSpec("typo", LoopbackBackend, LoopbackBackend.capabilities)]
"""

WRONG_ARGUMENT = """
import kvbridge

KVBRIDGE_PLUGIN_API = 3


@kvbridge.hookimpl
def kvbridge_devices(reg):  # the hook passes nothing
    return []
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Path]]:
    tmp = tmp_path_factory.mktemp("broken-dists")
    yield [
        install_dist(tmp, "kvbridge-raises", "kvbridge_raises", RAISES),
        install_dist(tmp, "kvbridge-misspelt", "kvbridge_misspelt", MISSPELT),
        install_dist(tmp, "kvbridge-wrongarg", "kvbridge_wrongarg", WRONG_ARGUMENT),
        install_dist(tmp, "kvbridge-throwaway", "kvbridge_throwaway", PLUGIN_MODULE.format(api=3)),
    ]


def cli(site: list[Path], *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, site))}
    return subprocess.run(
        [sys.executable, "-m", "kvbridge", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_plugins_lists_each_broken_plugin_with_its_distribution_and_error(site: list[Path]) -> None:
    out = cli(site, "plugins", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    broken = {r["name"]: r for r in rows if r["broken"]}
    assert set(broken) == {"kvbridge_raises", "kvbridge_misspelt", "kvbridge_wrongarg"}
    assert broken["kvbridge_raises"]["distribution"] == "kvbridge-raises"
    assert "RuntimeError: plugin bug: config file missing" in broken["kvbridge_raises"]["reason"]
    assert broken["kvbridge_misspelt"]["distribution"] == "kvbridge-misspelt"
    assert "unknown hook 'kvbridge_backend'" in broken["kvbridge_misspelt"]["reason"]
    assert "kvbridge_backends" in broken["kvbridge_misspelt"]["reason"]  # what it should have been
    assert "kvbridge_devices(reg)" in broken["kvbridge_wrongarg"]["reason"]
    assert "can not be found in the hookspec" in broken["kvbridge_wrongarg"]["reason"]
    # the good distribution beside them loaded, and nothing of the misspelt one was half-registered
    names = {r["name"]: r for r in rows if not r["broken"]}
    assert names["throwaway"]["available"] is True and "typo" not in names
    assert {"tcp", "loopback", "cpu"} <= set(names)


def test_plugins_table_marks_broken_plugins_and_exits_0(site: list[Path]) -> None:
    out = cli(site, "plugins")
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if "kvbridge_raises" in x)
    assert "BROKEN" in line and "kvbridge-raises" in line
    assert "Traceback" not in out.stderr


def test_doctor_reports_a_broken_plugin_as_a_problem(site: list[Path]) -> None:
    out = cli(site, "doctor", "--json")
    checks = {c["subject"]: c for c in json.loads(out.stdout)}
    for name in ("kvbridge_raises", "kvbridge_misspelt", "kvbridge_wrongarg"):
        assert checks[f"plugin {name}"]["status"] == "PROBLEM"
        assert checks[f"plugin {name}"]["fix"]
    assert checks["backend throwaway"]["status"] == "ok"
    assert out.returncode == 1


SHADOW = """
import kvbridge
from kvbridge.transport.loopback import LoopbackBackend

KVBRIDGE_PLUGIN_API = 3


@kvbridge.hookimpl(trylast=True)  # pluggy calls trylast implementations first
def kvbridge_backends():
    return [
        kvbridge.BackendSpec("TCP", LoopbackBackend, LoopbackBackend.capabilities),
        kvbridge.BackendSpec("shadow-own", LoopbackBackend, LoopbackBackend.capabilities),
    ]
"""

HALF = """
import kvbridge
from kvbridge.device.cpu import CpuDevice

KVBRIDGE_PLUGIN_API = 3


@kvbridge.hookimpl
def kvbridge_devices():
    return [kvbridge.DeviceSpec("halfreg", CpuDevice, "dram")]


@kvbridge.hookimpl
def kvbridge_backends():
    raise RuntimeError("plugin bug after its first registration")
"""

EXITS = "import sys\nsys.exit(3)\n"

CRASHES = """
import kvbridge
from kvbridge.device.cpu import CpuDevice

KVBRIDGE_PLUGIN_API = 3


def _factory(options):
    raise RuntimeError("vendor runtime crashed")


@kvbridge.hookimpl
def kvbridge_devices():
    return [kvbridge.DeviceSpec("crashing-dev", _factory, "dram")]
"""


CHATTY = """
import os

import kvbridge
from kvbridge.transport.loopback import LoopbackBackend

KVBRIDGE_PLUGIN_API = 3
print("chatty plugin loaded")
os.write(1, b"native library banner\\n")


def _probe():
    print("probing chatty")
    return None


@kvbridge.hookimpl
def kvbridge_backends():
    return [kvbridge.BackendSpec("chatty", LoopbackBackend, LoopbackBackend.capabilities, probe=_probe)]
"""


@pytest.fixture(scope="module")
def unruly(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Path]]:
    tmp = tmp_path_factory.mktemp("unruly-dists")
    yield [
        install_dist(tmp, "kvbridge-shadow", "kvbridge_shadow", SHADOW),
        install_dist(tmp, "kvbridge-half", "kvbridge_half", HALF),
        install_dist(tmp, "kvbridge-exits", "kvbridge_exits", EXITS),
        install_dist(tmp, "kvbridge-crashes", "kvbridge_crashes", CRASHES),
        install_dist(tmp, "kvbridge-chatty", "kvbridge_chatty", CHATTY),
        install_dist(tmp, "kvbridge-throwaway", "kvbridge_throwaway", PLUGIN_MODULE.format(api=3)),
    ]


def test_a_plugin_cannot_take_a_builtin_name_end_the_process_or_leave_half_its_registrations(
    unruly: list[Path],
) -> None:
    out = cli(unruly, "plugins", "--json")
    assert out.returncode == 0, out.stderr  # kvbridge_exits called sys.exit(3) at import
    rows = json.loads(out.stdout)  # kvbridge_chatty printed as it loaded and when probed
    assert "chatty plugin loaded" in out.stderr and "native library banner" in out.stderr
    assert "probing chatty" in out.stderr
    broken = {r["name"]: r for r in rows if r["broken"]}
    assert set(broken) == {"kvbridge_shadow", "kvbridge_half", "kvbridge_exits"}
    assert "SystemExit: 3" in broken["kvbridge_exits"]["reason"]
    assert "its backend 'tcp' is not used: kvbridge registered that name first" in broken["kvbridge_shadow"]["reason"]
    assert "plugin bug after its first registration" in broken["kvbridge_half"]["reason"]
    names = {r["name"]: r for r in rows if not r["broken"]}
    assert names["tcp"]["distribution"] == "kvbridge", "the built-in keeps its name whatever trylast says"
    assert names["shadow-own"]["distribution"] == "kvbridge-shadow", "the clash costs the plugin that name only"
    assert "halfreg" not in names, "a plugin whose hook raised registers nothing"
    assert names["throwaway"]["available"] is True


def test_a_plugin_factory_that_fails_is_named_with_its_distribution(unruly: list[Path]) -> None:
    code = """
import kvbridge
try:
    kvbridge.get_device("crashing-dev")
except kvbridge.PluginError as e:
    print(type(e.__cause__).__name__, "|", e)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, unruly))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "\nRuntimeError | " in out.stdout, out.stdout + out.stderr  # (kvbridge_chatty prints first)
    assert (
        "device 'crashing-dev' from kvbridge-crashes 1.2.3 failed to start: RuntimeError: vendor runtime crashed"
        in (out.stdout)
    )


def test_a_plugin_of_an_earlier_api_is_refused_and_every_other_plugin_still_listed(tmp_path: Path) -> None:
    from test_plugin_contract import API3, PORT

    earlier = API3.replace("KVBRIDGE_PLUGIN_API = 3", "KVBRIDGE_PLUGIN_API = 2")
    site = [install_dist(tmp_path, "kvbridge-deep", "kvbridge_deep", earlier)]
    out = cli(site, "plugins", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    refused = {r["name"]: r for r in rows if r["broken"]}
    assert set(refused) == {"kvbridge_deep"}
    assert "built for kvbridge plugin API 2" in refused["kvbridge_deep"]["reason"]
    assert PORT in refused["kvbridge_deep"]["hint"]
    listed = {(r["kind"], r["name"]): r["distribution"] for r in rows if not r["broken"]}
    assert ("backend", "deep") not in listed
    # the built-ins and the repo's plugins (scripts/setup installs them) load as before
    assert listed[("backend", "tcp")] == listed[("backend", "loopback")] == listed[("device", "cpu")] == "kvbridge"
    assert listed[("backend", "mooncake")] == "kvbridge-mooncake" and listed[("backend", "nixl")] == "kvbridge-nixl"
    assert listed[("device", "example")] == "kvbridge-example-device"
    doctor = cli(site, "doctor", "--json")
    checks = {c["subject"]: c for c in json.loads(doctor.stdout)}
    assert checks["plugin kvbridge_deep"]["status"] == "PROBLEM" and PORT in checks["plugin kvbridge_deep"]["fix"]
    for subject in ("backend tcp", "backend loopback", "backend mooncake", "backend nixl", "device example"):
        assert checks[subject]["status"] == "ok", checks[subject]
