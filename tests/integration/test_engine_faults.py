"""A broken or hostile engine, seen through every transport: each misbehaviour ends in a clear
answer to the client (a 502 problem, or a cut stream when the head is already out), never in a
traceback, a hang, or bytes the engine was not asked for reaching the client."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
import pytest
from aioquic.h3.connection import ErrorCode

from tests.h3client import request_headers
from tests.integration.conftest import read_request
from tests.stack import MODEL, NO_BRINGUP, PROTOCOLS, Stack, StackFactory

CHAT = "/v1/chat/completions"
BODY = json.dumps({"model": MODEL, "messages": [], "max_tokens": 2}).encode()
OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


@dataclass
class ScriptedEngine:
    """Answers each request with the next scripted bytes; `None` = stall (keep the socket)."""

    script: list[bytes | None]
    port: int = 0
    connections: int = 0
    closed: int = 0
    answered: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                await read_request(reader)
                reply = self.script.pop(0) if self.script else OK
                if reply is not None:
                    writer.write(reply)
                    await writer.drain()
                self.answered.set()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed += 1
            writer.close()


@pytest.fixture
async def engine() -> AsyncIterator[Callable[[list[bytes | None]], object]]:
    servers: list[asyncio.Server] = []

    async def factory(script: list[bytes | None]) -> ScriptedEngine:
        scripted = ScriptedEngine(script)
        server = await asyncio.start_server(scripted.handle, "127.0.0.1", 0)
        scripted.port = server.sockets[0].getsockname()[1]
        servers.append(server)
        return scripted

    yield factory
    for server in servers:
        server.close()


async def stack_before(
    make_stack: StackFactory,
    engine: Callable[[list[bytes | None]], object],
    script: list[bytes | None],
    **settings: object,
) -> tuple[Stack, ScriptedEngine]:
    scripted = await engine(script)  # type: ignore[misc]
    assert isinstance(scripted, ScriptedEngine)
    stack = await make_stack(upstream=f"http://127.0.0.1:{scripted.port}", **NO_BRINGUP, **settings)
    return stack, scripted


def headers(request_id: str) -> list[tuple[str, str]]:
    return [("x-request-id", request_id), ("x-model", MODEL)]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_an_engine_switching_protocols_is_502(
    make_stack: StackFactory,
    engine: Callable[[list[bytes | None]], object],
    protocol: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    upgrade = (
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n"
    )
    stack, _ = await stack_before(make_stack, engine, [upgrade + b"\x81\x00"])
    reply = await stack.send(protocol, CHAT, headers("up-1"), BODY)
    assert reply.status == 502, reply
    assert reply.json()["code"] == "upstream_protocol_error"
    assert reply.json()["request_id"] == "up-1"
    # Handled, not escaped: no unhandled-exception report from the event loop.
    assert not [r for r in caplog.records if r.name == "asyncio" and r.levelname == "ERROR"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_an_oversized_engine_response_head_is_502(
    make_stack: StackFactory, engine: Callable[[list[bytes | None]], object], protocol: str
) -> None:
    huge = b"HTTP/1.1 200 OK\r\n" + b"".join(
        b"x-filler-%d: %s\r\n" % (i, b"v" * 1000) for i in range(80)
    )
    stack, _ = await stack_before(make_stack, engine, [huge + b"content-length: 2\r\n\r\n{}"])
    reply = await stack.send(protocol, CHAT, headers("big-1"), BODY)
    assert reply.status == 502, reply
    assert reply.json()["code"] == "upstream_protocol_error"
    assert not any(name.startswith("x-filler") for name in reply.headers)


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_bytes_beyond_the_response_never_reach_the_client(
    make_stack: StackFactory, engine: Callable[[list[bytes | None]], object], protocol: str
) -> None:
    surplus = b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\nsurplus!"
    stack, scripted = await stack_before(make_stack, engine, [OK + surplus])
    first = await stack.send(protocol, CHAT, headers("s-1"), BODY)
    assert (first.status, first.body) == (200, b"{}")
    second = await stack.send(protocol, CHAT, headers("s-2"), BODY)
    assert (second.status, second.body) == (200, b"{}")
    # The connection that carried the surplus was never used again.
    assert scripted.connections == 2


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_body_that_stalls_after_the_head_is_cut_on_the_gap_timeout(
    make_stack: StackFactory, engine: Callable[[list[bytes | None]], object], protocol: str
) -> None:
    stalled = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{"
    gap = 0.3
    stack, scripted = await stack_before(make_stack, engine, [stalled], output_gap_timeout=gap)
    client = asyncio.create_task(send_expecting_a_cut(stack, protocol, "gap-1"))
    try:
        # The client keeps waiting; pylon, not the client, gives up on the stalled engine, within
        # a few gap timeouts (and far before the client's own 10 s timeout).
        async with asyncio.timeout(10 * gap):
            while scripted.closed == 0:
                await asyncio.sleep(0.01)
        await asyncio.wait_for(client, 5)
    finally:
        client.cancel()


async def send_expecting_a_cut(stack: Stack, protocol: str, request_id: str) -> None:
    """One request whose response pylon cuts after the head: the client must be able to tell
    (an HTTP/1.1 message short of its content-length, an HTTP/2 or HTTP/3 stream reset), so a
    cut body is never passed off as complete."""
    if protocol == "h3":
        async with stack.connect() as client:
            wire = request_headers("POST", CHAT, headers(request_id), BODY)
            response = await client.send(wire, BODY).wait(10)
        assert response.status == 200
        assert len(response.body) < 100
        assert response.reset_code == ErrorCode.H3_INTERNAL_ERROR, "the cut stream was not reset"
        return
    # httpx raises RemoteProtocolError for both an HTTP/1.1 body short of its content-length
    # and an HTTP/2 RST_STREAM; a complete-looking reply would return instead.
    with pytest.raises(httpx.RemoteProtocolError):
        await stack.send(protocol, CHAT, headers(request_id), BODY)


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_engine_retry_metadata_under_an_underscore_spelling_is_not_relayed(
    make_stack: StackFactory, engine: Callable[[list[bytes | None]], object], protocol: str
) -> None:
    twins = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx_stargate_retryable: true\r\n"
        b"x_stargate_retry_after_ms: 1\r\ncontent-length: 2\r\n\r\n{}"
    )
    stack, _ = await stack_before(make_stack, engine, [twins])
    reply = await stack.send(protocol, CHAT, headers("tw-1"), BODY)
    assert reply.status == 200
    names = {name.lower().replace("_", "-") for name in reply.headers}
    assert not {n for n in names if n.startswith("x-stargate-")}
