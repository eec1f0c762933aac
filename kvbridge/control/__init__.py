"""The control plane: side channel per rank, prefill leases, discovery, transfer params.

- `ControlServer` / `ControlClient`: one side channel per engine rank (ZeroMQ, attrs messages
  in `kvbridge.wire` frames, optional HMAC shared secret).
- `Ledger`: prefill-side leases: `offer`, DONE counting, expiry, abort, fencing.
- `open_registry` / `resolve`: peer-to-peer by default, redis or etcd for many nodes.
- `KVTransferParams`: what the proxy carries, in vLLM's key names.
(The decode side of a request wired end to end, `DecodeControl`, is in `kvbridge.session.decode`.)

See docs/control-plane.md.
"""

from kvbridge.control.channel import ClientPool, ControlClient, ControlServer
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
