"""A third party's path, end to end, for a device plugin and for the transport that docs/plugins.md builds.

`pip install -e plugins/example-device`, see it in `kvbridge plugins`, run its own conformance tests through the
`kvbridge.testing` pytest plugin, then a verified `kvbridge bench` on its device; the same for the transport that
docs/plugins.md builds from its own code blocks. Also: the bench through host staging.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "plugins" / "example-device"
DIST = "kvbridge-example-device"
QUICK = ["--model", "small", "--tokens", "256", "--requests", "2", "--repeat", "1"]


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, cwd=REPO)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {out.returncode}:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
    return out


def devices() -> dict[str, dict]:
    rows = json.loads(run("-m", "kvbridge", "plugins", "--json").stdout)
    return {r["name"]: r for r in rows if r["kind"] == "device"}


def installed() -> bool:
    try:
        metadata.distribution(DIST)
    except metadata.PackageNotFoundError:
        return False
    return True


@pytest.fixture
def fresh_install():
    """Uninstall the example plugin, and leave the environment as it was found.

    scripts/setup installs every plugins/*.
    """
    was = installed()
    run("-m", "pip", "uninstall", "-q", "-y", DIST)
    try:
        yield
    finally:
        if was and not installed():
            run("-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(EXAMPLE))
        elif not was and installed():
            run("-m", "pip", "uninstall", "-q", "-y", DIST)


@pytest.mark.slow
def test_example_plugin_from_pip_install_to_verified_bench(fresh_install: None) -> None:
    assert "example" not in devices()
    # --no-deps/--no-build-isolation: kvbridge and setuptools are already here; nothing is downloaded
    run("-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(EXAMPLE))
    row = devices()["example"]
    assert row["available"] and row["distribution"] == DIST

    # its own tests, through the pytest11 plugin: -m conformance selects the suite
    out = run("-m", "pytest", str(EXAMPLE), "-q", "-p", "no:cacheprovider", "-m", "conformance")
    assert " passed" in out.stdout and "failed" not in out.stdout and "skipped" not in out.stdout

    out = run("-m", "kvbridge", "bench", "--migration-backend", "tcp", "--device", "example", *QUICK, "--json")
    result = json.loads(out.stdout)
    assert result["verified"] is True and result["config"]["device"] == "example"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tcp", "mooncake"])
def test_bench_through_host_staging_is_verified(backend: str) -> None:
    out = run("-m", "kvbridge", "bench", "--migration-backend", backend, "--stage", *QUICK, "--json")
    result = json.loads(out.stdout)
    assert result["verified"] is True and result["config"]["stage"] is True


def doc_files() -> dict[str, str]:
    """The code blocks of docs/plugins.md that start with the file they are (``# path/to/file.py``)."""
    text = (REPO / "docs" / "plugins.md").read_text()
    files = {}
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        first, _, body = block.partition("\n")
        match = re.fullmatch(r"# ([\w./-]+\.(?:py|toml))", first.strip())
        if match:
            files[match.group(1)] = body
    return files


@pytest.mark.slow
def test_the_transport_in_the_docs_installs_conforms_and_benches(tmp_path: Path) -> None:
    files = doc_files()
    assert set(files) >= {
        "pyproject.toml",
        "src/kvbridge_mytransport/plugin.py",
        "src/kvbridge_mytransport/backend.py",
        "tests/test_mytransport_conformance.py",
    }
    root = tmp_path / "kvbridge-mytransport"
    for path, body in {**files, "src/kvbridge_mytransport/__init__.py": ""}.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(body)
    run("-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(root))
    try:
        rows = json.loads(run("-m", "kvbridge", "plugins", "--json").stdout)
        assert {(r["kind"], r["name"], r["available"]) for r in rows} >= {("backend", "mytransport", True)}
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "conformance"],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=root,
        )
        assert out.returncode == 0, out.stdout[-4000:]
        assert " passed" in out.stdout and "skipped" not in out.stdout
        result = json.loads(
            run("-m", "kvbridge", "bench", "--migration-backend", "mytransport", *QUICK, "--json").stdout
        )
        assert result["verified"] is True
    finally:
        run("-m", "pip", "uninstall", "-q", "-y", "kvbridge-mytransport")
