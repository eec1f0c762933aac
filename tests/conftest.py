"""Shared fixtures; tests never load the user's own plugins by accident.

Only kvbridge's own distributions (the repo's plugins) are allowed unless a test says otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from hypothesis import settings

import kvbridge
from kvbridge_tools.harness.hosts import Hosts, hosts_unavailable

# No wall-clock deadline per example: on a loaded 2-core CI box a 200 ms deadline failed a pure-Python property
# (test_memory, 875 ms), a flake that says nothing about the code. Tests assert behaviour, never time.
settings.register_profile("kvbridge", deadline=None)
settings.load_profile("kvbridge")


@pytest.fixture(autouse=True)
def _fresh_registry() -> Iterator[None]:
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
    from control_helpers import redis_server

    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture(scope="module")
def etcd_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from control_helpers import etcd_server

    with etcd_server(tmp_path_factory.mktemp("etcd")) as url:
        yield url
