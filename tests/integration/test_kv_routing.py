"""`--routing kv` over real mock_dynamo workers.

Default suite: a stand-in for Dynamo's native selection service (tests/router_ffi/fake_native)
behind router_ffi's real `SelectionCore`: the booking's calls follow the real exchange, and a
mixed load leaves no reservation, booking or engine connection behind.

A client that leaves while its large prompt is tokenized (in the router's tokenizer thread)
leaves nothing booked and nothing released twice.

`dynamo` marker: the real SelectionService, fed by the mocks' own KV events over ZMQ (the mocks
bind 127.0.0.1 only): a prompt whose prefix one worker holds goes to that worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from mock_dynamo.tokens import WordTokenizer
from pylon.routing.fleet import Fleet
from pylon.routing.kv import INLINE_TOKENIZE_BYTES
from tests.fleet import FleetFactory, WordPrompts, mixed_load
from tests.router_ffi.fake_native import FakeNative
from tests.stack import MODEL

CHAT = "/v1/chat/completions"


def chat(text: str, stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "stream": stream,
        **extra,
    }


@pytest.fixture
def fake() -> Iterator[FakeNative]:
    native = FakeNative()
    yield native
    native.join_helpers()


async def test_the_booking_follows_the_exchange(make_fleet: FleetFactory, fake: FakeNative) -> None:
    fleet = await make_fleet(
        workers=2,
        routing="kv",
        native=lambda: fake,
        mock={"num_tokens": 20, "token_delay_ms": 1},
    )
    body = chat("one two three", stream=True, max_tokens=40)
    reply = await fleet.post(CHAT, body, {"x-request-id": "s"})
    assert reply.status_code == 200
    await fleet.observer.wait_done(1)
    assert fleet.routing.kv is not None
    core = fleet.routing.kv.core
    assert core.quiesce()
    (sid,) = {arg for op, arg in fake.calls if op == "select_and_reserve"}
    ops = fake.ops_for(str(sid))
    # select, prefill at the first output event, a block per 16 output events, free at the end
    assert ops[:2] == ["select_and_reserve", "prefill_complete"]
    assert ops[-1] == "free_reservation"
    assert ops.count("add_output_block") == 1  # ~21 output events / block size 16
    assert fake.reservations == {}
    assert fleet.observer.finished["s"].worker in {fleet.label(0), fleet.label(1)}


async def test_no_reservation_leaks_under_a_mixed_load(
    make_fleet: FleetFactory, fake: FakeNative
) -> None:
    fleet = await make_fleet(
        workers=3,
        routing="kv",
        native=lambda: fake,
        mock={"token_delay_ms": 5, "num_tokens": 12},
        first_output_timeout=0.5,
    )
    sent = await mixed_load(fleet)
    await fleet.observer.wait_done(sent)
    outcomes = {record.outcome for record in fleet.observer.finished.values()}
    assert {"ok", "upstream_timeout", "client_disconnected"} <= outcomes
    assert fleet.routing.kv is not None and fleet.routing.kv.core.quiesce()
    assert fake.reservations == {}
    assert all(count == 0 for count in fleet.routing.active_bookings().values())
    assert all(count == 0 for count in fleet.connections_in_use().values())
    selected = [op for op, _ in fake.calls if op == "select_and_reserve"]
    freed = [op for op, _ in fake.calls if op == "free_reservation"]
    assert len(selected) == len(freed) == sent


class HeldWordPrompts(WordPrompts):
    """`WordPrompts` that, for a body over the inline threshold (tokenized in the router's
    thread), waits until the test releases it."""

    def __init__(self) -> None:
        super().__init__()
        self.started = threading.Event()
        self.release = threading.Event()

    def prompt_tokens(self, path: str, body: bytes) -> list[int] | None:
        if len(body) > INLINE_TOKENIZE_BYTES:
            self.started.set()
            self.release.wait(5)
        return super().prompt_tokens(path, body)


async def test_a_client_that_leaves_while_its_large_prompt_is_tokenized_leaves_nothing_booked(
    make_fleet: FleetFactory, fake: FakeNative
) -> None:
    tokenizer = HeldWordPrompts()
    fleet = await make_fleet(workers=2, routing="kv", native=lambda: fake, tokenizer=tokenizer)
    large = chat("word " * INLINE_TOKENIZE_BYTES)
    left = asyncio.create_task(fleet.post(CHAT, large, {"x-request-id": "left"}))
    assert await asyncio.to_thread(tokenizer.started.wait, 5)
    left.cancel()  # the client closes its connection while the thread tokenizes
    with contextlib.suppress(asyncio.CancelledError):
        await left
    await fleet.observer.wait_done(1)
    assert fleet.observer.finished["left"].outcome == "client_disconnected"
    tokenizer.release.set()  # the abandoned prompt's tokenization ends, unused
    reply = await fleet.post(CHAT, large, {"x-request-id": "stayed"})
    assert reply.status_code == 200
    await fleet.observer.wait_done(2)
    assert fleet.routing.kv is not None and fleet.routing.kv.core.quiesce()
    (selected,) = {str(arg) for op, arg in fake.calls if op == "select_and_reserve"}
    assert fake.ops_for(selected).count("free_reservation") == 1
    assert [op for op, _ in fake.calls if op == "free_reservation"] == ["free_reservation"]
    assert fake.reservations == {} and fleet.routing.fleet.active == 0
    assert tokenizer.calls == 2
    seen = [await fleet.inference_records(index) for index in range(2)]
    ids = [
        v
        for records in seen
        for r in records
        for k, v in r["headers"]
        if k.lower() == "x-request-id"
    ]
    assert ids == ["stayed"]  # no engine saw the request that left


# --- KV-event streams: gaps and restarts ----------------------------------------------------


async def test_a_gap_or_a_restart_in_a_workers_kv_events_resets_it_in_the_core(
    make_fleet: FleetFactory, fake: FakeNative
) -> None:
    fleet = await make_fleet(
        workers=2,
        routing="kv",
        native=lambda: fake,
        kv_block_size=4,
        mock={"token_delay_ms": 5, "num_tokens": 30},
    )
    kv = fleet.routing.kv
    assert kv is not None
    events = fleet.observer
    body = chat("a stream that stays in flight", stream=True, max_tokens=30)
    headers = {"x-request-id": "held", "x-model": MODEL}
    async with fleet.client.stream("POST", f"{fleet.url}{CHAT}", json=body, headers=headers) as r:
        chunks = r.aiter_bytes()
        await anext(chunks)  # in flight, prefill complete
        (index,) = [i for i, w in enumerate(fleet.routing.fleet.workers) if w.active == 1]
        worker = fleet.routing.fleet.workers[index]
        (sid,) = {str(arg) for op, arg in fake.calls if op == "select_and_reserve"}
        mock = fleet.mocks[index].base_url
        view = (await fleet.client.get(f"{mock}/test-control/kv")).json()
        next_seq = view["events"]["next_seq"]
        assert next_seq >= 1  # the held request's own BlockStored went out
        # Five messages "lost": the next one the engine sends comes 5 ahead.
        await fleet.control(index, "kv/sequence", {"next_seq": next_seq + 5})
        mark = events.mark()
        direct = {"model": MODEL, "prompt": "straight to the engine", "max_tokens": 2}
        assert (await fleet.client.post(f"{mock}/v1/completions", json=direct)).status_code == 200
        gap = await events.wait_for("kv_events_gap", after=mark, worker=worker.label)
        assert (gap["kind"], gap["expected"], gap["received"], gap["missed"]) == (
            "gap",
            next_seq,
            next_seq + 5,
            5,
        )
        assert gap["active"] == 1
        reset = await events.wait_for("kv_view_reset", after=mark, worker=worker.label)
        assert reset["lifecycle"] == "schedulable"
        wid = worker.spec.worker_id
        assert [op for op, arg in fake.calls if arg == wid][-2:] == [
            "delete_worker",
            "upsert_worker",
        ]
        async for _ in chunks:
            pass
    await fleet.observer.wait_done(1)
    assert kv.core.quiesce()
    # The held booking predates the reset: released in pylon, a no-op for the core (which
    # forgot it), never a "not found" error.
    assert "free_reservation" not in fake.ops_for(sid)
    assert fake.reservations == {} and worker.active == 0
    assert events.of("kv_router_error") == [] and events.of("kv_routing_failed") == []
    # The engine restarts: its sequence starts again at 0.
    mark = events.mark()
    await fleet.control(index, "kv/sequence", {"next_seq": 0})
    fresh = {**direct, "prompt": "new text makes new blocks, hence a message"}
    assert (await fleet.client.post(f"{mock}/v1/completions", json=fresh)).status_code == 200
    back = await events.wait_for("kv_events_gap", after=mark, worker=worker.label)
    assert (back["kind"], back["received"], back["missed"]) == ("regressed", 0, 0)
    await events.wait_for("kv_view_reset", after=mark, worker=worker.label)
    # A booking made after the resets is a live one again.
    reply = await fleet.post(CHAT, chat("after the resets"), {"x-request-id": "after"})
    assert reply.status_code == 200
    await fleet.observer.wait_done(2)
    assert kv.core.quiesce() and fake.reservations == {}
    metrics = await fleet.metrics()
    faults = "pylon_router_kv_event_faults_total"
    assert metrics[(faults, (("kind", "gap"), ("worker", worker.label)))] == 1
    assert metrics[(faults, (("kind", "regressed"), ("worker", worker.label)))] == 1
    other = fleet.label(1 - index)
    assert not any(key[0] == faults and ("worker", other) in key[1] for key in metrics)
    assert kv.resets == 2


async def test_the_watch_reads_sequence_frames_only_and_counts_malformed_messages() -> None:
    import zmq
    import zmq.asyncio

    from pylon.core.kv_events import SequenceCheck
    from pylon.routing.kv_watch import KvEventWatch
    from pylon.routing.spec import parse_worker_spec
    from tests.observers import EventObserver

    context = zmq.asyncio.Context()
    pub = context.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.1:*")
    endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    fleet = Fleet.from_specs(
        [parse_worker_spec(f"url=http://127.0.0.1:1,kv-events={endpoint}")], None
    )
    worker = fleet.workers[0]
    stale: list[SequenceCheck] = []
    observer = EventObserver()
    watch = KvEventWatch(fleet.workers, lambda w, e, check: stale.append(check), observer)
    task = asyncio.create_task(watch.run())
    try:
        async with asyncio.timeout(10):
            assert (await pub.recv())[:1] == b"\x01"  # subscribed
        seq = [0, 1, 3, 4, 2]
        for n in seq[:3]:  # not msgpack at all: only the sequence frame is read
            await pub.send_multipart([b"", n.to_bytes(8, "big"), b"\xc1"])
        await pub.send_multipart([b"", b"\x00" * 7, b""])  # a 7-byte sequence frame
        await pub.send_multipart([b"", b"\x00" * 8])  # two frames
        for n in seq[3:]:
            await pub.send_multipart([b"kv", n.to_bytes(8, "big"), b""])
        async with asyncio.timeout(10):
            while watch.messages < 7:
                await asyncio.sleep(0.005)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pub.close(0)
        context.term()
    assert [(c.kind, c.expected, c.received, c.missed) for c in stale] == [
        ("gap", 2, 3, 1),
        ("regressed", 5, 2, 0),
    ]
    assert worker.kv_faults == {"malformed": 2}  # the router counts gap / regressed itself
    assert [e["detail"][:25] for e in observer.of("kv_events_malformed")] == [
        "sequence frame must be 8 ",
        "expected 3 frames, got 2",
    ]


async def test_a_burst_of_kv_events_does_not_hold_the_loop() -> None:
    """60k in-order messages queued at the watch's socket: while it reads them the loop keeps
    running other tasks (the longest gap stays far under the burst's length) and every message is
    read and sorted, in order."""
    import threading

    import zmq

    from pylon.routing.kv_watch import MESSAGES_PER_TURN, KvEventWatch
    from pylon.routing.spec import parse_worker_spec
    from tests.looplag import LoopLag
    from tests.observers import EventObserver

    count = 60_000
    context = zmq.Context()
    pub = context.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 0)  # never drop here: the burst must arrive whole
    pub.setsockopt(zmq.RCVTIMEO, 10_000)
    pub.bind("tcp://127.0.0.1:*")
    endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    fleet = Fleet.from_specs(
        [parse_worker_spec(f"url=http://127.0.0.1:1,kv-events={endpoint}")], None
    )
    stale: list[object] = []
    observer = EventObserver()
    watch = KvEventWatch(fleet.workers, lambda w, e, check: stale.append(check), observer)
    task = asyncio.create_task(watch.run())
    sent = threading.Event()

    def publish() -> None:
        assert pub.recv()[:1] == b"\x01"  # subscribed
        for n in range(count):
            pub.send_multipart([b"", n.to_bytes(8, "big"), b""])
        sent.set()

    publisher = threading.Thread(target=publish, daemon=True)
    lag = LoopLag()
    try:
        await asyncio.wait_for(asyncio.shield(watch.subscribed.wait()), 10)
        publisher.start()
        # The loop is held here while the burst is sent, so it queues at the watch's SUB the
        # way a burst does behind a busy loop (ZMQ's I/O thread keeps receiving meanwhile).
        publisher.join(60)
        took = await lag.until(lambda: watch.messages == count, timeout=120)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        publisher.join(10)
        pub.close(0)
        context.term()
    assert sent.is_set() and stale == []
    tracker = watch.trackers[endpoint]
    assert (tracker.last, tracker.gaps, tracker.regressions) == (count - 1, 0, 0)
    # Reading the burst took a while (0.8 s here); the loop turned after every few dozen
    # messages, and no turn held it for a large part of the burst (1 ms here; without the
    # per-turn yield, the whole 0.8 s was one turn, with 3 ticks).
    assert lag.ticks >= count // MESSAGES_PER_TURN // 2, lag.ticks
    assert lag.max_gap < took / 2, (lag.max_gap, took, lag.ticks)


@pytest.mark.parametrize("fault", ["malformed", "gap"])
async def test_a_flood_of_kv_faults_writes_a_bounded_number_of_lines_and_counts_each(
    fault: str, fake: FakeNative, capfd: pytest.CaptureFixture[str]
) -> None:
    """A publisher that sends only malformed messages, or a sequence that skips on every
    message (each one a gap: the worker is reset in the core each time): the `kv` router's
    counters (the metric) count every one, and its log writes a few lines, the later ones
    saying how many were held back."""
    import json
    import threading

    import zmq

    from pylon.assemble import routing_options
    from pylon.logs import configure_logging, flush_logs
    from pylon.routing.build import build_routing
    from pylon.settings import load_settings
    from tests.looplag import LoopLag
    from tests.observers import EventObserver

    count = 5_000
    configure_logging("json", "warning")
    context = zmq.Context()
    pub = context.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.setsockopt(zmq.RCVTIMEO, 10_000)
    pub.bind("tcp://127.0.0.1:*")
    endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    settings = load_settings(
        {
            "listen": "127.0.0.1:0",
            "routing": "kv",
            "worker": [f"url=http://127.0.0.1:1,kv-events={endpoint}"],
            "tokenizer": "/",
            "worker_health_interval": 3600.0,
        }
    )
    observer = EventObserver()
    routing = await build_routing(
        routing_options(settings), observer, tokenizer=WordPrompts(), native=lambda: fake
    )
    kv = routing.kv
    assert kv is not None
    (worker,) = routing.fleet.workers

    def publish() -> None:
        assert pub.recv()[:1] == b"\x01"  # subscribed
        for n in range(count):
            if fault == "malformed":
                pub.send_multipart([b"", n.to_bytes(7, "big"), b""])  # a 7-byte sequence
            else:
                pub.send_multipart([b"", (2 * n).to_bytes(8, "big"), b""])  # skips one each time

    publisher = threading.Thread(target=publish, daemon=True)
    capfd.readouterr()
    kv.start()
    try:
        publisher.start()
        faults = count if fault == "malformed" else count - 1  # the first message is no gap
        await LoopLag().until(lambda: worker.kv_faults.get(fault, 0) == faults, timeout=60)
        await LoopLag().until(lambda: not kv._resetting, timeout=60)  # resets have settled
    finally:
        publisher.join(10)
        await routing.aclose()  # the kv router's too
        pub.close(0)
        context.term()
    flush_logs()
    lines = [json.loads(line) for line in capfd.readouterr().err.splitlines() if line]
    event = "kv_events_malformed" if fault == "malformed" else "kv_events_gap"
    logged = [line for line in lines if line["event"] == event]
    assert worker.kv_faults == {fault: faults}  # exact: what the metric reports
    assert len(observer.of(event)) == faults  # every fault reached the observers
    # The flood took well under a minute: the first line, and at most a few more.
    assert 1 <= len(logged) <= 7, len(logged)
    assert "suppressed" not in logged[0]
    assert sum(line.get("suppressed", 0) for line in logged) <= faults - len(logged)
    resets = [line for line in lines if line["event"] == "kv_view_reset"]
    assert len(resets) <= 7 and kv.resets >= (1 if fault == "gap" else 0)


# --- the real SelectionService ------------------------------------------------------------


async def until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """The native core takes the mocks' ZMQ events on its own threads and signals nothing:
    look again after each loop turn until it shows them (bounded)."""
    async with asyncio.timeout(timeout):
        while not await asyncio.to_thread(condition):
            await asyncio.sleep(0.01)
    del what


def words(n: int, seed: str) -> str:
    return " ".join(f"{seed}{i}" for i in range(n))


@pytest.mark.dynamo
@pytest.mark.timeout(120)
async def test_a_repeated_prefix_goes_to_the_worker_that_holds_it(
    make_fleet: FleetFactory,
) -> None:
    pytest.importorskip("dynamo._core", reason="ai-dynamo-runtime 1.6.1 is not installed")
    from router_ffi import TokenPrompt

    fleet = await make_fleet(workers=3, routing="kv", kv_block_size=4)
    assert fleet.routing.kv is not None
    core = fleet.routing.kv.core
    prefix = words(40, "shared")  # 10 full blocks of 4 words
    reply = await fleet.post(CHAT, chat(prefix + " first"), {"x-request-id": "warm"})
    assert reply.status_code == 200
    holder = await fleet.served_by("warm")
    holder_id = fleet.routing.fleet.workers[holder].spec.worker_id
    tokens = WordTokenizer().encode_text(prefix)
    await until(
        lambda: core.overlap(TokenPrompt(tokens)).blocks_on(holder_id) == 10,
        "the holder's BlockStored events",
    )
    for n in range(4):
        reply = await fleet.post(CHAT, chat(f"{prefix} turn {n}"), {"x-request-id": f"t{n}"})
        assert reply.status_code == 200
        assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 40
    assert [await fleet.served_by(f"t{n}") for n in range(4)] == [holder] * 4
    # Other prompts are spread by load; with the holder ejected, the prefix goes elsewhere.
    fleet.routing.fleet.set_in_rotation(fleet.routing.fleet.workers[holder], False)
    reply = await fleet.post(CHAT, chat(prefix + " elsewhere"), {"x-request-id": "away"})
    assert reply.status_code == 200
    assert await fleet.served_by("away") != holder
    await fleet.observer.wait_done(6)
    assert core.quiesce()
    assert all(w.active_requests == 0 for group in core.loads() for w in group.workers)
    assert sum(fleet.routing.active_bookings().values()) == 0
    metrics = await fleet.metrics()
    holder_label = (("policy", "kv"), ("worker", fleet.label(holder)))
    assert metrics[("pylon_router_decisions_total", holder_label)] >= 5
    assert metrics[("pylon_router_select_seconds_count", (("policy", "kv"),))] == 6
    assert 0 < metrics[("pylon_router_select_seconds_sum", (("policy", "kv"),))] < 6


@pytest.mark.dynamo
@pytest.mark.timeout(120)
async def test_real_core_loads_return_to_zero_after_aborts_and_faults(
    make_fleet: FleetFactory,
) -> None:
    pytest.importorskip("dynamo._core", reason="ai-dynamo-runtime 1.6.1 is not installed")
    fleet = await make_fleet(
        workers=2,
        routing="kv",
        kv_block_size=4,
        mock={"token_delay_ms": 5, "num_tokens": 12},
        first_output_timeout=0.5,
    )
    await fleet.control(0, "faults", [{"drop_after_events": 2, "times": 2}])
    await fleet.control(1, "faults", [{"stall_after_events": 0, "times": 2}])

    async def one(n: int) -> None:
        body = chat(words(12, f"p{n % 3}-"), stream=True, max_tokens=200)
        headers = {"x-request-id": f"real-{n}", "x-model": MODEL}
        async with fleet.client.stream(
            "POST", f"{fleet.url}{CHAT}", json=body, headers=headers
        ) as reply:
            async for _ in reply.aiter_bytes():
                if n % 4 == 3:
                    break  # the client leaves

    await asyncio.gather(*(one(n) for n in range(16)))
    await fleet.observer.wait_done(16)
    assert fleet.routing.kv is not None
    core = fleet.routing.kv.core
    assert core.quiesce()
    assert all(w.active_requests == 0 for group in core.loads() for w in group.workers)
    assert all(group.pending_count == 0 for group in core.loads())
    assert sum(fleet.routing.active_bookings().values()) == 0
    assert all(count == 0 for count in fleet.connections_in_use().values())
    assert core.failed_ops == 0


@pytest.mark.dynamo
@pytest.mark.timeout(120)
async def test_a_gap_clears_the_real_cores_view_of_that_worker_and_it_rebuilds(
    make_fleet: FleetFactory,
) -> None:
    """Dynamo 1.6.1's core keeps its view across a gap when the worker has no replay endpoint;
    pylon's reset clears it, the native listener comes back, and new events fill it again."""
    pytest.importorskip("dynamo._core", reason="ai-dynamo-runtime 1.6.1 is not installed")
    from router_ffi import TokenPrompt

    fleet = await make_fleet(workers=2, routing="kv", kv_block_size=4)
    kv = fleet.routing.kv
    assert kv is not None
    core = kv.core
    prefix = words(40, "held")  # 10 full blocks of 4 words
    assert (await fleet.post(CHAT, chat(prefix), {"x-request-id": "warm"})).status_code == 200
    holder = await fleet.served_by("warm")
    worker = fleet.routing.fleet.workers[holder]
    wid = worker.spec.worker_id
    tokens = WordTokenizer().encode_text(prefix)
    await until(lambda: core.overlap(TokenPrompt(tokens)).blocks_on(wid) == 10, "held blocks")
    mock = fleet.mocks[holder].base_url
    next_seq = (await fleet.client.get(f"{mock}/test-control/kv")).json()["events"]["next_seq"]
    await fleet.control(holder, "kv/sequence", {"next_seq": next_seq + 3})
    mark = fleet.observer.mark()
    direct = {"model": MODEL, "prompt": words(8, "direct"), "max_tokens": 2}
    assert (await fleet.client.post(f"{mock}/v1/completions", json=direct)).status_code == 200
    gap = await fleet.observer.wait_for("kv_events_gap", after=mark, worker=worker.label)
    assert (gap["kind"], gap["missed"]) == ("gap", 3)
    reset = await fleet.observer.wait_for("kv_view_reset", after=mark, worker=worker.label)
    assert reset["lifecycle"] == "schedulable"
    # The engine still holds the blocks, but the core no longer claims to know it.
    assert core.overlap(TokenPrompt(tokens)).blocks_on(wid) == 0
    # The native listener is back (the watch's SUB and the core's own), and it learns anew.
    reply = await fleet.client.get(
        f"{mock}/test-control/kv", params={"wait_subscribers": "2", "timeout": "10"}, timeout=15
    )
    reply.raise_for_status()
    fresh = words(40, "fresh")
    again = {"model": MODEL, "prompt": fresh, "max_tokens": 2}
    assert (await fleet.client.post(f"{mock}/v1/completions", json=again)).status_code == 200
    fresh_tokens = WordTokenizer().encode_text(fresh)
    await until(lambda: core.overlap(TokenPrompt(fresh_tokens)).blocks_on(wid) == 10, "new events")
    assert core.quiesce() and core.failed_ops == 0
    assert fleet.observer.of("kv_router_error") == []
