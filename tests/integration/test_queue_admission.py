"""Queue-mismatch admission end to end: pylon over HTTP/1.1, HTTP/2 and HTTP/3 in front of
mock_dynamo, with a request whose prefill is slow holding the queue.

A refused request is answered 429 `queue_estimate_mismatch` (retryable) and never reaches the
engine; accepted, unknown-estimate and disabled requests are served; every decision reaches the
observer; and every request leaves the live table however its exchange ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from pylon.core.errors import PylonError
from pylon.core.queue import MIN_SAMPLES, QueueDecision, QueueSnapshot
from pylon.core.record import RequestRecord
from pylon.observe import LogObserver
from tests.stack import MODEL, PROTOCOLS, Stack, StackFactory

CHAT = "/v1/chat/completions"
BIG = 100_000  # input tokens of the request holding the queue


class QueueObserver(LogObserver):
    """Keeps every queue decision, and an event per finished request, by request id."""

    def __init__(self) -> None:
        super().__init__()
        self.decisions: list[tuple[str | None, QueueDecision]] = []
        self.rejections: list[tuple[str | None, str]] = []
        self._done: dict[str, asyncio.Event] = {}

    def queue_gate(self, record: RequestRecord, decision: QueueDecision) -> None:
        self.decisions.append((record.request_id, decision))

    def rejected(self, record: RequestRecord, error: PylonError) -> None:
        self.rejections.append((record.request_id, error.code.value))

    def complete(self, record: RequestRecord) -> None:
        assert record.request_id is not None
        self.done_event(record.request_id).set()

    def done_event(self, request_id: str) -> asyncio.Event:
        return self._done.setdefault(request_id, asyncio.Event())

    async def wait_done(self, request_id: str) -> None:
        async with asyncio.timeout(10):
            await self.done_event(request_id).wait()

    def results(self) -> list[tuple[str | None, str]]:
        return [(request_id, decision.result.value) for request_id, decision in self.decisions]


def chat(stream: bool = True, content: str = "hi") -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "stream": stream}


def headers(request_id: str, tokens: int, expected: int | None = None) -> list[tuple[str, str]]:
    out = [("x-request-id", request_id), ("x-model", MODEL), ("x-input-tokens", str(tokens))]
    if expected is not None:
        out.append(("x-stargate-expected-queue-ms", str(expected)))
    return out


def table(stack: Stack) -> QueueSnapshot:
    (snapshot,) = stack.running.core.queue.table.snapshot()
    return snapshot


def assert_empty(stack: Stack) -> None:
    snap = table(stack)
    assert (snap.pending, snap.pending_tokens, snap.prefill, snap.prefill_tokens) == (0, 0, 0, 0)
    assert snap.decode == 0


async def engine_ids(stack: Stack) -> set[str]:
    ids = set()
    for record in await stack.records():
        ids.update(value for name, value in record["headers"] if name.lower() == "x-request-id")
    return ids


@contextlib.asynccontextmanager
async def slow_request(
    stack: Stack,
    observer: QueueObserver,
    request_id: str = "slow",
    tokens: int = BIG,
    body: bytes | None = None,
) -> AsyncIterator[None]:
    """A streaming request the engine holds before answering (its prefill never ends), in the
    table for as long as the block runs; then its client leaves and it must leave the table.
    Its prompt is as long as its claim unless `body` is given (a claim beyond what the body can
    hold is refused)."""
    await stack.faults([{"delay_ms": 30_000, "times": 1}])
    if body is None:
        body = json.dumps(chat(content="x" * tokens)).encode()
    task = asyncio.create_task(
        stack.post(
            CHAT,
            None,
            headers={"x-request-id": request_id, "x-input-tokens": str(tokens)},
            content=body,
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
        await observer.wait_done(request_id)
        await stack.wait_record(request_id, "cancelled")


async def queue_stack(make_stack: StackFactory, **settings: Any) -> tuple[Stack, QueueObserver]:
    observer = QueueObserver()
    stack = await make_stack("dynamo", observer=observer, **settings)
    return stack, observer


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_refused_before_the_engine_and_accepted_within_tolerance(
    make_stack: StackFactory, protocol: str
) -> None:
    stack, observer = await queue_stack(make_stack, initial_input_tps=1000)
    body = json.dumps(chat()).encode()
    async with slow_request(stack, observer):
        # 100,000 tokens ahead at 1000 tokens/s: 100 s, far above max(100 + 25, 125) ms.
        refused = await stack.send(protocol, CHAT, headers("late", 10, expected=100), body)
        assert refused.status == 429
        assert refused.headers["content-type"] == "application/problem+json"
        assert refused.headers["x-stargate-retryable"] == "true"
        assert refused.headers["x-stargate-retry-reason"] == "queue_estimate_mismatch"
        assert refused.headers["x-request-id"] == "late"
        assert "x-stargate-retry-after-ms" not in refused.headers
        problem = refused.json()
        assert problem["code"] == "queue_estimate_mismatch" and problem["status"] == 429
        assert problem["expected_queue_ms"] == 100
        assert problem["actual_queue_ms"] == 100_000
        assert problem["threshold_ms"] == 125
        assert "late" not in await engine_ids(stack)  # the engine never saw it
        # The gateway expected (about) as much: served.
        served = await stack.send(protocol, CHAT, headers("fits", 10, expected=80_000), body)
        assert served.status == 200 and b"data: [DONE]" in served.body
        await stack.wait_record("fits", "completed")
        assert observer.rejections == [("late", "queue_estimate_mismatch")]
    assert observer.results() == [("late", "rejected"), ("fits", "accepted")]
    late, fits = (decision for _, decision in observer.decisions)
    assert (late.estimate_ms, late.threshold_ms) == (100_000, 125)
    assert (fits.estimate_ms, fits.threshold_ms) == (100_000, 100_000)
    await observer.wait_done("fits")
    assert_empty(stack)


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_unknown_estimate_admits(make_stack: StackFactory, protocol: str) -> None:
    stack, observer = await queue_stack(make_stack)  # no --initial-input-tps, nothing measured
    body = json.dumps(chat()).encode()
    async with slow_request(stack, observer):
        reply = await stack.send(protocol, CHAT, headers("blind", 10, expected=0), body)
        assert reply.status == 200
        await stack.wait_record("blind", "completed")
    ((request_id, decision),) = observer.decisions
    assert request_id == "blind" and decision.result.value == "unknown_estimate"
    assert decision.estimate_ms is None
    assert_empty(stack)


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_disabled_admits_and_still_estimates(make_stack: StackFactory, protocol: str) -> None:
    stack, observer = await queue_stack(make_stack, initial_input_tps=1000, queue_admission=False)
    body = json.dumps(chat()).encode()
    async with slow_request(stack, observer):
        reply = await stack.send(protocol, CHAT, headers("anyway", 10, expected=0), body)
        assert reply.status == 200
        await stack.wait_record("anyway", "completed")
    ((request_id, decision),) = observer.decisions
    assert request_id == "anyway" and decision.result.value == "disabled"
    assert decision.estimate_ms == 100_000
    assert_empty(stack)


async def test_retry_after_hint_and_urgent_requests_skip_the_pending_queue(
    make_stack: StackFactory,
) -> None:
    stack, observer = await queue_stack(
        make_stack, initial_input_tps=1000, queue_admission_retry_after_ms=250
    )
    body = json.dumps(chat()).encode()
    async with slow_request(stack, observer):  # pending (no head yet), no x-priority
        refused = await stack.send("http1", CHAT, headers("late", 1, expected=0), body)
        assert refused.status == 429
        assert refused.headers["x-stargate-retry-after-ms"] == "250"
        # Rank 0 runs before the unprioritised request in the engine: nothing is ahead of it.
        urgent = [*headers("urgent", 1, expected=0), ("x-priority", "0")]
        assert (await stack.send("http1", CHAT, urgent, body)).status == 200
    assert observer.results() == [("late", "rejected"), ("urgent", "accepted")]
    assert observer.decisions[1][1].estimate_ms == 0


async def test_measured_throughput_replaces_the_unknown(make_stack: StackFactory) -> None:
    """With a slow prefill (mock ttft) pylon measures the input throughput from real streams,
    and then refuses with it."""
    stack, observer = await queue_stack(make_stack, mock={"ttft_ms": 100, "num_tokens": 2})
    assert stack.running.core.queue.table.input_tps(MODEL) is None
    body = json.dumps(chat()).encode()
    for i in range(MIN_SAMPLES):
        reply = await stack.send("http1", CHAT, headers(f"warm-{i}", 1000), body)
        assert reply.status == 200
        await observer.wait_done(f"warm-{i}")
    tps = stack.running.core.queue.table.input_tps(MODEL)
    # 1000 tokens per prefill of at least 100 ms: at most 10,000 tokens/s.
    assert tps is not None and 1000 < tps <= 10_000
    async with slow_request(stack, observer, tokens=10**5):
        refused = await stack.send("http1", CHAT, headers("late", 1, expected=500), body)
        assert refused.status == 429
        assert refused.json()["actual_queue_ms"] >= 10_000
    assert observer.results() == [("late", "rejected")]
    assert_empty(stack)


async def test_every_ending_leaves_the_table(make_stack: StackFactory) -> None:
    stack, observer = await queue_stack(
        make_stack, initial_input_tps=1000, first_output_timeout=0.3
    )
    body = json.dumps(chat()).encode()
    non_stream = json.dumps(chat(stream=False)).encode()
    # Success, streamed and not.
    assert (await stack.send("http1", CHAT, headers("ok", 5), body)).status == 200
    assert (await stack.send("http1", CHAT, headers("whole", 5), non_stream)).status == 200
    await observer.wait_done("whole")
    assert_empty(stack)
    # The engine's own error status.
    await stack.faults([{"status": 500, "times": 1}])
    assert (await stack.send("http1", CHAT, headers("error", 5), body)).status == 500
    await observer.wait_done("error")
    assert_empty(stack)
    # The engine breaks the stream after its head.
    await stack.faults([{"drop_after_events": 1, "times": 1}])
    reply = await stack.send("http1", CHAT, headers("dropped", 5), body)
    assert b"upstream_protocol_error" in reply.body
    await observer.wait_done("dropped")
    assert_empty(stack)
    # No first output in time.
    await stack.faults([{"stall_after_events": 0, "times": 1}])
    reply = await stack.send("http1", CHAT, headers("stalled", 5), body)
    assert b"upstream_timeout" in reply.body
    await observer.wait_done("stalled")
    assert_empty(stack)
    # The client leaves (the slow request's context cancels it): checked on leaving the block.
    async with slow_request(stack, observer, request_id="left"):
        assert table(stack).pending_tokens + table(stack).prefill_tokens == BIG
    assert_empty(stack)
    # Refused requests never entered; a request pylon answers itself before the queue neither.
    bad = [*headers("bad", 5), ("x-priority", "-1")]
    assert (await stack.send("http1", CHAT, bad, body)).status == 400
    assert_empty(stack)
