"""The test suites' shared fixtures and helpers: tests/conftest.py and plugins/proxy/tests/conftest.py import them.

A fixture function imported into a conftest is registered there. Importing this module also loads the hypothesis
profile every suite runs under.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import settings

import kvbridge
from kvbridge_tools.harness.hosts import Hosts, hosts_unavailable

if TYPE_CHECKING:
    from kvbridge_tools.harness.hosts import Host

# No wall-clock deadline per example: on a loaded CI box a pure-Python property can take several times any fixed
# deadline, a flake that says nothing about the code. Tests assert behaviour, never time.
settings.register_profile("kvbridge", deadline=None)
settings.load_profile("kvbridge")


def wait_for(cond: Callable[[], bool], timeout: float = 30.0, what: str | Callable[[], str] = "condition") -> None:
    """Poll `cond` until it holds; fail the test after `timeout` seconds, saying `what` (called then, if callable)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what() if callable(what) else what}"
        time.sleep(0.02)


def _require(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.fail(f"{binary} is not installed; run scripts/setup --test")
    return path


@contextmanager
def redis_server(tmp: Path, host: Host | None = None) -> Iterator[str]:
    """A real redis-server on a free port of 127.0.0.1, or of `host` (a namespace host), stopped by its PID.

    On a namespace host it takes a password, as redis does off loopback. Yields redis://[:PASSWORD@]ADDRESS:PORT.
    """
    from kvbridge_tools.harness.redis import redis_server as start

    _require("redis-server")
    with start(tmp, host) as url:
        yield url


@contextmanager
def etcd_server(tmp: Path, host: Host | None = None) -> Iterator[str]:
    """A real single-member etcd on free ports of 127.0.0.1, or of `host` (a namespace host), stopped by its PID.

    Yields etcd://ADDRESS:PORT.
    """
    from kvbridge_tools.harness.etcd import etcd_server as start

    _require("etcd")
    with start(tmp, host) as url:
        yield url


@pytest.fixture(autouse=True)
def fresh_registry() -> Iterator[None]:
    """Each test starts and ends with kvbridge's plugin registry as loaded fresh."""
    kvbridge.reset_plugins()
    yield
    kvbridge.reset_plugins()


def _hosts_factory() -> Iterator[Callable[..., Hosts]]:
    reason = hosts_unavailable()
    if reason:
        pytest.skip(reason)
    made: list[Hosts] = []

    def make(names: Sequence[str], **kwargs: Any) -> Hosts:
        hosts = Hosts(names, **kwargs)
        made.append(hosts)  # before open(): a failed open cleans up itself, close() is then a no-op
        hosts.open()
        return hosts

    try:
        yield make
    finally:
        for hosts in reversed(made):
            hosts.close()


@pytest.fixture
def hosts_factory() -> Iterator[Callable[..., Hosts]]:
    """`make(["prefill", "decode"], subnet=...)` -> open `Hosts`, closed after the test.

    Skips where namespaces cannot be made (not root, tools missing). As root, a failure to make them fails.
    """
    yield from _hosts_factory()


@pytest.fixture(scope="module")
def module_hosts_factory() -> Iterator[Callable[..., Hosts]]:
    """`hosts_factory` whose hosts live for the whole module (shared servers)."""
    yield from _hosts_factory()


# A real redis and a real etcd for the tests of one module that use them (registry records, membership).
@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture(scope="module")
def etcd_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with etcd_server(tmp_path_factory.mktemp("etcd")) as url:
        yield url


SLOW_GROUP = "slow"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the groups into the node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Group the tests for `pytest -n N --dist loadgroup` (scripts/test): the slow ones run one at a time.

    Each slow test starts whole servers (vLLM's take a core each and about a GiB): they take turns on one worker,
    in collection order so that a module's servers serve all its tests, while the other workers run the quick tests
    beside them, each module on one worker. Without pytest-xdist the marks do nothing.
    """
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            group = SLOW_GROUP if item.get_closest_marker("slow") else item.nodeid.partition("::")[0]
            item.add_marker(pytest.mark.xdist_group(group))
