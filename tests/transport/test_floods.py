"""Flood guards: rapid reset (CVE-2023-44487), PING/SETTINGS floods and floods of other cheap
HTTP/2 frames cost the abuser its connection, never pylon or the other connections (reliability
cases F28, F29); streams over the advertised limit are refused, never the connection killed."""

from __future__ import annotations

import asyncio
import json

import pytest
from h2.errors import ErrorCodes
from h2.settings import SettingCodes
from hyperframe.frame import DataFrame, PriorityFrame, WindowUpdateFrame

from pylon.core.flood import RateGuard
from tests.h3client import request_headers
from tests.stack import Stack, StackFactory
from tests.transport.h2client import H2Client
from tests.transport.h2client import request_headers as h2_request_headers

Header = tuple[bytes, bytes]
BODY = json.dumps({"model": "mock-model", "messages": [], "max_tokens": 2}).encode()


async def assert_calmed(h2: H2Client) -> None:
    """The abusive connection got GOAWAY ENHANCE_YOUR_CALM and was closed."""
    async with asyncio.timeout(5):
        await h2.closed.wait()
    assert h2.terminated is not None
    assert h2.terminated.error_code == ErrorCodes.ENHANCE_YOUR_CALM


async def assert_others_unaffected(stack: Stack) -> None:
    """Only the abusive connection paid: a fresh one is served as usual."""
    fresh = await H2Client.connect(stack.pylon_address)
    try:
        reply = await fresh.response(fresh.send(h2_request_headers(request_id="ok"), BODY))
        assert reply.status == 200
    finally:
        await fresh.close()


def test_rate_guard_trips_past_the_limit_and_resets_per_window() -> None:
    guard = RateGuard(limit=3, window=10.0)
    assert [guard.hit(0.0) for _ in range(4)] == [False, False, False, True]
    assert guard.hit(10.0) is False  # a new window
    assert RateGuard(limit=0, window=1.0).hit(0.0) is False  # 0 = off


async def test_h2_rapid_reset_gets_enhance_your_calm(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", mock={"ttft_ms": 500}, max_stream_resets=20)
    h2 = await H2Client.connect(stack.pylon_address)
    try:
        for i in range(40):
            sid = h2.send(h2_request_headers(request_id=f"rr-{i}"), BODY)
            h2.reset(sid)
            if h2.closed.is_set():
                break
        await assert_calmed(h2)
    finally:
        await h2.close()
    # Other clients are unaffected.
    await assert_others_unaffected(stack)


async def test_h2_normal_cancellations_below_the_limit_keep_the_connection(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack("dynamo", mock={"ttft_ms": 200}, max_stream_resets=20)
    h2 = await H2Client.connect(stack.pylon_address)
    try:
        for i in range(10):
            h2.reset(h2.send(h2_request_headers(request_id=f"c-{i}"), BODY))
        reply = await h2.response(h2.send(h2_request_headers(request_id="after"), BODY))
        assert reply.status == 200
        assert h2.terminated is None
    finally:
        await h2.close()


async def test_h2_ping_flood_gets_enhance_your_calm(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", max_control_frames=30)
    h2 = await H2Client.connect(stack.pylon_address)
    try:
        for i in range(60):
            h2.conn.ping(i.to_bytes(8, "big"))
        h2._flush()
        await assert_calmed(h2)
    finally:
        await h2.close()


async def test_h2_settings_flood_gets_enhance_your_calm(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", max_control_frames=30)
    h2 = await H2Client.connect(stack.pylon_address)
    try:
        for i in range(60):
            h2.conn.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: 100 + i})
        h2._flush()
        await assert_calmed(h2)
    finally:
        await h2.close()


async def test_h3_rapid_reset_closes_the_connection(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", mock={"ttft_ms": 500}, max_stream_resets=20)
    async with stack.connect() as client:
        for i in range(40):
            extra = [("x-request-id", f"rr-{i}"), ("x-model", "mock-model")]
            response = client.send(request_headers("POST", extra=extra, body=BODY), BODY)
            client.reset(response.stream_id)
        async with asyncio.timeout(5):
            await client.wait_closed()
        assert client._quic._close_event is not None
        assert client._quic._close_event.error_code == 0x107  # H3_EXCESSIVE_LOAD
    async with stack.connect() as fresh:
        reply = await fresh.request(body={"model": "mock-model", "messages": [], "max_tokens": 2})
        assert reply.status == 200


async def _flood(
    stack_address: tuple[str, int], frames: list[bytes], opener: list[Header] | None = None
) -> H2Client:
    """Open a connection (and a request stream left open), write raw frames, return the client."""
    h2 = await H2Client.connect(stack_address)
    if opener is not None:
        h2.send(opener, None, end=False)
    h2.writer.write(b"".join(frames))
    return h2


@pytest.mark.parametrize("kind", ["empty_data", "priority", "window_update", "unknown"])
async def test_h2_cheap_frame_floods_get_enhance_your_calm(
    make_stack: StackFactory, kind: str
) -> None:
    """CVE-2019-9513 (priority), -9518 (empty frames), -9517/9511 kin (window updates): frames
    that carry no request progress cost the abuser its connection, and nobody else anything."""
    stack = await make_stack("dynamo", max_control_frames=50)
    frames = {
        "empty_data": [DataFrame(1, data=b"").serialize() for _ in range(200)],
        "priority": [PriorityFrame(3, depends_on=0, stream_weight=16).serialize()] * 200,
        "window_update": [WindowUpdateFrame(0, window_increment=1).serialize()] * 2000,
        # An extension frame type (RFC 9113 5.5): length 1, type 0xfa, no flags, stream 0.
        "unknown": [b"\x00\x00\x01\xfa\x00\x00\x00\x00\x00x"] * 200,
    }[kind]
    h2 = await _flood(stack.pylon_address, frames, h2_request_headers(request_id="flood"))
    try:
        await assert_calmed(h2)
    finally:
        await h2.close()
    await assert_others_unaffected(stack)


async def test_h2_streams_over_the_limit_are_refused_and_the_connection_lives(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(
        "dynamo", mock={"ttft_ms": 300}, h2_max_concurrent_streams=2, max_stream_resets=100
    )
    h2 = await H2Client.connect(stack.pylon_address)
    try:
        h2.ignore_stream_limit()
        sids = [h2.send(h2_request_headers(request_id=f"s-{i}"), BODY) for i in range(40)]
        replies = [await h2.response(sid) for sid in sids]
        assert [r.status for r in replies[:2]] == [200, 200]
        assert {r.reset_code for r in replies[2:]} == {ErrorCodes.REFUSED_STREAM}
        assert h2.terminated is None, "the connection was killed"
        after = await h2.response(h2.send(h2_request_headers(request_id="after"), BODY))
        assert after.status == 200
    finally:
        await h2.close()


async def test_h2_refused_stream_flood_gets_enhance_your_calm(make_stack: StackFactory) -> None:
    """Opening stream after stream past the advertised limit costs pylon a reset each, as a
    rapid reset does: past the reset allowance the connection goes."""
    stack = await make_stack(
        "dynamo", mock={"ttft_ms": 300}, h2_max_concurrent_streams=2, max_stream_resets=20
    )
    h2 = await H2Client.connect(stack.pylon_address)
    try:
        h2.ignore_stream_limit()
        for i in range(60):
            h2.send(h2_request_headers(request_id=f"over-{i}"), BODY)
            if h2.closed.is_set():
                break
        await assert_calmed(h2)
    finally:
        await h2.close()
    await assert_others_unaffected(stack)
