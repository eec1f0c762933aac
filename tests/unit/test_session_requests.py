"""RequestParams: a request's kv_transfer_params decoded once, the engine's dict left as it came."""

from __future__ import annotations

import copy
import logging

import pytest

from kvbridge.base.errors import ConfigError
from kvbridge.session.requests import RequestParams, move_of

REMOTE = {"remote_engine_id": "p", "remote_host": "10.0.0.1", "remote_port": 5600}


def entry(params: dict) -> RequestParams:
    sent = copy.deepcopy(params)
    got = RequestParams.read("r", params)
    assert params == sent, "the engine's dict is never changed"
    assert got is not None
    return got


def test_none_or_empty_params_give_an_empty_entry() -> None:
    for params in (None, {}):
        got = RequestParams.read("r", params)
        assert got is not None and not got.given and got.decoded is None
        assert not (got.remote_prefill or got.remote_decode)


def test_params_that_are_no_object_or_do_not_decode_are_refused_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    bad = (["do_remote_prefill"], "x", {"do_remote_prefill": True, "remote_port": "no port"}, {"do_remote_decode": 1.5})
    with caplog.at_level(logging.ERROR, logger="kvbridge.session.requests"):
        for params in bad:
            assert RequestParams.read("r7", params) is None, params
    assert len(caplog.records) == len(bad)
    assert all("request r7" in r.getMessage() and "the params ignored" in r.getMessage() for r in caplog.records)
    assert "must be a JSON object, got list" in caplog.records[0].getMessage()
    got = RequestParams.read("r8", {"temperature": 0})  # asks for no transfer: nothing to decode
    assert got is not None and got.given and got.decoded is None


def test_a_prefill_request_served_in_pull_mode_says_so_in_its_entry_only() -> None:
    params = {"do_remote_decode": True, "do_remote_prefill": True, "transfer_mode": "layerwise", **REMOTE}
    got = entry(params)
    assert got.given and got.layerwise and got.remote_decode and got.remote_prefill
    got.served_pulled()
    assert not got.layerwise and got.decoded is not None and got.decoded.transfer_mode == "pull"
    assert params["transfer_mode"] == "layerwise"


def test_a_pull_mode_prefill_request_is_leased_under_the_transfer_id_the_proxy_gave(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert entry({"do_remote_decode": True, "transfer_id": "t1"}).lease_id == "t1"
    assert entry({"do_remote_decode": True}).lease_id is None, "no id given: the engine's request id"
    # a stream's lease is keyed by its transfer id already; served in pull mode it stays on the engine's id
    streamed = entry({"do_remote_decode": True, "transfer_mode": "layerwise", "transfer_id": "t2"})
    streamed.served_pulled()
    assert streamed.lease_id is None
    assert entry({"do_remote_prefill": True, "transfer_id": "t3", "remote_request_id": "r", **REMOTE}).lease_id is None
    with caplog.at_level(logging.WARNING, logger="kvbridge.session.requests"):
        for tid in ("", "x" * 513):
            assert entry({"do_remote_decode": True, "transfer_id": tid}).lease_id is None
    assert ["over 512 characters; unused" in r.getMessage() for r in caplog.records] == [True, True]


def test_what_a_decode_request_pulls() -> None:
    got = entry({"do_remote_prefill": True, "remote_request_id": "r", **REMOTE})
    assert got.to_pull(16).remote_request_id == "r"
    # a pre-copy reads the whole blocks of all but the last 3 tokens the proxy saw; a live move's lease is named
    for seen, whole in ((70, 64), (67, 64), (66, 48), (2, 0)):
        got = entry({"do_remote_prefill": True, "kvbridge_move_id": "M~precopy1", "remote_num_tokens": seen, **REMOTE})
        pull = got.to_pull(16)
        assert (pull.remote_num_tokens, pull.remote_request_id) == (whole, "M~precopy1"), seen
    with pytest.raises(ConfigError, match="lack remote_request_id"):
        entry({"do_remote_prefill": True, **REMOTE}).to_pull(16)


def test_move_of_a_marked_decode_request_only() -> None:
    assert move_of({"kvbridge_move_id": "M"}) == "M"
    for params in (None, [], {"kvbridge_move_id": 7}, {"kvbridge_move_id": ""}):
        assert move_of(params) is None
    assert move_of({"kvbridge_move_id": "M~precopy2"}) is None, "a pre-copy's own request"
    assert move_of({"kvbridge_move_id": "M", "do_remote_decode": True}) is None
    assert entry({"kvbridge_move_id": "M"}).move_id == "M"


def test_a_layerwise_decode_request_marked_movable_is_still_read_from_its_stream() -> None:
    # The proxy with --live-moves marks each stream it may move later; layer-wise, that mark once made the decode
    # refuse the params ("need transfer_mode 'pull'") and compute the prompt, its prefill's lease left to expire.
    params = {"do_remote_prefill": True, "transfer_mode": "layerwise", "transfer_id": "T", "remote_request_id": "T"}
    got = entry({**params, "kvbridge_move_id": "M", **REMOTE})
    assert got.layerwise and got.move_id == "M", "marked: its decode lends its blocks if it is moved"
    pull = got.to_pull(16)
    assert (pull.transfer_mode, pull.remote_request_id) == ("layerwise", "T")
    assert not pull.resumes_move and not pull.lease_blocks, "its blocks come from its own stream, not a moved lease"
    # a move's continuation is pulled from the moved stream's lease, its block ids taken from there
    resumed = entry({"do_remote_prefill": True, "kvbridge_move_id": "M", "remote_num_tokens": 40, **REMOTE})
    assert resumed.to_pull(16).remote_request_id == "M" and resumed.to_pull(16).lease_blocks
