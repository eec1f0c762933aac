"""Shared fixtures; tests never load the user's own plugins by accident.

Only kvbridge's own distributions (the repo's plugins) are allowed unless a test says otherwise. The fixtures live in
kvbridge_tools.harness.fixtures, shared with plugins/proxy/tests (a fixture imported into a conftest is registered).
"""

from kvbridge_tools.harness.fixtures import (
    etcd_url,
    fresh_registry,
    hosts_factory,
    module_hosts_factory,
    redis_url,
)

__all__ = ["etcd_url", "fresh_registry", "hosts_factory", "module_hosts_factory", "redis_url"]
