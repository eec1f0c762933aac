"""`kvbridge bench --scale`: the short form CI runs (real side channels, ledgers, redis, tcp transport, a real proxy).

The curves to hundreds of ranks are docs/measurements/scale.md; here, what must hold at any size: every pull lands the
bytes of the prefill it named, leases are released, the cost per connected peer does not grow with the peers, and a
proxy with a registry full of records sees a server join.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def _bench(*args: str, timeout: float = 300, tmp: Path | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "kvbridge", "bench", "--scale", "--migration-backend", "tcp", *args]
    env = dict(os.environ, TMPDIR=str(tmp)) if tmp else None
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


def test_short_form_pulls_everything_and_the_cost_per_peer_stays_flat(tmp_path: Path) -> None:
    plot, temp = tmp_path / "scale.svg", tmp_path / "temp"
    temp.mkdir()
    done = _bench("--sizes", "2x8,8x32", "--records", "200", "--json", "--plot", str(plot), tmp=temp)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not list(temp.iterdir())  # a run that passed leaves nothing behind (the proxy's log included)
    report = json.loads(done.stdout)
    small, large = report["sizes"]
    assert (small["pairs"], large["pairs"]) == (16, 128)  # every decode rank pulls from a spread of 2 (or 4)
    for size in (small, large):
        assert size["failed"] == 0, size["errors"]
        assert size["pulls"] >= 2 * size["pairs"]  # warm-ups, a first-contact round and an all-at-once round
        assert size["released"] == size["pulls"]  # every lease released by its DONE
        assert 0 < size["first_contacts"] <= size["pairs"]
        assert 0 < size["first_contact_p50_ms"] <= size["first_contact_p99_ms"]
    # Threads and descriptors are counts, not times: per connected peer they must not grow with the peers.
    for side in ("prefill", "decode"):
        for cost in ("threads_per_peer", "fds_per_peer"):
            assert large[side][cost] <= 1.5 * max(small[side][cost], 1.0), (side, cost, small[side], large[side])
    membership = report["membership"]
    assert membership["records"] == 200 and membership["join_seen_ms"] > 0
    assert plot.read_text().startswith("<svg")


def test_a_figure_with_nothing_to_measure_is_null_in_valid_json() -> None:
    # 1 x 1: the deployment's one pair is its warm-up, so there is no first contact to give a median of
    done = _bench("--sizes", "1x1", "--records", "0", "--json")
    assert done.returncode == 0, done.stderr[-3000:]

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON (jq and JSON.parse refuse it)")

    [size] = json.loads(done.stdout, parse_constant=refuse)["sizes"]
    assert size["first_contacts"] == 0 and size["first_contact_p50_ms"] is None and size["failed"] == 0


def test_bad_sizes_and_spreads_are_refused_with_what_to_do() -> None:
    done = _bench("--sizes", "0x4")
    assert done.returncode == 2 and "at least one prefill and one decode rank" in done.stderr
    done = _bench("--sizes", "1x1", "--spread", "9", "--records", "0")
    assert done.returncode != 0 and "--spread must be 1 to 8" in done.stderr
    # a typo of a size is refused before it starts a process, not run until the machine is out of memory
    done = _bench("--sizes", "2x8,100000x100000", "--records", "0", timeout=30)
    assert done.returncode != 0 and "--sizes 100000x100000 needs about" in done.stderr, done.stderr[-2000:]
    assert "ask for fewer ranks" in done.stderr
