"""Client disconnects are recorded promptly as cancellations."""

from __future__ import annotations

import asyncio
import time

import httpx
import orjson
import pytest

from tests.cancellation import cancellation_lag_for, wait_for_record
from tests.mock_dynamo.conftest import MakeMock, snapshot


async def test_disconnect_mid_stream_sets_cancelled_at(make_mock: MakeMock) -> None:
    server = await make_mock(token_delay_ms=50, num_tokens=200)
    body = orjson.dumps(
        {"model": "mock-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-request-id: raw-1\r\n"
        b"Content-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    await writer.drain()
    buf = b""
    while buf.count(b"data: ") < 2:
        buf += await asyncio.wait_for(reader.read(4096), 2)
    writer.close()
    closed_at = time.time()
    async with httpx.AsyncClient(base_url=server.base_url, timeout=5) as c:
        assert await cancellation_lag_for(c, server.base_url, "raw-1", since=closed_at) < 0.1
        record = await wait_for_record(c, server.base_url, "raw-1", "cancelled")
        counters = (await snapshot(c))["counters"]
    assert record["completed_at"] is None and record["status"] == 200
    assert counters["cancelled"] == 1


async def test_disconnect_before_headers_records_499(make_mock: MakeMock) -> None:
    server = await make_mock(ttft_ms=5000)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=5) as c:
        with_timeout = httpx.Timeout(5, read=0.2)
        with pytest.raises(httpx.ReadTimeout):
            await c.post(
                "/v1/chat/completions",
                timeout=with_timeout,
                json={"model": "mock-model", "messages": []},
                headers={"x-request-id": "early-1"},
            )
        record = await wait_for_record(c, server.base_url, "early-1", "finished")
    assert record["cancelled_at"] is not None
    assert record["status"] == 499 and record["completed_at"] is None
