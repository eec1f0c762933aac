"""Make LMDeploy's `Mooncake` migration backend kvbridge's, in every Python process.

`kvbridge_lmdeploy.pth` calls `install()` when an interpreter starts. That only puts a small
finder on `sys.meta_path` (standard library only, nothing imported): when a process imports
`lmdeploy.pytorch.disagg.backend` — where LMDeploy registers its backends, in its API server
and in every executor worker it spawns — the finder lets that module run and then calls
`kvbridge.adapters.lmdeploy.register()`. Processes that never import LMDeploy pay nothing else.
Where kvbridge's adapter is imported first, LMDeploy's module runs inside that import, before the
adapter's class exists: the registration then waits until the adapter's import has finished (its last
line calls `adapter_ready()`). That holds whoever loads the adapter: pytest's assertion rewriter, which
loads every module of a distribution with a pytest plugin (kvbridge's conformance kit), comes first.

Turn it off with `KVBRIDGE_LMDEPLOY=0` (read when LMDeploy's module is imported), or uninstall
the distribution (`pip uninstall kvbridge-lmdeploy`).
"""

from __future__ import annotations

# Runs at every interpreter start: standard-library modules that are already loaded, nothing else.
import os
import sys

TARGET = "lmdeploy.pytorch.disagg.backend"
ADAPTER = "kvbridge.adapters.lmdeploy"
_deferred: set[str] = set()  # {TARGET} when it loaded inside the adapter's import: register after that
ENV = "KVBRIDGE_LMDEPLOY"
_OFF = {"0", "off", "false", "no"}


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in _OFF


def activate() -> bool:
    """Register kvbridge's backend in LMDeploy now, unless turned off. Says whether it did."""
    import logging

    log = logging.getLogger(__name__)
    if not enabled():
        log.info("%s is off: LMDeploy keeps its own migration backends", ENV)
        return False
    try:
        from kvbridge.adapters.lmdeploy import register

        register()
    except Exception as exc:  # LMDeploy must still start; the warning says why its own backend stays
        log.warning(
            "kvbridge could not register its LMDeploy migration backend (%s: %s); LMDeploy keeps its "
            "own. Check `pip show kvbridge kvbridge-lmdeploy`, or set %s=0 to silence this",
            type(exc).__name__,
            exc,
            ENV,
        )
        return False
    return True


def adapter_ready() -> None:
    """The adapter's import has finished (its module calls this last): register now if LMDeploy's ran inside it."""
    if _deferred:
        _deferred.clear()
        activate()


def _adapter_loading() -> bool:
    """Whether kvbridge's adapter is being imported and has not defined `register` yet."""
    adapter = sys.modules.get(ADAPTER)
    return adapter is not None and not hasattr(adapter, "register")


# Duck-typed loader and finder: this runs at every interpreter start, which importing importlib.abc would slow.
class _Loader:
    """Runs LMDeploy's loader, then registers kvbridge's backend (after the adapter's import, if inside it)."""

    def __init__(self, loader: object) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> object:  # get_resource_reader, is_package, ... of the real loader
        return getattr(self._loader, name)

    def create_module(self, spec: object) -> object:
        return self._loader.create_module(spec)

    def exec_module(self, module: object) -> None:
        self._loader.exec_module(module)
        if _adapter_loading():  # kvbridge's class is not defined yet: adapter_ready() registers it
            _deferred.add(TARGET)
        else:
            activate()


class _Finder:
    """Finds nothing itself: wraps the loader of TARGET as the other finders find it."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> object:
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Arrange for `activate()` to run when LMDeploy's backend registry is imported (idempotent)."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    if TARGET in sys.modules:  # installed late, after LMDeploy was imported
        activate()
        return
    sys.meta_path.insert(0, _Finder())


def uninstall() -> None:
    """Remove the finder (the registry keeps whatever was registered already)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
