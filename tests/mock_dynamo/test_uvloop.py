"""Embedding under uvloop, the loop pylon runs on: disconnects and drops still work."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from mock_dynamo.server import MockConfig, start_mock
from tests.cancellation import cancellation_lag_for, wait_for_record

uvloop = pytest.importorskip("uvloop")
STREAM = {"model": "mock-model", "stream": True, "messages": []}


async def _scenario() -> None:
    server = await start_mock(MockConfig(token_delay_ms=50, num_tokens=200), port=0)
    try:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=5) as c:
            async with c.stream(
                "POST", "/v1/chat/completions", json=STREAM, headers={"x-request-id": "uv-1"}
            ) as resp:
                chunks = resp.aiter_bytes()
                buf = b""
                while buf.count(b"\n\n") < 2:
                    buf += await asyncio.wait_for(anext(chunks), 2)
            closed_at = time.time()
            assert await cancellation_lag_for(c, server.base_url, "uv-1", closed_at) < 0.1

            await c.put("/test-control/faults", json=[{"drop_after_events": 1}])
            with pytest.raises(httpx.TransportError):
                await c.post("/v1/chat/completions", json=STREAM, headers={"x-request-id": "uv-2"})
            record = await wait_for_record(c, server.base_url, "uv-2", "finished")
            assert record["cancelled_at"] is None and record["completed_at"] is not None
    finally:
        await asyncio.wait_for(server.stop(), 5)


def test_runs_under_uvloop() -> None:
    uvloop.run(_scenario())
