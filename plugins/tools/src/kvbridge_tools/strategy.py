"""How to move one request: its planned descriptors as they are, or gathered through staging.

A transport that pays per descriptor (Mooncake TCP: about 18 µs each beyond the bytes, measured on
loopback) moves a fragmented request (one descriptor per block and layer) at half its speed. The
alternative is to gather the request's blocks on the sending side into one contiguous staging region
(on a GPU a device kernel, `index_select` into registered device memory; here a host copy), read it in
the transport's best piece size, and scatter it into place on the receiving side, chunk by chunk so
copies overlap the wire. `choose` compares the two with the transport's declared `TransferCost` and the
devices' copy rate, and says which and why. A transport that declares no cost always goes direct.
"""

from __future__ import annotations

from typing import Literal

import attrs

from kvbridge.base.types import TransferCost

Strategy = Literal["direct", "gather"]
STRATEGIES: tuple[Strategy, ...] = ("direct", "gather")
GATHER_CHUNK_BYTES = 16 << 20  # one pipelined step of a gathered request: copies of one overlap the next's wire


@attrs.frozen
class Choice:
    """The strategy picked for one request, with the predicted seconds of each."""

    strategy: Strategy
    direct_s: float | None
    gather_s: float | None
    reason: str


def predict_direct(cost: TransferCost, descriptors: int, nbytes: int) -> float | None:
    if cost.bytes_per_s is None or cost.descriptor_s is None:
        return None
    return nbytes / cost.bytes_per_s + descriptors * cost.descriptor_s


def predict_gather(
    cost: TransferCost, nbytes: int, copy_bytes_per_s: float, chunk_bytes: int, *, copies_overlap: bool = True
) -> float | None:
    """Wire time of the staged bytes in best-size pieces, plus the copies not hidden by the pipeline.

    With `copies_overlap` (a device's copy engine or kernels) the first chunk's gather and the last chunk's scatter;
    without (host copies on the cores a CPU-driven transport keeps busy) all of both."""
    if cost.bytes_per_s is None or cost.descriptor_s is None:
        return None
    piece = cost.piece_bytes or nbytes
    wire = nbytes / cost.bytes_per_s + -(-nbytes // piece) * cost.descriptor_s
    exposed = 2 * (min(nbytes, chunk_bytes) if copies_overlap else nbytes) / copy_bytes_per_s
    return wire + exposed


def choose(
    cost: TransferCost,
    descriptors: int,
    nbytes: int,
    *,
    copy_bytes_per_s: float,
    chunk_bytes: int = GATHER_CHUNK_BYTES,
    copies_overlap: bool = True,
) -> Choice:
    """Direct unless gathering is predicted faster by the transport's own cost model.

    `copies_overlap`: False where the gather and scatter copies run on the cores that also drive the transport (host
    memory over TCP), so they add to the wire time rather than hide behind it."""
    direct = predict_direct(cost, descriptors, nbytes)
    gather = predict_gather(cost, nbytes, copy_bytes_per_s, chunk_bytes, copies_overlap=copies_overlap)
    if direct is None or gather is None:
        return Choice("direct", direct, gather, "the transport declares no per-descriptor cost")
    if gather < direct:
        return Choice(
            "gather",
            direct,
            gather,
            f"{descriptors} descriptors cost {descriptors * cost.descriptor_s * 1e3:.1f} ms on this transport; "
            "gathering is predicted faster",
        )
    return Choice("direct", direct, gather, f"{descriptors} descriptors: direct is predicted faster")
