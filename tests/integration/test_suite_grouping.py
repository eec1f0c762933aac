"""scripts/test's two workers: the slow tests take turns on one worker, each module's quick tests stay together.

A small suite in a temporary directory, run the way scripts/test runs the real one, records which worker ran each
test. Were the groups lost (pytest-xdist's loadgroup reads them through a node id attribute that pytest 9.2 no longer
reads, hence the pin in pyproject.toml), the slow tests would spread over both workers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PYTEST = [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider", "-q"]
CONFTEST = "from kvbridge_tools.harness.fixtures import pytest_collection_modifyitems\n"

MODULE = """
import json, os, pathlib, pytest

def record(name):
    out = pathlib.Path(os.environ["GROUPING_OUT"]) / name
    out.write_text(json.dumps(os.environ.get("PYTEST_XDIST_WORKER")))

{tests}
"""


def _tests(module: str, slow: int, quick: int) -> str:
    lines = []
    for i in range(slow):
        lines += ["@pytest.mark.slow", f"def test_slow_{i}():", f"    record('{module}-slow-{i}')", ""]
    for i in range(quick):
        lines += [f"def test_quick_{i}():", f"    record('{module}-quick-{i}')", ""]
    return MODULE.format(tests="\n".join(lines))


def test_slow_tests_share_one_worker_and_a_modules_quick_tests_stay_together(tmp_path: Path) -> None:
    suite, out = tmp_path / "suite", tmp_path / "out"
    suite.mkdir()
    out.mkdir()
    (suite / "conftest.py").write_text(CONFTEST)
    (suite / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: long runs\n")
    for module in ("a", "b", "c", "d"):
        (suite / f"test_{module}.py").write_text(_tests(module, slow=2, quick=3))
    done = subprocess.run(
        # its own basetemp: a numbered one in the shared root would make pytest drop the oldest of other runs'
        [*PYTEST, "--basetemp", str(tmp_path / "basetemp"), str(suite)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=suite,
        env={**os.environ, "GROUPING_OUT": str(out)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    ran = {p.name: json.loads(p.read_text()) for p in out.iterdir()}
    assert len(ran) == 4 * 5, ran
    assert set(ran.values()) == {"gw0", "gw1"}, f"both workers should have run tests: {ran}"
    slow = {worker for name, worker in ran.items() if "-slow-" in name}
    assert len(slow) == 1, f"the slow tests ran on {sorted(slow)}, not on one worker: {ran}"
    for module in ("a", "b", "c", "d"):
        quick = {worker for name, worker in ran.items() if name.startswith(f"{module}-quick-")}
        assert len(quick) == 1, f"module {module}'s quick tests were split over {sorted(quick)}: {ran}"
