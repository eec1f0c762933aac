"""The GPU kit (scripts/gpu-pack, scripts/gpu-check; docs/gpu.md) on this machine, which has no GPU.

`gpu-check --device cpu --dry-run` runs every check the GPU machine runs, on host memory, with the tcp
transport and nothing installed, so the kit cannot rot between the sessions that are lent a GPU. The
install path (wheels into a folder of their own, .debs unpacked, entry points declared for the tree)
runs on the pure wheels and the .deb made here."""

from __future__ import annotations

import importlib.metadata
import io
import json
import os
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

from kvbridge_tools.harness import gpu_kit

REPO = Path(__file__).resolve().parents[3]


def test_the_cpu_dry_run_passes_every_check_and_writes_its_json(tmp_path: Path) -> None:
    out = subprocess.run(
        ["scripts/gpu-check", "--device", "cpu", "--dry-run", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert (report["device"], report["transport"], report["dry_run"], report["ok"]) == ("cpu", "tcp", True, True)
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == ["install", *gpu_kit.STEPS]
    for name, step in steps.items():
        assert step["status"] == "pass", (name, step["detail"])
        assert step["seconds"] >= 0 and step["detail"]
        assert name in out.stdout  # one table row per step
    assert steps["conformance"]["data"]["passed"] > 0 and steps["conformance"]["data"]["skipped"] == 0
    (run,) = steps["pair-bench"]["data"]["runs"]
    assert run["verified"] is True and run["kvbridge_gbps"] > 0 and run["raw_gbps"] > 0
    assert steps["landing"]["data"]["pairs"] == 36 and steps["landing"]["data"]["wrong"] == []
    assert steps["layerwise"]["data"]["wrong_layers"] == [] and steps["layerwise"]["data"]["marks"] == "none"


def test_the_pack_dry_run_sizes_what_travels_without_downloading(tmp_path: Path) -> None:
    out = subprocess.run(
        ["scripts/gpu-pack", "--transport", "tcp", "--dry-run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**_env(), "KVBRIDGE_GPU_PACK_CACHE": str(tmp_path / "cache")},
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "working tree" in out.stdout and "of 64 MiB travel" in out.stdout
    assert "8 of the files are not in" in out.stdout  # an empty cache: nothing counted, nothing fetched
    assert not (tmp_path / "cache").exists()


def test_a_payload_over_the_limit_is_refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(gpu_kit, "LIMIT_BYTES", 1024)
    assert gpu_kit.pack("tcp", dry_run=True) == 1
    assert "REFUSED" in capsys.readouterr().err


def test_the_tree_that_travels_is_what_git_does_not_ignore(tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text(".gpu-pack/\n")
    (tmp_path / ".gpu-pack").mkdir()
    (tmp_path / ".gpu-pack" / "big.whl").write_bytes(b"x" * 1000)
    (tmp_path / "code.py").write_text("x = 1\n")
    names = sorted(p.name for p in gpu_kit.tree_files(tmp_path))
    assert names == [".gitignore", "code.py"]  # untracked, not ignored: they travel; the pack is counted apart


def test_each_transport_carries_its_own_wheels_pinned() -> None:
    for transport in gpu_kit.TRANSPORTS:
        wheels, debs = gpu_kit.wanted(transport)
        assert all("==" in w for w in wheels) and not any(w.startswith("torch") for w in wheels)
        assert {"cattrs", "pyzmq"} <= {w.split("==")[0] for w in wheels}
    assert "libibverbs1" in gpu_kit.wanted("mooncake")[1]
    assert gpu_kit.wheel_glob("markdown-it-py==4.3.0") == "markdown_it_py-4.3.0-*.whl"
    with pytest.raises(SystemExit, match="unknown transport"):
        gpu_kit.wanted("rdma")


def test_declared_entry_points_make_the_trees_plugins_findable(tmp_path: Path) -> None:
    # On the GPU machine the tree is on PYTHONPATH, not pip-installed: kvbridge finds plugins by entry point.
    dists = {d["name"]: d for d in gpu_kit._pyproject_dists()}
    assert {"kvbridge", "kvbridge-cuda", "kvbridge-mooncake", "kvbridge-nixl"} <= set(dists)
    gpu_kit.write_dist_info([dists["kvbridge-cuda"], dists["kvbridge"]], tmp_path)
    found = {d.metadata["Name"]: d for d in importlib.metadata.distributions(path=[str(tmp_path)])}
    assert set(found) == {"kvbridge-cuda", "kvbridge"}
    eps = {(e.group, e.name, e.value) for e in found["kvbridge-cuda"].entry_points}
    assert eps == {("kvbridge", "cuda", "kvbridge_cuda.plugin")}
    assert ("pytest11", "kvbridge", "kvbridge.testing.plugin") in {
        (e.group, e.name, e.value) for e in found["kvbridge"].entry_points
    }
    assert gpu_kit._uninstalled(["kvbridge", "no-such-dist-x"], _env()) == ["no-such-dist-x"]


def test_install_puts_the_pack_in_its_own_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pack, site, debs = tmp_path / "pack", tmp_path / "site", tmp_path / "debs"
    pack.mkdir()
    _wheel(pack / "kitprobe-1.0-py3-none-any.whl")
    _deb(pack / "libprobe1_1.0_amd64.deb")
    (pack / "MANIFEST.json").write_text(json.dumps({"transport": "tcp", "files": []}))
    monkeypatch.setattr(gpu_kit, "PACK_DIR", pack)
    monkeypatch.setattr(gpu_kit, "SITE", site)
    monkeypatch.setattr(gpu_kit, "DEBS_ROOT", debs)
    result, env = gpu_kit.install("tcp", dry_run=False)
    assert result["status"] == "pass", result["detail"]
    assert (site / "kitprobe" / "__init__.py").is_file()
    assert (debs / "usr/lib/x86_64-linux-gnu/libprobe.so.1").read_bytes() == b"ELF?"
    assert (
        str(site) in env["PYTHONPATH"].split(":") and str(debs / "usr/lib/x86_64-linux-gnu") in env["LD_LIBRARY_PATH"]
    )
    (debs / "usr").rename(tmp_path / "moved")
    monkeypatch.setattr(gpu_kit.shutil, "which", lambda name: None)  # no dpkg: unpacked by hand, the same
    gpu_kit._unpack_deb(pack / "libprobe1_1.0_amd64.deb", debs)
    assert (debs / "usr/lib/x86_64-linux-gnu/libprobe.so.1").read_bytes() == b"ELF?"
    gpu_kit._unpack_wheels([pack / "kitprobe-1.0-py3-none-any.whl"], tmp_path / "bare")
    assert (tmp_path / "bare" / "kitprobe" / "__init__.py").read_text() == "X = 1\n"


def test_install_refuses_a_pack_of_another_transport(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "MANIFEST.json").write_text(json.dumps({"transport": "nixl", "files": []}))
    monkeypatch.setattr(gpu_kit, "PACK_DIR", tmp_path)
    result, _ = gpu_kit.install("mooncake", dry_run=False)
    assert result["status"] == "fail"
    assert "holds 'nixl'" in result["detail"] and "gpu-pack --transport mooncake" in result["detail"]
    monkeypatch.setattr(gpu_kit, "PACK_DIR", tmp_path / "none")
    result, _ = gpu_kit.install("tcp", dry_run=False)
    assert result["status"] == "fail" and "run scripts/gpu-pack --transport tcp first" in result["detail"]


def _env() -> dict[str, str]:
    return dict(os.environ)


def _wheel(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("kitprobe/__init__.py", "X = 1\n")
        z.writestr("kitprobe-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: kitprobe\nVersion: 1.0\n")
        z.writestr(
            "kitprobe-1.0.dist-info/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr("kitprobe-1.0.dist-info/RECORD", "")


def _deb(path: Path) -> None:
    """A minimal .deb (ar archive: debian-binary, control.tar.gz, data.tar.xz) holding one library file."""

    def tar(files: dict[str, bytes], mode: str) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode=mode) as t:
            for name, body in files.items():
                info = tarfile.TarInfo(name)
                info.size = len(body)
                t.addfile(info, io.BytesIO(body))
        return buf.getvalue()

    control = b"Package: libprobe1\nVersion: 1.0\nArchitecture: amd64\nMaintainer: t <t@t>\nDescription: probe\n"
    members = [
        ("debian-binary", b"2.0\n"),
        ("control.tar.gz", tar({"./control": control}, "w:gz")),
        ("data.tar.xz", tar({"./usr/lib/x86_64-linux-gnu/libprobe.so.1": b"ELF?"}, "w:xz")),
    ]
    out = bytearray(b"!<arch>\n")
    for name, body in members:
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(body):<10}`\n".encode()
        out += body + (b"\n" if len(body) % 2 else b"")
    path.write_bytes(bytes(out))
