"""Engine bring-up and model discovery against a real mock_dynamo, seen through pylon's own
listeners: the health gate (order, retries, time-out), requests during it, the published model
set (static, discovered, failed polls, retirement, generations) and readiness through a drain.

Waits are on pylon's process events (`EventObserver`) and mock_dynamo's records, never on the
clock; intervals are small so each test takes a fraction of a second.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from pylon.bringup import EngineNotReady
from pylon.lifecycle import Lifecycle
from tests.fleet import FleetFactory
from tests.observers import EventObserver
from tests.stack import MODEL, PROTOCOLS, Reply, Stack, StackFactory

CHAT = "/v1/chat/completions"
FAST_GATE = {"upstream_health_interval": 0.02}
FAST_POLLS = {"model_discovery_interval": 0.02}


def chat(model: str = MODEL, **extra: Any) -> bytes:
    return json.dumps({"model": model, "messages": [], "max_tokens": 2, **extra}).encode()


def tunnel(request_id: str, model: str = MODEL) -> list[tuple[str, str]]:
    return [("x-request-id", request_id), ("x-model", model)]


def lifecycle(stack: Stack) -> Lifecycle:
    return stack.running.core.lifecycle


def assert_retryable_503(reply: Reply, code: str, request_id: str) -> None:
    assert reply.status == 503, reply
    problem = json.loads(reply.body)
    assert problem["code"] == code and problem["request_id"] == request_id
    assert reply.headers["x-stargate-retryable"] == "true"
    assert reply.headers["x-stargate-retry-reason"] == code


async def paths(stack: Stack) -> list[tuple[str, int]]:
    return [(record["path"], record["status"]) for record in await stack.records()]


async def control(stack: Stack, name: str, value: Any) -> None:
    reply = await stack.http.put(f"{stack.mock.base_url}/test-control/{name}", json=value)
    reply.raise_for_status()


# --- the health gate ---------------------------------------------------------------------------


async def ready_endpoint(stack: Stack) -> tuple[int, Any]:
    """What the admin listener's `/ready` answers (status, JSON body)."""
    assert stack.running.admin_url is not None
    reply = await stack.client.get(f"{stack.running.admin_url}/ready")
    return reply.status_code, reply.json()


async def test_the_gate_passes_on_the_first_path_that_answers_2xx_in_order(
    make_stack: StackFactory,
) -> None:
    observer = EventObserver()
    stack = await make_stack(
        observer=observer,
        upstream_health_path=["/custom-health"],
        engine_controls={"health": {"status": 503, "ready_status": 200}},
    )
    assert await paths(stack) == [
        ("/custom-health", 404),
        ("/health", 503),
        ("/v1/health/ready", 200),
        ("/v1/models", 200),  # discovery's first poll, after the gate
    ]
    healthy = observer.of("engine_healthy")[0]
    assert healthy["path"] == "/v1/health/ready" and healthy["rounds"] == 1
    assert lifecycle(stack).readiness() == (True, "ready")
    assert (await stack.send("http1", CHAT, tunnel("after-gate"), chat())).status == 200
    ready = observer.of("ready")[0]
    assert ready["health_path"] == "/v1/health/ready" and ready["models"] == [MODEL]


async def test_the_gate_probes_again_each_interval_until_health_answers(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(
        engine_controls={"faults": [{"path": "/health", "status": 503, "times": 2}]}, **FAST_GATE
    )
    assert await paths(stack) == [
        ("/health", 503),
        ("/v1/health/ready", 404),
        ("/health", 503),
        ("/v1/health/ready", 404),
        ("/health", 200),
        ("/v1/models", 200),
    ]


async def test_requests_during_the_gate_get_503_not_ready_on_every_transport(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(
        wait_ready=False, engine_controls={"health": {"status": 503}}, **FAST_GATE
    )
    assert lifecycle(stack).readiness() == (False, "engine_not_ready")
    assert await ready_endpoint(stack) == (503, {"ready": False, "reason": "engine_not_ready"})
    for protocol in PROTOCOLS:
        reply = await stack.send(protocol, CHAT, tunnel(f"early-{protocol}"), chat())
        assert_retryable_503(reply, "not_ready", f"early-{protocol}")
    # `/health` is the engine's own answer, gate or not.
    health = await stack.send("http1", "/health", [("x-request-id", "hc")], b"", method="GET")
    assert health.status == 503 and json.loads(health.body)["error"]["code"] == 503
    assert {path for path, _ in await paths(stack)} <= {"/health", "/v1/health/ready"}
    await control(stack, "health", {"status": 200})
    assert stack.running.ready is not None
    async with asyncio.timeout(5):
        await stack.running.ready
    assert lifecycle(stack).readiness() == (True, "ready")
    assert await ready_endpoint(stack) == (200, {"ready": True, "reason": "ready"})
    for protocol in PROTOCOLS:
        reply = await stack.send(protocol, CHAT, tunnel(f"late-{protocol}"), chat())
        assert reply.status == 200, reply


async def test_a_gate_that_runs_out_fails_the_start_with_the_reason(
    make_stack: StackFactory,
) -> None:
    observer = EventObserver()
    with pytest.raises(EngineNotReady) as failed:
        await make_stack(
            observer=observer,
            upstream_health_wait=0.1,
            engine_controls={"health": {"status": 503, "ready_status": 500}},
            **FAST_GATE,
        )
    reason = str(failed.value)
    assert "/health: status 503" in reason and "/v1/health/ready: status 500" in reason
    assert observer.of("engine_health_gate_failed")[0]["detail"] == reason
    assert "ready" not in observer.kinds()


# --- the model set -----------------------------------------------------------------------------


async def test_discovery_adds_retires_and_republishes_with_generations(
    make_stack: StackFactory,
) -> None:
    observer = EventObserver()
    stack = await make_stack(observer=observer, **FAST_POLLS)
    models = lifecycle(stack).models
    assert models.published == {MODEL} and models.generation(MODEL) == 1

    mark = observer.mark()
    await control(stack, "models", {"models": [MODEL, "b"]})
    added = await observer.wait_for("model_published", after=mark, model="b")
    assert added == {"model": "b", "generation": 1, "source": "discovery"}
    assert (await stack.send("h2", CHAT, tunnel("to-b", "b"), chat("b"))).status == 200

    mark = observer.mark()
    await control(stack, "models", {"models": []})
    await observer.wait_for("model_discovery_poll", after=mark, models=0)
    retired = {(f["model"], f["generation"]) for f in observer.of("model_retired", after=mark)}
    assert retired == {(MODEL, 1), ("b", 1)}
    assert lifecycle(stack).readiness() == (False, "no_models")
    assert await ready_endpoint(stack) == (503, {"ready": False, "reason": "no_models"})
    reply = await stack.send("http1", CHAT, tunnel("gone", "b"), chat("b"))
    assert_retryable_503(reply, "model_generation_unavailable", "gone")

    mark = observer.mark()
    await control(stack, "models", {"models": ["b"]})
    again = await observer.wait_for("model_published", after=mark, model="b")
    assert again["generation"] == 2 and models.generation("b") == 2
    assert lifecycle(stack).readiness() == (True, "ready")
    assert await ready_endpoint(stack) == (200, {"ready": True, "reason": "ready"})
    assert (await stack.send("h3", CHAT, tunnel("back", "b"), chat("b"))).status == 200


@pytest.mark.parametrize(
    ("fault", "reason"),
    [({"status": 500}, "status"), ({"malformed_event": True}, "invalid")],
)
async def test_a_failed_poll_keeps_the_last_good_set(
    make_stack: StackFactory, fault: dict[str, Any], reason: str
) -> None:
    observer = EventObserver()
    stack = await make_stack(observer=observer, **FAST_POLLS)
    mark = observer.mark()
    await stack.faults([{"path": "/v1/models", "times": 1, **fault}])
    failed = await observer.wait_for("model_discovery_poll", after=mark, outcome="failed")
    assert failed["reason"] == reason and failed["models"] == 1
    assert lifecycle(stack).models.published == {MODEL}
    assert lifecycle(stack).readiness() == (True, "ready")
    assert (await stack.send("http1", CHAT, tunnel("kept"), chat())).status == 200
    assert not observer.of("model_retired")
    # The next poll is good again and changes nothing.
    await observer.wait_for("model_discovery_poll", after=mark, outcome="ok")
    assert lifecycle(stack).models.generation(MODEL) == 1


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_an_unpublished_model_is_503_and_never_reaches_the_engine(
    make_stack: StackFactory, protocol: str
) -> None:
    stack = await make_stack()
    reply = await stack.send(protocol, CHAT, tunnel(f"nope-{protocol}", "other"), chat("other"))
    assert_retryable_503(reply, "model_generation_unavailable", f"nope-{protocol}")
    assert "'other' is not published" in json.loads(reply.body)["detail"]
    assert await stack.records() == []


async def test_an_engine_with_no_models_is_not_ready_but_health_still_passes(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(engine_controls={"models": {"models": []}})
    assert lifecycle(stack).readiness() == (False, "no_models")
    health = await stack.send("h2", "/health", [("x-request-id", "hc")], b"", method="GET")
    assert health.status == 200 and json.loads(health.body)["models"] == []
    reply = await stack.send("h2", CHAT, tunnel("none"), chat())
    assert_retryable_503(reply, "model_generation_unavailable", "none")


async def test_a_static_model_set_is_published_and_never_polled(make_stack: StackFactory) -> None:
    observer = EventObserver()
    stack = await make_stack(observer=observer, model=[MODEL, "extra"], engine_controls={})
    assert await paths(stack) == [("/health", 200)]
    published = {(f["model"], f["generation"], f["source"]) for f in observer.of("model_published")}
    assert published == {(MODEL, 1, "static"), ("extra", 1, "static")}
    assert not observer.of("model_discovery_poll")
    assert observer.of("ready")[0]["model_source"] == "static"
    # Published, so it reaches the engine (which does not serve it: its own 404).
    assert (await stack.send("http1", CHAT, tunnel("x", "extra"), chat("extra"))).status == 404
    reply = await stack.send("http1", CHAT, tunnel("y", "third"), chat("third"))
    assert_retryable_503(reply, "model_generation_unavailable", "y")


# --- readiness and the drain -------------------------------------------------------------------


async def test_readiness_flips_first_on_drain_while_in_flight_requests_finish(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(mock={"token_delay_ms": 20, "num_tokens": 10})
    assert lifecycle(stack).readiness() == (True, "ready")
    reader, writer = await asyncio.open_connection(*stack.pylon_address)
    body = chat(stream=True, max_tokens=10)
    writer.write(
        b"POST %s HTTP/1.1\r\nhost: x\r\nx-request-id: long\r\nx-model: %s\r\n"
        b"content-length: %d\r\n\r\n%s" % (CHAT.encode(), MODEL.encode(), len(body), body)
    )
    async with asyncio.timeout(5):
        await reader.readuntil(b"data:")  # in flight
    # A second connection has begun a request head (new connections are closed by the drain).
    late_reader, late_writer = await asyncio.open_connection(*stack.pylon_address)
    late = b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-request-id: new\r\n"
    late_writer.write(late)
    async with asyncio.timeout(5):
        while stack.running.listeners.live.in_progress < 2:
            await asyncio.sleep(0)  # pylon runs in this loop: let it read the bytes
    stack.drain()
    assert lifecycle(stack).readiness() == (False, "draining")
    assert await ready_endpoint(stack) == (503, {"ready": False, "reason": "draining"})
    late_writer.write(b"x-model: %s\r\n\r\n" % MODEL.encode())
    async with asyncio.timeout(5):
        refused = await late_reader.read()
    late_writer.close()
    assert refused.startswith(b"HTTP/1.1 503 "), refused[:100]
    assert b"x-stargate-retryable: true" in refused.lower()
    assert json.loads(refused.partition(b"\r\n\r\n")[2])["code"] == "shutting_down"
    async with asyncio.timeout(5):
        rest = await reader.read()  # the stream in flight finishes
    writer.close()
    assert rest.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    assert [record["path"] for record in await stack.records()] == [CHAT]


# --- readiness after start-up: the engine and the fleet -------------------------------------------

FAST_CHECKS = {"upstream_health_check_interval": 0.02, "upstream_health_timeout": 1.0}


async def readiness_change(events: EventObserver, after: int, **match: Any) -> dict[str, Any]:
    return await events.wait_for("readiness_changed", after=after, **match)


async def ready_gauge(stack: Stack) -> str:
    """The `pylon_ready` sample of the admin listener's /metrics."""
    reply = await stack.client.get(f"{stack.running.admin_url}/metrics")
    lines = [line for line in reply.text.splitlines() if line.startswith("pylon_ready ")]
    assert len(lines) == 1, lines
    return lines[0].split()[1]


def checks_between(events: EventObserver, start: int, end: int) -> int:
    """Failed engine health checks reported between two marks."""
    return sum(1 for kind, _ in events.events[start:end] if kind == "engine_health_probe")


async def test_readiness_follows_the_engine_after_start_up(make_stack: StackFactory) -> None:
    """An engine that fails its health checks after start-up makes `/ready` 503
    `engine_unhealthy` (with the last answer) after 2 failed checks, and 200 again at its next
    pass; an engine that is gone entirely the same."""
    events = EventObserver()
    stack = await make_stack(observer=events, **FAST_CHECKS)
    assert await ready_endpoint(stack) == (200, {"ready": True, "reason": "ready"})
    mark = events.mark()
    await control(stack, "health", {"status": 503})
    down = await readiness_change(events, mark, ready=False)
    assert down["reason"] == "engine_unhealthy" and "status 503" in down["detail"]
    assert checks_between(events, mark, len(events.events)) == 2  # ENGINE_UNHEALTHY_AFTER
    status, body = await ready_endpoint(stack)
    assert (status, body["ready"], body["reason"]) == (503, False, "engine_unhealthy")
    assert "/health" in body["detail"] and "status 503" in body["detail"]
    assert await ready_gauge(stack) == "0.0"
    mark = events.mark()
    await control(stack, "health", {"status": 200})
    up = await readiness_change(events, mark, ready=True)
    assert up == {"ready": True, "reason": "ready", "detail": None}
    assert await ready_endpoint(stack) == (200, {"ready": True, "reason": "ready"})
    assert await ready_gauge(stack) == "1.0"
    mark = events.mark()
    await stack.mock.stop()  # the engine dies
    down = await readiness_change(events, mark, ready=False)
    assert down["reason"] == "engine_unhealthy" and "connect" in down["detail"]
    assert (await ready_endpoint(stack))[0] == 503


async def test_readiness_follows_the_fleet_in_rotation(make_fleet: FleetFactory) -> None:
    """Every worker out of rotation: `/ready` 503 `no_worker_in_rotation` (every request would
    get 503 no_worker); one back in rotation: 200."""
    fleet = await make_fleet(
        workers=2, routing="round-robin", worker_health_interval=0.02, worker_eject_after=1
    )
    events = fleet.observer
    assert fleet.running.admin_url is not None
    ready_url = f"{fleet.running.admin_url}/ready"
    assert (await fleet.client.get(ready_url)).status_code == 200
    mark = events.mark()
    await fleet.control(0, "health", {"status": 500})
    await events.wait_for("worker_ejected", after=mark, worker=fleet.label(0))
    assert (await fleet.client.get(ready_url)).status_code == 200  # one worker still serves
    await fleet.control(1, "health", {"status": 500})
    down = await events.wait_for("readiness_changed", after=mark, ready=False)
    assert down["reason"] == "no_worker_in_rotation" and "status 500" in down["detail"]
    reply = await fleet.client.get(ready_url)
    assert reply.status_code == 503 and reply.json()["reason"] == "no_worker_in_rotation"
    mark = events.mark()
    await fleet.control(1, "health", {"status": 200})
    await events.wait_for("readiness_changed", after=mark, ready=True, reason="ready")
    assert (await fleet.client.get(ready_url)).status_code == 200


async def test_the_wait_for_workers_at_start_is_reported_at_a_bounded_rate(
    make_fleet: FleetFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No worker passes at start: an `engine_waiting` line every `WAIT_REPORT_INTERVAL` (made
    short here) with each worker's last answer, not one per health check."""
    from pylon import bringup

    monkeypatch.setattr(bringup, "WAIT_REPORT_INTERVAL", 0.1)
    fleet = await make_fleet(
        workers=2,
        routing="round-robin",
        wait_ready=False,
        worker_health_interval=0.01,
        upstream_health_wait=0.35,
        engine_controls={0: {"health": {"status": 503}}, 1: {"health": {"status": 500}}},
    )
    with pytest.raises(EngineNotReady):
        await fleet.running.ready
    waiting = fleet.observer.of("engine_waiting")
    assert 1 <= len(waiting) <= 3, waiting  # at 0.1, 0.2 (0.3) s of a 0.35 s wait
    assert f"{fleet.label(0)}: status 503" in waiting[0]["last"]
    assert f"{fleet.label(1)}: status 500" in waiting[0]["last"]
    assert len(fleet.observer.of("worker_health_probe")) > len(waiting)
