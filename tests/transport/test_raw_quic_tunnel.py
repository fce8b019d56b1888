"""Pylon serving raw-QUIC request streams on a reverse-tunnel connection, in front of
mock_dynamo: the test plays the gateway (an aioquic QUIC server on 127.0.0.1:0 that opens
server-initiated bidirectional streams and writes Cap'n Proto messages), pylon is the QUIC
client running `RawQuicTunnelProtocol` with the stack's real `Ingress`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import (
    ConnectionTerminated,
    HandshakeCompleted,
    QuicEvent,
    StopSendingReceived,
    StreamDataReceived,
    StreamReset,
)

from pylon.gateway.wire import FrameReader, RawBody, RawHeaders, decode_raw, encode_raw
from pylon.server.rawquic import (
    STOP_CANCELLED,
    STOP_GOAWAY,
    RawQuicOptions,
    RawQuicTunnelProtocol,
    raw_quic_protocol,
)
from tests.cancellation import assert_cancelled_promptly
from tests.h3client import CHAT, MODEL, chat, sse_payloads
from tests.observers import SeenObserver
from tests.stack import Stack, StackFactory
from tests.unit.quic_pair import certificate

HANDSHAKE_STREAM_REPLY = b"ack"


@dataclass
class GatewayStream:
    """One request the gateway sent and what came back on its stream."""

    stream_id: int
    reader: FrameReader = field(default_factory=lambda: FrameReader(8 << 20))
    messages: list[RawHeaders | RawBody] = field(default_factory=list)
    ended: bool = False
    reset_code: int | None = None
    stop_code: int | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def head(self) -> dict[str, str]:
        first = self.messages[0]
        assert isinstance(first, RawHeaders) and not first.trailers
        return dict(first.fields)

    @property
    def fields(self) -> tuple[tuple[str, str], ...]:
        first = self.messages[0]
        assert isinstance(first, RawHeaders)
        return first.fields

    @property
    def status(self) -> int:
        return int(self.head["x-status"])

    @property
    def body(self) -> bytes:
        return b"".join(m.content for m in self.messages if isinstance(m, RawBody))

    def json(self) -> Any:
        return orjson.loads(self.body)

    async def wait(self, timeout: float = 10.0) -> GatewayStream:
        async with asyncio.timeout(timeout):
            await self.done.wait()
        return self

    async def wait_until(self, check: Callable[[], bool], timeout: float = 10.0) -> None:
        async with asyncio.timeout(timeout):
            while not check():
                self.changed.clear()
                await self.changed.wait()


class Gateway(QuicConnectionProtocol):
    """The gateway's end of one reverse-tunnel connection."""

    connected: asyncio.Future[Gateway]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.streams: dict[int, GatewayStream] = {}
        self.handshake = b""
        self.terminated = asyncio.Event()
        self.close_reason: str | None = None

    def open(
        self,
        fields: Sequence[tuple[str, str]],
        chunks: Sequence[bytes] = (),
        *,
        fin: bool = True,
        raw: bytes | None = None,
    ) -> GatewayStream:
        sid = self._quic.get_next_available_stream_id()
        stream = self.streams[sid] = GatewayStream(sid)
        wire = raw if raw is not None else encode_raw(RawHeaders(tuple(fields)))
        wire += b"".join(encode_raw(RawBody(chunk)) for chunk in chunks)
        self._quic.send_stream_data(sid, wire, fin)
        self.transmit()
        return stream

    def stop(self, stream: GatewayStream, code: int = STOP_CANCELLED) -> None:
        """STOP_SENDING only: the gateway no longer wants the response."""
        self._quic.stop_stream(stream.stream_id, code)
        self.transmit()

    def reset(self, stream: GatewayStream, code: int = STOP_CANCELLED) -> None:
        self._quic.reset_stream(stream.stream_id, code)
        self._quic.stop_stream(stream.stream_id, code)
        self.transmit()

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, HandshakeCompleted):
            if not type(self).connected.done():
                type(self).connected.set_result(self)
        elif isinstance(event, ConnectionTerminated):
            self.close_reason = event.reason_phrase
            self.terminated.set()
            for stream in self.streams.values():
                stream.done.set()
        elif isinstance(event, StreamDataReceived):
            if event.stream_id % 4 == 0:  # pylon's own stream (its handshake): answer it
                self.handshake += event.data
                if event.end_stream:
                    self._quic.send_stream_data(event.stream_id, HANDSHAKE_STREAM_REPLY, True)
                return
            stream = self.streams[event.stream_id]
            stream.messages += [decode_raw(m) for m in stream.reader.feed(event.data)]
            stream.ended = stream.ended or event.end_stream
            stream.changed.set()
            if event.end_stream:
                stream.done.set()
        elif isinstance(event, StreamReset):
            stream = self.streams[event.stream_id]
            stream.reset_code = event.error_code
            stream.changed.set()
            stream.done.set()
        elif isinstance(event, StopSendingReceived):
            self.streams[event.stream_id].stop_code = event.error_code


@dataclass
class Tunnel:
    gateway: Gateway
    pylon: RawQuicTunnelProtocol
    stack: Stack


def request(
    path: str = CHAT, request_id: str = "raw-1", method: str = "POST"
) -> list[tuple[str, str]]:
    return [
        ("x-method", method),
        ("x-path", path),
        ("content-type", "application/json"),
        ("x-request-id", request_id),
        ("x-model", MODEL),
    ]


async def forgotten(pylon: RawQuicTunnelProtocol, timeout: float = 5.0) -> None:
    """Until pylon holds no state for any request stream (polled, with a deadline)."""
    async with asyncio.timeout(timeout):
        while pylon.tracked_streams or pylon.in_progress:
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def tunnel(stack: Stack, options: RawQuicOptions | None = None) -> AsyncIterator[Tunnel]:
    cert, key = certificate("localhost")
    server_config = QuicConfiguration(is_client=False, certificate=cert, private_key=key)
    loop = asyncio.get_running_loop()

    class ThisGateway(Gateway):
        connected = loop.create_future()

    transport, server = await loop.create_datagram_endpoint(
        lambda: QuicServer(configuration=server_config, create_protocol=ThisGateway),
        local_addr=("127.0.0.1", 0),
    )
    try:
        port = transport.get_extra_info("sockname")[1]
        client_config = QuicConfiguration(
            is_client=True, server_name="localhost", verify_mode=ssl.CERT_NONE
        )
        factory = raw_quic_protocol(stack.running.core.ingress, options)
        async with asyncio.timeout(10):
            async with connect(
                "127.0.0.1",
                port,
                configuration=client_config,
                create_protocol=factory,
                wait_connected=True,
            ) as pylon:
                assert isinstance(pylon, RawQuicTunnelProtocol)
                gateway = await ThisGateway.connected
                yield Tunnel(gateway, pylon, stack)
    finally:
        server.close()


async def test_chat_completion(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo")
    async with tunnel(stack) as t:
        reply = await t.gateway.open(request(), [json.dumps(chat()).encode()]).wait()
        assert reply.ended and reply.reset_code is None
        assert reply.fields[0] == ("x-status", "200")
        assert reply.head["content-type"].startswith("application/json")
        assert int(reply.head["content-length"]) == len(reply.body)
        assert reply.json()["choices"]
        record = await stack.last_request()
        names = [name.lower() for name, _ in record["headers"]]
        assert "x-method" not in names and "x-path" not in names
        assert record["method"] == "POST" and record["raw_path"] == CHAT
        await forgotten(t.pylon)


async def test_body_in_many_chunks_and_split_messages(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo")
    payload = json.dumps(chat()).encode()
    async with tunnel(stack) as t:
        chunks = [payload[i : i + 7] for i in range(0, len(payload), 7)]
        reply = await t.gateway.open(request(request_id="raw-chunks"), chunks).wait()
        assert reply.status == 200, reply.body
        record = await stack.last_request()
        assert record["body"]["messages"] == chat()["messages"]


async def test_streaming_chat_arrives_as_body_messages(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", mock={"token_delay_ms": 5, "num_tokens": 6})
    async with tunnel(stack) as t:
        body = json.dumps(chat(stream=True, max_tokens=6)).encode()
        reply = await t.gateway.open(request(request_id="raw-sse"), [body]).wait()
        assert reply.status == 200
        assert reply.head["content-type"].startswith("text/event-stream")
        assert "content-length" not in reply.head
        bodies = [m for m in reply.messages[1:] if isinstance(m, RawBody)]
        assert len(bodies) >= 2  # relayed as the engine produced them, not buffered whole
        assert reply.body.rstrip().endswith(b"data: [DONE]")
        assert len(sse_payloads(reply.body)) >= 2
        await forgotten(t.pylon)


async def test_unknown_route_is_pylons_problem(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo")
    async with tunnel(stack) as t:
        reply = await t.gateway.open(request("/v1/nope", "raw-404"), [b"{}"]).wait()
        assert reply.status == 404
        assert reply.head["content-type"] == "application/problem+json"
        problem = reply.json()
        assert problem["status"] == 404 and problem["code"] == "route_not_served"
        assert reply.head.get("x-request-id") == "raw-404"


async def test_missing_x_method_is_a_400_on_that_stream_only(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo")
    async with tunnel(stack) as t:
        fields = [f for f in request(request_id="raw-bad") if f[0] != "x-method"]
        bad = await t.gateway.open(fields, [b"{}"]).wait()
        assert bad.status == 400
        assert bad.head["content-type"] == "application/problem+json"
        assert bad.json()["code"] == "malformed_request"
        assert bad.head.get("x-request-id") == "raw-bad"
        good = await t.gateway.open(request(), [json.dumps(chat()).encode()]).wait()
        assert good.status == 200
        await forgotten(t.pylon)


async def test_garbage_on_a_stream_is_a_400_problem(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo")
    async with tunnel(stack) as t:
        bad = await t.gateway.open(
            [], raw=b"\x00\x00\x00\x00\x02\x00\x00\x00" + b"\xff" * 16
        ).wait()
        assert bad.status == 400


async def test_oversized_head_is_refused_unread(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo")
    async with tunnel(stack) as t:
        # A segment table announcing 1 GiB, and nothing else: answered at once, not buffered.
        raw = b"\x00\x00\x00\x00" + (128 * 1024 * 1024).to_bytes(4, "little")
        bad = await t.gateway.open([], raw=raw, fin=False).wait()
        assert bad.status == 431
        assert bad.stop_code is not None  # pylon asked the gateway to stop sending
        t.gateway.reset(bad, 0)  # what a gateway does on STOP_SENDING
        await forgotten(t.pylon)


async def test_gateway_reset_cancels_the_engine_request(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", mock={"token_delay_ms": 50, "num_tokens": 400})
    async with tunnel(stack) as t:
        body = json.dumps(chat(stream=True, max_tokens=400)).encode()
        reply = t.gateway.open(request(request_id="raw-reset"), [body])
        await reply.wait_until(lambda: reply.body.count(b"data:") >= 3)
        t.gateway.reset(reply)
        reset_at = time.time()
        await assert_cancelled_promptly(stack.client, stack.mock.base_url, "raw-reset", reset_at)
        await forgotten(t.pylon)
        # The connection stays usable.
        again = await t.gateway.open(request(), [json.dumps(chat()).encode()]).wait()
        assert again.status == 200


async def test_own_streams_stay_aioquics(make_stack: StackFactory) -> None:
    """Stream 0 (pylon's handshake, opened by pylon) is not a request: it reaches the base
    class's stream readers, so the tunnel can run its handshake with `create_stream()`."""
    stack = await make_stack("dynamo")
    async with tunnel(stack) as t:
        reader, writer = await t.pylon.create_stream()
        writer.write(b"hello")
        writer.write_eof()
        async with asyncio.timeout(5):
            assert await reader.read() == HANDSHAKE_STREAM_REPLY
        assert t.gateway.handshake == b"hello"
        reply = await t.gateway.open(request(), [json.dumps(chat()).encode()]).wait()
        assert reply.status == 200


async def test_drain_finishes_in_flight_refuses_new_then_closes(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", mock={"token_delay_ms": 20, "num_tokens": 10})
    async with tunnel(stack) as t:
        body = json.dumps(chat(stream=True, max_tokens=10)).encode()
        first = t.gateway.open(request(request_id="raw-drain"), [body])
        await first.wait_until(lambda: b"data:" in first.body)
        assert t.pylon.in_progress == 1
        t.pylon.drain()
        refused = await t.gateway.open(request(request_id="raw-late"), [body]).wait()
        assert refused.reset_code == STOP_GOAWAY and not refused.messages
        await first.wait()
        assert first.status == 200 and first.body.rstrip().endswith(b"data: [DONE]")
        async with asyncio.timeout(5):
            await t.pylon.wait_closed()
            await t.gateway.terminated.wait()


async def test_close_now_cancels_what_runs(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", mock={"token_delay_ms": 50, "num_tokens": 400})
    async with tunnel(stack) as t:
        body = json.dumps(chat(stream=True, max_tokens=400)).encode()
        reply = t.gateway.open(request(request_id="raw-close"), [body])
        await reply.wait_until(lambda: b"data:" in reply.body)
        t.pylon.close_now()
        closed_at = time.time()
        await assert_cancelled_promptly(stack.client, stack.mock.base_url, "raw-close", closed_at)
        async with asyncio.timeout(5):
            await t.gateway.terminated.wait()


async def test_one_answer_when_a_rejected_head_is_followed_by_garbage(
    make_stack: StackFactory,
) -> None:
    # The head is refused at once (no x-model), and the bytes after it in the same packet are
    # malformed: the stream still gets exactly one answer, the head's, and one record.
    observer = SeenObserver()
    stack = await make_stack("dynamo", observer=observer)
    async with tunnel(stack) as t:
        fields = [f for f in request(request_id="raw-twice") if f[0] != "x-model"]
        head = encode_raw(RawHeaders(tuple(fields)))
        garbage = b"\x00\x00\x00\x00\x02\x00\x00\x00" + b"\xff" * 16
        reply = await t.gateway.open([], raw=head + garbage, fin=True).wait()
        heads = [m for m in reply.messages if isinstance(m, RawHeaders)]
        assert len(heads) == 1, reply.messages
        assert reply.status == 400 and reply.json()["code"] == "missing_model"
        assert observer.seen == [("rejected", "raw-twice")]
        again = await t.gateway.open(request(), [json.dumps(chat()).encode()]).wait()
        assert again.status == 200


async def test_rapid_reset_closes_the_connection(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", mock={"ttft_ms": 500}, max_stream_resets=20)
    async with tunnel(stack) as t:
        body = json.dumps(chat()).encode()
        for i in range(40):
            t.gateway.reset(t.gateway.open(request(request_id=f"rr-{i}"), [body]))
        async with asyncio.timeout(5):
            await t.gateway.terminated.wait()
        assert t.gateway.close_reason == "too many stream resets"
    async with tunnel(stack) as fresh:
        reply = await fresh.gateway.open(request(), [json.dumps(chat()).encode()]).wait()
        assert reply.status == 200


async def test_gateway_stop_sending_cancels_the_engine_request(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", mock={"token_delay_ms": 50, "num_tokens": 400})
    async with tunnel(stack) as t:
        body = json.dumps(chat(stream=True, max_tokens=400)).encode()
        reply = t.gateway.open(request(request_id="raw-stop"), [body])
        await reply.wait_until(lambda: reply.body.count(b"data:") >= 2)
        t.gateway.stop(reply)
        stopped_at = time.time()
        await assert_cancelled_promptly(stack.client, stack.mock.base_url, "raw-stop", stopped_at)
        await reply.wait()
        assert reply.reset_code is not None
        await forgotten(t.pylon)
