"""The GPU kit (docs/gpu.md): what one call to a lent GPU machine carries, and the checks run there.

`scripts/gpu-pack` (here) and `scripts/gpu-check` (on the GPU machine) run this file by its path, with
the standard library only: there, kvbridge cannot be imported before the carried wheels it needs
(cattrs, pyzmq, rich) are installed. Each check then runs in a child process of its own
(`kvbridge_tools.harness.gpu_check`), so a crash or a hang fails that check alone.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[5]  # plugins/tools/src/kvbridge_tools/harness
PACK_DIR = REPO / ".gpu-pack"  # ignored by git; it travels beside the working tree (docs/gpu.md)
CACHE_DIR = Path(os.environ.get("KVBRIDGE_GPU_PACK_CACHE", Path.home() / ".cache" / "kvbridge-gpu-pack"))
LIMIT_BYTES = 64 << 20  # what one call to the GPU machine carries, working tree and pack together
TRANSPORTS = ("tcp", "nixl", "mooncake")
# What the GPU machine's image (Python 3.12, torch 2.11 CUDA 13, pluggy, attrs, msgpack, numpy, pytest)
# lacks for kvbridge, pinned to the versions tested here. attrs is carried too: cattrs needs a recent one.
COMMON_WHEELS = (
    "attrs==26.1.0",
    "cattrs==26.2.1",
    "typing-extensions==4.16.0",
    "pyzmq==27.3.0",
    "rich==15.0.0",
    "markdown-it-py==4.3.0",
    "mdurl==0.1.2",
    "pygments==2.21.0",
)
TRANSPORT_WHEELS = {
    "tcp": (),
    # the meta package provides `nixl._api` and picks nixl_cu13 by torch's CUDA version
    "nixl": ("nixl==1.5.1", "nixl-cu13==1.5.1"),
    "mooncake": ("mooncake-transfer-engine-cuda13==0.3.14",),
}
# Mooncake links libibverbs even for TCP (and libibverbs links libnl); the image cannot run apt.
TRANSPORT_DEBS = {"mooncake": ("libibverbs1", "libnl-3-200", "libnl-route-3-200")}
PYTHON_VERSION = "3.12"
# pip matches --platform exactly: every manylinux tag a cp312 x86_64 wheel of these may carry
PLATFORMS = ("manylinux2014_x86_64", *(f"manylinux_2_{n}_x86_64" for n in range(17, 40)))
SITE = Path("/tmp/kvbridge-gpu-site")  # where gpu-check installs what was carried, never into the image
DEBS_ROOT = Path("/tmp/kvbridge-gpu-debs")
CHECK_BUDGET_S = 240.0  # a first try that fails leaves time to rerun within the 15 minutes lent
# each check's share of the budget (seconds); a check also stops at what is left of the budget
STEPS = {"environment": 30.0, "conformance": 75.0, "pair-bench": 60.0, "landing": 40.0, "layerwise": 30.0}


# -- the pack (here) ---------------------------------------------------------------------------


def wanted(transport: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The pinned wheels and the Debian packages one transport's call carries."""
    if transport not in TRANSPORTS:
        raise SystemExit(f"gpu kit: unknown transport {transport!r}; pick one of {', '.join(TRANSPORTS)}")
    return COMMON_WHEELS + TRANSPORT_WHEELS[transport], TRANSPORT_DEBS.get(transport, ())


def wheel_glob(requirement: str) -> str:
    """The file name pattern of a pinned requirement's wheel (`pyzmq==27.3.0` -> `pyzmq-27.3.0-*.whl`)."""
    name, _, version = requirement.partition("==")
    return f"{name.replace('-', '_').lower()}-{version}-*.whl"


def deb_glob(package: str) -> str:
    return f"{package}_*_amd64.deb"


def find(folder: Path, pattern: str) -> Path | None:
    """The newest file in `folder` matching `pattern`, case-insensitively."""
    hits = sorted(
        (p for p in folder.glob("*") if fnmatch.fnmatch(p.name.lower(), pattern)), key=lambda p: p.stat().st_mtime
    )
    return hits[-1] if hits else None


def tree_files(repo: Path = REPO) -> list[Path]:
    """Files that travel with the working tree: tracked, and untracked ones git does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=repo, capture_output=True, check=True
    ).stdout
    return [repo / name for name in out.decode().split("\0") if name and (repo / name).is_file()]


def size_bytes(files: list[Path]) -> int:
    return sum(f.lstat().st_size for f in files)


def _download(wheels: tuple[str, ...], debs: tuple[str, ...]) -> list[Path]:
    """Each wheel and .deb in the cache, downloaded unless it is there already."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    missing = [w for w in wheels if find(CACHE_DIR, wheel_glob(w)) is None]
    if missing:
        platforms = [a for p in PLATFORMS for a in ("--platform", p)]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version"]
        cmd += [PYTHON_VERSION, "--implementation", "cp", *platforms, "-d", str(CACHE_DIR), *missing]
        if subprocess.run(cmd, check=False).returncode != 0:
            raise SystemExit(f"gpu-pack: pip could not download {' '.join(missing)} (cp312 manylinux builds)")
    missing_debs = [d for d in debs if find(CACHE_DIR, deb_glob(d)) is None]
    # apt-get download writes into the current folder; it needs the package lists (apt-get update)
    if missing_debs and subprocess.run(["apt-get", "download", *missing_debs], cwd=CACHE_DIR).returncode != 0:
        raise SystemExit(f"gpu-pack: apt-get download {' '.join(missing_debs)} failed; run apt-get update first")
    found = [find(CACHE_DIR, wheel_glob(w)) for w in wheels] + [find(CACHE_DIR, deb_glob(d)) for d in debs]
    if any(f is None for f in found):
        raise SystemExit(f"gpu-pack: downloaded, yet not found in {CACHE_DIR}: {wheels + debs}")
    return [f for f in found if f is not None]


def pack(transport: str, dry_run: bool = False) -> int:
    """Fill PACK_DIR with exactly one transport's payload; print what travels; 1 when it is over the limit.

    A dry run downloads nothing and changes nothing: it sizes the working tree and what the pack would
    hold where the cache already has it."""
    wheels, debs = wanted(transport)
    if dry_run:
        cached = (
            [find(CACHE_DIR, p) for p in [*map(wheel_glob, wheels), *map(deb_glob, debs)]] if CACHE_DIR.is_dir() else []
        )
        files = [f for f in cached if f is not None]
        unknown = len(wheels) + len(debs) - len(files)
    else:
        files = _download(wheels, debs)
        PACK_DIR.mkdir(exist_ok=True)
        keep = {f.name for f in files}
        for old in PACK_DIR.iterdir():  # another transport's payload would not fit beside this one
            if old.name not in keep and old.name != "MANIFEST.json":
                if old.is_dir() and not old.is_symlink():
                    shutil.rmtree(old)
                else:
                    old.unlink()
        for f in files:
            target = PACK_DIR / f.name
            if not target.exists() or target.stat().st_size != f.stat().st_size:
                shutil.copyfile(f, target)
        (PACK_DIR / "MANIFEST.json").write_text(
            json.dumps({"transport": transport, "files": sorted(keep)}, indent=1) + "\n"
        )
        files = sorted(PACK_DIR.iterdir())
        unknown = 0
    travelling = tree_files()
    tree = size_bytes(travelling)
    payload = size_bytes(files)
    total = tree + payload
    print(f"gpu-pack: transport {transport}: {len(wheels)} wheels, {len(debs)} .debs")
    for f in files:
        print(f"  {f.stat().st_size / 2**20:8.2f} MiB  {f.name}")
    print(f"  {tree / 2**20:8.2f} MiB  working tree ({len(travelling)} files: tracked + untracked, not ignored)")
    what = f"{PACK_DIR.name}/ and the working tree" if not dry_run else "the working tree and the pack (dry run)"
    print(f"gpu-pack: {total / 2**20:.2f} MiB of {LIMIT_BYTES / 2**20:.0f} MiB travel: {what}")
    if unknown:
        print(
            f"gpu-pack: dry run: {unknown} of the files are not in {CACHE_DIR} yet, so not counted; "
            "run without --dry-run to download them"
        )
    if total > LIMIT_BYTES:
        print(
            f"gpu-pack: REFUSED: {total / 2**20:.2f} MiB is over the {LIMIT_BYTES / 2**20:.0f} MiB one call carries; "
            "pack one transport per call (--transport tcp is the smallest) or shrink the working tree",
            file=sys.stderr,
        )
        return 1
    return 0


# -- the install (there) -------------------------------------------------------------------------


def _unpack_wheels(wheels: list[Path], site: Path) -> None:
    """What `pip install --no-index --no-deps --target` does, where the image has no pip.

    A wheel is a zip whose `*.data/purelib` and `platlib` belong beside its packages.
    """
    for whl in wheels:
        with zipfile.ZipFile(whl) as z:
            for member in z.infolist():
                parts = Path(member.filename).parts
                if parts[0].endswith(".data"):
                    if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                        continue  # scripts and headers: not needed to import it
                    parts = parts[2:]
                target = site.joinpath(*parts)
                if member.is_dir():
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(member))
                mode = member.external_attr >> 16
                if mode & 0o111:
                    target.chmod(0o755)


def _unpack_deb(deb: Path, root: Path) -> None:
    """`dpkg -x deb root`, or the same by hand where there is no dpkg: an ar archive holding data.tar.*."""
    if shutil.which("dpkg"):
        subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
        return
    data = deb.read_bytes()
    at = 8  # after "!<arch>\n": 60-byte headers, each member padded to an even length
    while at < len(data):
        name, size = data[at : at + 16].decode().strip().rstrip("/"), int(data[at + 48 : at + 58].decode().strip())
        body = data[at + 60 : at + 60 + size]
        if name.startswith("data.tar"):
            tmp = root / name
            root.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(body)
            try:
                with tarfile.open(tmp) as tar:
                    tar.extractall(root, filter="tar")
            finally:
                tmp.unlink()
            return
        at += 60 + size + (size % 2)
    raise RuntimeError(f"{deb.name}: no data.tar member")


def _pyproject_dists(repo: Path = REPO) -> list[dict[str, Any]]:
    """kvbridge's distributions in this tree (kvbridge and plugins/*): name, version, entry points."""
    import tomllib  # Python 3.11+: the kit runs on the GPU machine's 3.12 and this machine's 3.11

    found = []
    for path in [repo / "pyproject.toml", *sorted(repo.glob("plugins/*/pyproject.toml"))]:
        project = tomllib.loads(path.read_text())["project"]
        found.append(
            {"name": project["name"], "version": project["version"], "entry_points": project.get("entry-points", {})}
        )
    return found


def write_dist_info(dists: list[dict[str, Any]], folder: Path) -> list[str]:
    """Metadata only (`NAME-VERSION.dist-info` with METADATA and entry_points.txt) for distributions on PYTHONPATH.

    Their code is on PYTHONPATH but they are not installed, and kvbridge finds its plugins by entry point.
    """
    written = []
    for d in dists:
        info = folder / f"{d['name'].replace('-', '_')}-{d['version']}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {d['name']}\nVersion: {d['version']}\n")
        groups = [
            f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in sorted(eps.items()))
            for group, eps in sorted(d["entry_points"].items())
        ]
        (info / "entry_points.txt").write_text("\n".join(groups))
        written.append(d["name"])
    return written


def _uninstalled(names: list[str], env: dict[str, str]) -> list[str]:
    """Which of `names` no distribution on the children's path provides."""
    probe = (
        "import importlib.metadata as m, json, sys\n"
        "def has(n):\n"
        "    try:\n        m.distribution(n)\n        return True\n"
        "    except m.PackageNotFoundError:\n        return False\n"
        "print(json.dumps([n for n in sys.argv[1:] if not has(n)]))"
    )
    out = subprocess.run([sys.executable, "-c", probe, *names], env=env, capture_output=True, text=True, check=True)
    return list(json.loads(out.stdout))


def child_env(site: Path | None, debs: Path | None) -> dict[str, str]:
    """The children's environment: this tree's code first, then what was installed from the pack."""
    env = dict(os.environ)
    paths = [str(REPO), *(str(p) for p in sorted(REPO.glob("plugins/*/src")))]
    paths += [str(site)] if site is not None else []
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    if debs is not None:
        libs = [str(debs / d) for d in ("usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu")]
        env["LD_LIBRARY_PATH"] = os.pathsep.join([*libs, *filter(None, [env.get("LD_LIBRARY_PATH")])])
    return env


def install(transport: str, dry_run: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """Install what the pack carried into SITE (and its .debs under DEBS_ROOT).

    Returns the `install` step's result and the children's environment. A dry run installs nothing and checks that
    what the pack would provide imports here.
    """
    start = time.monotonic()
    env = child_env(None, None)
    data: dict[str, Any] = {}
    try:
        if dry_run:
            detail = "dry run: nothing carried, nothing installed; "
        else:
            manifest = PACK_DIR / "MANIFEST.json"
            if not manifest.is_file():
                raise RuntimeError(f"{manifest} is missing: run scripts/gpu-pack --transport {transport} first")
            packed = json.loads(manifest.read_text())
            if packed["transport"] != transport:
                raise RuntimeError(
                    f"the pack holds {packed['transport']!r}, not {transport!r}: run scripts/gpu-pack --transport "
                    f"{transport}, or scripts/gpu-check --transport {packed['transport']}"
                )
            wheels = sorted(PACK_DIR.glob("*.whl"))
            debs = sorted(PACK_DIR.glob("*.deb"))
            shutil.rmtree(SITE, ignore_errors=True)
            SITE.mkdir(parents=True)
            cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(SITE)]
            if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0:
                subprocess.run([*cmd, *map(str, wheels)], check=True)
                data["installer"] = "pip"
            else:
                _unpack_wheels(wheels, SITE)
                data["installer"] = "zipfile (no pip in this image)"
            for deb in debs:
                _unpack_deb(deb, DEBS_ROOT)
            env = child_env(SITE, DEBS_ROOT if debs else None)
            data["wheels"] = [w.name for w in wheels]
            data["debs"] = [d.name for d in debs]
            detail = f"{len(wheels)} wheels into {SITE}, {len(debs)} .debs under {DEBS_ROOT}; "
        dists = _pyproject_dists()
        missing = _uninstalled([d["name"] for d in dists], env)
        if missing:  # the tree is not pip-installed there: its entry points are declared beside the wheels
            shims = SITE if not dry_run else Path(env.get("TMPDIR", "/tmp")) / "kvbridge-gpu-dists"
            write_dist_info([d for d in dists if d["name"] in missing], shims)
            if dry_run:
                env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(shims)])
            detail += f"entry points declared for {', '.join(missing)}; "
        probe = "import cattrs, zmq, rich, kvbridge; print(kvbridge.__version__)"
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"kvbridge does not import after the install: {out.stderr.strip()[-800:]}")
        return _result("install", "pass", start, detail + "kvbridge imports", data), env
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
        return _result("install", "fail", start, str(exc), data), env


# -- the checks (there) --------------------------------------------------------------------------


def _result(name: str, status: str, start: float, detail: str, data: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "status": status,
        "seconds": round(time.monotonic() - start, 2),
        "detail": detail,
        "data": data or {},
    }


def run_step(name: str, args: argparse.Namespace, env: dict[str, str], out: Path, limit_s: float) -> dict[str, Any]:
    """One check in a child process (`python -m kvbridge_tools.harness.gpu_check NAME`), its log in out/NAME.log."""
    start = time.monotonic()
    if limit_s < 5:
        return _result(name, "fail", start, f"not run: the {CHECK_BUDGET_S:.0f} s budget is spent")
    result_file = out / f"{name}.result.json"
    result_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "kvbridge_tools.harness.gpu_check", name, "--device", args.device]
    cmd += ["--transport", args.transport, "--out", str(out), "--result", str(result_file), "--limit", str(limit_s)]
    with open(out / f"{name}.log", "w") as log:
        try:
            proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=limit_s, check=False)
        except subprocess.TimeoutExpired:
            return _result(name, "fail", start, f"timed out after {limit_s:.0f} s (log: {name}.log)")
    if result_file.is_file():
        found = json.loads(result_file.read_text())
        found["seconds"] = round(time.monotonic() - start, 2)
        if proc.returncode != 0 and found.get("status") == "pass":
            found["status"], found["detail"] = "fail", f"exit status {proc.returncode}; " + found["detail"]
        return found
    tail = (out / f"{name}.log").read_text()[-600:].strip()
    return _result(name, "fail", start, f"exit status {proc.returncode}, no result: {tail}")


def table(results: list[dict[str, Any]]) -> str:
    rows = [("step", "result", "seconds", "detail")]
    rows += [(r["name"], r["status"].upper(), f"{r['seconds']:.1f}", r["detail"]) for r in results]
    width = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join([*(c.ljust(w) for c, w in zip(row[:3], width)), row[3]]) for row in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def check(args: argparse.Namespace) -> int:
    """Install what was carried, run every check, print one table, write gpu-check.json; 0 when all pass."""
    out = Path(args.out or os.environ.get("OUT") or REPO / "gpu-check-out").resolve()
    out.mkdir(parents=True, exist_ok=True)
    began = time.time()
    deadline = time.monotonic() + CHECK_BUDGET_S
    first, env = install(args.transport, args.dry_run)
    results = [first]
    for name, share in STEPS.items():
        if results[0]["status"] != "pass" or (results[1:2] and results[1]["status"] == "fail"):
            why = "install failed" if results[0]["status"] != "pass" else "the environment step failed"
            results.append(_result(name, "skip", time.monotonic(), f"not run: {why}"))
            continue
        results.append(run_step(name, args, env, out, min(share, deadline - time.monotonic())))
    ok = all(r["status"] != "fail" for r in results) and results[0]["status"] == "pass"
    report = {
        "kit": "kvbridge gpu-check",
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(began)),
        "device": args.device,
        "transport": args.transport,
        "dry_run": args.dry_run,
        "ok": ok,
        "steps": results,
    }
    (out / "gpu-check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"kvbridge gpu-check: device {args.device}, transport {args.transport}{' (dry run)' if args.dry_run else ''}")
    print(table(results))
    print(f"gpu-check: {'every check passed' if ok else 'FAILED'}; JSON in {out / 'gpu-check.json'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu kit", description="kvbridge's GPU proof (docs/gpu.md)")
    sub = p.add_subparsers(dest="command", required=True)
    pk = sub.add_parser("pack", help="prepare .gpu-pack/ for one transport and size what travels")
    pk.add_argument("--transport", choices=TRANSPORTS, default="tcp")
    pk.add_argument("--dry-run", action="store_true", help="download nothing: only size the tree and the cache")
    ck = sub.add_parser("check", help="install what was carried and run the checks")
    ck.add_argument("--transport", choices=TRANSPORTS, default="tcp")
    ck.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ck.add_argument("--dry-run", action="store_true", help="install nothing: use what this machine has (CI)")
    ck.add_argument("--out", default=None, help="folder for gpu-check.json and the logs (default: $OUT)")
    args = p.parse_args(argv)
    return pack(args.transport, args.dry_run) if args.command == "pack" else check(args)


if __name__ == "__main__":
    sys.exit(main())
