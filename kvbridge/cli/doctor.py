"""`kvbridge doctor`: check this machine for every installed plugin and say how to fix each problem."""

from __future__ import annotations

import argparse
import ctypes.util
import os
from pathlib import Path

import attrs

from kvbridge.base import wire
from kvbridge.base.secret import SECRET_ENV, SECRET_FILE_ENV, load_secret
from kvbridge.cli.output import print_json, print_table
from kvbridge.plugin.registry import list_backends, list_devices, refused_plugins
from kvbridge.transport import netguard

TCP_SYSCTLS = ("ipv4/tcp_congestion_control", "core/default_qdisc")


@attrs.frozen
class Check:
    """One line of the report. See docs/internals.md."""

    subject: str
    ok: bool
    detail: str
    fix: str = ""
    absent: bool = False

    @property
    def status(self) -> str:
        return "ok" if self.ok else "not here" if self.absent else "PROBLEM"


def machine_checks() -> list[Check]:
    """Native libraries, RDMA devices and network interfaces that transports depend on."""
    verbs = ctypes.util.find_library("ibverbs")
    fix = "" if verbs else "apt-get install libibverbs1 (Mooncake needs it, even for TCP)"
    checks = [Check("libibverbs", verbs is not None, verbs or "not found", fix)]
    ib = Path("/sys/class/infiniband")
    rdma = sorted(p.name for p in ib.iterdir()) if ib.is_dir() else []
    checks.append(Check("RDMA devices", True, ", ".join(rdma) or "none (tcp only; rdma needs an RDMA NIC)"))
    net = Path("/sys/class/net")
    nics = sorted(p.name for p in net.iterdir()) if net.is_dir() else []
    checks.append(Check("network interfaces", bool(nics), ", ".join(nics) or "none", "" if nics else "no network"))
    checks.append(guard_check())
    checks.append(tcp_check())
    for var in ("KVBRIDGE_PLUGINS", "KVBRIDGE_BLOCK_PLUGINS"):
        if var in os.environ:
            checks.append(Check(var, True, f"set to {os.environ[var]!r}: limits which plugins load"))
    return checks


def tcp_check(sysctl: Path = Path("/proc/sys/net")) -> Check:
    """The host's TCP congestion control: BBR pacing without `fq` stalled Mooncake TCP's idle lanes under load."""
    cc, qdisc = ((sysctl / f).read_text().strip() if (sysctl / f).is_file() else "?" for f in TCP_SYSCTLS)
    detail, fix = f"{cc} (qdisc {qdisc})", ""
    if cc == "bbr" and qdisc != "fq":  # docs/measurements/vllm-load.md, 2026-12-07
        detail += ": reads over Mooncake TCP stalled 80-165 ms now and then on a loaded host (none with cubic)"
        fix = "sysctl -w net.ipv4.tcp_congestion_control=cubic where a server's transport is TCP"
    return Check("TCP congestion control", True, detail, fix)


def guard_check() -> Check:
    """Whether Mooncake's and NIXL's listeners can be closed to strangers here, and who they would admit."""
    why = netguard.self_test()
    if why:
        return Check(
            "listener guard",
            False,
            f"cannot filter Mooncake's and NIXL's listeners: {why}; they refuse to start unless insecure=True",
            "run on Linux with /proc mounted",
        )
    try:
        secret = load_secret() is not None
    except Exception as exc:  # noqa: BLE001 - a bad secret is this check's finding
        return Check("listener guard", False, f"the shared secret cannot be read: {exc}", f"fix {SECRET_ENV}")
    admits = "hosts that prove the shared secret" if secret else f"no other host ({SECRET_ENV} is not set)"
    admitted = netguard.ADMISSION.hosts()
    v4, v6 = (netguard.capacity(v, admitted) for v in (4, 6))
    room = (
        f"{len(admitted)} hosts admitted here; room for {v4} more IPv4 or {v6} more IPv6 hosts in one filter "
        f"(net.core.optmem_max = {netguard.optmem_max()} bytes)"
    )
    return Check(
        "listener guard",
        True,
        f"Mooncake's and NIXL's listeners admit loopback, allow= networks and {admits}, each while a lease or peer "
        f"relation needs it; {room}; with insecure=True (the trust option) they are OPEN to any host",
        "" if secret else f"to serve other hosts: set {SECRET_ENV} or {SECRET_FILE_ENV} on every engine",
    )


def plugin_checks() -> list[Check]:
    out = []
    for info in list_backends() + list_devices() + refused_plugins():
        detail = "available" if info.available else info.reason
        absent = not info.available and info.hardware_here is False
        out.append(Check(f"{info.kind} {info.name}", info.available, detail, "" if absent else info.hint, absent))
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="check this machine for each installed plugin",
        description="Check native libraries, devices and NICs for every installed plugin; print the fix for "
        "each problem. A device plugin whose hardware is not on this machine (a GPU plugin on a CPU-only "
        "host) is listed as 'not here'. Exit status 1 when there is a problem: an installed plugin that "
        "cannot run although its hardware is here (or is not tied to hardware), or a missing library.",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--probe", action="store_true", help="time a small read of device memory in place and staged, per transport"
    )
    p.set_defaults(run=run)


def probe_checks() -> list[Check]:
    """Which path (in place or staged through host memory) is faster for each device and each transport reaching it."""
    from kvbridge import create_backend, get_device
    from kvbridge.transport import staging

    out = []
    for d in (d for d in list_devices() if d.available and get_device(d.name).synchronizes):
        for name in (b.name for b in list_backends() if b.available):
            device, made = get_device(d.name), create_backend(name)
            made.close()  # it was made for its default protocol and capabilities, which `reaches` reads
            if staging.reaches(device, made):
                key = f"{d.name}/{name}/{made.protocol}"
                choice = staging.probe_paths(lambda n=name: create_backend(n), device, key=key)
                out.append(Check(f"path {key}", min(choice.in_place_s, choice.staged_s) < float("inf"), str(choice)))
    return out or [Check("path probe", True, "no device memory a transport reaches in place here: nothing to pick")]


def run(args: argparse.Namespace) -> int:
    checks = machine_checks() + plugin_checks() + (probe_checks() if args.probe else [])
    if args.json:
        print_json([{**wire.to_dict(c), "status": c.status} for c in checks])
    else:
        rows = [(c.subject, c.status, c.detail, c.fix) for c in checks]
        print_table("kvbridge doctor", ["check", "status", "detail", "fix"], rows)
    return 0 if all(c.ok or c.absent for c in checks) else 1
