"""The `kvbridge` command as a user runs it: plugins, doctor, and the verified pair bench."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KVBRIDGE = [sys.executable, "-m", "kvbridge"]
QUICK = ["--model", "small", "--tokens", "256", "--requests", "2", "--repeat", "1"]


def kvbridge(
    *args: str, prefix: list[str] | None = None, check: bool = True, python: str = sys.executable
) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [*(prefix or []), python, "-m", "kvbridge", *args], capture_output=True, text=True, timeout=600
    )
    if check and out.returncode != 0:
        raise AssertionError(f"kvbridge {' '.join(args)} exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
    return out


def test_plugins_lists_the_builtins_and_mooncake() -> None:
    rows = {(r["kind"], r["name"]): r for r in json.loads(kvbridge("plugins", "--json").stdout)}
    for key in [("backend", "mooncake"), ("backend", "tcp"), ("backend", "loopback"), ("device", "cpu")]:
        assert rows[key]["available"], rows[key]
    assert rows[("backend", "mooncake")]["distribution"] == "kvbridge-mooncake"
    table = kvbridge("plugins").stdout
    assert "mooncake" in table and "kvbridge-mooncake" in table


def test_version_is_printed_as_its_neighbours_print_theirs() -> None:
    import kvbridge as package

    assert kvbridge("--version").stdout.startswith(f"kvbridge {package.__version__} ")


def test_doctor_reports_each_plugin() -> None:
    # The repo's cuda/npu/mlu device plugins are installed; this machine has none of that hardware,
    # which is not a problem to fix, so doctor lists them as "not here" and exits 0.
    assert not list(Path("/dev").glob("nvidia[0-9]*")), "this test expects a machine without a GPU"
    out = kvbridge("doctor", "--json", check=False)
    checks = {c["subject"]: c for c in json.loads(out.stdout)}
    assert checks["libibverbs"]["ok"]
    assert checks["backend mooncake"]["ok"]
    assert checks["TCP congestion control"]["ok"]  # advice, never a problem (the machine's own choice)
    assert checks["device cuda"]["status"] == "not here" and "no CUDA device" in checks["device cuda"]["detail"]
    assert checks["device npu"]["status"] == checks["device mlu"]["status"] == "not here"
    assert out.returncode == 0, out.stdout


@pytest.mark.parametrize(
    ("cc", "qdisc", "advised"), [("bbr", "pfifo_fast", True), ("bbr", "fq", False), ("cubic", "pfifo_fast", False)]
)
def test_doctor_advises_on_bbr_paced_by_tcp_itself(tmp_path: Path, cc: str, qdisc: str, advised: bool) -> None:
    # A stand-in for /proc/sys/net: the host's own values are whatever this machine has.
    from kvbridge.cli.doctor import TCP_SYSCTLS, tcp_check

    for name, value in zip(TCP_SYSCTLS, (cc, qdisc), strict=True):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(value + "\n")
    check = tcp_check(tmp_path)
    assert check.ok and check.detail.startswith(f"{cc} (qdisc {qdisc})")
    assert bool(check.fix) == advised and ("cubic" in check.fix) == advised


def test_doctor_probe_says_which_path_each_device_and_transport_takes() -> None:
    """Issue 42 (5): in place or staged through host memory, measured.

    The example device is host memory behind a device plugin that synchronizes: every transport reaching host memory
    reaches it in place, and staging is a real second path."""
    out = kvbridge("doctor", "--probe", "--json", check=False)
    paths = {c["subject"]: c for c in json.loads(out.stdout) if c["subject"].startswith("path ")}
    assert "path example/tcp/tcp" in paths and "path example/loopback/loopback" in paths, paths
    for check in paths.values():
        assert check["ok"] and re.fullmatch(
            r"(in place|staged) \(in place [\d.]+ ms, staged [\d.]+ ms for \d+ bytes\)", check["detail"]
        ), check
    assert "path probe" not in {c["subject"] for c in json.loads(kvbridge("doctor", "--json", check=False).stdout)}


@pytest.mark.parametrize(
    "backend, extra",
    [
        ("mooncake", []),
        ("tcp", ["--fragmented"]),
        ("mooncake", ["--fragmented"]),
        ("mooncake", ["--fragmented", "--layout", "ascend-kv-tuple"]),
        ("mooncake", ["--layout", "LBHNC"]),
    ],
)
def test_bench_verifies_a_two_process_migration(backend: str, extra: list[str]) -> None:
    result = json.loads(kvbridge("bench", "--migration-backend", backend, *QUICK, *extra, "--json").stdout)
    assert result["verified"] is True
    assert result["kvbridge"]["gbps"] > 0 and result["raw"]["gbps"] > 0
    per_request = result["kvbridge"]
    layout = extra[extra.index("--layout") + 1] if "--layout" in extra else "BLHNC"  # the default: the connector's
    assert result["config"]["layout"] == layout
    # runs of a block in the layout: every layer (block-outermost), one per layer, or one per (K/V, layer)
    units = {"BLHNC": 1, "LBHNC": 4, "ascend-kv-tuple": 4 * 2}[layout]
    assert (per_request["units_per_block"], per_request["descriptors_per_request"]) == (units, units * 16)
    assert per_request["unit_bytes"] * units * 16 == result["config"]["bytes_per_request"]
    if "--fragmented" in extra and layout == "ascend-kv-tuple":
        # Mooncake TCP's declared cost (18 us a descriptor) makes 128 scattered 32 KiB pages cheaper gathered
        assert result["strategy"]["used"] == "gather"
        assert per_request["merged_runs_per_request"] == 1  # one staged chunk
    elif "--fragmented" in extra:  # 16 blocks of 256 KiB: direct on Mooncake; tcp declares no cost: direct
        assert result["strategy"]["used"] == "direct"
        assert per_request["merged_runs_per_request"] > 1
    else:  # contiguous blocks: one run per outer index of the layout (every layer at once in BLHNC)
        assert result["strategy"]["used"] == "direct"
        assert per_request["merged_runs_per_request"] == units


def test_bench_passes_transport_options_to_both_sides() -> None:
    piece = 100_000  # bytes: the request's one contiguous run (BLHNC, contiguous) is cut into ceil(run / piece)
    result = json.loads(
        kvbridge(
            "bench", "--migration-backend", "mooncake", *QUICK, "--option", f"max_descriptor_bytes={piece}", "--json"
        ).stdout
    )
    assert result["verified"] is True and result["config"]["options"] == {"max_descriptor_bytes": piece}
    run_bytes = result["config"]["bytes_per_request"]
    assert result["kvbridge"]["submitted_descriptors_per_request"] == math.ceil(run_bytes / piece)
    bad = kvbridge("bench", "--migration-backend", "mooncake", "--option", "no-equals-sign", check=False)
    assert bad.returncode == 2 and "expected KEY=VALUE" in bad.stderr
    bad = kvbridge("bench", "--migration-backend", "mooncake", "--option", "protocol=tcp", check=False)
    assert bad.returncode == 2 and "--protocol" in bad.stderr and "Traceback" not in bad.stderr
    bad = kvbridge("bench", "--migration-backend", "tcp", *QUICK, "--option", "workers=0", check=False)
    assert bad.returncode != 0 and "option workers must be from 1 to" in bad.stderr


def test_bench_options_reach_the_schema_as_given() -> None:
    # converted by the transport's declared types, not guessed as numbers first: insecure=1 is a bool
    result = json.loads(
        kvbridge("bench", "--migration-backend", "tcp", *QUICK, "--option", "insecure=1", "--json").stdout
    )
    assert result["verified"] is True and result["config"]["options"] == {"insecure": True}


def test_bench_refuses_a_layout_vllm_does_not_name() -> None:
    out = kvbridge("bench", "--migration-backend", "tcp", *QUICK, "--layout", "HND", check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--layout" in out.stderr and "invalid choice: 'HND'" in out.stderr and "BLHNC" in out.stderr


def test_bench_table_for_people() -> None:
    out = kvbridge("bench", "--migration-backend", "tcp", *QUICK).stdout
    assert "raw transport" in out and "kvbridge migration" in out and "verified" in out
    assert "layout BLHNC" in out  # the title names the layout (JSON: test above)


def test_bench_refuses_a_transport_that_cannot_cross_processes() -> None:
    out = kvbridge("bench", "--migration-backend", "loopback", *QUICK, check=False)
    assert out.returncode == 2 and "one process only" in out.stderr and "Traceback" not in out.stderr


def _hide_libibverbs() -> list[str]:
    """Run under a private mount namespace where libibverbs.so.1 is an empty file (root only)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("hiding a system library needs root and unshare")
    lib = subprocess.run(
        ["sh", "-c", "ldconfig -p | grep -m1 'libibverbs.so.1 ' | sed 's/.*=> //'"], capture_output=True, text=True
    ).stdout.strip()
    real = os.path.realpath(lib)
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        f'mount --bind /dev/null {real} && exec "$0" "$@"',
    ]


def test_without_libibverbs_mooncake_is_unavailable_with_reason_and_hint() -> None:
    prefix = _hide_libibverbs()
    rows = {r["name"]: r for r in json.loads(kvbridge("plugins", "--json", prefix=prefix).stdout)}
    assert rows["mooncake"]["available"] is False
    assert "libibverbs.so.1" in rows["mooncake"]["reason"]
    assert "apt-get install libibverbs1" in rows["mooncake"]["hint"]
    assert rows["tcp"]["available"] is True
    out = kvbridge("bench", "--migration-backend", "mooncake", *QUICK, prefix=prefix, check=False)
    assert out.returncode == 2
    assert "libibverbs.so.1" in out.stderr and "apt-get install libibverbs1" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_without_the_mooncake_wheel_mooncake_is_unavailable(tmp_path: Path) -> None:
    """A fresh virtualenv with kvbridge, kvbridge-tools and kvbridge-mooncake but no Mooncake wheel."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    deps = ["attrs", "cattrs", "msgpack", "numpy", "pluggy", "pyzmq", "rich"]
    subprocess.run([py, "-m", "pip", "install", "-q", *deps], check=True, capture_output=True)
    # Build from copies: a non-editable install leaves build/ folders in the source tree.
    ignore = shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__", "tests", "plugins")
    core = shutil.copytree(REPO, tmp_path / "kvbridge-src", ignore=ignore)
    plugin = shutil.copytree(REPO / "plugins" / "mooncake", tmp_path / "mooncake-src", ignore=ignore)
    tools = shutil.copytree(REPO / "plugins" / "tools", tmp_path / "tools-src", ignore=ignore)
    subprocess.run(
        [py, "-m", "pip", "install", "-q", "--no-deps", str(core), str(plugin), str(tools)],
        check=True,
        capture_output=True,
    )
    rows = {r["name"]: r for r in json.loads(kvbridge("plugins", "--json", python=py).stdout)}
    assert rows["mooncake"]["available"] is False
    assert "mooncake.engine is not importable" in rows["mooncake"]["reason"]
    assert "kvbridge-mooncake[non-cuda]" in rows["mooncake"]["hint"]
    out = kvbridge("bench", "--migration-backend", "Mooncake", python=py, check=False)
    assert out.returncode == 2 and "unavailable" in out.stderr and "Traceback" not in out.stderr


def test_sigterm_stops_the_processes_the_bench_started() -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvbridge",
            "bench",
            "--migration-backend",
            "mooncake",
            "--model",
            "llama3-8b",
            "--tokens",
            "4096",
            "--repeat",
            "100",
            "--json",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        children: list[int] = []
        deadline = time.monotonic() + 120
        while len(children) < 2:  # the prefill and decode ranks
            assert proc.poll() is None and time.monotonic() < deadline, "the bench did not start its ranks"
            time.sleep(0.2)
            children = [
                int(c) for t in Path(f"/proc/{proc.pid}/task").iterdir() for c in (t / "children").read_text().split()
            ]
        proc.terminate()
        assert proc.wait(timeout=60) == 128 + 15
        for pid in children:
            deadline = time.monotonic() + 30
            while _alive(pid):
                assert time.monotonic() < deadline, f"rank process {pid} outlived the bench"
                time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def _alive(pid: int) -> bool:
    """Running, not gone and not a zombie waiting for its parent to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_readme_first_command_prints_no_native_log_lines() -> None:
    # Exactly the README's first command: its table and verdict, none of Mooncake's glog start-up lines
    # (they are routed to kvbridge's logging, the harmless ones at debug); -v brings the library's back.
    from kvbridge_tools.harness.nativelog import classify

    out = kvbridge("bench", "--migration-backend", "mooncake")
    assert "verified" in out.stdout.lower(), out.stdout
    native = [line for line in out.stderr.splitlines() if classify(line) is not None]
    assert native == [], out.stderr
    assert out.stderr.strip() == ""  # nor anything else: no routed records, no progress bar when piped


def test_bench_plot_writes_an_svg_of_the_sweep(tmp_path: Path) -> None:
    import xml.etree.ElementTree as ET

    svg = tmp_path / "out.svg"
    results = json.loads(
        kvbridge(
            "bench", "--plot", str(svg), "--sweep-tokens", "256,4096", "--requests", "2", "--repeat", "1", "--json"
        ).stdout
    )
    assert [r["config"]["tokens"] for r in results] == [256, 4096] and all(r["verified"] for r in results)
    root = ET.parse(svg).getroot()  # well-formed XML, or this raises
    ns = {"s": "http://www.w3.org/2000/svg"}
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    lines = root.findall("s:polyline", ns)
    assert len(lines) == 2  # raw and kvbridge
    assert all(len(p.get("points").split()) == 2 for p in lines)  # one point per swept length
    labels = {t.text for t in root.iter("{http://www.w3.org/2000/svg}text")}
    assert {"raw mooncake", "kvbridge mooncake", "256", "4096"} <= labels
    bad = kvbridge(
        "bench", "--plot", str(tmp_path / "out.gif"), "--tokens", "256", "--requests", "1", "--repeat", "1", check=False
    )
    assert bad.returncode == 2 and ".svg" in bad.stderr


def test_proxy_refuses_a_port_out_of_range_instead_of_never_listening() -> None:
    out = kvbridge(
        "proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--port", "99999", check=False
    )
    assert out.returncode == 2 and "a port is from 0 to 65535, got 99999" in out.stderr


def test_a_command_plugin_that_does_not_load_leaves_the_rest_of_the_cli_working(tmp_path: Path) -> None:
    """A plugin whose `kvbridge_commands` names a broken module: `kvbridge plugins` still runs.

    The broken subcommand exits 2 naming the error and the fix, without a traceback.
    """
    info = tmp_path / "kvbridge_broken_command-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvbridge-broken-command\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[kvbridge]\nbroken_command = kvbridge_broken_command\n")
    (tmp_path / "kvbridge_broken_command.py").write_text(
        "import kvbridge\n\nKVBRIDGE_PLUGIN_API = 3\n\n\n@kvbridge.hookimpl\n"
        "def kvbridge_commands():\n    return {'frobnicate': 'kvbridge_broken_command_xyz'}\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    run = [sys.executable, "-m", "kvbridge"]
    listed = subprocess.run([*run, "plugins", "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    out = subprocess.run([*run, "frobnicate", "--now"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "kvbridge_broken_command_xyz" in out.stderr and "ModuleNotFoundError" in out.stderr
    assert "pip install --force-reinstall kvbridge-broken-command" in out.stderr and "Traceback" not in out.stderr
    assert "frobnicate" in subprocess.run([*run, "--help"], env=env, capture_output=True, text=True).stdout
