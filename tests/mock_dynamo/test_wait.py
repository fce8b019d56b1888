"""GET /test-control/wait: long polls on a request's x-request-id, answered by events."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from mock_dynamo.app import SIGNAL_KEY
from mock_dynamo.server import MockConfig, start_mock
from tests.cancellation import cancellation_lag_for, wait_for_record
from tests.mock_dynamo.conftest import MakeMock

CHAT = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}]}
STREAM = {**CHAT, "stream": True}
# How soon after the recorded moment a waiting long poll must have answered: an event
# wake-up takes about a millisecond, generous for a loaded CI box, far below any timeout.
PROMPT_S = 0.1


def _rid(value: str) -> dict[str, str]:
    return {"x-request-id": value}


async def _wait(client: httpx.AsyncClient, **params: str) -> tuple[httpx.Response, float]:
    reply = await client.get("/test-control/wait", params=params, timeout=40)
    return reply, time.time()


async def test_event_already_happened_answers_at_once(client: httpx.AsyncClient) -> None:
    await client.post("/v1/chat/completions", json=CHAT, headers=_rid("done-1"))
    for event in ("received", "completed", "finished"):
        start = time.monotonic()
        reply, _ = await _wait(client, request_id="done-1", event=event, timeout="0")
        assert reply.status_code == 200 and time.monotonic() - start < 1
        record = reply.json()
        assert record["status"] == 200 and record["completed_at"] is not None
        assert ["x-request-id", "done-1"] in record["headers"]


async def test_long_poll_answers_when_the_request_completes(
    make_mock: MakeMock,
) -> None:
    server = await make_mock(ttft_ms=300)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=5) as c:
        waiter = asyncio.create_task(_wait(c, request_id="slow-1", event="completed"))
        post = asyncio.create_task(
            c.post("/v1/chat/completions", json=CHAT, headers=_rid("slow-1"))
        )
        received = await wait_for_record(c, server.base_url, "slow-1", "received")
        assert received["completed_at"] is None and received["status"] is None
        assert not waiter.done()
        reply, answered_at = await waiter
        assert reply.status_code == 200
        record = reply.json()
        assert record["completed_at"] - record["received_at"] >= 0.29
        assert answered_at - record["completed_at"] < PROMPT_S
        assert (await post).status_code == 200


async def test_long_poll_answers_when_a_stream_is_cancelled(make_mock: MakeMock) -> None:
    server = await make_mock(token_delay_ms=50, num_tokens=200)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=5) as c:
        cancelled = asyncio.create_task(_wait(c, request_id="gone-1", event="cancelled"))
        finished = asyncio.create_task(_wait(c, request_id="gone-1", event="finished"))
        async with c.stream(
            "POST", "/v1/chat/completions", json=STREAM, headers=_rid("gone-1")
        ) as resp:
            chunks = resp.aiter_bytes()
            buf = b""
            while buf.count(b"\n\n") < 2:
                buf += await asyncio.wait_for(anext(chunks), 2)
            assert not cancelled.done() and not finished.done()
        closed_at = time.time()
        for task in (cancelled, finished):
            reply, answered_at = await task
            assert reply.status_code == 200
            record = reply.json()
            assert record["cancelled_at"] - closed_at < PROMPT_S
            assert answered_at - record["cancelled_at"] < PROMPT_S
            assert record["completed_at"] is None and record["status"] == 200
        lag = await cancellation_lag_for(c, server.base_url, "gone-1", since=closed_at)
        assert 0 <= lag < PROMPT_S


async def test_timeout_answers_408_with_what_was_seen(client: httpx.AsyncClient) -> None:
    start = time.monotonic()
    reply, _ = await _wait(client, request_id="never", event="received", timeout="0.2")
    elapsed = time.monotonic() - start
    assert reply.status_code == 408 and 0.19 <= elapsed < 2
    body = reply.json()
    assert body["error"]["code"] == 408 and body["error"]["type"] == "RequestTimeoutError"
    assert "never" in body["error"]["message"] and body["record"] is None

    await client.post("/v1/chat/completions", json=CHAT, headers=_rid("ok-1"))
    reply, _ = await _wait(client, request_id="ok-1", event="cancelled", timeout="0")
    assert reply.status_code == 408
    assert reply.json()["record"]["status"] == 200


async def test_helper_fails_the_test_clearly_on_timeout(client: httpx.AsyncClient) -> None:
    base = str(client.base_url)
    with pytest.raises(pytest.fail.Exception, match=r"never received.*'nope'"):
        await wait_for_record(client, base, "nope", "completed", timeout=0.05)
    await client.post("/v1/chat/completions", json=CHAT, headers=_rid("done-2"))
    with pytest.raises(pytest.fail.Exception, match="did not see it cancelled"):
        await wait_for_record(client, base, "done-2", "cancelled", timeout=0)
    with pytest.raises(pytest.fail.Exception, match=r"never saw .*'done-2' cancelled"):
        await cancellation_lag_for(client, base, "done-2", since=time.time())


@pytest.mark.parametrize(
    "params",
    [
        {"event": "completed"},
        {"request_id": "", "event": "completed"},
        {"request_id": "r"},
        {"request_id": "r", "event": "done"},
        {"request_id": "r", "event": "completed", "timeout": "soon"},
        {"request_id": "r", "event": "completed", "timeout": "-1"},
        {"request_id": "r", "event": "completed", "timeout": "30.5"},
        {"request_id": "r", "event": "completed", "timeout": "nan"},
        {"request_id": "r", "event": "completed", "timeout": "inf"},
        {"request_id": "r", "event": "completed", "request-id": "r"},
        {"request_id": ["r", "s"], "event": "completed"},
    ],
)
async def test_bad_parameters_answer_400(client: httpx.AsyncClient, params: Any) -> None:
    reply = await client.get("/test-control/wait", params=params)
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == 400


async def test_latest_record_with_the_id_and_header_name_case(
    client: httpx.AsyncClient,
) -> None:
    await client.post("/v1/chat/completions", json={**CHAT, "model": "nope"}, headers=_rid("dup"))
    await client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-ID": "dup"})
    record = await wait_for_record(client, str(client.base_url), "dup", "completed")
    assert record["status"] == 200 and record["model"] == "mock-model"
    # Values are compared exactly.
    reply, _ = await _wait(client, request_id="DUP", event="received", timeout="0")
    assert reply.status_code == 408


async def test_a_newer_request_with_the_id_is_the_one_waited_for(make_mock: MakeMock) -> None:
    server = await make_mock(ttft_ms=200)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=5) as c:
        await c.post("/v1/chat/completions", json={**CHAT, "model": "nope"}, headers=_rid("re"))
        await c.post("/test-control/reset")
        waiter = asyncio.create_task(_wait(c, request_id="re", event="completed"))
        await c.post("/v1/chat/completions", json=CHAT, headers=_rid("re"))
        reply, _ = await waiter
    assert reply.status_code == 200 and reply.json()["status"] == 200


async def test_stop_answers_pending_long_polls() -> None:
    server = await start_mock(MockConfig(), port=0)
    # Spy on the signal to know when the long poll is parked on it (no race with stop()).
    signal = server._runner.app[SIGNAL_KEY]
    parked = asyncio.Event()
    next_change = signal.next_change

    def spy() -> asyncio.Event:
        parked.set()
        return next_change()

    signal.next_change = spy  # type: ignore[method-assign]
    async with httpx.AsyncClient(base_url=server.base_url, timeout=5) as c:
        waiter = asyncio.create_task(_wait(c, request_id="x", event="completed", timeout="30"))
        await asyncio.wait_for(parked.wait(), 5)
        start = time.monotonic()
        await asyncio.wait_for(server.stop(), 5)
        reply, _ = await asyncio.wait_for(waiter, 5)
    assert reply.status_code == 503 and time.monotonic() - start < 1
