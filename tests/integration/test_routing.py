"""Routing over several real mock_dynamo workers: round-robin and least-loaded choices, active
health checks (ejection, return to rotation, bring-up), 503 no_worker when none is in rotation, the
Dynamo instance pin, and bookings that end with their exchange."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from pylon.routing.fleet import INSTANCE_PIN_HEADER
from tests.fleet import FleetFactory, FleetStack, mixed_load
from tests.stack import MODEL

CHAT = "/v1/chat/completions"


def chat(stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "stream": stream,
        **extra,
    }


async def send(
    fleet: FleetStack, request_id: str, timeout: float | None = None, **extra: Any
) -> httpx.Response:
    kw = {} if timeout is None else {"timeout": timeout}
    return await fleet.post(CHAT, chat(**extra), headers={"x-request-id": request_id}, **kw)


async def test_round_robin_takes_the_workers_in_turn(make_fleet: FleetFactory) -> None:
    fleet = await make_fleet(workers=3, routing="round-robin")
    for n in range(6):
        assert (await send(fleet, f"rr-{n}")).status_code == 200
    assert [await fleet.served_by(f"rr-{n}") for n in range(6)] == [0, 1, 2, 0, 1, 2]
    await fleet.observer.wait_done(6)
    assert fleet.observer.finished["rr-4"].worker == fleet.label(1)
    assert fleet.routing.active_bookings() == dict.fromkeys((fleet.label(i) for i in range(3)), 0)
    metrics = await fleet.metrics()
    for index in range(3):
        worker = (("worker", fleet.label(index)),)
        decided = (("policy", "round-robin"), ("worker", fleet.label(index)))
        assert metrics[("pylon_router_decisions_total", decided)] == 2
        assert metrics[("pylon_router_active_bookings", worker)] == 0
        assert metrics[("pylon_router_worker_healthy", worker)] == 1


async def test_least_loaded_avoids_the_busy_worker(make_fleet: FleetFactory) -> None:
    """A long stream keeps worker 0 busy: the next requests all go to the idle worker, where
    round-robin would have sent every other one to worker 0; once it ends, turns resume."""
    fleet = await make_fleet(workers=2, routing="least-loaded")
    await fleet.control(0, "knobs", {"num_tokens": 1000, "token_delay_ms": 20})
    async with fleet.client.stream(
        "POST",
        f"{fleet.url}{CHAT}",
        json=chat(stream=True, max_tokens=1000),
        headers={"x-request-id": "long", "x-model": MODEL},
    ) as long_stream:
        await fleet.wait_record(0, "long", "received")
        assert fleet.routing.active_bookings() == {fleet.label(0): 1, fleet.label(1): 0}
        for n in range(3):
            assert (await send(fleet, f"short-{n}")).status_code == 200
        assert [await fleet.served_by(f"short-{n}") for n in range(3)] == [1, 1, 1]
        assert long_stream.status_code == 200
    # The client left: the engine request is cancelled and the booking released.
    await fleet.wait_record(0, "long", "cancelled")
    await fleet.observer.wait_done(4)
    assert sum(fleet.routing.active_bookings().values()) == 0
    for n in range(2):
        assert (await send(fleet, f"after-{n}")).status_code == 200
    assert sorted([await fleet.served_by(f"after-{n}") for n in range(2)]) == [0, 1]


async def test_a_failing_worker_is_ejected_and_readmitted(make_fleet: FleetFactory) -> None:
    fleet = await make_fleet(
        workers=3,
        routing="round-robin",
        worker_health_interval=0.05,
        worker_eject_after=2,
        worker_readmit_after=2,
    )
    events = fleet.observer
    mark = events.mark()
    await fleet.control(1, "health", {"status": 503})
    ejected = await events.wait_for("worker_ejected", after=mark, worker=fleet.label(1))
    assert ejected["failures"] == 2 and "status 503" in ejected["detail"]
    for n in range(4):
        assert (await send(fleet, f"while-out-{n}")).status_code == 200
    assert await fleet.inference_records(1) == []
    assert {await fleet.served_by(f"while-out-{n}") for n in range(4)} == {0, 2}
    mark = events.mark()
    await fleet.control(1, "health", {"status": 200})
    readmitted = await events.wait_for("worker_readmitted", after=mark, worker=fleet.label(1))
    assert readmitted["passes"] == 2
    for n in range(3):
        assert (await send(fleet, f"back-{n}")).status_code == 200
    assert sorted([await fleet.served_by(f"back-{n}") for n in range(3)]) == [0, 1, 2]


async def test_no_admitted_worker_is_a_retryable_503_before_any_engine(
    make_fleet: FleetFactory,
) -> None:
    fleet = await make_fleet(
        workers=2, routing="least-loaded", worker_health_interval=0.05, worker_eject_after=1
    )
    mark = fleet.observer.mark()
    for index in range(2):
        await fleet.control(index, "health", {"status": 500})
    for index in range(2):
        await fleet.observer.wait_for("worker_ejected", after=mark, worker=fleet.label(index))
    reply = await send(fleet, "nobody", stream=True)
    assert reply.status_code == 503
    assert reply.headers["x-stargate-retryable"] == "true"
    assert reply.headers["content-type"].startswith("application/problem+json")
    problem = reply.json()
    assert problem["code"] == "no_worker" and "health checks" in problem["detail"]
    assert problem["request_id"] == "nobody"
    for index in range(2):
        assert await fleet.inference_records(index) == []
    assert sum(fleet.routing.active_bookings().values()) == 0
    metrics = await fleet.metrics()
    for index in range(2):
        assert metrics[("pylon_router_worker_healthy", (("worker", fleet.label(index)),))] == 0


async def test_bring_up_admits_the_healthy_workers_and_the_rest_join_later(
    make_fleet: FleetFactory,
) -> None:
    """A worker that is unhealthy at start is out of rotation (and gets nothing); pylon is ready
    with the others, and the late one joins as soon as a check passes."""
    fleet = await make_fleet(
        workers=2,
        routing="round-robin",
        worker_health_interval=0.05,
        engine_controls={1: {"health": {"status": 503}}},
    )
    assert [worker.label for worker in fleet.routing.fleet.in_rotation] == [fleet.label(0)]
    healthy = fleet.observer.of("engine_healthy")[0]
    assert healthy["workers_in_rotation"] == 1 and healthy["workers"] == 2
    for n in range(2):
        assert (await send(fleet, f"early-{n}")).status_code == 200
    assert [await fleet.served_by(f"early-{n}") for n in range(2)] == [0, 0]
    mark = fleet.observer.mark()
    await fleet.control(1, "health", {"status": 200})
    await fleet.observer.wait_for("worker_admitted", after=mark, worker=fleet.label(1))
    for n in range(2):
        assert (await send(fleet, f"late-{n}")).status_code == 200
    assert sorted([await fleet.served_by(f"late-{n}") for n in range(2)]) == [0, 1]


async def test_bring_up_fails_when_no_worker_ever_passes(make_fleet: FleetFactory) -> None:
    from pylon.bringup import EngineNotReady

    fleet = await make_fleet(
        workers=2,
        routing="least-loaded",
        wait_ready=False,
        worker_health_interval=0.02,
        upstream_health_wait=0.2,
        engine_controls={0: {"health": {"status": 503}}, 1: {"health": {"status": 500}}},
    )
    assert fleet.running.ready is not None
    with pytest.raises(EngineNotReady) as caught:
        await fleet.running.ready
    line = str(caught.value)
    assert "none of the 2 engine workers passed its health check (GET /health)" in line
    assert f"{fleet.label(0)}: status 503" in line and f"{fleet.label(1)}: status 500" in line
    assert "\n" not in line
    failed = fleet.observer.of("engine_health_gate_failed")[0]
    assert failed["last"] == {fleet.label(0): "status 503", fleet.label(1): "status 500"}
    reply = await send(fleet, "too-early")
    assert reply.status_code == 503 and reply.json()["code"] == "not_ready"


async def test_instance_workers_are_pinned_by_pylon_alone(make_fleet: FleetFactory) -> None:
    """instance-id workers: every request goes to the one frontend with pylon's pin, in turn;
    the client's own pins (headers, aliases, body) never reach it."""
    big = (1 << 64) - 1
    fleet = await make_fleet(routing="round-robin", instance_ids=[7, big])
    pins = {
        "x-dynamo-worker-instance-id": "999",
        "x-worker-instance-id": "999",
        "x-dynamo-dp-rank": "3",
        "x-data-parallel-rank": "3",
    }
    for n in range(2):
        reply = await fleet.post(
            CHAT,
            chat(nvext={"backend_instance_id": 999, "decode_worker_id": 999}),
            headers={"x-request-id": f"pin-{n}", **pins},
        )
        assert reply.status_code == 200
    records = await fleet.inference_records(0)
    assert len(records) == 2
    for record, expected in zip(records, ("7", str(big)), strict=True):
        names = [name.lower() for name, _ in record["headers"]]
        pinned = [v for n, v in record["headers"] if n.lower() == INSTANCE_PIN_HEADER.decode()]
        assert pinned == [expected]
        assert "x-worker-instance-id" not in names and "x-dynamo-dp-rank" not in names
        assert "x-data-parallel-rank" not in names
        assert "nvext" not in record["body"] or not {
            "backend_instance_id",
            "decode_worker_id",
        } & set(record["body"]["nvext"])
    await fleet.observer.wait_done(2)
    assert fleet.observer.finished["pin-1"].worker == f"instance-id={big}"


async def test_a_frontend_health_without_instances_speaks_for_all(
    make_fleet: FleetFactory,
) -> None:
    """The frontend's /health without an `instances` list (the mock's): its 2xx admits every
    instance-id worker, its failure ejects them all, in one probe per round. (A list that
    leaves an instance out: tests/unit/test_worker_health.py.)"""
    fleet = await make_fleet(
        routing="round-robin",
        instance_ids=[7, 8],
        worker_health_interval=0.05,
        worker_eject_after=1,
    )
    assert len(fleet.routing.fleet.in_rotation) == 2
    mark = fleet.observer.mark()
    await fleet.control(0, "health", {"status": 503})
    for label in ("instance-id=7", "instance-id=8"):
        ejected = await fleet.observer.wait_for("worker_ejected", after=mark, worker=label)
        assert "frontend: status 503" in ejected["detail"]
    reply = await send(fleet, "no-instance")
    assert reply.status_code == 503 and reply.json()["code"] == "no_worker"


@pytest.mark.parametrize("routing", ["round-robin", "least-loaded"])
async def test_no_booking_and_no_engine_connection_leaks_under_a_mixed_load(
    make_fleet: FleetFactory, routing: str
) -> None:
    """Concurrent requests over 3 workers, with client aborts, engine faults (dropped streams,
    error statuses, malformed events, bodies cut in half) and timeouts (pylon's and the
    client's): afterwards no booking is left on any worker and no engine connection is in use."""
    fleet = await make_fleet(
        workers=3,
        routing=routing,
        mock={"token_delay_ms": 5, "num_tokens": 12},
        first_output_timeout=0.5,
    )
    sent = await mixed_load(fleet)
    await fleet.observer.wait_done(sent)
    outcomes = {record.outcome for record in fleet.observer.finished.values()}
    assert {
        "ok",
        "upstream_timeout",
        "upstream_protocol_error",
        "upstream_broken_mid_body",
        "client_disconnected",
    } <= outcomes
    assert all(count == 0 for count in fleet.routing.active_bookings().values())
    assert all(count == 0 for count in fleet.connections_in_use().values())
