"""The options of the `mooncake` transport, declared once: the registry checks them before Mooncake loads."""

from __future__ import annotations

import attrs

from kvbridge.options import TransportOptions, option

# Mooncake's TCP transport moves one descriptor per lane: ~1 MiB pieces keep its lanes busy in
# parallel (measured: 64 x 1 MiB about twice as fast as 1 x 64 MiB on loopback).
TCP_DESCRIPTOR_BYTES = 1 << 20


@attrs.frozen
class MooncakeOptions(TransportOptions):
    """Options of the `mooncake` transport (`create_backend("mooncake", protocol=..., **options)`)."""

    max_batch: int = option(1024, "most descriptors per Mooncake batch call")
    max_descriptor_bytes: int | None = option(
        None, f"split descriptors into pieces of at most this many bytes (None: {TCP_DESCRIPTOR_BYTES} on tcp, "
        "unsplit on other protocols)"
    )
    retries: int = option(3, "times a failed batch is resubmitted before the transfer fails")
    retry_backoff: float = option(0.05, "seconds before the first retry, doubling after each")
