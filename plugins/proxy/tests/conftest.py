"""The proxy's tests: the fixtures tests/ has, from kvbridge_tools.harness.fixtures (imported, a fixture registers)."""

from kvbridge_tools.harness.fixtures import fresh_registry, hosts_factory, pytest_collection_modifyitems

__all__ = ["fresh_registry", "hosts_factory", "pytest_collection_modifyitems"]
