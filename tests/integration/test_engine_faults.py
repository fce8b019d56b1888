"""A broken or hostile engine, seen through every transport: each misbehaviour ends in a clear
answer to the client (a 502 problem, or a cut stream when the head is already out), never in a
traceback, a hang, or bytes the engine was not asked for reaching the client."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import tracemalloc
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from aioquic.h3.connection import ErrorCode

from pylon.core.record import RequestRecord
from pylon.core.upstream import Upstream
from pylon.observe import LogObserver
from pylon.upstream.connection import MAX_RESPONSE_FIELDS
from pylon.upstream.probe import FetchError, fetch
from tests.h3client import request_headers
from tests.integration.conftest import read_request
from tests.stack import MODEL, NO_BRINGUP, PROTOCOLS, Stack, StackFactory

CHAT = "/v1/chat/completions"
BODY = json.dumps({"model": MODEL, "messages": [], "max_tokens": 2}).encode()
OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


@dataclass(frozen=True)
class Pieces:
    """A reply written piece by piece, each piece drained before the next (so the engine holds
    one piece, not the whole reply); `then`: how the engine ends it."""

    pieces: Callable[[], Iterator[bytes]]
    then: str = "keep"  # "keep" the socket, "close" it (FIN), "reset" it (RST)


Script = list[bytes | Pieces | None]


@dataclass
class ScriptedEngine:
    """Answers each request with the next scripted bytes; `None` = stall (keep the socket)."""

    script: Script
    port: int = 0
    connections: int = 0
    closed: int = 0
    sent: int = 0  # bytes of `Pieces` replies written (and drained)
    answered: asyncio.Event = field(default_factory=asyncio.Event)
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # a connection ended

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                await read_request(reader)
                reply = self.script.pop(0) if self.script else OK
                if isinstance(reply, Pieces):
                    await self._write_pieces(reply, writer)
                elif reply is not None:
                    writer.write(reply)
                    await writer.drain()
                self.answered.set()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed += 1
            self.gone.set()
            writer.close()

    async def _write_pieces(self, reply: Pieces, writer: asyncio.StreamWriter) -> None:
        for piece in reply.pieces():
            writer.write(piece)
            await writer.drain()
            self.sent += len(piece)
        if reply.then == "reset":
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            raise ConnectionResetError
        if reply.then == "close":
            raise ConnectionResetError  # (the handler's `finally` closes: a FIN)


@pytest.fixture
async def engine() -> AsyncIterator[Callable[[Script], object]]:
    servers: list[asyncio.Server] = []

    async def factory(script: Script) -> ScriptedEngine:
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
    engine: Callable[[Script], object],
    script: Script,
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
    engine: Callable[[Script], object],
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
    make_stack: StackFactory, engine: Callable[[Script], object], protocol: str
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
    make_stack: StackFactory, engine: Callable[[Script], object], protocol: str
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
    make_stack: StackFactory, engine: Callable[[Script], object], protocol: str
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
    make_stack: StackFactory, engine: Callable[[Script], object], protocol: str
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


HUGE = 8 * 1024 * 1024  # one header value, 140 times the 60 KiB head cap
PIECE = 64 * 1024


def one_huge_header_line() -> Iterator[bytes]:
    yield b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-huge: "
    for _ in range(HUGE // PIECE):
        yield b"v" * PIECE
    yield b"\r\ncontent-length: 2\r\n\r\n{}"


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_one_huge_engine_header_line_is_a_502_before_it_is_buffered(
    make_stack: StackFactory, engine: Callable[[Script], object], protocol: str
) -> None:
    """The head cap holds for one endless field too: llhttp's callbacks see a value only once
    it ends, so pylon counts the head's bytes as they arrive and cuts the engine off at the
    cap, with the documented 502, long before the engine has sent its 8 MiB line, and holding
    a small fraction of it."""
    stack, scripted = await stack_before(make_stack, engine, [Pieces(one_huge_header_line)])
    tracemalloc.start()
    try:
        reply = await stack.send(protocol, CHAT, headers("huge-1"), BODY)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert reply.status == 502, reply
    assert reply.json()["code"] == "upstream_protocol_error"
    assert "x-huge" not in reply.headers
    # Cut off before the line ended (what was sent beyond the cap sat in the kernel's buffers).
    assert scripted.sent < HUGE, scripted.sent
    # Everything this process allocated meanwhile (pylon, the client, the engine's one piece):
    # far below the line's size.
    assert peak < HUGE // 4, peak


def endless_interim_heads() -> Iterator[bytes]:
    interim = b"HTTP/1.1 100 Continue\r\n\r\n"
    for _ in range(HUGE // PIECE):
        yield interim * (PIECE // len(interim))


def endless_tiny_fields() -> Iterator[bytes]:
    yield b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
    for _ in range(HUGE // PIECE):
        yield b"a: b\r\n" * (PIECE // 6)


def endless_chunk_extension() -> Iterator[bytes]:
    yield b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    yield b"1;ext="
    for _ in range(HUGE // PIECE):
        yield b"e" * PIECE


ENDLESS_SHAPES = {
    "interim_heads": endless_interim_heads,
    "tiny_fields": endless_tiny_fields,
    "chunk_extension": endless_chunk_extension,
}


@pytest.mark.parametrize("shape", sorted(ENDLESS_SHAPES))
@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_every_shape_of_endless_engine_framing_is_cut_as_it_arrives(
    make_stack: StackFactory, engine: Callable[[Script], object], protocol: str, shape: str
) -> None:
    """The byte count holds whatever shape the bytes take: a flood of `100 Continue` heads,
    thousands of tiny fields, a chunk extension that never ends. Before a head: the 502; after
    it: a cut response. Either way the engine is cut off long before it has sent it all."""
    script = [Pieces(ENDLESS_SHAPES[shape])]
    stack, scripted = await stack_before(make_stack, engine, script)
    tracemalloc.start()
    try:
        if shape == "chunk_extension" and protocol == "h3":
            async with stack.connect() as client:
                wire = request_headers("POST", CHAT, headers("endless-h3"), BODY)
                response = await client.send(wire, BODY).wait(10)
            # Reset, with or without the head (it may still have been queued): never complete.
            assert response.reset_code == ErrorCode.H3_INTERNAL_ERROR, response
        elif shape == "chunk_extension":
            await send_expecting_a_cut(stack, protocol, f"endless-{shape}")
        else:
            reply = await stack.send(protocol, CHAT, headers(f"endless-{shape}"), BODY)
            assert reply.status == 502, reply
            assert reply.json()["code"] == "upstream_protocol_error"
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert scripted.sent < HUGE, scripted.sent
    assert peak < HUGE // 4, peak


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_an_engine_head_over_the_field_count_is_502(
    make_stack: StackFactory, engine: Callable[[Script], object], protocol: str
) -> None:
    """A head far under the byte cap in more fields than any engine sends: each field costs
    pylon a tuple, so the count is capped too (the 502, not a relayed head)."""
    fields = b"".join(b"x-f%d: v\r\n" % n for n in range(MAX_RESPONSE_FIELDS + 1))
    reply = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + fields
    stack, _ = await stack_before(make_stack, engine, [reply + b"content-length: 2\r\n\r\n{}"])
    answer = await stack.send(protocol, CHAT, headers("many-fields"), BODY)
    assert answer.status == 502, answer
    assert answer.json()["code"] == "upstream_protocol_error"
    # The same count of fields less one is an engine's business: relayed.
    fewer = b"".join(b"x-f%d: v\r\n" % n for n in range(MAX_RESPONSE_FIELDS - 3))
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + fewer
    stack, _ = await stack_before(make_stack, engine, [head + b"content-length: 2\r\n\r\n{}"])
    answer = await stack.send(protocol, CHAT, headers("fewer-fields"), BODY)
    assert answer.status == 200, answer


def one_huge_trailer_line() -> Iterator[bytes]:
    yield b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    yield b"2\r\n{}\r\n0\r\nx-huge-trailer: "
    for _ in range(HUGE // PIECE):
        yield b"v" * PIECE
    yield b"\r\n\r\n"


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_one_huge_engine_trailer_line_cuts_the_stream_before_it_is_buffered(
    make_stack: StackFactory, engine: Callable[[Script], object], protocol: str
) -> None:
    """After the body, the bytes up to the next body piece (here: trailers) are held to the
    same cap as the head: the relayed response is cut, never completed, and the engine is cut
    off long before its 8 MiB trailer ends."""
    stack, scripted = await stack_before(make_stack, engine, [Pieces(one_huge_trailer_line)])
    tracemalloc.start()
    try:
        await send_expecting_a_cut(stack, protocol, "trailer-1")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert scripted.sent < HUGE, scripted.sent
    assert peak < HUGE // 4, peak


async def test_the_probe_counts_one_huge_header_line_as_it_arrives(
    engine: Callable[[Script], object],
) -> None:
    """The health gate's and model discovery's probe (`pylon.upstream.probe.fetch`) holds its
    head to the same cap, counted per read: a `too_large` failure, not 8 MiB buffered."""
    scripted = await engine([Pieces(one_huge_header_line)])  # type: ignore[misc]
    assert isinstance(scripted, ScriptedEngine)
    upstream = Upstream.from_url(f"http://127.0.0.1:{scripted.port}")
    tracemalloc.start()
    try:
        with pytest.raises(FetchError) as failure:
            await fetch(upstream, "/v1/models", timeout=10, max_body=1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert failure.value.reason == "too_large"
    assert peak < HUGE // 4, peak


# Every way a client reaches pylon: HTTP/1.1 kept alive, HTTP/1.1 with `connection: close` (the
# response then ends the connection), HTTP/2, HTTP/3.
CLIENTS = ("http1", "http1-close", "h2", "h3")
JSON_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
# Engine responses cut short: each promises more than it sends, then the engine closes (FIN).
TRUNCATED = {
    "content-length": JSON_HEAD + b'content-length: 100\r\n\r\n{"abc"',
    "chunked": JSON_HEAD + b'transfer-encoding: chunked\r\n\r\n6\r\n{"abc"\r\n',
    "chunked-mid-chunk": JSON_HEAD + b'transfer-encoding: chunked\r\n\r\n64\r\n{"abc"',
}
# Without a length or chunking, the body runs to the engine's close (RFC 9112 6.3): a FIN ends it.
CLOSE_DELIMITED = JSON_HEAD + b"\r\n" + b'{"abc": 1}'


class Records(LogObserver):
    """The record of every exchange, as observers (logs, metrics) read it at its end."""

    def __init__(self) -> None:
        super().__init__()
        self.done: list[RequestRecord] = []
        self.ended = asyncio.Event()

    def complete(self, record: RequestRecord) -> None:
        super().complete(record)
        self.done.append(record)
        self.ended.set()

    async def last(self) -> RequestRecord:
        async with asyncio.timeout(5):
            await self.ended.wait()
        return self.done[-1]


@dataclass
class Answer:
    status: int
    body: bytes
    complete: bool  # the client read a complete response (False: cut, by framing or a reset)


async def ask(stack: Stack, client: str, request_id: str, body: bytes = BODY) -> Answer:
    """One request as `client` (see CLIENTS) and what that client can tell of the answer."""
    fields = headers(request_id)
    if client == "h3":
        async with stack.connect() as h3:
            wire = request_headers("POST", CHAT, fields, body)
            response = await h3.send(wire, body).wait(10)
        assert response.reset_code in (None, ErrorCode.H3_INTERNAL_ERROR), response.reset_code
        return Answer(response.status or 0, response.body, response.reset_code is None)
    if client == "http1-close":
        fields.append(("connection", "close"))
    protocol = "h2" if client == "h2" else "http1"
    url = f"{stack.pylon_url}{CHAT}"
    async with (
        httpx.AsyncClient(http1=protocol == "http1", http2=protocol == "h2") as http,
        http.stream("POST", url, headers=fields, content=body) as r,
    ):
        got = bytearray()
        try:
            async for piece in r.aiter_raw():
                got += piece
        except httpx.RemoteProtocolError:
            # An HTTP/1.1 body short of its content-length or of its last chunk, a reset
            # connection, an HTTP/2 RST_STREAM.
            return Answer(r.status_code, bytes(got), complete=False)
        return Answer(r.status_code, bytes(got), complete=True)


def pieces_then(reply: bytes, then: str) -> Pieces:
    return Pieces(lambda: iter((reply,)), then)


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("framing", sorted(TRUNCATED))
async def test_a_truncated_engine_body_is_never_complete_for_any_client(
    make_stack: StackFactory, engine: Callable[[Script], object], client: str, framing: str
) -> None:
    """An engine that promises more body than it sends and closes: the client gets the head
    and the bytes that came, and a response it can tell is cut (HTTP/1.1: short of its
    content-length or its last chunk, also with `connection: close`; HTTP/2 and HTTP/3: the
    stream reset), never a clean end; the record says how it ended."""
    records = Records()
    script: Script = [pieces_then(TRUNCATED[framing], "close")]
    stack, _ = await stack_before(make_stack, engine, script, observer=records)
    answer = await ask(stack, client, "cut-1")
    assert answer.status == 200
    assert not answer.complete, answer
    assert answer.body in (b"", b'{"abc"'), answer  # (HTTP/3: a reset may overtake the data)
    record = await records.last()
    assert (record.status, record.outcome) == (200, "upstream_broken_mid_body")


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_close_delimited_engine_body_ends_at_the_engines_fin(
    make_stack: StackFactory, engine: Callable[[Script], object], client: str
) -> None:
    """Without a length or chunking, the engine's body ends where its connection does (RFC 9112
    6.3): a FIN is its legitimate end, and the client gets a complete response (re-framed as
    its transport frames an unknown length)."""
    records = Records()
    script: Script = [pieces_then(CLOSE_DELIMITED, "close")]
    stack, _ = await stack_before(make_stack, engine, script, observer=records)
    answer = await ask(stack, client, "fin-1")
    assert (answer.status, answer.body, answer.complete) == (200, b'{"abc": 1}', True)
    record = await records.last()
    assert (record.status, record.outcome) == (200, "ok")


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_close_delimited_engine_body_ended_by_a_reset_is_cut(
    make_stack: StackFactory, engine: Callable[[Script], object], client: str
) -> None:
    """The same body ended by a reset (RST) instead of a FIN is cut short: never complete."""
    records = Records()
    script: Script = [pieces_then(CLOSE_DELIMITED, "reset")]
    stack, _ = await stack_before(make_stack, engine, script, observer=records)
    answer = await ask(stack, client, "rst-1")
    assert not answer.complete, answer
    record = await records.last()
    assert record.outcome in ("upstream_broken_mid_body", "upstream_protocol_error"), record


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_truncated_event_stream_ends_in_an_error_event_and_an_error_outcome(
    make_stack: StackFactory, engine: Callable[[Script], object], client: str
) -> None:
    """An event stream the engine cuts (its chunked body short of its last chunk): the client
    gets the events that came and pylon's terminal `event: error`, in a response that ends
    cleanly (the error is in the stream, where an SSE client reads it); never a stream that
    just ends as if complete. The record says `upstream_protocol_error`."""
    records = Records()
    event = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
    cut = SSE_HEAD + b"transfer-encoding: chunked\r\n\r\n%x\r\n%b\r\n" % (len(event), event)
    stack, _ = await stack_before(make_stack, engine, [pieces_then(cut, "close")], observer=records)
    streamed = json.dumps({"model": MODEL, "messages": [], "stream": True}).encode()
    answer = await ask(stack, client, "sse-1", streamed)
    assert answer.status == 200
    assert answer.body.startswith(event), answer
    assert b"event: error" in answer.body, answer
    record = await records.last()
    assert (record.status, record.outcome) == (200, "upstream_protocol_error")


async def ask_http10(stack: Stack, request_id: str) -> tuple[bytes, bool]:
    """One HTTP/1.0 request on a raw socket: everything read, and whether the connection ended
    with a FIN (True) or a reset (False)."""
    host, port = stack.pylon_address
    reader, writer = await asyncio.open_connection(host, port)
    head = b"POST %b HTTP/1.0\r\nhost: pylon\r\nx-request-id: %b\r\nx-model: %b\r\n" % (
        CHAT.encode(),
        request_id.encode(),
        MODEL.encode(),
    )
    writer.write(head + b"content-length: %d\r\n\r\n%b" % (len(BODY), BODY))
    got = bytearray()
    try:
        async with asyncio.timeout(10):
            while piece := await reader.read(65536):
                got += piece
    except ConnectionResetError:
        return bytes(got), False
    finally:
        writer.close()
    return bytes(got), True


async def test_an_http10_client_sees_a_cut_body_as_a_reset_and_a_whole_one_as_a_fin(
    make_stack: StackFactory, engine: Callable[[Script], object]
) -> None:
    """HTTP/1.0 has no chunked coding: a body of unknown length ends with the connection. A
    whole one ends with a FIN; one the engine cut ends with a reset (RST), which no HTTP/1.0
    client reads as a complete answer."""
    cut = pieces_then(TRUNCATED["chunked"], "close")
    whole = pieces_then(CLOSE_DELIMITED, "close")
    stack, _ = await stack_before(make_stack, engine, [cut, whole])
    got, fin = await ask_http10(stack, "h10-cut")
    assert got.startswith(b"HTTP/1.1 200 "), got
    assert b"transfer-encoding" not in got.lower()
    assert not fin, "a cut body ended with a FIN, as a complete one does"
    got, fin = await ask_http10(stack, "h10-whole")
    assert got.startswith(b"HTTP/1.1 200 ") and got.endswith(b'\r\n\r\n{"abc": 1}'), got
    assert fin


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_an_engine_that_never_sends_its_head_is_a_504_on_the_head_timeout(
    make_stack: StackFactory, engine: Callable[[Script], object], protocol: str, stream: bool
) -> None:
    """Every request's response head is due within --response-head-timeout of its dispatch, a
    whole response's as a stream's (whose first output has its own, here longer, timeout): the
    client gets the 504 `upstream_timeout`, and the engine's connection is closed, so the
    engine hears that pylon gave up."""
    timeout, later = 0.3, 60.0
    records = Records()
    stack, scripted = await stack_before(
        make_stack,
        engine,
        [None],
        observer=records,
        response_head_timeout=timeout,
        first_output_timeout=later,
    )
    body = json.dumps({"model": MODEL, "messages": [], "stream": stream}).encode()
    loop = asyncio.get_running_loop()
    started = loop.time()
    reply = await stack.send(protocol, CHAT, headers("head-1"), body)
    # On the head timeout, not the later one: the bound sits between the two, far from both
    # (an HTTP/3 send includes its QUIC handshake; a busy CI box once took 3.2 s in all).
    assert loop.time() - started < later / 4
    assert reply.status == 504, reply
    assert reply.json()["code"] == "upstream_timeout"
    assert reply.json()["request_id"] == "head-1"
    record = await records.last()
    assert (record.status, record.outcome) == (504, "upstream_timeout")
    async with asyncio.timeout(5):
        await scripted.gone.wait()  # the engine sees its connection close
