"""One bad request must cost only its own stream: malformed HTTP/3 requests next to a live SSE
stream on the same QUIC connection, the limits, and GOAWAY drain."""

from __future__ import annotations

import asyncio

import pytest
from aioquic.h3.connection import ErrorCode

from pylon.server.http3 import Http3Protocol
from tests.h3client import CHAT, MODEL, H3Client, H3Response, chat, request_headers, sse_payloads
from tests.observers import SeenObserver
from tests.stack import StackFactory

BASE = request_headers(extra=[("x-request-id", "bad-1"), ("x-model", MODEL)])
PSEUDO, REGULAR = BASE[:4], BASE[4:]
MALFORMED = {
    "connection_header": [*BASE, (b"connection", b"keep-alive")],
    "transfer_encoding": [*BASE, (b"transfer-encoding", b"chunked")],
    "te_not_trailers": [*BASE, (b"te", b"gzip")],
    "uppercase_name": [*BASE, (b"X-Upper", b"1")],
    "space_in_name": [*BASE, (b"x bad", b"1")],
    "value_with_newline": [*BASE, (b"x-evil", b"a\nb")],
    "value_with_leading_space": [*BASE, (b"x-evil", b" a")],
    "repeated_path": [*PSEUDO, (b":path", b"/other"), *REGULAR],
    "missing_authority": [h for h in BASE if h[0] != b":authority"],
    "pseudo_after_regular": [*PSEUDO[:3], *REGULAR, PSEUDO[3]],
    "unknown_pseudo": [*PSEUDO, (b":custom", b"1"), *REGULAR],
    "method_with_space": [(b":method", b"GET /x"), *BASE[1:]],
    "scheme_not_a_scheme": [BASE[0], (b":scheme", b"ht tp"), *BASE[2:]],
    "authority_userinfo": [*BASE[:2], (b":authority", b"user@localhost"), *BASE[3:]],
    "host_differs": [*BASE, (b"host", b"evil.example")],
    "network_path": [*BASE[:3], (b":path", b"//evil.example/v1/models"), *BASE[4:]],
    "two_hosts_no_authority": [
        *(h for h in BASE if h[0] != b":authority"),
        (b"host", b"a"),
        (b"host", b"a"),
    ],
}


async def _streaming(client: H3Client, request_id: str = "long-1") -> H3Response:
    body = b'{"model": "mock-model", "stream": true, "max_tokens": 20, "messages": []}'
    headers = request_headers(extra=[("x-request-id", request_id), ("x-model", MODEL)], body=body)
    reply = client.send(headers, body)
    await client.wait_until(lambda: reply.body.count(b"data:") >= 2, what="2 SSE events")
    return reply


@pytest.mark.parametrize("case", sorted(MALFORMED))
async def test_malformed_request_costs_only_its_stream(make_stack: StackFactory, case: str) -> None:
    stack = await make_stack("dynamo", mock={"token_delay_ms": 20, "num_tokens": 20})
    async with stack.connect() as client:
        long = await _streaming(client)
        bad = await client.send(MALFORMED[case], b'{"a": 1}').wait(3)
        assert bad.status == 400, case
        assert bad.json()["code"] == "malformed_request"
        await long.wait(5)
        assert client.terminated is None, f"{case} closed the whole connection"
        assert long.status == 200 and long.reset_code is None
        assert len(sse_payloads(long.body)) >= 20, "the live stream was cut"
        after = await client.request(CHAT, chat())
        assert after.status == 200
    ids = [dict(r["headers"]).get("x-request-id") for r in (await stack.control())["requests"]]
    assert "bad-1" not in ids, "a malformed request reached the engine"


async def test_content_length_disagreeing_with_data_is_a_stream_error(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack("dynamo", mock={"token_delay_ms": 20, "num_tokens": 10})
    async with stack.connect() as client:
        long = await _streaming(client)
        short = client.send([*BASE, (b"content-length", b"100")], b'{"a": 1}')
        longer = client.send([*BASE, (b"content-length", b"2")], b'{"a": 1}')
        for reply in (await short.wait(3), await longer.wait(3)):
            assert reply.status == 400
        await long.wait(5)
        assert client.terminated is None and long.status == 200
    assert len((await stack.control())["requests"]) == 1


async def test_too_many_headers_is_431(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", max_headers=20)
    extra = [(f"x-h{i}".encode(), b"v") for i in range(30)]
    async with stack.connect() as client:
        reply = await client.send(BASE + extra, b"{}").wait(3)
        assert reply.status == 431
        assert reply.json()["code"] == "headers_too_large"
        assert (await client.request(CHAT, chat())).status == 200


async def test_header_bytes_over_the_limit_is_431(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", max_header_bytes=4096)
    async with stack.connect() as client:
        reply = await client.send([*BASE, (b"x-big", b"a" * 5000)], b"{}").wait(3)
        assert reply.status == 431
        huge = await client.send([*BASE, (b"x-huge", b"a" * 20000)], b"{}").wait(3)
        assert huge.status == 431  # refused before aioquic buffers/decodes the block
        assert client.terminated is None
        assert (await client.request(CHAT, chat())).status == 200


async def test_declared_body_over_the_limit_is_413_at_once(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", max_body_bytes=1000)
    async with stack.connect() as client:
        headers = [*BASE, (b"content-length", b"5000")]
        reply = await client.send(headers, body=None, end=False).wait(3)
        assert reply.status == 413
        assert reply.json()["code"] == "body_too_large"


async def test_streamed_body_over_the_limit_is_413(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", max_body_bytes=1000)
    async with stack.connect() as client:
        reply = client.send(BASE, b"x" * 600, end=False)
        client.send_data(reply.stream_id, b"x" * 600, end=False)
        await reply.wait(3)
        assert reply.status == 413
        assert (await client.request(CHAT, chat())).status == 200
    assert (await stack.control())["requests"][-1]["body"]["model"] == MODEL


async def test_concurrent_streams_are_capped_by_quic_max_streams(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack("dynamo", quic_max_concurrent_streams=3)
    async with stack.connect() as client:
        assert client.peer_max_streams == 3
        replies = await asyncio.gather(*(client.request(CHAT, chat()) for _ in range(8)))
        assert [r.status for r in replies] == [200] * 8  # queued by flow control, not refused


@pytest.mark.interpreted
async def test_idle_connection_is_closed(
    make_stack: StackFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = await make_stack("dynamo", quic_idle_timeout=0.3)
    # Each side runs its own idle timer: the server forgets the connection when its own fires.
    gone = asyncio.Event()
    forget = stack.server.forget

    def forget_and_note(protocol: Http3Protocol) -> None:
        forget(protocol)
        if stack.server.connections == 0:
            gone.set()

    monkeypatch.setattr(stack.server, "forget", forget_and_note)
    async with stack.connect() as client:
        assert stack.server.connections == 1
        async with asyncio.timeout(3):
            await client.wait_closed()
        assert client.terminated is not None
    async with asyncio.timeout(3):
        await gone.wait()
    assert stack.server.connections == 0


async def test_drain_sends_goaway_and_lets_in_flight_streams_finish(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack("dynamo", mock={"token_delay_ms": 30, "num_tokens": 10})
    async with stack.connect() as client:
        long = await _streaming(client)
        stack.drain()
        await client.wait_until(lambda: bool(client.goaways), 3, what="a GOAWAY")
        assert client.goaways == [long.stream_id + 4]  # the first stream not processed
        refused = await client.request(CHAT, chat(), timeout=3)
        assert refused.reset_code == ErrorCode.H3_REQUEST_REJECTED
        await long.wait(5)
        assert long.status == 200 and long.reset_code is None
        assert long.body.rstrip().endswith(b"data: [DONE]")
        async with asyncio.timeout(3):
            await client.wait_closed()  # pylon closes once everything was acknowledged
        assert client.terminated is not None
        assert client.terminated.error_code == ErrorCode.H3_NO_ERROR
    assert len((await stack.control())["requests"]) == 1


async def test_stalled_request_body_is_408_on_that_stream_only(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", header_timeout=0.3)
    async with stack.connect() as client:
        extra = [("x-request-id", "slow-body"), ("x-model", MODEL)]
        stalled = client.send(
            request_headers("POST", extra=extra, body=b"x"), b'{"model"', end=False
        )
        healthy = await client.request(body=chat())
        assert healthy.status == 200
        reply = await stalled.wait(3)
        assert reply.status == 408
        assert reply.json()["code"] == "request_timeout"
        assert reply.json()["request_id"] == "slow-body"
        assert (await client.request(body=chat())).status == 200


async def test_settings_advertise_the_header_limit_and_no_extended_connect(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack("dynamo", max_header_bytes=8192, max_headers=50)
    async with stack.connect() as client:
        assert (await client.request(body=chat())).status == 200
        received = client.http.received_settings
        assert received is not None
        assert received[0x6] == 8192 + 32 * 50  # SETTINGS_MAX_FIELD_SECTION_SIZE
        assert 0x8 not in received  # SETTINGS_ENABLE_CONNECT_PROTOCOL


async def test_one_answer_when_a_refused_head_is_followed_by_a_body_over_its_length(
    make_stack: StackFactory,
) -> None:
    """The head is refused at once (no x-model) and the DATA after it in the same packet breaks
    its content-length: the stream gets the head's answer, and there is one record, not a second
    `malformed_request` with no request id."""
    observer = SeenObserver()
    stack = await make_stack("dynamo", observer=observer)
    headers = [h for h in BASE if h[0] != b"x-model"]
    headers = [(n, b"h3-once" if n == b"x-request-id" else v) for n, v in headers]
    async with stack.connect() as client:
        reply = await client.send([*headers, (b"content-length", b"2")], b'{"a": 1}').wait(3)
        assert reply.status == 400 and reply.json()["code"] == "missing_model"
        assert (await client.request(CHAT, chat())).status == 200
    assert [seen for seen in observer.seen if seen[0] == "rejected"] == [("rejected", "h3-once")]
