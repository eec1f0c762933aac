"""kvbridge: move LLM KV caches between prefill and decode engines, over pluggable transports. See docs/internals.md."""

from kvbridge.base.errors import (
    ConfigError,
    InvalidDescriptor,
    KVBridgeError,
    LayoutMismatch,
    LoadError,
    PeerGone,
    PluginAPIMismatch,
    PluginError,
    PluginNotFound,
    PluginUnavailable,
    ProtocolError,
    TopologyError,
    TransferError,
    TransferFailed,
    TransferTimeout,
)
from kvbridge.base.options import BackendOptions, NoOptions, option
from kvbridge.base.types import BackendCapabilities, BackendConfig, EndpointInfo, MemoryKind, MemoryRegion, PluginInfo
from kvbridge.device.contract import Device
from kvbridge.plugin.hookspecs import hookimpl
from kvbridge.plugin.registry import (
    PLUGIN_API_VERSION,
    create_backend,
    get_device,
    list_backends,
    list_devices,
    refused_plugins,
    reset_plugins,
)
from kvbridge.plugin.specs import BackendSpec, DeviceSpec
from kvbridge.transport.contract import MigrationBackend, Peer, TransferHandle, wait_all

__version__ = "0.1.0"

__all__ = [
    "PLUGIN_API_VERSION",
    "BackendCapabilities",
    "BackendConfig",
    "BackendOptions",
    "BackendSpec",
    "ConfigError",
    "Device",
    "DeviceSpec",
    "EndpointInfo",
    "InvalidDescriptor",
    "KVBridgeError",
    "LayoutMismatch",
    "LoadError",
    "MemoryKind",
    "MemoryRegion",
    "MigrationBackend",
    "NoOptions",
    "Peer",
    "PeerGone",
    "PluginAPIMismatch",
    "PluginError",
    "PluginInfo",
    "PluginNotFound",
    "PluginUnavailable",
    "ProtocolError",
    "TopologyError",
    "TransferError",
    "TransferFailed",
    "TransferHandle",
    "TransferTimeout",
    "create_backend",
    "get_device",
    "hookimpl",
    "list_backends",
    "list_devices",
    "option",
    "refused_plugins",
    "reset_plugins",
    "wait_all",
]

# Agent, KV layouts and pull planning (docs/planning.md)
from kvbridge.agent.kv_agent import KVAgent, PullHandle, PullResult, RankInfo  # noqa: E402
from kvbridge.plan.layout import KVLayout, KVRegion, check_compatible  # noqa: E402
from kvbridge.plan.topology import ParallelConfig, Plan, Pull, plan  # noqa: E402

__all__ += [
    "KVAgent",
    "KVLayout",
    "KVRegion",
    "ParallelConfig",
    "Plan",
    "Pull",
    "PullHandle",
    "PullResult",
    "RankInfo",
    "check_compatible",
    "plan",
]
