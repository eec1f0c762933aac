"""Plugin discovery through real installed distributions, name lookup, API versions, allow/block lists."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvbridge
from kvbridge.base.errors import PluginNotFound, PluginUnavailable

REPO = Path(__file__).resolve().parents[2]

PLUGIN_MODULE = """
import kvbridge
from kvbridge.device.cpu import CpuDevice
from kvbridge.transport.loopback import LoopbackBackend

KVBRIDGE_PLUGIN_API = {api}


class ThrowawayBackend(LoopbackBackend):
    name = "throwaway"


@kvbridge.hookimpl
def kvbridge_backends():
    return [
        kvbridge.BackendSpec("Throwaway", ThrowawayBackend, LoopbackBackend.capabilities),
        kvbridge.BackendSpec("needs-lib", ThrowawayBackend, LoopbackBackend.capabilities,
                               probe=lambda: "libmissing.so.9: cannot open shared object file",
                               install_hint="apt-get install libmissing9"),
    ]


class ThrowawayDevice(CpuDevice):
    name = "throwaway-dev"


def _device(options):
    return ThrowawayDevice()


@kvbridge.hookimpl
def kvbridge_devices():
    return [
        kvbridge.DeviceSpec("Throwaway-Dev", _device, "dram"),
        kvbridge.DeviceSpec("gone-dev", _device, "vram", probe=lambda: "no such device",
                            install_hint="install the driver", hardware=lambda: False),
        kvbridge.DeviceSpec("broken-dev", _device, "vram", probe=lambda: "driver too old",
                            install_hint="upgrade the driver", hardware=lambda: True),
    ]
"""

BROKEN_MODULE = "raise ImportError('libfoo.so.1: cannot open shared object file')\n"


def install_dist(tmp: Path, dist: str, module: str, source: str) -> Path:
    """Build and pip-install a real distribution with a `kvbridge` entry point into its own target dir."""
    project = tmp / f"{dist}-src"
    (project / module).mkdir(parents=True)
    (project / module / "__init__.py").write_text(source)
    (project / "pyproject.toml").write_text(
        textwrap.dedent(f'''
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "{dist}"
        version = "1.2.3"
        [project.entry-points.kvbridge]
        {module} = "{module}"
        [tool.setuptools]
        packages = ["{module}"]
    ''')
    )
    target = tmp / f"{dist}-site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(project),
        ],
        check=True,
        capture_output=True,
        env={**os.environ, "PIP_FIND_LINKS": "", "PIP_EXTRA_INDEX_URL": ""},
    )
    assert list(target.glob(f"{dist.replace('-', '_')}-1.2.3.dist-info"))
    return target


def run_kvbridge(code: str, *paths: Path, env: dict[str, str] | None = None) -> dict:
    """Run `code` in a fresh interpreter that sees the installed throwaway distributions."""
    full = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in paths), **(env or {})}
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=full)
    return json.loads(out.stdout.strip().splitlines()[-1])


LIST = """
import json, kvbridge
print(json.dumps({
    "backends": {i.name: [i.available, i.reason, i.hint, i.distribution, i.version] for i in kvbridge.list_backends()},
    "devices": {i.name: [i.available, i.distribution] for i in kvbridge.list_devices()},
    "refused": {i.name: [i.reason, i.hint, i.distribution] for i in kvbridge.refused_plugins()},
}))
"""


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    tmp = tmp_path_factory.mktemp("dists")
    yield {
        "good": install_dist(tmp, "kvbridge-throwaway", "kvbridge_throwaway", PLUGIN_MODULE.format(api=3)),
        "future": install_dist(tmp, "kvbridge-future", "kvbridge_future", PLUGIN_MODULE.format(api=4)),
        "broken": install_dist(tmp, "kvbridge-broken", "kvbridge_broken", BROKEN_MODULE),
    }


def test_a_real_installed_distribution_is_discovered_through_its_entry_point(dists: dict[str, Path]) -> None:
    got = run_kvbridge(LIST, dists["good"])
    assert got["backends"]["throwaway"] == [True, "", "", "kvbridge-throwaway", "1.2.3"]
    assert got["devices"]["throwaway-dev"] == [True, "kvbridge-throwaway"]
    # built-ins come first and stay
    assert list(got["backends"])[:2] == ["tcp", "loopback"]
    assert list(got["devices"])[0] == "cpu"


def test_a_distribution_found_twice_on_the_path_is_one_plugin(dists: dict[str, Path], tmp_path: Path) -> None:
    # An editable install is found twice: its metadata in site-packages and its build's egg-info beside its sources
    # (the repo's own plugins, as scripts/setup installs them). One distribution is one plugin, refused by nobody.
    again = install_dist(tmp_path, "kvbridge-throwaway", "kvbridge_throwaway", PLUGIN_MODULE.format(api=3))
    got = run_kvbridge(LIST, dists["good"], again)
    assert got["backends"]["throwaway"] == [True, "", "", "kvbridge-throwaway", "1.2.3"]
    assert got["refused"] == {}


def test_a_plugin_missing_its_native_library_is_unavailable_with_reason_and_hint(dists: dict[str, Path]) -> None:
    got = run_kvbridge(LIST, dists["good"])
    available, reason, hint, *_ = got["backends"]["needs-lib"]
    assert not available
    assert "libmissing.so.9" in reason
    assert hint == "apt-get install libmissing9"


def test_a_plugin_built_for_another_api_version_is_refused(dists: dict[str, Path]) -> None:
    got = run_kvbridge(LIST, dists["future"])
    assert "throwaway" not in got["backends"]
    reason, hint, dist = got["refused"]["kvbridge_future"]
    assert "plugin API 4" in reason and "speaks 3" in reason and dist == "kvbridge-future"
    assert "plugin API 3" in hint
    code = """
import json, kvbridge
try:
    kvbridge.create_backend("kvbridge_future")
except kvbridge.PluginAPIMismatch as e:
    print(json.dumps({"error": str(e)}))
"""
    assert "refused" in run_kvbridge(code, dists["future"])["error"]


def test_a_plugin_that_fails_to_import_never_breaks_import_kvbridge(dists: dict[str, Path]) -> None:
    got = run_kvbridge(LIST, dists["broken"], dists["good"])
    assert "libfoo.so.1" in got["refused"]["kvbridge_broken"][0]
    assert got["backends"]["throwaway"][0] is True


def test_allow_list_and_block_list(dists: dict[str, Path]) -> None:
    only_builtins = run_kvbridge(LIST, dists["good"], env={"KVBRIDGE_PLUGINS": ""})
    assert set(only_builtins["backends"]) == {"tcp", "loopback"}
    allowed = run_kvbridge(LIST, dists["good"], env={"KVBRIDGE_PLUGINS": "kvbridge_throwaway"})
    assert set(allowed["backends"]) == {"tcp", "loopback", "throwaway", "needs-lib"}
    blocked = run_kvbridge(LIST, dists["good"], env={"KVBRIDGE_BLOCK_PLUGINS": "kvbridge_throwaway,mooncake"})
    assert "throwaway" not in blocked["backends"] and "mooncake" not in blocked["backends"]


def test_names_are_case_insensitive() -> None:
    for name in ("Mooncake", "mooncake", "MOONCAKE"):
        backend = kvbridge.create_backend(name)
        try:
            assert backend.name == "mooncake"
        finally:
            backend.close()
    assert kvbridge.get_device("CPU").name == "cpu"


def test_an_unknown_name_lists_what_is_installed() -> None:
    with pytest.raises(PluginNotFound) as err:
        kvbridge.create_backend("no-such-transport")  # not "nixl": that one is a plugin now
    text = str(err.value)
    for name in ("mooncake", "tcp", "loopback"):
        assert name in text
    assert "kvbridge plugins" in text


def test_an_unknown_name_suggests_a_close_one_and_a_package_only_for_kvbridge_s_own() -> None:
    with pytest.raises(PluginNotFound, match="Did you mean 'mooncake'"):
        kvbridge.create_backend("mooncak")
    with pytest.raises(PluginNotFound) as err:
        kvbridge.create_backend("no-such-transport")
    assert "pip install" not in str(err.value), "a guessed package name could be anyone's"


def test_an_unknown_name_says_which_plugins_the_environment_kept_from_loading() -> None:
    code = """
import kvbridge
try:
    kvbridge.create_backend("mooncake")
except kvbridge.PluginNotFound as e:
    print(e)
"""
    env = {**os.environ, "KVBRIDGE_BLOCK_PLUGINS": "mooncake"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "KVBRIDGE_PLUGINS/KVBRIDGE_BLOCK_PLUGINS kept these plugins from loading: mooncake" in out.stdout, (
        out.stdout + out.stderr
    )


def test_unavailable_plugin_raises_with_reason_and_hint_on_create(dists: dict[str, Path]) -> None:
    code = """
import json, kvbridge
try:
    kvbridge.create_backend("NEEDS-LIB")
except kvbridge.PluginUnavailable as e:
    print(json.dumps({"reason": e.reason, "hint": e.hint, "text": str(e)}))
"""
    got = run_kvbridge(code, dists["good"])
    assert "libmissing.so.9" in got["reason"] and "Fix: apt-get install libmissing9" in got["text"]
    assert issubclass(PluginUnavailable, kvbridge.KVBridgeError)


def test_doctor_tells_absent_hardware_from_a_problem(dists: dict[str, Path]) -> None:
    env = {**os.environ, "PYTHONPATH": str(dists["good"])}
    out = subprocess.run(
        [sys.executable, "-m", "kvbridge", "doctor", "--json"], capture_output=True, text=True, env=env, timeout=120
    )
    checks = {c["subject"]: c for c in json.loads(out.stdout)}
    assert checks["device gone-dev"]["status"] == "not here" and checks["device gone-dev"]["fix"] == ""
    assert checks["device broken-dev"]["status"] == "PROBLEM"
    assert checks["device broken-dev"]["fix"] == "upgrade the driver"
    assert checks["device throwaway-dev"]["status"] == "ok"
    assert out.returncode == 1  # broken-dev (and needs-lib) are problems; gone-dev alone would not be


def test_a_plugin_api_1_plugin_is_refused_beside_an_api_3_one_that_loads(tmp_path: Path) -> None:
    from test_plugin_contract import API3

    api1 = API3.replace("KVBRIDGE_PLUGIN_API = 3", "KVBRIDGE_PLUGIN_API = 1")  # its hooks are never called
    site = [
        install_dist(tmp_path, "kvbridge-old", "kvbridge_old", api1),
        install_dist(tmp_path, "kvbridge-deep", "kvbridge_deep", API3),
    ]
    code = """
import json, kvbridge
new = kvbridge.create_backend("Deep", depth="8")
print(json.dumps({
    "new": [new.depth, type(new.options).__name__, kvbridge.get_device("paged").page],
    "from": {i.name: i.distribution for i in kvbridge.list_backends()},
    "refused": {r.name: [r.reason, r.hint] for r in kvbridge.refused_plugins()},
}))
"""
    got = run_kvbridge(code, *site)
    assert list(got["refused"]) == ["kvbridge_old"]
    reason, hint = got["refused"]["kvbridge_old"]
    assert "built for kvbridge plugin API 1" in reason and "speaks 3" in reason
    assert "plugin API 3" in hint
    assert "old" not in got["from"]
    assert got["new"] == [8, "DepthOptions", 4096]
    assert got["from"]["deep"] == "kvbridge-deep"
