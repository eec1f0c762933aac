"""Shared fixtures; tests never load the user's own plugins by accident.

Only kvbridge's own distributions (the repo's plugins) are allowed unless a test says otherwise. The fixtures, and the
hook that groups the tests for pytest-xdist, live in kvbridge_tools.harness.fixtures, shared with plugins/proxy/tests
(a fixture or hook imported into a conftest is registered).
"""

from kvbridge_tools.harness.fixtures import (
    etcd_url,
    fresh_registry,
    hosts_factory,
    module_hosts_factory,
    pytest_collection_modifyitems,
    redis_url,
)

__all__ = [
    "etcd_url",
    "fresh_registry",
    "hosts_factory",
    "module_hosts_factory",
    "pytest_collection_modifyitems",
    "redis_url",
]
