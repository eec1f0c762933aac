"""The pytest plugin behind ``kvbridge.testing`` (loaded through the ``pytest11`` entry point).

It only marks tests: every test collected from a class built on a conformance suite gets the
``conformance`` marker, so ``pytest -m conformance`` runs exactly the suites. It defines no
autouse fixture and changes nothing for other tests.
"""

from __future__ import annotations

import pytest

SUITES = ("DeviceConformance", "UnavailableDeviceConformance", "BackendConformance")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "conformance: a kvbridge plugin conformance test (kvbridge.testing)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    from kvbridge import testing

    suites = tuple(getattr(testing, name) for name in SUITES)
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is not None and issubclass(cls, suites):
            item.add_marker(pytest.mark.conformance)
