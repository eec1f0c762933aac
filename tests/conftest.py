"""Shared fixtures. Tests never load the user's own plugins by accident: only kvbridge's own
distributions (the repo's plugins) are allowed unless a test says otherwise."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import kvbridge


@pytest.fixture(autouse=True)
def _fresh_registry() -> Iterator[None]:
    kvbridge.reset_plugins()
    yield
    kvbridge.reset_plugins()
