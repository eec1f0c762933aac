"""The tree passes ruff's lint and format checks, configured in pyproject.toml ([tool.ruff])."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("check", [["check", "--no-fix"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(check: list[str]) -> None:
    # ruff comes with the `test` extra; `python -m ruff` uses the one installed beside this interpreter
    out = subprocess.run(
        [sys.executable, "-m", "ruff", *check, "--no-cache", "."], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, (
        f"ruff {' '.join(check)} found problems (fix them, or run `ruff check --fix .` / `ruff format .`):\n"
        f"{out.stdout}{out.stderr}"
    )
