"""Passive health and the connect-failure move over real mock_dynamo workers on 127.0.0.1.

A worker that passes `/health` but answers every request 500 leaves rotation after
`--worker-outlier-failures` answers, under every routing mode; it returns after its ejection,
on probation. A worker whose port is closed costs the client nothing: each request that could
not reach it is moved, once, to another worker; with no other worker it is a retryable 503.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import orjson
import pytest

from pylon.core.plan import ForwardPlan
from pylon.routing import Booking
from pylon.routing.fleet import Fleet
from pylon.routing.round_robin import RoundRobinRouter
from pylon.routing.spec import parse_worker_spec
from tests.fleet import FleetFactory, FleetStack, RoutingObserver
from tests.integration.test_engine_faults import Pieces, ScriptedEngine
from tests.integration.test_tracing import SpanWaiter
from tests.router_ffi.fake_native import FakeNative
from tests.stack import MODEL, PROTOCOLS, StackFactory

CHAT = "/v1/chat/completions"


def chat(n: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"prompt {n} with some words"}],
        "max_tokens": 4,
    }


async def statuses(fleet: FleetStack, prefix: str, count: int) -> list[int]:
    """`count` requests one after the other; their statuses."""
    out = []
    for n in range(count):
        reply = await fleet.post(CHAT, chat(n), headers={"x-request-id": f"{prefix}-{n}"})
        out.append(reply.status_code)
    return out


def metric(metrics: dict[Any, float], name: str, **labels: str) -> float | None:
    return metrics.get((name, tuple(sorted(labels.items()))))


@pytest.mark.parametrize("routing", ["round-robin", "least-loaded", "kv"])
async def test_a_worker_that_answers_500_leaves_rotation_after_n_failures(
    make_fleet: FleetFactory, routing: str
) -> None:
    fake = FakeNative()
    fleet = await make_fleet(
        workers=2,
        routing=routing,
        native=(lambda: fake) if routing == "kv" else None,
        worker_outlier_failures=3,
        worker_outlier_ejection=3600.0,
        worker_outlier_max_ejection=3600.0,
        admin_listen="127.0.0.1:0",
    )
    try:
        # The worker the router chooses first turns bad (the kv stand-in keeps choosing it).
        assert await statuses(fleet, "probe", 1) == [200]
        bad = await fleet.served_by("probe-0")
        good = 1 - bad
        await fleet.control(bad, "faults", [{"status": 500}])
        mark = fleet.observer.mark()
        got = await statuses(fleet, "load", 30)
        # Exactly the three failures that ejected it reached the client; nothing after them.
        assert got.count(500) == 3 and got.count(200) == 27
        last_500 = max(i for i, status in enumerate(got) if status == 500)
        assert set(got[last_500 + 1 :]) == {200}
        ejected = await fleet.observer.wait_for(
            "worker_outlier_ejected", after=mark, worker=fleet.label(bad)
        )
        assert (ejected["reason"], ejected["failures"], ejected["ejections"]) == (
            "status_5xx",
            3,
            1,
        )
        after = [f"load-{n}" for n in range(last_500 + 1, 30)]
        assert {await fleet.served_by(rid) for rid in after} == {good}
        # One rotation: the routers, the metrics and the fleet's state agree.
        assert [w.label for w in fleet.routing.fleet.in_rotation] == [fleet.label(good)]
        metrics = await fleet.metrics()
        bad_label = fleet.label(bad)
        assert metric(metrics, "pylon_router_worker_ejected", worker=bad_label) == 1
        assert metric(metrics, "pylon_router_worker_healthy", worker=bad_label) == 0
        assert metric(metrics, "pylon_router_worker_ejected", worker=fleet.label(good)) == 0
        assert (
            metric(
                metrics,
                "pylon_router_worker_ejections_total",
                worker=bad_label,
                reason="status_5xx",
            )
            == 1
        )
    finally:
        fake.join_helpers()


async def test_an_ejected_worker_returns_on_probation_and_its_backoff_grows(
    make_fleet: FleetFactory,
) -> None:
    fleet = await make_fleet(
        workers=2,
        routing="round-robin",
        worker_outlier_failures=2,
        worker_outlier_ejection=0.2,
        worker_outlier_max_ejection=10.0,
    )
    events = fleet.observer
    await fleet.control(1, "faults", [{"status": 500}])
    mark = events.mark()
    await statuses(fleet, "first", 4)
    first = await events.wait_for("worker_outlier_ejected", after=mark, worker=fleet.label(1))
    assert (first["ejected_for_s"], first["ejections"]) == (0.2, 1)
    back = await events.wait_for("worker_outlier_returned", after=mark, worker=fleet.label(1))
    assert back["ejected_for_s"] == 0.2
    assert len(fleet.routing.fleet.in_rotation) == 2
    # On probation: its first failure ejects it again, for twice as long.
    mark = events.mark()
    got = await statuses(fleet, "probation", 2)
    assert sorted(got) == [200, 500]
    again = await events.wait_for("worker_outlier_ejected", after=mark, worker=fleet.label(1))
    assert (again["failures"], again["ejected_for_s"], again["ejections"]) == (1, 0.4, 2)
    # Mended: once back, a success forgives it and it serves its share again.
    await fleet.control(1, "faults", [])
    await events.wait_for("worker_outlier_returned", after=mark, worker=fleet.label(1))
    assert await statuses(fleet, "mended", 4) == [200] * 4
    served = [await fleet.served_by(f"mended-{n}") for n in range(4)]
    assert sorted(served) == [0, 0, 1, 1]
    assert fleet.routing.fleet.workers[1].outlier.ejections == 0


async def test_a_dead_worker_costs_the_client_nothing(make_fleet: FleetFactory) -> None:
    fleet = await make_fleet(workers=2, routing="round-robin", admin_listen="127.0.0.1:0")
    await fleet.mocks[1].stop()  # its port closes; the active checks (hourly) do not notice
    mark = fleet.observer.mark()
    got = await statuses(fleet, "dead", 10)
    assert got == [200] * 10
    served = {
        value for record in await fleet.inference_records(0) for _, value in record["headers"]
    }
    assert {f"dead-{n}" for n in range(10)} <= served
    await fleet.observer.wait_done(10)
    records = [fleet.observer.finished[f"dead-{n}"] for n in range(10)]
    assert {record.worker for record in records} == {fleet.label(0)}
    moved = [record for record in records if record.attempts == 2]
    # Round-robin sent every other request to the dead worker until passive health ejected it
    # (5 connect failures, the default); each of those was moved, once.
    assert len(moved) == 5
    assert all(record.attempts == 1 for record in records if record not in moved)
    lines = fleet.observer.of("upstream_moved")
    assert len(lines) == 5 and {line["to"] for line in lines} == {fleet.label(0)}
    assert {line["worker"] for line in lines} == {fleet.label(1)}
    ejected = await fleet.observer.wait_for(
        "worker_outlier_ejected", after=mark, worker=fleet.label(1)
    )
    assert ejected["reason"] == "connect_failure"
    assert sum(fleet.routing.active_bookings().values()) == 0
    metrics = await fleet.metrics()
    assert (
        metric(
            metrics,
            "pylon_router_worker_ejections_total",
            worker=fleet.label(1),
            reason="connect_failure",
        )
        == 1
    )


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_request_no_worker_can_be_reached_for_is_a_retryable_503(
    make_fleet: FleetFactory, workers: int
) -> None:
    fleet = await make_fleet(workers=workers, routing="least-loaded")
    for mock in fleet.mocks:
        await mock.stop()
    reply = await fleet.post(CHAT, chat(0), headers={"x-request-id": "nobody"})
    assert reply.status_code == 503
    problem = reply.json()
    assert (problem["code"], problem["request_id"]) == ("upstream_unavailable", "nobody")
    # No engine saw it: the gateway may send it to another node.
    assert reply.headers["x-stargate-retryable"] == "true"
    assert reply.headers["x-stargate-retry-reason"] == "local_connect_failure"
    await fleet.observer.wait_done(1)
    # With two workers it was moved once (never twice), then answered.
    assert fleet.observer.finished["nobody"].attempts == workers - 1
    assert len(fleet.observer.of("upstream_moved")) == workers - 1
    assert sum(fleet.routing.active_bookings().values()) == 0


@pytest.mark.parametrize("routing", ["round-robin", "least-loaded"])
async def test_under_concurrent_load_the_failing_worker_gets_no_more_than_n_plus_in_flight(
    make_fleet: FleetFactory, routing: str
) -> None:
    """The issue's case: the 500 worker answers at once, so it always looks idle to
    least-loaded (without passive health it drew 91-96% of the requests). With it, the worker
    gets the failures that eject it and at most the requests already on their way to it."""
    clients, each, failures = 4, 25, 5
    fleet = await make_fleet(
        workers=2,
        routing=routing,
        mock={"ttft_ms": 5, "num_tokens": 4},
        worker_outlier_failures=failures,
        worker_outlier_ejection=3600.0,
        worker_outlier_max_ejection=3600.0,
    )
    await fleet.control(1, "faults", [{"status": 500}])

    async def client(c: int) -> list[int]:
        return await statuses(fleet, f"c{c}", each)

    got = [status for part in await asyncio.gather(*map(client, range(clients))) for status in part]
    assert len(got) == clients * each
    assert failures <= got.count(500) <= failures + clients - 1
    assert len(await fleet.inference_records(1)) == got.count(500)


class LateRouter:
    """Round-robin over a fleet given once the stack runs (the engine's URL is known then)."""

    def __init__(self) -> None:
        self.router: RoundRobinRouter | None = None

    async def book(self, plan: ForwardPlan) -> Booking:
        assert self.router is not None
        return await self.router.book(plan)

    def elsewhere(self, plan: ForwardPlan, failed: Booking) -> Booking | None:
        assert self.router is not None
        return self.router.elsewhere(plan, failed)


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_the_move_on_every_transport(make_stack: StackFactory, protocol: str) -> None:
    """A round-robin over a dead worker (a closed port) first and the stack's engine: whatever
    the client speaks, the request booked on the dead worker is answered by the other."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    observer, late, spans = RoutingObserver(), LateRouter(), SpanWaiter()
    stack = await make_stack("dynamo", observer=observer, router=late, span_exporter=spans)
    specs = [parse_worker_spec(f"url={url}") for url in (dead, stack.mock.base_url)]
    fleet = Fleet.from_specs(specs, None)
    for worker in fleet.workers:
        fleet.set_in_rotation(worker, True)
    late.router = RoundRobinRouter(fleet)
    headers = [("x-request-id", f"moved-{protocol}"), ("x-model", MODEL)]
    reply = await stack.send(protocol, CHAT, headers, orjson.dumps(chat(0)))
    assert reply.status == 200, reply.body
    await observer.wait_done(1)
    record = observer.finished[f"moved-{protocol}"]
    assert (record.attempts, record.worker, record.outcome) == (2, fleet.workers[1].label, "ok")
    assert [worker.active for worker in fleet.workers] == [0, 0]
    [moved] = observer.of("upstream_moved")
    assert (moved["worker"], moved["to"]) == (fleet.workers[0].label, fleet.workers[1].label)
    # The span names the worker that served it, and the attempts it took.
    span = (await spans.span(f"moved-{protocol}")).attributes
    assert span is not None
    assert (span["pylon.worker"], span["pylon.attempts"]) == (fleet.workers[1].label, 2)


# A worker that answers 200 and then breaks: the fault, and the reason its ejection names.
BROKEN_AFTER_HEAD = {
    "cut_body": ({"drop_after_events": 1}, False, "broken"),
    "cut_stream": ({"drop_after_events": 1}, True, "broken"),
    "stalled_stream": ({"stall_after_events": 1}, True, "timeout"),
}


@pytest.mark.parametrize(
    ("routing", "fault"),
    [
        ("round-robin", "cut_body"),
        ("round-robin", "cut_stream"),
        ("round-robin", "stalled_stream"),
        ("least-loaded", "cut_stream"),
        ("kv", "cut_body"),
        ("kv", "stalled_stream"),
    ],
)
async def test_a_worker_that_answers_200_and_then_breaks_leaves_rotation(
    make_fleet: FleetFactory, routing: str, fault: str
) -> None:
    """A good head is no success until its response is whole: a worker whose bodies are cut,
    whose streams end short or stall is ejected like one that answers 500."""
    spec, stream, reason = BROKEN_AFTER_HEAD[fault]
    fake = FakeNative()
    fleet = await make_fleet(
        workers=2,
        routing=routing,
        native=(lambda: fake) if routing == "kv" else None,
        worker_outlier_failures=2,
        worker_outlier_ejection=3600.0,
        worker_outlier_max_ejection=3600.0,
        output_gap_timeout=0.3,
        first_output_timeout=5.0,
    )
    try:
        assert await statuses(fleet, "probe", 1) == [200]
        bad = await fleet.served_by("probe-0")
        good = 1 - bad
        await fleet.control(bad, "faults", [spec])
        mark = fleet.observer.mark()
        # Every answer's head is a 200; the broken ones never complete (their end is cut).
        whole = 0
        for n in range(12):
            body = {**chat(n), "stream": stream}
            try:
                reply = await fleet.post(CHAT, body, headers={"x-request-id": f"load-{n}"})
            except httpx.HTTPError:
                continue  # the cut body: the connection ends short
            assert reply.status_code == 200
            whole += b"event: error" not in reply.content
        ejected = await fleet.observer.wait_for(
            "worker_outlier_ejected", after=mark, worker=fleet.label(bad)
        )
        assert (ejected["reason"], ejected["failures"]) == (reason, 2)
        assert [w.label for w in fleet.routing.fleet.in_rotation] == [fleet.label(good)]
        # Only the two breaks that ejected it reached the client.
        assert whole == 10
    finally:
        fake.join_helpers()


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_reset_after_the_request_was_written_is_not_moved_nor_retryable(
    make_stack: StackFactory, protocol: str
) -> None:
    """A worker that read the request and then reset the connection (no response byte) may
    have started on it: the request is not moved to another worker and its 502 is not
    retryable (only a request that provably reached no engine moves)."""
    scripted = ScriptedEngine([Pieces(lambda: iter(()), then="reset")])
    server = await asyncio.start_server(scripted.handle, "127.0.0.1", 0)
    scripted.port = server.sockets[0].getsockname()[1]
    try:
        observer, late = RoutingObserver(), LateRouter()
        stack = await make_stack("dynamo", observer=observer, router=late)
        urls = (f"http://127.0.0.1:{scripted.port}", stack.mock.base_url)
        fleet = Fleet.from_specs([parse_worker_spec(f"url={url}") for url in urls], None)
        for worker in fleet.workers:
            fleet.set_in_rotation(worker, True)
        late.router = RoundRobinRouter(fleet)
        rid = f"reset-{protocol}"
        headers = [("x-request-id", rid), ("x-model", MODEL)]
        reply = await stack.send(protocol, CHAT, headers, orjson.dumps(chat(0)))
        assert reply.status == 502, reply.body
        assert reply.json()["code"] == "upstream_protocol_error"
        assert reply.headers["x-stargate-retryable"] == "false"
        await observer.wait_done(1)
        record = observer.finished[rid]
        assert (record.attempts, record.worker) == (1, fleet.workers[0].label)
        assert observer.of("upstream_moved") == []
        assert scripted.connections == 1  # not sent again either
        assert await stack.records() == []  # the other worker never saw it
    finally:
        server.close()
