"""NIXL passes kvbridge's transport conformance suite, unchanged, over UCX between two agents."""

from __future__ import annotations

from kvbridge.testing import BackendConformance


class TestNixlConformance(BackendConformance):
    backend_name = "nixl"
    protocol = "ucx"


class TestNixlOwnProgressThreadConformance(BackendConformance):
    """The same contract with NIXL's own (busy-polling) progress thread, the `progress_thread` option."""

    backend_name = "nixl"
    options = {"progress_thread": True}
