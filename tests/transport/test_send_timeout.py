"""A client that stops reading cannot keep an engine request (a GPU sequence) running: after
`--client-send-timeout` its stream is reset and the engine request cancelled, on every transport.
A slow reader is not a stalled engine: the engine's output-gap clock is paused meanwhile."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from tests.h3client import request_headers as h3_request_headers
from tests.stack import MODEL, Stack, StackFactory
from tests.transport.h2client import H2Client
from tests.transport.h2client import request_headers as h2_request_headers

CHAT = "/v1/chat/completions"
SEND_TIMEOUT = 0.5
# A stream far larger than any socket buffer, produced as fast as the engine can.
ENGINE = {"token_delay_ms": 0, "num_tokens": 200_000, "ttft_ms": 0}


def body(request_id: str) -> bytes:
    return json.dumps(
        {"model": MODEL, "messages": [], "max_tokens": 200_000, "stream": True, "user": request_id}
    ).encode()


async def stack_for(make_stack: StackFactory) -> Stack:
    # The gap timeout is short too: it must not fire while pylon waits for the reader.
    return await make_stack(
        "dynamo", mock=ENGINE, client_send_timeout=SEND_TIMEOUT, output_gap_timeout=0.2
    )


async def assert_engine_cancelled(stack: Stack, request_id: str, started: float) -> None:
    record: dict[str, Any] = await stack.wait_record(request_id, "finished", timeout=20)
    assert record["cancelled_at"] is not None, "the engine finished the request for nobody"
    assert record["completed_at"] is None
    # Filling the buffers takes a moment; the bound is generous next to the 200k-token stream.
    assert time.monotonic() - started < 15


async def test_http1_client_that_stops_reading(make_stack: StackFactory) -> None:
    stack = await stack_for(make_stack)
    _reader, writer = await asyncio.open_connection(*stack.pylon_address)
    payload = body("stall-h1")
    writer.write(
        f"POST {CHAT} HTTP/1.1\r\nhost: x\r\nx-request-id: stall-h1\r\nx-model: {MODEL}\r\n"
        f"content-length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    started = time.monotonic()
    try:
        await assert_engine_cancelled(stack, "stall-h1", started)  # and we never read a byte
    finally:
        writer.transport.abort()


async def test_h2_client_that_never_opens_its_window(make_stack: StackFactory) -> None:
    stack = await stack_for(make_stack)
    h2 = await H2Client.connect(stack.pylon_address, auto_ack=False, window=1024)
    try:
        sid = h2.send(h2_request_headers(request_id="stall-h2"), body("stall-h2"))
        started = time.monotonic()
        await assert_engine_cancelled(stack, "stall-h2", started)
        reply = await h2.response(sid, timeout=5)
        assert reply.reset_code is not None, "the stalled stream was not reset"
        assert h2.terminated is None, "only the stream goes, not the connection"
    finally:
        await h2.close()


async def test_h3_client_that_stops_acknowledging(make_stack: StackFactory) -> None:
    stack = await stack_for(make_stack)
    async with stack.connect() as client:
        payload = body("stall-h3")
        client.send(
            h3_request_headers(
                "POST", CHAT, [("x-request-id", "stall-h3"), ("x-model", MODEL)], payload
            ),
            payload,
        )
        client.transmit()
        # From now on the client hears nothing: no ACKs, no window updates reach pylon.
        client.datagram_received = lambda data, addr: None  # type: ignore[method-assign]
        await assert_engine_cancelled(stack, "stall-h3", time.monotonic())
