"""The exception hierarchy: one root, one subclass per thing that can go wrong. See docs/internals.md."""

from __future__ import annotations

from collections.abc import Iterable


def described(exc: BaseException) -> str:
    """An error as a log line names it: its type, then its message where it has one (many carry none)."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class KVBridgeError(Exception):
    """Root of every error kvbridge raises on purpose."""


class ConfigError(KVBridgeError, ValueError):
    """Bad input from the caller: a wrong argument, descriptor or option."""


class PluginError(KVBridgeError):
    """A plugin could not be found, loaded or used."""


class PluginNotFound(PluginError, LookupError):
    """No plugin of that kind is registered under the name."""

    def __init__(self, kind: str, name: str, installed: Iterable[str], hint: str = "") -> None:
        self.kind = kind
        self.name = name
        self.installed = sorted(installed)
        listed = ", ".join(self.installed) or "none"
        hint = hint or "Install the plugin that provides it or pick one of the installed names"
        super().__init__(f"no {kind} named {name!r}; installed: {listed}. {hint}; `kvbridge plugins` lists them.")


class PluginUnavailable(PluginError):
    """The plugin is installed but cannot run here (a missing library or device)."""

    def __init__(self, kind: str, name: str, reason: str, hint: str = "") -> None:
        self.kind = kind
        self.name = name
        self.reason = reason
        self.hint = hint
        text = f"{kind} {name!r} is unavailable: {reason}"
        if hint:
            text += f". Fix: {hint}"
        super().__init__(text)


class PluginAPIMismatch(PluginError):
    """A plugin was built for another kvbridge plugin API version."""


class LayoutMismatch(KVBridgeError):
    """Two KV layouts cannot exchange blocks; names the field that differs."""

    def __init__(self, field: str, local: object, remote: object, hint: str = "") -> None:
        self.field = field
        self.local = local
        self.remote = remote
        text = f"KV layout mismatch on {field!r}: local {local!r}, remote {remote!r}"
        text += f". {hint}" if hint else ". Start both sides with the same model and cache settings."
        super().__init__(text)


class TopologyError(ConfigError):
    """A prefill/decode parallel configuration pair that cannot be planned."""


class TransferError(KVBridgeError):
    """A transfer did not complete; names the peer (and request, where known) and the cause."""

    def __init__(self, message: str, *, peer: str = "", request: str = "", cause: str = "", retries: int = 0) -> None:
        self.peer = peer
        self.request = request
        self.cause = cause
        self.retries = retries  # resubmissions made before it failed (a metric, see TransferHandle.retries)
        super().__init__(message)


class TransferFailed(TransferError):
    """The transport reported a failure."""


class TransferTimeout(TransferError, TimeoutError):
    """The transfer did not finish within the timeout."""


class InvalidDescriptor(TransferError, ConfigError):
    """A descriptor reaches outside the memory registered on its side."""


class PeerGone(TransferFailed):
    """The peer closed or died."""


class LoadError(TransferError):
    """Pulled KV data cannot be trusted (a lease expired during the read); recompute."""


class ProtocolError(KVBridgeError):
    """A control message was malformed, too large, of another version, or unauthenticated."""
