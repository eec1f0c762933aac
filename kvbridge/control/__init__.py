"""The control plane: side channel per rank, prefill leases, discovery, transfer params. See docs/internals.md."""

from kvbridge.control.channel import ControlServer
from kvbridge.control.client import ClientPool, ControlClient
from kvbridge.control.discovery import (
    DiscoveryRegistry,
    EtcdRegistry,
    RankRecord,
    RedisRegistry,
    open_registry,
    resolve,
)
from kvbridge.control.ledger import Lease, Ledger
from kvbridge.control.messages import LeaseState, LeaseStatus, RegisteredMemory
from kvbridge.control.params import KVTransferParams

__all__ = [
    "ClientPool",
    "ControlClient",
    "ControlServer",
    "EtcdRegistry",
    "KVTransferParams",
    "Lease",
    "LeaseState",
    "LeaseStatus",
    "Ledger",
    "RankRecord",
    "RedisRegistry",
    "RegisteredMemory",
    "DiscoveryRegistry",
    "open_registry",
    "resolve",
]
