"""kvbridge-tools' tests: tests/' fixtures, from kvbridge_tools.harness.fixtures (imported, a fixture registers)."""

from kvbridge_tools.harness.fixtures import (
    fresh_registry,
    hosts_factory,
    module_hosts_factory,
    pytest_collection_modifyitems,
)

__all__ = ["fresh_registry", "hosts_factory", "module_hosts_factory", "pytest_collection_modifyitems"]
