"""The upstream pool against real sockets: connections kept per target, the per-target cap (wait
in turn, then 503 upstream_busy), idle connections reaped, and the one safe retry of a request
written into a kept-alive connection the engine had just closed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
import pytest

from pylon.app import start
from pylon.core.plan import ForwardPlan
from pylon.core.priority import NO_WRITE
from pylon.core.target import UpstreamTarget
from pylon.logs import configure_logging
from pylon.settings import load_settings
from pylon.upstream.pool import UpstreamBusy, UpstreamPool
from tests.integration.conftest import read_request

RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


@dataclass
class Engine:
    """A tiny HTTP/1.1 engine: counts connections and requests, can hold or drop requests."""

    port: int = 0
    connections: int = 0
    requests: list[int] = field(default_factory=list)  # connection number of each request
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    hold: bool = False
    drop_second_request: bool = False
    arrived: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def wait_requests(self, count: int) -> None:
        async with self.arrived:
            await asyncio.wait_for(self.arrived.wait_for(lambda: len(self.requests) >= count), 5)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        served = 0
        try:
            while True:
                await read_request(reader)
                self.requests.append(number)
                async with self.arrived:
                    self.arrived.notify_all()
                served += 1
                if self.drop_second_request and served == 2:
                    # The keep-alive race: the engine closes the idle connection just as pylon
                    # writes the next request into it; not a byte of response.
                    writer.transport.abort()
                    return
                if self.hold:
                    await self.release.wait()
                writer.write(RESPONSE)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed.set()
            writer.close()


@contextlib.asynccontextmanager
async def engine_server(engine: Engine) -> AsyncIterator[Engine]:
    server = await asyncio.start_server(engine.handle, "127.0.0.1", 0)
    engine.port = server.sockets[0].getsockname()[1]
    try:
        yield engine
    finally:
        server.close()


def plan_for(target: UpstreamTarget) -> ForwardPlan:
    return ForwardPlan(
        "POST", "/v1/x", ((b"x-request-id", b"r"),), b"{}", "r", "m", False, (), NO_WRITE, target
    )


async def exchange(pool: UpstreamPool, target: UpstreamTarget) -> int:
    ex = await pool.send(plan_for(target))
    await ex.head
    while await ex.next_chunk() is not None:
        pass
    pool.finish(ex)
    return ex.status


async def test_connections_are_kept_per_target() -> None:
    async with engine_server(Engine()) as one, engine_server(Engine()) as two:
        pool = UpstreamPool(connect_timeout=2, idle_timeout=5, max_idle=8)
        first, second = (UpstreamTarget("127.0.0.1", e.port, "") for e in (one, two))
        for _ in range(3):
            assert await exchange(pool, first) == 200
            assert await exchange(pool, second) == 200
        assert (one.connections, two.connections) == (1, 1)
        assert pool.idle_connections(first) == pool.idle_connections(second) == 1
        pool.close()


async def test_requests_above_the_cap_wait_for_a_free_connection() -> None:
    engine = Engine(hold=True)
    async with engine_server(engine):
        pool = UpstreamPool(connect_timeout=2, idle_timeout=5, max_idle=8, max_connections=2)
        target = UpstreamTarget("127.0.0.1", engine.port, "")
        tasks = [asyncio.create_task(exchange(pool, target)) for _ in range(5)]
        await engine.wait_requests(2)
        assert pool.open_connections(target) == 2
        engine.release.set()
        assert await asyncio.gather(*tasks) == [200] * 5
        assert engine.connections == 2, "the cap was exceeded"
        pool.close()


async def test_a_request_that_waits_too_long_is_upstream_busy() -> None:
    engine = Engine(hold=True)
    async with engine_server(engine):
        pool = UpstreamPool(
            connect_timeout=2, idle_timeout=5, max_idle=8, max_connections=1, queue_timeout=0.05
        )
        target = UpstreamTarget("127.0.0.1", engine.port, "")
        held = asyncio.create_task(exchange(pool, target))
        await engine.wait_requests(1)
        with pytest.raises(UpstreamBusy):
            await pool.send(plan_for(target))
        engine.release.set()
        assert await held == 200
        assert pool.open_connections(target) == 1
        pool.close()


async def test_idle_connections_are_reaped_on_the_idle_timeout() -> None:
    engine = Engine()
    async with engine_server(engine):
        pool = UpstreamPool(connect_timeout=2, idle_timeout=0.2, max_idle=8)
        target = UpstreamTarget("127.0.0.1", engine.port, "")
        assert await exchange(pool, target) == 200
        assert pool.idle_connections(target) == 1
        # The engine sees pylon close the connection, without any new request to trigger it.
        await asyncio.wait_for(engine.closed.wait(), 5)
        assert pool.idle_connections(target) == 0 and pool.open_connections(target) == 0
        pool.close()


@pytest.fixture
async def pylon_in_front_of() -> AsyncIterator[Callable[[Engine], object]]:
    configure_logging("json", "warning")
    async with contextlib.AsyncExitStack() as exits:

        async def factory(engine: Engine) -> str:
            await exits.enter_async_context(engine_server(engine))
            settings = load_settings(
                {
                    "listen": "127.0.0.1:0",
                    "upstream": f"http://127.0.0.1:{engine.port}",
                    "log_level": "warning",
                    # The engine answers every request alike: no health gate, a static model.
                    "upstream_health_gate": False,
                    "model": ["m"],
                }
            )
            running = await exits.enter_async_context(start(settings))
            return running.url

        yield factory


async def test_a_request_written_into_a_just_closed_connection_is_sent_once_more(
    pylon_in_front_of: Callable[[Engine], object],
) -> None:
    engine = Engine(drop_second_request=True)
    url = await pylon_in_front_of(engine)  # type: ignore[misc]
    headers = {"x-request-id": "r", "x-model": "m"}
    async with httpx.AsyncClient(timeout=5) as client:
        for _ in range(2):
            reply = await client.post(f"{url}/v1/chat/completions", json={}, headers=headers)
            assert reply.status_code == 200, reply.text
    # First request on connection 1; the second went into connection 1 (dropped unanswered)
    # and again, on connection 2.
    assert engine.requests == [1, 1, 2]
