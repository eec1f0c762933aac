"""NIXL passes kvbridge's transport conformance suite, unchanged, over UCX between two agents."""

from __future__ import annotations

from kvbridge.testing import TransportConformance


class TestNixlConformance(TransportConformance):
    transport_name = "nixl"
    protocol = "ucx"


class TestNixlOwnProgressThreadConformance(TransportConformance):
    """The same contract with NIXL's own (busy-polling) progress thread, the `progress_thread` option."""

    transport_name = "nixl"
    options = {"progress_thread": True}
