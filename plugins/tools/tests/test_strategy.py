"""`kvbridge_tools.strategy.choose`: the transport's declared cost model picks direct or gather per request."""

from __future__ import annotations

from kvbridge_mooncake.spec import TCP_DESCRIPTOR_BYTES
from kvbridge_tools.strategy import TransferCost, choose, copy_rate, predict_direct, transfer_cost

MiB = 1 << 20
TCP = transfer_cost("mooncake", "tcp")


def test_mooncake_tcp_has_its_measured_cost_and_other_protocols_none() -> None:
    assert TCP.descriptor_s and TCP.bytes_per_s and TCP.piece_bytes == 4 * MiB and TCP.peer_admission == 2048
    assert TCP.piece_bytes == TCP_DESCRIPTOR_BYTES  # the plugin's pieces
    assert transfer_cost("Mooncake", "rdma") == TransferCost() == transfer_cost("tcp", "tcp")
    assert copy_rate("cpu") == copy_rate("cuda") == 8e9  # host memory's, as before


def test_fragmented_request_is_gathered_and_contiguous_goes_direct() -> None:
    request = 512 * MiB  # llama3-8b, 4096 tokens: 64 tensors x 256 blocks of 32 KiB
    fragmented = choose(TCP, 64 * 256, request, copy_bytes_per_s=8e9)
    assert fragmented.strategy == "gather" and fragmented.gather_s < fragmented.direct_s
    assert "16384 descriptors" in fragmented.reason
    contiguous = choose(TCP, request // TCP.piece_bytes, request, copy_bytes_per_s=8e9)  # runs cut to pieces
    assert contiguous.strategy == "direct"


def test_slow_copies_keep_a_fragmented_request_direct() -> None:
    request = 512 * MiB
    # copies at 100 MB/s: the exposed first gather and last scatter cost more than the descriptors save
    assert choose(TCP, 64 * 256, request, copy_bytes_per_s=1e8).strategy == "direct"


def test_a_transport_without_a_cost_model_goes_direct() -> None:
    choice = choose(TransferCost(), 10**6, 512 * MiB, copy_bytes_per_s=8e9)
    assert choice.strategy == "direct" and choice.direct_s is None and "declares no" in choice.reason
    assert predict_direct(TransferCost(bytes_per_s=1e9), 10, 10) is None


def test_host_copies_that_share_the_transports_cores_count_in_full() -> None:
    request = 512 * MiB
    # vLLM's LBHNC for llama3-8b: 8192 pages of 64 KiB. Host copies on the cores Mooncake TCP keeps busy
    # cost more than the 8192 descriptors (measured: direct 58 % of raw, gathered 45-47 %) ...
    assert choose(TCP, 8192, request, copy_bytes_per_s=7e9, copies_overlap=False).strategy == "direct"
    # ... a device's copies hide behind the wire ...
    assert choose(TCP, 8192, request, copy_bytes_per_s=7e9).strategy == "gather"
    # ... and 16384 pages of 32 KiB (separate K and V tensors) still gather (measured 63-67 % against 43 %).
    assert choose(TCP, 16384, request, copy_bytes_per_s=7e9, copies_overlap=False).strategy == "gather"
