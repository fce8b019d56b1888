"""The active canary against a real mock_dynamo (a forced 500, a forced runaway generation: the
model's health flips and comes back), `/ready` through the admin listener while a canary fails
(and the canary never shows as client traffic), and the live ModelStats following real traffic
through a running pylon."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from mock_dynamo.server import MockConfig, start_mock
from pylon.adapters import AdapterOptions, build_adapter
from pylon.core.upstream import Upstream
from pylon.gateway.board import GatewayBoard, ModelHealth
from pylon.gateway.canary import Canaries, CanaryOptions, single_target
from pylon.gateway.model_stats import LevelPriorities, OutputMeter, build_collector
from pylon.observe import Observers
from tests.observers import EventObserver, SeenObserver
from tests.stack import FLAVOR, MODEL, Stack, StackFactory

FAST = CanaryOptions(interval=0.05, timeout=2.0, max_tokens=237, recovery_interval=0.05)
CHAT = "/v1/chat/completions"


@contextlib.asynccontextmanager
async def canaries_on(
    upstream: str, board: GatewayBoard, observer: EventObserver, **kw: Any
) -> AsyncIterator[Canaries]:
    canaries = Canaries(FAST, board, single_target(Upstream.from_url(upstream)), observer, **kw)
    try:
        yield canaries
    finally:
        await canaries.aclose()


async def test_a_forced_failure_flips_the_models_health_and_back() -> None:
    mock = await start_mock(
        MockConfig(models=("m", "other"), num_tokens=16), host="127.0.0.1", port=0
    )
    board = GatewayBoard(reverse=False)
    observer = EventObserver()
    try:
        async with (
            httpx.AsyncClient(base_url=mock.base_url, timeout=5) as control,
            canaries_on(mock.base_url, board, observer) as canaries,
        ):
            canaries.sync(["m", "other"])
            await observer.wait_for("canary_passed", model="m")
            mark = observer.mark()
            reply = await control.put("/test-control/faults", json=[{"model": "m", "status": 500}])
            reply.raise_for_status()
            failed = await observer.wait_for("canary_failed", after=mark, model="m")
            assert failed["reason"] == "status" and failed["detail"] == "status 500"
            assert board.model_health("m") == ModelHealth(False, "status 500")
            assert board.model_health("other").healthy  # only that model's canary fails
            (await control.delete("/test-control/faults")).raise_for_status()
            recovered = await observer.wait_for("canary_recovered", after=mark, model="m")
            assert recovered["failed_s"] > 0 and board.model_health("m").healthy

            # A runaway: the engine answers max_tokens tokens (its cap is above the canary's).
            mark = observer.mark()
            (await control.put("/test-control/knobs", json={"num_tokens": 500})).raise_for_status()
            failed = await observer.wait_for("canary_failed", after=mark, model="m")
            assert failed["reason"] == "runaway" and board.model_health("m").reason == "runaway"
            (await control.put("/test-control/knobs", json={"num_tokens": 16})).raise_for_status()
            await observer.wait_for("canary_recovered", after=mark, model="m")
            assert board.unhealthy_models() == {}

            records = (await control.get("/test-control")).json()["requests"]
            canary = [r for r in records if r["path"] == CHAT]
            assert canary and all(
                value.startswith("canary-")
                for r in canary
                for name, value in r["headers"]
                if name.lower() == "x-request-id"
            )
            assert {r["body"]["stream"] for r in canary} == {False}
    finally:
        await mock.stop()


@pytest.mark.parametrize("backend", ["dynamo", "vllm", "sglang", "passthrough"])
async def test_each_backend_answers_the_canary_with_its_priority(backend: str) -> None:
    """The canary as each backend's engine takes it, with the most urgent priority written
    the backend's way (a header for Dynamo, the body for vLLM and SGLang, nothing for
    passthrough)."""
    flavor = FLAVOR[backend]
    mock = await start_mock(MockConfig(flavor=flavor, models=("m",)), host="127.0.0.1", port=0)  # type: ignore[arg-type]
    board = GatewayBoard(reverse=False)
    observer = EventObserver()
    adapter = build_adapter(backend, AdapterOptions(3600), derive=True)
    try:
        async with (
            httpx.AsyncClient(base_url=mock.base_url, timeout=5) as control,
            canaries_on(mock.base_url, board, observer, priority=adapter.derive(0)) as canaries,
        ):
            canaries.sync(["m"])
            passed = await observer.wait_for("canary_passed", model="m")
            assert passed["completion_tokens"] == 16  # the mock's default answer length
            (record, *_) = (await control.get("/test-control")).json()["requests"]
            assert record["body"].get("priority") == adapter.derive(0).body_priority
            sent = {name.lower() for name, _ in record["headers"]}
            assert ("x-dynamo-request-priority" in sent) == (backend == "dynamo")
            assert board.unhealthy_models() == {}
    finally:
        await mock.stop()


async def test_ready_is_503_while_a_canary_fails_and_the_canary_is_no_client_traffic(
    make_stack: StackFactory,
) -> None:
    events = EventObserver()
    seen = SeenObserver()
    meter = OutputMeter()
    stack = await make_stack("dynamo", observer=Observers(events, seen, meter))
    running = stack.running
    lifecycle = running.core.lifecycle
    board = GatewayBoard(reverse=False)
    admin = running.admin_url
    assert admin is not None
    async with canaries_on(
        running.upstream, board, events, on_fault=lifecycle.set_canary
    ) as canaries:
        canaries.sync(lifecycle.models.published)
        await events.wait_for("canary_passed", model=MODEL)
        assert (await stack.http.get(f"{admin}/ready")).status_code == 200
        mark = events.mark()
        await stack.faults([{"model": MODEL, "status": 503}])
        await events.wait_for("canary_failed", after=mark, model=MODEL)
        reply = await stack.http.get(f"{admin}/ready")
        assert reply.status_code == 503
        body = reply.json()
        assert body["reason"] == "canary_failed" and f"{MODEL} (status 503)" in body["detail"]
        await stack.faults([])
        await events.wait_for("canary_recovered", after=mark, model=MODEL)
        assert (await stack.http.get(f"{admin}/ready")).json() == {"ready": True, "reason": "ready"}
    # The canaries went to the engine, not through pylon: no queue table, no output counted,
    # no request seen by the observers, nothing in pylon's request metrics.
    assert any(r["path"] == CHAT for r in await stack.records())
    assert running.core.queue.table.snapshot() == []
    assert meter.models() == []
    assert seen.seen == []
    metrics = (await stack.http.get(f"{admin}/metrics")).text
    counted = [
        line
        for line in metrics.splitlines()
        if line.startswith("pylon_requests_total{") and f'model="{MODEL}"' in line
    ]
    assert counted == []


async def test_the_stats_follow_real_traffic(make_stack: StackFactory) -> None:
    meter = OutputMeter(window=10.0)
    events = EventObserver()
    stack = await make_stack("dynamo", observer=Observers(events, meter), initial_input_tps=1000)
    running = stack.running
    collector = build_collector(running.core, running.routing, meter)
    published = sorted(running.core.lifecycle.models.published)
    adapter = running.core.queue.adapter
    unconfigured = LevelPriorities(adapter)(adapter.queue_level(None))

    idle = collector.collect(published)[MODEL]
    assert (idle.queue_size, idle.num_running_queries, idle.output_tps) == (0, 0, 0.0)
    assert idle.last_mean_input_tps == 1000.0

    async with held_request(stack, "held", tokens=50_000):
        value = collector.collect(published)[MODEL]
        assert value.queue_size == 1 and value.queued_input_size == 50_000
        assert value.num_running_queries == 1 and value.total_query_input_size == 50_000
        estimates = value.queue_time_estimate_ms_by_priority
        assert estimates == {0: 0, unconfigured: 50_000}  # 50,000 tokens at 1000 tokens/s
        # An urgent request is not behind it: the gateway reads 0 ms for rank 0.
        urgent = await stack.post(
            CHAT,
            chat(),
            headers={"x-request-id": "urgent", "x-input-tokens": "10", "x-priority": "0"},
        )
        assert urgent.status_code == 200
    await stack.wait_record("held", "cancelled")
    await events_done(stack)
    after = collector.collect(published)[MODEL]
    assert (after.queue_size, after.num_running_queries, after.queued_input_size) == (0, 0, 0)
    # The urgent stream's output tokens (the engine's 16) are in the window now.
    assert after.output_tps > 0 and after.max_output_tps == after.output_tps
    assert "request.output.tokens" in after.stats_capabilities


def chat() -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}


@contextlib.asynccontextmanager
async def held_request(stack: Stack, request_id: str, tokens: int) -> AsyncIterator[None]:
    """A streaming request the engine holds before its head (pending in pylon's table) for as
    long as the block runs; then its client leaves."""
    await stack.faults([{"delay_ms": 30_000, "times": 1}])
    body = json.dumps({**chat(), "messages": [{"role": "user", "content": "x" * tokens}]})
    task = asyncio.create_task(
        stack.post(
            CHAT,
            None,
            headers={"x-request-id": request_id, "x-input-tokens": str(tokens)},
            content=body.encode(),
            timeout=60,
        )
    )
    try:
        await stack.wait_record(request_id, "received")
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def events_done(stack: Stack) -> None:
    """Until pylon's table is empty again (the cancelled exchange ended), within a deadline."""
    async with asyncio.timeout(5):
        while any(
            s.pending or s.prefill or s.decode for s in stack.running.core.queue.table.snapshot()
        ):
            await asyncio.sleep(0.01)
