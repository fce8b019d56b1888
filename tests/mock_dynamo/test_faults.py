"""Injected faults via PUT /test-control/faults."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.cancellation import wait_for_record
from tests.mock_dynamo.conftest import MakeMock, sse_data

CHAT = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}]}
STREAM = {**CHAT, "stream": True}
STALL, DROP = {"x-request-id": "stall"}, {"x-request-id": "drop"}


async def _set_faults(client: httpx.AsyncClient, faults: list[dict[str, Any]]) -> None:
    resp = await client.put("/test-control/faults", json=faults)
    assert resp.status_code == 200, resp.text


async def _read_events(chunks: AsyncIterator[bytes], buf: bytes, count: int) -> bytes:
    """Read until `buf` holds `count` complete SSE events (bounded by timeouts)."""
    while buf.count(b"\n\n") < count:
        buf += await asyncio.wait_for(anext(chunks), 2)
    return buf


async def test_status_fault_with_retry_headers(client: httpx.AsyncClient) -> None:
    await _set_faults(client, [{"status": 503, "retryable": True, "retry_after": "2"}])
    for body in (CHAT, STREAM):
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 503
        assert resp.headers["x-stargate-upstream-retryable"] == "true"
        assert resp.headers["retry-after"] == "2"
        assert set(resp.json()["error"]) == {"message", "type", "code"}


async def test_retryable_header_on_success(client: httpx.AsyncClient) -> None:
    await _set_faults(client, [{"retryable": False}])
    resp = await client.post("/v1/chat/completions", json=STREAM)
    assert resp.status_code == 200
    assert resp.headers["x-stargate-upstream-retryable"] == "false"
    assert "retry-after" not in resp.headers
    assert sse_data(resp.text)[-1] == "[DONE]"


async def test_times_limits_and_filters_select(client: httpx.AsyncClient) -> None:
    await _set_faults(
        client,
        [
            {"path": "/v1/completions", "status": 429},
            {"model": "mock-model", "status": 500, "times": 2},
        ],
    )
    statuses = [
        (await client.post("/v1/chat/completions", json=CHAT)).status_code for _ in range(3)
    ]
    assert statuses == [500, 500, 200]
    resp = await client.post("/v1/completions", json={"model": "mock-model", "prompt": "x"})
    assert resp.status_code == 429
    faults = (await client.get("/test-control")).json()["faults"]
    assert faults == [
        {
            "path": "/v1/completions",
            "status": 429,
            "delay_ms": 0,
            "malformed_event": False,
            "after_events": 1,
            "remaining": None,
        }
    ]


async def test_pathless_fault_spares_health_explicit_path_hits_it(
    client: httpx.AsyncClient,
) -> None:
    await _set_faults(client, [{"status": 500}])
    assert (await client.get("/health")).status_code == 200
    await _set_faults(client, [{"path": "/health", "status": 503}])
    assert (await client.get("/health")).status_code == 503
    assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert (await client.delete("/test-control/faults")).status_code == 200
    assert (await client.get("/health")).status_code == 200


async def test_delay_fault(client: httpx.AsyncClient) -> None:
    await _set_faults(client, [{"delay_ms": 200}])
    start = time.monotonic()
    await client.post("/v1/embeddings", json={"model": "mock-model", "input": "x"})
    assert time.monotonic() - start >= 0.19


async def test_stall_after_events_hangs_without_closing(client: httpx.AsyncClient) -> None:
    await _set_faults(client, [{"stall_after_events": 2}])
    async with client.stream("POST", "/v1/chat/completions", json=STREAM, headers=STALL) as resp:
        chunks = resp.aiter_bytes()
        buf = await _read_events(chunks, b"", 2)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(anext(chunks), 0.3)
    assert buf.count(b"\n\n") == 2
    record = await wait_for_record(client, str(client.base_url), "stall", "finished")
    assert record["cancelled_at"] is not None
    assert record["status"] == 200 and record["completed_at"] is None


async def test_drop_after_events_aborts_connection(client: httpx.AsyncClient) -> None:
    await _set_faults(client, [{"drop_after_events": 3}])
    buf = b""
    with pytest.raises(httpx.TransportError):
        async with client.stream("POST", "/v1/chat/completions", json=STREAM, headers=DROP) as resp:
            async for chunk in resp.aiter_bytes():
                buf += chunk
    assert buf.count(b"\n\n") == 3 and b"[DONE]" not in buf
    record = await wait_for_record(client, str(client.base_url), "drop", "finished")
    # The mock hung up, not the client: not counted as a cancellation.
    assert record["cancelled_at"] is None and record["status"] == 200


async def test_drop_before_response_on_non_streaming(client: httpx.AsyncClient) -> None:
    await _set_faults(client, [{"drop_after_events": 0}])
    with pytest.raises(httpx.TransportError):
        await client.post("/v1/chat/completions", json=CHAT, headers=DROP)
    record = await wait_for_record(client, str(client.base_url), "drop", "finished")
    assert record["status"] == 0 and record["cancelled_at"] is None


async def test_stall_mid_body_on_non_streaming(client: httpx.AsyncClient) -> None:
    await _set_faults(client, [{"stall_after_events": 1}])
    async with client.stream("POST", "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status_code == 200
        expected = int(resp.headers["content-length"])
        chunks = resp.aiter_bytes()
        got = await asyncio.wait_for(anext(chunks), 2)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(anext(chunks), 0.3)
    assert 0 < len(got) < expected


async def test_malformed_event(client: httpx.AsyncClient) -> None:
    await _set_faults(client, [{"malformed_event": True, "times": 1}])
    data = sse_data((await client.post("/v1/chat/completions", json=STREAM)).text)
    assert data[1] == "{not json"
    assert data[-1] == "[DONE]" and len(data) == 1 + 1 + 16 + 1 + 1
    await _set_faults(client, [{"malformed_event": True}])
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 200 and resp.content == b"{not json"


async def test_huge_unterminated_event(client: httpx.AsyncClient) -> None:
    await _set_faults(client, [{"huge_event_bytes": 200_000, "after_events": 2}])
    raw = (await client.post("/v1/chat/completions", json=STREAM)).content
    head, _, tail = raw.rpartition(b"\n\n")
    assert head.count(b"\n\n") == 1  # two complete events precede it
    assert len(tail) == 200_000 and tail.startswith(b"data: xxx")


@pytest.mark.parametrize(
    "bad",
    [
        {"status": 503},
        [{"nope": 1}],
        [{"status": "503"}],
        [{"times": -1}],
        [{"retryable": "yes"}],
        [{"status": 42}],
        [1],
    ],
)
async def test_invalid_faults_rejected(client: httpx.AsyncClient, bad: object) -> None:
    assert (await client.put("/test-control/faults", json=bad)).status_code == 400


async def test_stop_is_prompt_with_stalled_stream(make_mock: MakeMock) -> None:
    server = await make_mock()
    async with httpx.AsyncClient(base_url=server.base_url, timeout=5) as c:
        await _set_faults(c, [{"stall_after_events": 0}])
        async with c.stream("POST", "/v1/chat/completions", json=STREAM) as resp:
            assert resp.status_code == 200
            start = time.monotonic()
            await asyncio.wait_for(server.stop(), 3)
            assert time.monotonic() - start < 2
    assert server.state.recorder.cancelled == 1
