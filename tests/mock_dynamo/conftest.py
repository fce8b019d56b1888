"""Fixtures: real mock servers on ephemeral 127.0.0.1 ports, in the test's loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import orjson
import pytest

from mock_dynamo.server import MockConfig, MockServer, start_mock

MakeMock = Callable[..., Awaitable[MockServer]]
CLIENT_TIMEOUT_S = 5.0


@pytest.fixture
async def make_mock() -> AsyncIterator[MakeMock]:
    """Factory starting servers with MockConfig overrides; all stopped at teardown."""
    servers: list[MockServer] = []

    async def factory(**overrides: Any) -> MockServer:
        server = await start_mock(MockConfig(**overrides), host="127.0.0.1", port=0)
        servers.append(server)
        return server

    yield factory
    for server in servers:
        await asyncio.wait_for(server.stop(), timeout=5)


@pytest.fixture
async def mock(make_mock: MakeMock) -> MockServer:
    return await make_mock()


@pytest.fixture
async def client(mock: MockServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=mock.base_url, timeout=CLIENT_TIMEOUT_S) as c:
        yield c


def sse_data(raw: str) -> list[str]:
    """`data:` payloads of a complete SSE body, in order."""
    out = []
    for block in raw.split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: "):
                out.append(line[len("data: ") :])
    return out


def sse_events(raw: str) -> list[tuple[str | None, Any]]:
    """(event name, parsed data) pairs; `[DONE]` is kept as the string."""
    out: list[tuple[str | None, Any]] = []
    for block in raw.split("\n\n"):
        name, data = None, None
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                payload = line[len("data: ") :]
                data = payload if payload == "[DONE]" else orjson.loads(payload)
        if data is not None:
            out.append((name, data))
    return out


async def snapshot(client: httpx.AsyncClient) -> dict[str, Any]:
    resp = await client.get("/test-control")
    assert resp.status_code == 200
    result: dict[str, Any] = resp.json()
    return result


async def raw_exchange(port: int, request: bytes, timeout_s: float = 5.0) -> bytes:
    """Send raw bytes and read until the server closes (use `Connection: close`)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()
