"""No client connection holds the event loop or piles up requests: a flood sent in one write
is worked through a bounded amount at a time. A `LoopLag` probe (tests/looplag.py) measures the
longest the loop went without running another task while the flood is answered."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hyperframe.frame import DataFrame, PingFrame

from pylon.core.record import RequestRecord
from pylon.server import http2
from pylon.server.http1 import FEED_BYTES
from tests.h3client import request_headers as h3_request_headers
from tests.integration.conftest import MODEL, StackFactory
from tests.looplag import LoopLag
from tests.observers import SeenObserver
from tests.transport.h2client import H2Client
from tests.transport.h2client import request_headers as h2_request_headers

# The longest loop turn allowed while a flood is answered: generous, for a 2-core box shared
# with other work (a turn here takes a few ms to ~25 ms; the OS can still take the CPU away for
# longer). What each reader may take at once is pinned exactly beside it (parsed requests held,
# bytes handed to h2 per turn).
MAX_GAP_S = 0.5


class InFlight(SeenObserver):
    """Requests admitted and not finished yet, and the most there ever were at once."""

    def __init__(self) -> None:
        super().__init__()
        self.open = 0
        self.most = 0
        self.done = 0

    def admitted(self, record: RequestRecord) -> None:
        super().admitted(record)
        self.open += 1
        self.most = max(self.most, self.open)

    def complete(self, record: RequestRecord) -> None:
        super().complete(record)
        self.open -= 1
        self.done += 1


async def test_http1_pipelined_requests_in_one_write_are_parsed_one_turn_at_a_time(
    make_stack: StackFactory,
) -> None:
    """5,000 pipelined requests in one 370 KB write: every one is answered, in order, while
    pylon never holds more than one parse piece's worth of them (the rest of the input waits
    unparsed, reading paused) and the loop keeps turning."""
    observer = InFlight()
    stack = await make_stack(backend="vllm", observer=observer)
    host, port = stack.pylon_address
    one = (
        f"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-request-id: r\r\nx-model: {MODEL}\r\n\r\n"
    ).encode()
    count = 5_000
    reader, writer = await asyncio.open_connection(host, port)
    got = bytearray()

    async def read_all() -> None:
        while got.count(b"HTTP/1.1 ") < count:
            chunk = await reader.read(65536)
            if not chunk:
                return
            got.extend(chunk)

    lag = LoopLag()
    try:
        writer.write(one * count)
        reading = asyncio.create_task(read_all())
        took = await lag.until(reading.done, timeout=120)
    finally:
        writer.close()
    assert got.count(b"HTTP/1.1 200 OK\r\n") == count and observer.done == count
    # One piece of input holds at most this many whole requests (and the one running).
    assert observer.most <= FEED_BYTES // len(one) + 2, observer.most
    assert lag.max_gap < MAX_GAP_S, (lag.max_gap, took)


@pytest.fixture
def h2_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every piece of input pylon's HTTP/2 connections hand their codec at once
    (h2 and ngh2 both parse a whole piece into events in one go), whichever codec runs."""
    sizes: list[int] = []
    for codec in codec_classes():
        receive = codec.__dict__["_receive"]

        def recording(self: Any, data: bytes, receive: Any = receive) -> Any:
            sizes.append(len(data))
            return receive(self, data)

        monkeypatch.setattr(codec, "_receive", recording)
    return sizes


def codec_classes() -> list[type[http2.Http2Connection]]:
    classes: list[type[http2.Http2Connection]] = [http2.Http2Connection]
    try:
        from pylon.server.http2_ngh2 import Ngh2Connection
    except ImportError:
        return classes
    return [*classes, Ngh2Connection]


@pytest.mark.interpreted
async def test_http2_a_body_in_one_byte_data_frames_is_parsed_a_piece_per_turn(
    make_stack: StackFactory, h2_reads: list[int]
) -> None:
    """A 60 KB body sent as 60,000 one-byte DATA frames in one write (660 KB): pylon parses it
    a piece per loop turn, forwards exactly that body, and the loop keeps turning."""
    stack = await make_stack("vllm")
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    ).encode()
    body += b" " * (60_000 - len(body))
    h2 = await H2Client.connect(stack.pylon_address)
    try:
        sid = h2.send(h2_request_headers(request_id="one-byte", model=MODEL), None, end=False)
        frames = [DataFrame(sid, data=body[i : i + 1]) for i in range(len(body))]
        frames[-1].flags.add("END_STREAM")
        lag = LoopLag()
        h2.writer.write(b"".join(frame.serialize() for frame in frames))
        reply = asyncio.create_task(h2.response(sid, timeout=60))
        took = await lag.until(reply.done, timeout=60)
        assert (await reply).status == 200
    finally:
        await h2.close()
    forwarded = (await stack.last_request())["body"]
    assert forwarded.pop("priority") is not None  # vLLM's: pylon writes its own
    assert forwarded == json.loads(body)
    assert max(h2_reads) <= http2.FEED_BYTES
    assert lag.max_gap < MAX_GAP_S, (lag.max_gap, took)


@pytest.mark.interpreted
async def test_http2_a_ping_flood_in_one_write_trips_the_guard_within_a_piece(
    make_stack: StackFactory, h2_reads: list[int]
) -> None:
    """20,000 PINGs in one write: the flood guard closes the connection after the first piece;
    the rest of the input is never parsed."""
    stack = await make_stack("vllm", max_control_frames=100)
    h2 = await H2Client.connect(stack.pylon_address)
    pings = b"".join(
        PingFrame(0, opaque_data=i.to_bytes(8, "big")).serialize() for i in range(20_000)
    )
    try:
        lag = LoopLag()
        h2.writer.write(pings)
        await lag.until(h2.closed.is_set, timeout=20)
    finally:
        await h2.close()
    assert h2.terminated is not None and h2.terminated.error_code == 11  # ENHANCE_YOUR_CALM
    assert max(h2_reads) <= http2.FEED_BYTES
    assert sum(h2_reads) < len(pings) // 4  # parsing stopped with the guard, not at the end
    assert lag.max_gap < MAX_GAP_S, lag.max_gap


async def test_http3_a_burst_of_requests_is_worked_through_a_datagram_at_a_time(
    make_stack: StackFactory,
) -> None:
    """As many requests as the connection may open at once, each body written in 1-byte
    pieces, all in one burst: pylon takes one datagram per callback, so the loop keeps turning
    while they arrive, and every request is answered."""
    stack = await make_stack("vllm")
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    ).encode()
    async with stack.connect() as client:
        lag = LoopLag()
        count = min(client.peer_max_streams, 100)
        replies = []
        for n in range(count):
            extra = [("x-request-id", f"burst-{n}"), ("x-model", MODEL)]
            reply = client.send(h3_request_headers("POST", extra=extra, body=body), None, end=False)
            for i in range(len(body)):
                client.http.send_data(reply.stream_id, body[i : i + 1], end_stream=False)
            client.http.send_data(reply.stream_id, b"", end_stream=True)
            replies.append(reply)
        client.transmit()
        took = await lag.until(lambda: all(r.done.is_set() for r in replies), timeout=60)
    assert [r.status for r in replies] == [200] * count
    assert lag.max_gap < MAX_GAP_S, (lag.max_gap, took)
