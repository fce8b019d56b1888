"""The drain (SIGTERM), seen from each transport's side of the wire: what is in flight finishes,
nothing new is taken, and every connection ends by itself once it has nothing left to finish.

`Stack.drain` starts the drain only (what SIGTERM does first); nothing here waits for the grace
period or the process to stop, so every close seen here is the drain's own doing.
tests/transport/test_shutdown.py runs the whole `pylon serve` stop, and
tests/transport/test_http3_isolation.py the HTTP/3 GOAWAY.
"""

from __future__ import annotations

import asyncio
import json

import hpack
from hyperframe.frame import (
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    RstStreamFrame,
    SettingsFrame,
)

from tests.observers import SeenObserver
from tests.stack import MODEL, Stack, StackFactory

CHAT = "/v1/chat/completions"
BODY = json.dumps({"model": MODEL, "messages": [], "max_tokens": 2}).encode()
SSE = json.dumps({"model": MODEL, "messages": [], "max_tokens": 10, "stream": True}).encode()
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
REFUSED_STREAM = 0x7
# Long enough that no close seen below can come from a connection timer.
QUIET = {"header_timeout": 60.0, "client_idle_timeout": 60.0}


def http1_request(request_id: str, body: bytes = BODY, path: str = CHAT) -> bytes:
    method = "POST" if body else "GET"
    head = (
        f"{method} {path} HTTP/1.1\r\nhost: x\r\nx-request-id: {request_id}\r\n"
        f"x-model: {MODEL}\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def read_to_close(reader: asyncio.StreamReader, timeout: float = 5.0) -> bytes:
    """Everything until pylon closes the connection; the timeout only bounds a failure."""
    async with asyncio.timeout(timeout):
        return await reader.read()


async def head_started(stack: Stack, writer: asyncio.StreamWriter, head: bytes) -> None:
    """Send the first bytes of a request head and wait until pylon has read them."""
    writer.write(head[:20])
    await writer.drain()
    async with asyncio.timeout(5):
        while stack.running.listeners.live.in_progress == 0:
            await asyncio.sleep(0)  # pylon runs in this loop: let it read the bytes


# --- HTTP/1.1 ---


async def test_health_arriving_during_the_drain_is_503(make_stack: StackFactory) -> None:
    """/health bypasses the contract, not the lifecycle: a probe must see pylon going away."""
    stack = await make_stack("dynamo", **QUIET)
    reader, writer = await asyncio.open_connection(*stack.pylon_address)
    head = http1_request("probe-1", b"", "/health")
    await head_started(stack, writer, head)
    stack.drain()
    writer.write(head[20:])
    reply = await read_to_close(reader)
    writer.close()
    status_line, _, rest = reply.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 503 Service Unavailable", reply[:200]
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["code"] == "shutting_down"
    assert await stack.records() == []


async def test_h1_request_completed_during_the_drain_is_answered_with_connection_close(
    make_stack: StackFactory,
) -> None:
    """Admitted before the drain, its body complete after: it is served, as the connection's
    last response, and says so."""
    observer = SeenObserver()
    stack = await make_stack("dynamo", observer=observer, **QUIET)
    reader, writer = await asyncio.open_connection(*stack.pylon_address)
    request = http1_request("late-body")  # keep-alive, as HTTP/1.1 is by default
    head, _, body = request.partition(b"\r\n\r\n")
    writer.write(head + b"\r\n\r\n")
    async with asyncio.timeout(5):
        await observer.admitted_event.wait()
    stack.drain()
    writer.write(body)
    reply = await read_to_close(reader)
    writer.close()
    response_head, _, payload = reply.partition(b"\r\n\r\n")
    assert response_head.startswith(b"HTTP/1.1 200 "), reply[:200]
    assert b"\r\nconnection: close" in response_head.lower(), response_head
    assert json.loads(payload)["choices"]


async def test_h1_drain_closes_after_the_response_in_flight_and_runs_no_more(
    make_stack: StackFactory,
) -> None:
    """A response that began before the drain (kept alive) finishes, then the connection closes;
    the pipelined request behind it was admitted but never runs (the client may retry it)."""
    stack = await make_stack("dynamo", mock={"token_delay_ms": 20, "num_tokens": 10}, **QUIET)
    reader, writer = await asyncio.open_connection(*stack.pylon_address)
    writer.write(http1_request("first", SSE) + http1_request("behind"))
    async with asyncio.timeout(5):
        first = await reader.readuntil(b"data:")  # the response is under way
    assert first.startswith(b"HTTP/1.1 200 ")
    assert b"connection: close" not in first.lower()
    stack.drain()
    rest = await read_to_close(reader)
    writer.close()
    assert rest.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), rest[-80:]
    assert b"HTTP/1.1" not in rest, "the pipelined request was answered"
    ids = [
        dict((k.lower(), v) for k, v in r["headers"])["x-request-id"] for r in await stack.records()
    ]
    assert ids == ["first"]


async def test_h1_idle_keep_alive_is_closed_at_once_on_drain(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", **QUIET)
    reader, writer = await asyncio.open_connection(*stack.pylon_address)
    writer.write(http1_request("before"))
    async with asyncio.timeout(5):
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
    assert head.startswith(b"HTTP/1.1 200 ")
    stack.drain()
    assert await read_to_close(reader) == b""
    writer.close()


async def test_tcp_connection_that_has_not_spoken_is_closed_on_drain(
    make_stack: StackFactory,
) -> None:
    """Before its first byte a TCP connection is neither HTTP/1.1 nor HTTP/2 yet."""
    stack = await make_stack("dynamo", **QUIET)
    reader, writer = await asyncio.open_connection(*stack.pylon_address)
    stack.drain()
    assert await read_to_close(reader) == b""
    writer.close()


# --- HTTP/2 ---


class RawH2:
    """HTTP/2 frames in and out with no connection state of its own: h2, as a client, drops
    every stream at a GOAWAY and refuses the frames after it, so it cannot show what pylon sends
    once its graceful GOAWAY is out."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()

    @classmethod
    async def connect(cls, address: tuple[str, int]) -> RawH2:
        reader, writer = await asyncio.open_connection(*address)
        writer.write(PREFACE + SettingsFrame(0).serialize())
        return cls(reader, writer)

    def request(self, stream_id: int, request_id: str, body: bytes) -> None:
        headers = [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", CHAT.encode()),
            (b":authority", b"127.0.0.1"),
            (b"x-request-id", request_id.encode()),
            (b"x-model", MODEL.encode()),
        ]
        block = self.encoder.encode(headers)
        self.writer.write(
            HeadersFrame(stream_id, data=block, flags=["END_HEADERS"]).serialize()
            + DataFrame(stream_id, data=body, flags=["END_STREAM"]).serialize()
        )

    async def frames_to_close(self, timeout: float = 5.0) -> list[Frame]:
        """Every frame until pylon closes the connection (HEADERS decoded into `.decoded`)."""
        frames: list[Frame] = []
        async with asyncio.timeout(timeout):
            while header := await self.reader.read(9):
                header += await self.reader.readexactly(9 - len(header))
                frame, length = Frame.parse_frame_header(memoryview(header))
                frame.parse_body(memoryview(await self.reader.readexactly(length)))
                if isinstance(frame, HeadersFrame):
                    frame.decoded = dict(self.decoder.decode(frame.data, raw=True))  # type: ignore[attr-defined]
                if isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
                    self.writer.write(SettingsFrame(0, flags=["ACK"]).serialize())
                frames.append(frame)
        return frames


async def test_h2_drain_sends_goaway_and_refuses_new_streams(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", mock={"token_delay_ms": 20, "num_tokens": 10}, **QUIET)
    h2 = await RawH2.connect(stack.pylon_address)
    h2.request(1, "in-flight", SSE)
    await stack.wait_record("in-flight", "received")
    h2.request(3, "late", BODY)
    stack.drain()  # in this loop iteration: pylon has not read stream 3 yet
    frames = await h2.frames_to_close()
    h2.writer.close()
    goaways = [f for f in frames if isinstance(f, GoAwayFrame)]
    assert goaways, "no GOAWAY"
    assert (goaways[0].last_stream_id, goaways[0].error_code) == (1, 0)
    late = [f for f in frames if f.stream_id == 3]
    assert len(late) == 1 and isinstance(late[0], RstStreamFrame), late
    assert late[0].error_code == REFUSED_STREAM
    # The stream named in the GOAWAY finished whole, after it.
    first = [f for f in frames if f.stream_id == 1]
    assert first[0].decoded[b":status"] == b"200"  # type: ignore[attr-defined]
    body = b"".join(f.data for f in first if isinstance(f, DataFrame))
    assert body.rstrip().endswith(b"data: [DONE]")
    assert "END_STREAM" in first[-1].flags
    ids = [
        dict((k.lower(), v) for k, v in r["headers"])["x-request-id"] for r in await stack.records()
    ]
    assert ids == ["in-flight"]
