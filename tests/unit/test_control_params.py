"""KVTransferParams: round trips, and compatibility with vLLM's own NIXL connector metadata."""

from __future__ import annotations

import json

import pytest

from kvbridge.base.errors import ConfigError
from kvbridge.control import KVTransferParams

# What vLLM 0.32's NIXL pull scheduler returns from request_finished() on a prefill node
# (nixl/pull_scheduler.py: do_remote_prefill ... transfer_mode), as a proxy forwards it.
VLLM_PREFILL_RESPONSE = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[3, 4, 9]],
    "remote_engine_id": "prefill-engine-0",
    "remote_request_id": "cmpl-abc-0",
    "remote_host": "10.1.2.3",
    "remote_port": 5600,
    "tp_size": 2,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 40,
    "remote_blocks_expiry_time": None,
    "transfer_mode": "pull",
}


def test_params_read_vllm_keys_and_write_them_back() -> None:
    p = KVTransferParams.from_dict(VLLM_PREFILL_RESPONSE)
    assert (p.do_remote_prefill, p.remote_engine_id, p.remote_request_id) == (True, "prefill-engine-0", "cmpl-abc-0")
    assert p.remote_block_ids == ((3, 4, 9),) and p.block_ids == (3, 4, 9)
    assert (p.tp_size, p.remote_num_tokens, p.side_channel(1)) == (2, 40, ("10.1.2.3", 5601))
    out = p.to_dict()
    assert {k: v for k, v in VLLM_PREFILL_RESPONSE.items() if v is not None}.items() <= out.items()
    assert json.loads(json.dumps(out)) == out  # JSON-safe for an HTTP proxy
    assert KVTransferParams.from_dict(out) == p


def test_params_keep_unknown_keys_and_accept_flat_block_ids() -> None:
    p = KVTransferParams.from_dict(
        {"do_remote_decode": True, "remote_block_ids": [1, 2], "_p_side_truncated": True, "router_hint": {"x": 1}}
    )
    assert p.remote_block_ids == ((1, 2),)
    assert p.extra == {"_p_side_truncated": True, "router_hint": {"x": 1}}
    assert p.to_dict()["_p_side_truncated"] is True and p.to_dict()["remote_block_ids"] == [[1, 2]]


def test_params_kvbridge_fields_round_trip() -> None:
    p = KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id="e",
        remote_request_id="r",
        remote_host="h",
        remote_port=1,
        tp_size=4,
        pcp_size=2,
        dcp_size=2,
        dp_size=2,
        dp_rank=1,
        prefix_prompt_ids=[1, 2, 3],
        cache_keys=["k0", "k1"],
        remote_num_tokens=3,
    )
    d = p.to_dict()
    assert d["prefix_prompt_ids"] == [1, 2, 3] and d["cache_keys"] == ["k0", "k1"] and d["pcp_size"] == 2
    assert KVTransferParams.from_dict(d) == p
    assert KVTransferParams.from_dict(None) == KVTransferParams()


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"remote_port": "not-a-port"}, "remote_port"),
        ({"remote_block_ids": [[1, "x"]]}, "remote_block_ids"),
        ({"tp_size": [2]}, "tp_size"),
    ],
)
def test_params_bad_values_are_config_errors(bad: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as err:
        KVTransferParams.from_dict(bad)
    assert "ConfigError:" not in str(err.value), "a validator's own message, not wrapped in a converter's"


def test_params_missing_remote_keys_say_what_the_proxy_must_pass() -> None:
    with pytest.raises(ConfigError, match="remote_host, remote_port"):
        KVTransferParams(remote_engine_id="e", remote_request_id="r").side_channel(0)
    with pytest.raises(ConfigError, match="must be a dict"):
        KVTransferParams.from_dict([1, 2])  # type: ignore[arg-type]


def test_params_feed_vllm_nixl_metadata_unchanged() -> None:
    """vLLM's real decode-side metadata builder accepts what KVTransferParams.to_dict() writes."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import metadata

    params = KVTransferParams.from_dict(VLLM_PREFILL_RESPONSE).to_dict()
    meta = metadata.NixlConnectorMetadata()
    meta.add_new_req_to_recv(request_id="decode-req", local_block_ids=([0, 1, 2],), kv_transfer_params=params)
    req = meta.reqs_to_recv["decode-req"]
    assert req.remote.block_ids == [[3, 4, 9]]
    assert (req.remote.engine_id, req.remote.request_id) == ("prefill-engine-0", "cmpl-abc-0")
    assert (req.remote.host, req.remote.port, req.remote.num_tokens) == ("10.1.2.3", 5600, 40)
    assert (req.tp_size, req.dcp_size, req.pp_size) == (2, 1, 1)


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"remote_port": 70000}, "remote_port"),
        ({"remote_port": -1}, "remote_port"),
        ({"remote_port": True}, "remote_port"),
        ({"tp_size": 0}, "tp_size"),
        ({"pp_size": -3}, "pp_size"),
        ({"remote_num_tokens": -5}, "remote_num_tokens"),
        ({"dp_rank": 2, "dp_size": 2}, "dp_rank"),
        ({"transfer_mode": "bogus"}, "transfer_mode"),
        ({"remote_host": ["10.0.0.1"]}, "remote_host"),
        ({"remote_host": "fe80::1"}, "remote_host"),
        ({"remote_blocks_expiry_time": "nan"}, "remote_blocks_expiry_time"),
        ({"remote_blocks_expiry_time": float("inf")}, "remote_blocks_expiry_time"),
        ({"remote_engine_id": 7}, "remote_engine_id"),
        ({"kvbridge_prefix_cache": "false"}, "kvbridge_prefix_cache"),  # a string would read as true
    ],
)
def test_params_out_of_range_values_are_config_errors_naming_the_key(bad: dict, match: str) -> None:
    # Each was accepted and failed later far from its cause: port 70000 as a timeout after the ready wait,
    # a malformed host as a raw zmq.ZMQError.
    with pytest.raises(ConfigError, match=match) as err:
        KVTransferParams.from_dict(bad)
    assert "ConfigError:" not in str(err.value), "a validator's own message, not wrapped in a converter's"


def test_params_the_modes_keys_and_bracketed_ipv6_parse() -> None:
    p = KVTransferParams.from_dict(
        {**VLLM_PREFILL_RESPONSE, "remote_host": "[fd00::1]", "transfer_mode": "layerwise", "transfer_id": "t-1"}
    )
    assert (p.transfer_mode, p.transfer_id, p.side_channel(2)) == ("layerwise", "t-1", ("[fd00::1]", 5602))
    with pytest.raises(ConfigError, match="port 65536"):
        KVTransferParams.from_dict({**VLLM_PREFILL_RESPONSE, "remote_port": 65535}).side_channel(1)


def test_a_client_for_a_malformed_address_fails_as_a_config_error_and_keeps_no_socket() -> None:
    import zmq

    from kvbridge.control import ControlClient

    ctx = zmq.Context.instance()
    before = len(ctx._sockets) if hasattr(ctx, "_sockets") else None
    client = ControlClient("a b", 5600, timeout_s=1)  # a host zmq cannot parse
    for _ in range(3):
        with pytest.raises(ConfigError, match="cannot connect to side channel tcp://a b:5600"):
            client.query_lease("r")
    client.close()
    if before is not None:
        assert len(ctx._sockets) == before, "a socket leaked per failed request"


@pytest.mark.parametrize("key", ["tp_size", "pcp_size", "dcp_size", "pp_size", "dp_size"])
@pytest.mark.parametrize("size", [4097, 10**12, 2**63])
def test_params_parallel_sizes_have_an_upper_bound(key: str, size: int) -> None:
    with pytest.raises(ConfigError, match=rf"{key}.*from 1 to 4096"):
        KVTransferParams.from_dict({key: size})
