"""Native transport logs: levels set before the library loads, lines routed through kvbridge's logging."""

from __future__ import annotations

import io
import logging
import subprocess
import sys

import pytest

from kvbridge.base.nativelog import native_env
from kvbridge_tools.harness.nativelog import classify, relay_stderr


def test_levels_follow_kvbridge_and_the_operator_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MC_LOG_LEVEL", "NIXL_LOG_LEVEL", "UCX_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    assert native_env(logging.WARNING) == {"MC_LOG_LEVEL": "WARNING", "NIXL_LOG_LEVEL": "WARN", "UCX_LOG_LEVEL": "warn"}
    assert native_env(logging.INFO)["MC_LOG_LEVEL"] == "INFO"  # -v
    assert native_env(logging.DEBUG) == {}  # -vv: the libraries' own defaults, everything
    monkeypatch.setenv("MC_LOG_LEVEL", "ERROR")
    assert "MC_LOG_LEVEL" not in native_env(logging.WARNING)


def test_a_real_mooncake_start_is_routed_and_its_harmless_lines_are_debug(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine-non-cuda (scripts/setup)")
    code = (
        "from mooncake.engine import TransferEngine\n"
        "e = TransferEngine()\n"
        "assert e.initialize('127.0.0.1', 'P2PHANDSHAKE', 'tcp', '') == 0\n"
        "import sys; print('plain line from python', file=sys.stderr)\n"
    )
    env = {"MC_LOG_LEVEL": "INFO", "PATH": "/usr/bin:/bin"}  # every line the library has, to classify
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True, env=env)
    rest = io.StringIO()
    with caplog.at_level(logging.DEBUG, logger="kvbridge.native"):
        relay_stderr("rank", proc.stderr, rest)
    assert proc.wait(timeout=60) == 0
    assert rest.getvalue() == "plain line from python\n"  # not a native line: passed through as it was
    by_level = {r.levelno for r in caplog.records}
    assert caplog.records and all(r.getMessage().startswith("rank: ") for r in caplog.records)
    assert logging.INFO in by_level  # the library's info lines are info records (shown with -v)
    harmless = [r for r in caplog.records if "Local segment descriptor not found" in r.getMessage()]
    assert harmless and all(r.levelno == logging.DEBUG for r in harmless)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]


def test_classify_keeps_real_failures_at_their_severity() -> None:
    assert classify("E1123 05:17:40.758323 15467 transport.cpp:12] batch failed: peer closed") == (
        logging.ERROR,
        "batch failed: peer closed (transport.cpp:12)",
    )
    assert classify("INFO kvbridge.agent.kv_agent: pulled") is None
