"""`--routing kv` over real mock_dynamo workers.

Default suite: a stand-in for Dynamo's native selection service (tests/router_ffi/fake_native)
behind router_ffi's real `SelectionCore`: the booking's calls follow the real exchange, and a
mixed load leaves no reservation, booking or engine connection behind.

`dynamo` marker: the real SelectionService, fed by the mocks' own KV events over ZMQ (the mocks
bind 127.0.0.1 only): a prompt whose prefix one worker holds goes to that worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from mock_dynamo.tokens import WordTokenizer
from tests.fleet import FleetFactory, mixed_load
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
    fleet.routing.fleet.set_admitted(fleet.routing.fleet.workers[holder], False)
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
