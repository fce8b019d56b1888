"""Real servers on 127.0.0.1 ephemeral ports: mock_dynamo and pylon, in the test's event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from mock_dynamo.server import MockConfig, MockServer, start_mock
from pylon.app import serve
from pylon.logs import configure_logging
from pylon.settings import load_settings

FLAVOR = {"dynamo": "dynamo", "passthrough": "dynamo", "vllm": "vllm", "sglang": "sglang"}
MODEL = "mock-model"


@dataclass
class Stack:
    pylon_url: str
    mock: MockServer
    client: httpx.AsyncClient

    @property
    def pylon_address(self) -> tuple[str, int]:
        host, port = self.pylon_url.removeprefix("http://").rsplit(":", 1)
        return host, int(port)

    async def control(self) -> dict[str, Any]:
        reply = await self.client.get(f"{self.mock.base_url}/test-control")
        reply.raise_for_status()
        data: dict[str, Any] = reply.json()
        return data

    async def last_request(self) -> dict[str, Any]:
        requests = (await self.control())["requests"]
        assert requests, "nothing reached the engine"
        last: dict[str, Any] = requests[-1]
        return last

    async def faults(self, faults: list[dict[str, Any]]) -> None:
        reply = await self.client.put(f"{self.mock.base_url}/test-control/faults", json=faults)
        reply.raise_for_status()

    async def knobs(self, **knobs: Any) -> None:
        reply = await self.client.put(f"{self.mock.base_url}/test-control/knobs", json=knobs)
        reply.raise_for_status()

    async def post(self, path: str, body: Any, headers: Any = None, **kw: Any) -> httpx.Response:
        merged = {"x-request-id": "req-1", "x-model": MODEL}
        if headers is not None:
            merged = headers if isinstance(headers, list) else {**merged, **headers}
        return await self.client.post(f"{self.pylon_url}{path}", json=body, headers=merged, **kw)


StackFactory = Callable[..., Awaitable[Stack]]


@pytest.fixture
async def make_stack() -> AsyncIterator[StackFactory]:
    """Start mock_dynamo and pylon with the given settings; everything stops at teardown."""
    configure_logging("json", "warning")
    cleanups: list[Callable[[], Awaitable[None]]] = []

    async def factory(
        backend: str = "dynamo", mock: dict[str, Any] | None = None, **settings: Any
    ) -> Stack:
        engine = await start_mock(
            MockConfig(flavor=FLAVOR[backend], models=(MODEL,), **(mock or {})),  # type: ignore[arg-type]
            host="127.0.0.1",
            port=0,
        )
        cleanups.append(engine.stop)
        config = load_settings(
            {
                "listen": "127.0.0.1:0",
                "upstream": engine.base_url,
                "backend": backend,
                "log_level": "warning",
                **settings,
            }
        )
        ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        stop = asyncio.Event()
        task = asyncio.create_task(
            serve(config, on_ready=ready.set_result, stop=stop, handle_signals=False)
        )

        async def stop_pylon() -> None:
            stop.set()
            await asyncio.wait_for(task, 5)

        cleanups.append(stop_pylon)
        address = await asyncio.wait_for(ready, 5)
        client = httpx.AsyncClient(timeout=10)
        cleanups.append(client.aclose)
        return Stack(pylon_url=f"http://{address}", mock=engine, client=client)

    yield factory
    for cleanup in reversed(cleanups):
        await cleanup()


async def raw_exchange(host: str, port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send raw bytes, read until the server closes (or the timeout): for malformed input."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(data)
        await writer.drain()
        chunks = []
        async with asyncio.timeout(timeout):
            while chunk := await reader.read(65536):
                chunks.append(chunk)
        return b"".join(chunks)
    finally:
        writer.close()


def header_values(record: dict[str, Any], name: str) -> list[str]:
    return [value for key, value in record["headers"] if key.lower() == name.lower()]
