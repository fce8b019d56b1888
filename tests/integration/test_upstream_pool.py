"""The upstream pool against real sockets: connections kept per target, the per-target cap (wait
in turn, then 503 upstream_busy), idle connections reaped, the one safe retry of a request
written into a kept-alive connection the engine had just closed, and streamed responses
acknowledged at once (an engine with Nagle on, like the Dynamo frontend, would otherwise hold
its first event ~40 ms behind the head)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

import httpx
import pytest

from pylon.core.plan import ForwardPlan
from pylon.core.priority import NO_WRITE
from pylon.core.upstream import Upstream
from pylon.logs import configure_logging
from pylon.run import start
from pylon.settings import load_settings
from pylon.upstream.pool import PoolOptions, UpstreamBusy, UpstreamPool
from tests.integration.conftest import read_request

POOL = PoolOptions(connect_timeout=2, idle_timeout=5, max_idle=8)
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


def plan_for(target: Upstream) -> ForwardPlan:
    return ForwardPlan(
        "POST", "/v1/x", ((b"x-request-id", b"r"),), b"{}", "r", "m", False, (), NO_WRITE, target
    )


async def exchange(pool: UpstreamPool, target: Upstream) -> int:
    ex = await pool.send(plan_for(target))
    await ex.head
    while await ex.next_chunk() is not None:
        pass
    pool.finish(ex)
    return ex.status


async def test_connections_are_kept_per_target() -> None:
    async with engine_server(Engine()) as one, engine_server(Engine()) as two:
        pool = UpstreamPool(POOL)
        first, second = (Upstream("127.0.0.1", e.port, "") for e in (one, two))
        for _ in range(3):
            assert await exchange(pool, first) == 200
            assert await exchange(pool, second) == 200
        assert (one.connections, two.connections) == (1, 1)
        assert pool.idle_connections(first) == pool.idle_connections(second) == 1
        pool.close()


async def test_requests_above_the_cap_wait_for_a_free_connection() -> None:
    engine = Engine(hold=True)
    async with engine_server(engine):
        pool = UpstreamPool(replace(POOL, max_connections=2))
        target = Upstream("127.0.0.1", engine.port, "")
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
        pool = UpstreamPool(replace(POOL, max_connections=1, queue_timeout=0.05))
        target = Upstream("127.0.0.1", engine.port, "")
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
        pool = UpstreamPool(replace(POOL, idle_timeout=0.2))
        target = Upstream("127.0.0.1", engine.port, "")
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
            reply = await client.post(
                f"{url}/v1/chat/completions", json={"model": "m"}, headers=headers
            )
            assert reply.status_code == 200, reply.text
    # First request on connection 1; the second went into connection 1 (dropped unanswered)
    # and again, on connection 2.
    assert engine.requests == [1, 1, 2]


STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
EVENT = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'


@dataclass
class NagleEngine:
    """Streams an SSE response in separate small writes with Nagle's algorithm on (no
    TCP_NODELAY), as the Dynamo 1.6.1 frontend does; after the head it waits for `go`."""

    port: int = 0
    go: asyncio.Queue[None] = field(default_factory=asyncio.Queue)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)
        try:
            while True:
                await read_request(reader)
                writer.write(STREAM_HEAD)
                await writer.drain()
                await self.go.get()
                for piece in (EVENT, b"data: [DONE]\n\n"):
                    writer.write(b"%x\r\n%b\r\n" % (len(piece), piece))
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="TCP_QUICKACK and delayed-ACK modes are Linux's"
)
async def test_a_streamed_response_is_acknowledged_at_once_on_a_kept_alive_connection() -> None:
    """Linux delays the ACK of a small segment (40 ms at least) on a connection in "ping-pong"
    mode, which a kept-alive connection enters when pylon writes its next request right after
    a response. An engine with Nagle on then holds the event it writes after the head until that
    ACK: the ~40 ms stall of cache hits in front of the Dynamo frontend. Once a streamed
    response's head is read, the connection must be out of ping-pong mode (what getsockopt
    TCP_QUICKACK reports on Linux), so every read of the stream is acknowledged at once."""
    engine = NagleEngine()
    server = await asyncio.start_server(engine.handle, "127.0.0.1", 0)
    engine.port = server.sockets[0].getsockname()[1]
    pool = UpstreamPool(POOL)
    target = Upstream("127.0.0.1", engine.port, "")
    quick_after_head = []
    try:
        for _ in range(5):  # some kernels enter ping-pong mode only after 3 such exchanges
            ex = await pool.send(plan_for(target))
            await ex.head
            sock = ex.connection.transport.get_extra_info("socket")  # type: ignore[union-attr]
            quick_after_head.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK))
            engine.go.put_nowait(None)
            body = b""
            while (chunk := await ex.next_chunk()) is not None:
                body += chunk
            assert body.endswith(b"data: [DONE]\n\n")
            pool.finish(ex)
        assert pool.open_connections(target) == 1, "the exchanges shared one connection"
        assert quick_after_head == [1] * 5, "a streamed response's head waits on a delayed ACK"
    finally:
        pool.close()
        server.close()


class CountingSocket:
    """Wraps a transport's socket and records the options set on it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.set: list[tuple[int, int, int]] = []

    def setsockopt(self, level: int, option: int, value: int) -> None:
        self.set.append((level, option, value))
        self.sock.setsockopt(level, option, value)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_QUICKACK is Linux's")
async def test_a_response_complete_in_its_first_read_costs_no_ack_syscall() -> None:
    """The ACK push is for responses that go on after their first read (streams); the common
    small response, head and body in one read, costs no syscall."""
    engine = Engine()
    async with engine_server(engine):
        pool = UpstreamPool(POOL)
        target = Upstream("127.0.0.1", engine.port, "")
        assert await exchange(pool, target) == 200
        conn = pool._upstreams[target.label].idle[0]  # keyed by label
        counting = CountingSocket(conn._sock)  # type: ignore[arg-type]
        conn._sock = counting  # type: ignore[assignment]
        for _ in range(3):
            assert await exchange(pool, target) == 200
        assert counting.set == []
        pool.close()
