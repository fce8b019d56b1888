"""The injected parts seen from outside: a router's booking lives exactly as long as the engine
exchange (released once, on every exit path), the observer sees every step with its clock
readings, and the lifecycle's drain answers late requests with a retryable 503."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from pylon.core.errors import PylonError
from pylon.core.hooks import ExchangeHooks
from pylon.core.plan import ForwardPlan
from pylon.core.record import RequestRecord
from pylon.core.retry import RetryMark
from pylon.core.upstream import Upstream
from pylon.observe import LogObserver
from pylon.routing import Booking
from tests.stack import MODEL, Stack, StackFactory

CHAT = "/v1/chat/completions"
# A booking's life on a successful exchange: every moment once, in order, then the release.
LIFE_OK = ["dispatched", "response_head", "first_output", "release:ok"]


class RecordingBooking(ExchangeHooks):
    counts_output = True
    quiet = False
    body = None

    def __init__(self, upstream: Upstream, log: list[str], tokens: list[int]) -> None:
        self.upstream = upstream
        self.worker = upstream.label
        self.headers = ((b"x-worker-pin", b"7"),)
        self._log = log
        self._tokens = tokens

    def dispatched(self, record: RequestRecord) -> None:
        self._log.append("dispatched")

    def response_head(self, record: RequestRecord) -> None:
        self._log.append("response_head")

    def first_output(self, record: RequestRecord) -> None:
        self._log.append("first_output")

    def output(self, record: RequestRecord, count: int) -> None:
        assert self._log[-1] == "first_output", "output is counted from the first output on"
        self._tokens.append(count)

    def complete(self, record: RequestRecord) -> None:
        self._log.append(f"release:{record.outcome}")

    def rejected(self, record: RequestRecord, error: PylonError) -> None:
        self._log.append(f"rejected:{error.code.value}")


class RecordingRouter:
    """Books every request on one target and keeps each booking's life story."""

    def __init__(self) -> None:
        self.upstream: Upstream | None = None
        self.lives: dict[str, list[str]] = {}
        self.tokens: dict[str, list[int]] = {}  # what `output_tokens` was told, per block

    async def book(self, plan: ForwardPlan) -> Booking:
        assert self.upstream is not None and plan.request_id is not None
        rid = plan.request_id
        return RecordingBooking(
            self.upstream, self.lives.setdefault(rid, []), self.tokens.setdefault(rid, [])
        )

    def elsewhere(self, plan: ForwardPlan, failed: Booking) -> Booking | None:
        return None  # one target


class RecordingObserver(LogObserver):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str | None]] = []
        self.records: list[RequestRecord] = []

    def admitted(self, record: RequestRecord) -> None:
        self.events.append(("admitted", record.request_id))

    def rejected(self, record: RequestRecord, error: PylonError) -> None:
        self.events.append(("rejected", record.request_id))

    def dispatched(self, record: RequestRecord) -> None:
        self.events.append(("dispatched", record.request_id))

    def response_head(self, record: RequestRecord) -> None:
        self.events.append(("response_head", record.request_id))

    def first_output(self, record: RequestRecord) -> None:
        self.events.append(("first_output", record.request_id))

    def upstream_status(self, record: RequestRecord, mark: RetryMark) -> None:
        self.events.append(("upstream_status", record.request_id))

    def upstream_failed(self, record: RequestRecord, error: PylonError, after_head: bool) -> None:
        self.events.append(("upstream_failed", record.request_id))

    def complete(self, record: RequestRecord) -> None:
        self.events.append(("complete", record.request_id))
        self.records.append(record)


async def routed_stack(make_stack: StackFactory, **settings: Any) -> tuple[Stack, RecordingRouter]:
    router = RecordingRouter()
    stack = await make_stack(
        "dynamo", mock={"token_delay_ms": 20, "num_tokens": 8}, router=router, **settings
    )
    router.upstream = Upstream.from_url(stack.mock.base_url)
    return stack, router


def chat(stream: bool, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [], "max_tokens": 8, "stream": stream, **extra}


async def test_booking_is_released_once_after_the_exchange_on_success(
    make_stack: StackFactory,
) -> None:
    stack, router = await routed_stack(make_stack)
    bodies = {}
    for request_id, stream in (("ok-stream", True), ("ok-json", False)):
        reply = await stack.post(CHAT, chat(stream), headers={"x-request-id": request_id})
        assert reply.status_code == 200
        assert router.lives[request_id] == LIFE_OK
        bodies[request_id] = reply.content
    # Every output event of the stream was counted ([DONE] not); a whole JSON answer counts
    # nothing (its booking ends with it).
    data_events = [line for line in bodies["ok-stream"].splitlines() if line.startswith(b"data:")]
    assert sum(router.tokens["ok-stream"]) == len(data_events) - 1 >= 8
    assert router.tokens["ok-json"] == []
    # The booking's trusted header is part of what the engine received.
    assert ["x-worker-pin", "7"] in (await stack.last_request())["headers"]


async def test_booking_is_released_on_engine_faults_and_timeouts(make_stack: StackFactory) -> None:
    stack, router = await routed_stack(make_stack, first_output_timeout=0.3)
    await stack.faults([{"drop_after_events": 2, "times": 1}])
    reply = await stack.post(CHAT, chat(True), headers={"x-request-id": "dropped"})
    assert reply.status_code == 200 and b"upstream_protocol_error" in reply.content
    assert router.lives["dropped"] == [*LIFE_OK[:-1], "release:upstream_protocol_error"]
    await stack.faults([{"stall_after_events": 0, "times": 1}])
    reply = await stack.post(CHAT, chat(True), headers={"x-request-id": "stalled"})
    assert b"upstream_timeout" in reply.content
    assert router.lives["stalled"] == ["dispatched", "response_head", "release:upstream_timeout"]
    await stack.faults([{"status": 503, "retryable": True, "times": 1}])
    reply = await stack.post(CHAT, chat(False), headers={"x-request-id": "refused"})
    assert reply.status_code == 503
    assert router.lives["refused"] == LIFE_OK


async def test_booking_is_released_when_the_client_leaves(make_stack: StackFactory) -> None:
    stack, router = await routed_stack(make_stack)
    await stack.knobs(num_tokens=400, token_delay_ms=50)
    host, port = stack.pylon_address
    reader, writer = await asyncio.open_connection(host, port)
    body = json.dumps(chat(True, max_tokens=400)).encode()
    writer.write(
        f"POST {CHAT} HTTP/1.1\r\nhost: x\r\nx-request-id: leaver\r\nx-model: {MODEL}\r\n"
        f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    seen = b""
    while seen.count(b"data:") < 2:
        seen += await asyncio.wait_for(reader.read(4096), 5)
    writer.transport.abort()
    await stack.wait_record("leaver", "cancelled")
    async with asyncio.timeout(5):
        while len(router.lives["leaver"]) < len(LIFE_OK):
            await asyncio.sleep(0)  # the release runs in pylon's task, after the engine saw it
    assert router.lives["leaver"] == [*LIFE_OK[:-1], "release:client_disconnected"]


@pytest.mark.parametrize("protocol", ["http1", "h2", "h3"])
async def test_observer_sees_every_step_in_clock_order(
    make_stack: StackFactory, protocol: str
) -> None:
    observer = RecordingObserver()
    stack = await make_stack(
        "dynamo", mock={"token_delay_ms": 5, "num_tokens": 4}, observer=observer
    )
    headers = [("x-request-id", "seen-1"), ("x-model", MODEL)]
    reply = await stack.send(protocol, CHAT, headers, json.dumps(chat(True)).encode())
    assert reply.status == 200
    steps = [name for name, request_id in observer.events if request_id == "seen-1"]
    assert steps == ["admitted", "dispatched", "response_head", "first_output", "complete"]
    record = observer.records[-1]
    assert record.transport == protocol and record.outcome == "ok" and record.status == 200
    assert record.dispatched_at is not None and record.first_byte_at is not None
    assert record.done_at is not None
    assert record.head_at <= record.dispatched_at <= record.first_byte_at <= record.done_at
    bad = await stack.send(protocol, CHAT, [("x-request-id", "bad-1")], b"{}")
    assert bad.status == 400
    assert ("rejected", "bad-1") in observer.events


async def test_a_request_arriving_during_the_drain_gets_a_retryable_503(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack("dynamo")
    host, port = stack.pylon_address
    reader, writer = await asyncio.open_connection(host, port)
    body = json.dumps(chat(False)).encode()
    head = (
        f"POST {CHAT} HTTP/1.1\r\nhost: x\r\nx-request-id: late-1\r\nx-model: {MODEL}\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    try:
        writer.write(head[:20])  # the head has started when the drain begins
        await writer.drain()
        async with asyncio.timeout(5):
            while stack.running.listeners.live.in_progress == 0:
                await asyncio.sleep(0)  # pylon runs in this loop: let it read the bytes
        stack.drain()
        writer.write(head[20:] + body)
        reply = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    status_line, _, rest = reply.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 503 Service Unavailable"
    assert b"x-stargate-retryable: true" in rest and b"connection: close" in rest
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["code"] == "shutting_down"
    assert await stack.records() == []
    # New connections are not taken any more.
    async with httpx.AsyncClient(timeout=2) as client:
        with pytest.raises(httpx.TransportError):
            await client.get(f"{stack.pylon_url}/health")
