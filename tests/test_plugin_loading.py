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
from kvbridge.transports.loopback import LoopbackBackend

KVBRIDGE_PLUGIN_API = 1


@kvbridge.hookimpl
def kvbridge_register_backend(register):  # the hook is kvbridge_register_backends
    register("typo", LoopbackBackend, capabilities=LoopbackBackend.capabilities)
"""

WRONG_ARGUMENT = """
import kvbridge

KVBRIDGE_PLUGIN_API = 1


@kvbridge.hookimpl
def kvbridge_register_devices(reg):  # the hook passes `register`
    pass
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Path]]:
    tmp = tmp_path_factory.mktemp("broken-dists")
    yield [
        install_dist(tmp, "kvbridge-raises", "kvbridge_raises", RAISES),
        install_dist(tmp, "kvbridge-misspelt", "kvbridge_misspelt", MISSPELT),
        install_dist(tmp, "kvbridge-wrongarg", "kvbridge_wrongarg", WRONG_ARGUMENT),
        install_dist(tmp, "kvbridge-throwaway", "kvbridge_throwaway", PLUGIN_MODULE.format(api=1)),
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
    assert "unknown hook 'kvbridge_register_backend'" in broken["kvbridge_misspelt"]["reason"]
    assert "kvbridge_register_backends" in broken["kvbridge_misspelt"]["reason"]  # what it should have been
    assert "reg" in broken["kvbridge_wrongarg"]["reason"] and "register" in broken["kvbridge_wrongarg"]["reason"]
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
