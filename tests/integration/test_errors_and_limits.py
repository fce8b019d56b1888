"""Bad input, limits, engine failures and timeouts: a clear answer every time, never a hang."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from tests.cancellation import assert_cancelled_promptly
from tests.integration.conftest import MODEL, StackFactory, raw_exchange
from tests.stack import NO_BRINGUP

CHAT = "/v1/chat/completions"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def problem(reply_status: int, body: bytes | str, code: str) -> dict[str, object]:
    data = json.loads(body)
    assert data["status"] == reply_status
    assert data["code"] == code
    assert data["type"].endswith(code)
    assert data["title"] and data["detail"]
    return data


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ({"x-model": MODEL}, "missing_request_id"),
        ({"x-request-id": "a b", "x-model": MODEL}, "invalid_request_id"),
        ({"x-request-id": "r" * 257, "x-model": MODEL}, "invalid_request_id"),
        ({"x-request-id": "r"}, "missing_model"),
        ({"x-request-id": "r", "x-model": MODEL, "x-priority": ""}, "invalid_priority"),
        ({"x-request-id": "r", "x-model": MODEL, "x-priority": "-1"}, "invalid_priority"),
        ({"x-request-id": "r", "x-model": MODEL, "x-priority": "4294967296"}, "invalid_priority"),
        ({"x-request-id": "r", "x-model": MODEL, "x-input-tokens": "1.5"}, "invalid_input_tokens"),
    ],
)
async def test_contract_errors_never_reach_the_engine(
    make_stack: StackFactory, headers: dict[str, str], code: str
) -> None:
    stack = await make_stack("dynamo")
    reply = await stack.client.post(f"{stack.pylon_url}{CHAT}", json=BODY, headers=headers)
    assert reply.status_code == 400
    assert reply.headers["content-type"] == "application/problem+json"
    assert reply.headers["x-stargate-retryable"] == "false"
    data = problem(400, reply.content, code)
    if code not in ("missing_request_id", "invalid_request_id"):
        assert data["request_id"] == "r"
    assert (await stack.control())["requests"] == []


async def test_duplicate_priority_is_rejected(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo")
    reply = await stack.post(
        CHAT,
        BODY,
        headers=[
            ("x-request-id", "r"),
            ("x-model", MODEL),
            ("x-priority", "1"),
            ("X-Priority", "2"),
        ],
    )
    assert reply.status_code == 400
    problem(400, reply.content, "invalid_priority")


@pytest.mark.parametrize("raw", [b"[1,2]", b"not json", b"", b'"s"', b'{"nvext": 3}'])
async def test_body_must_be_a_json_object(make_stack: StackFactory, raw: bytes) -> None:
    stack = await make_stack("dynamo")
    reply = await stack.client.post(
        f"{stack.pylon_url}{CHAT}", content=raw, headers={"x-request-id": "b", "x-model": MODEL}
    )
    assert reply.status_code == 400
    assert problem(400, reply.content, "body_not_json_object")["request_id"] == "b"
    assert (await stack.control())["requests"] == []


@pytest.mark.parametrize(
    "raw",
    [
        b'{"cache_salt":"t","x":' + b"[" * 1010 + b"]" * 1010 + b"}",  # was: RecursionError
        b'{"x":' + b"[" * 5000 + b"]" * 5000 + b"}",
        b"{" + b",".join(b'"k%d":0' % i for i in range(2000)) + b"}",
        b'{"nvext":{' + b",".join(b'"k%d":0' % i for i in range(2000)) + b"}}",
    ],
)
async def test_body_too_complex_is_400(make_stack: StackFactory, raw: bytes) -> None:
    stack = await make_stack("dynamo")
    reply = await stack.client.post(
        f"{stack.pylon_url}{CHAT}", content=raw, headers={"x-request-id": "c", "x-model": MODEL}
    )
    assert reply.status_code == 400
    assert problem(400, reply.content, "body_too_complex")["request_id"] == "c"
    assert (await stack.control())["requests"] == []


async def test_declared_body_over_limit_is_413_before_reading(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", max_body_bytes=1000)
    host, port = stack.pylon_address
    head = (
        f"POST {CHAT} HTTP/1.1\r\nhost: x\r\nx-request-id: big\r\nx-model: {MODEL}\r\n"
        "content-length: 5000\r\n\r\n"
    ).encode()
    reply = await raw_exchange(host, port, head)
    assert reply.startswith(b"HTTP/1.1 413 ")
    assert b"connection: close" in reply
    assert problem(413, reply.split(b"\r\n\r\n", 1)[1], "body_too_large")["request_id"] == "big"


async def test_chunked_body_over_limit_is_413(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", max_body_bytes=1000)
    host, port = stack.pylon_address
    chunk = b"x" * 600
    data = (
        f"POST {CHAT} HTTP/1.1\r\nhost: x\r\nx-request-id: c\r\nx-model: {MODEL}\r\n"
        "transfer-encoding: chunked\r\n\r\n"
    ).encode()
    data += b"%x\r\n%b\r\n" % (len(chunk), chunk) * 2 + b"0\r\n\r\n"
    reply = await raw_exchange(host, port, data)
    assert reply.startswith(b"HTTP/1.1 413 ")
    assert (await stack.control())["requests"] == []


async def test_header_limits_are_431(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", max_headers=10, max_header_bytes=2048)
    many = [(f"x-h{i}", "v") for i in range(20)] + [("x-request-id", "h"), ("x-model", MODEL)]
    reply = await stack.post(CHAT, BODY, headers=many)
    assert reply.status_code == 431
    problem(431, reply.content, "headers_too_large")
    reply = await stack.post(CHAT, BODY, headers={"x-big": "v" * 4000})
    assert reply.status_code == 431


@pytest.mark.parametrize(
    "raw",
    [
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n"
        b"transfer-encoding: chunked\r\n\r\n0\r\n\r\n",
        b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-model : m\r\n\r\n",
        b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-a: 1\r\n folded\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
        b"GET http://evil.example/v1/models HTTP/1.1\r\nx-request-id: r\r\nx-model: m\r\n\r\n",
        b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03garbage\r\n\r\n",
    ],
)
async def test_malformed_http_is_400_and_closes(make_stack: StackFactory, raw: bytes) -> None:
    stack = await make_stack("dynamo")
    host, port = stack.pylon_address
    reply = await raw_exchange(host, port, raw)
    assert reply.startswith(b"HTTP/1.1 400 "), reply[:100]
    assert (await stack.control())["requests"] == []


async def test_engine_down_is_503_with_retry_marking(make_stack: StackFactory) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    stack = await make_stack("dynamo", upstream=f"http://127.0.0.1:{dead_port}", **NO_BRINGUP)
    reply = await stack.post(CHAT, BODY)
    assert reply.status_code == 503
    assert reply.headers["x-stargate-retryable"] == "false"
    assert reply.headers["x-stargate-retry-reason"] == "local_connect_failure"
    problem(503, reply.content, "upstream_unavailable")
    stack = await make_stack(
        "dynamo",
        upstream=f"http://127.0.0.1:{dead_port}",
        local_connect_failures_retryable=True,
        **NO_BRINGUP,
    )
    assert (await stack.post(CHAT, BODY)).headers["x-stargate-retryable"] == "true"


@pytest.mark.parametrize(
    ("fault", "retryable", "reason", "after_ms"),
    [
        (
            {"status": 503, "retryable": True, "retry_after": "2"},
            "true",
            "upstream_admission_rejected",
            "2000",
        ),
        ({"status": 429, "retryable": True}, "true", "upstream_admission_rejected", None),
        ({"status": 503}, "false", "missing_upstream_retry_header", None),
        ({"status": 503, "retryable": False}, "false", "missing_upstream_retry_header", None),
        ({"status": 500, "retryable": True}, "false", "upstream_nonretryable_status", None),
    ],
)
async def test_upstream_status_retry_marking(
    make_stack: StackFactory,
    fault: dict[str, object],
    retryable: str,
    reason: str,
    after_ms: str | None,
) -> None:
    stack = await make_stack("dynamo")
    await stack.faults([fault])
    reply = await stack.post(CHAT, BODY)
    assert reply.status_code == fault["status"]
    assert reply.headers["x-stargate-retryable"] == retryable
    assert reply.headers["x-stargate-retry-reason"] == reason
    assert reply.headers.get("x-stargate-retry-after-ms") == after_ms
    assert "x-stargate-upstream-retryable" not in reply.headers


async def test_upstream_retry_header_not_required(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", require_upstream_retry_header=False)
    await stack.faults([{"status": 503}])
    reply = await stack.post(CHAT, BODY)
    assert reply.headers["x-stargate-retryable"] == "true"


async def sse_events(stack: object, body: dict[str, object]) -> tuple[int, list[str]]:
    reply = await stack.post(CHAT, {**body, "stream": True})  # type: ignore[attr-defined]
    events = [e for e in reply.text.split("\n\n") if e.strip()]
    return reply.status_code, events


def terminal_error(events: list[str]) -> dict[str, object]:
    last = events[-1]
    assert last.startswith("event: error\ndata: "), last
    error: dict[str, object] = json.loads(last.split("data: ", 1)[1])["error"]
    return error


async def test_first_output_timeout_ends_the_stream(make_stack: StackFactory) -> None:
    engine_ms = 10_000  # the engine's first token comes only after this
    stack = await make_stack("dynamo", mock={"ttft_ms": engine_ms}, first_output_timeout=0.3)
    started = time.monotonic()
    status, events = await sse_events(stack, {**BODY})
    # Pylon's timeout ended it, far sooner than the engine would have.
    assert time.monotonic() - started < engine_ms / 1000 / 4
    # The engine sent its head at once and then nothing: the stream ends with an error event.
    assert status == 200
    assert terminal_error(events)["code"] == "upstream_timeout"
    assert not [e for e in events if e.startswith("data: {")]


async def test_gap_timeout_ends_the_stream_with_an_error_event(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", output_gap_timeout=0.3)
    await stack.faults([{"stall_after_events": 2}])
    status, events = await sse_events(stack, {**BODY, "max_tokens": 10})
    assert status == 200
    assert len(events) == 3
    error = terminal_error(events)
    assert error["code"] == "upstream_timeout"
    assert error["type"] == "server_error"  # OpenAI's type for a server-side failure
    assert error["request_id"] == "req-1"


async def test_engine_drop_mid_stream_ends_with_an_error_event(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo")
    await stack.faults([{"drop_after_events": 2, "times": 1}])
    status, events = await sse_events(stack, {**BODY, "max_tokens": 10})
    assert status == 200
    assert terminal_error(events)["code"] == "upstream_protocol_error"
    # The broken engine connection is not reused: the next request works.
    assert (await stack.post(CHAT, BODY)).status_code == 200


async def test_oversized_sse_event_ends_the_stream(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", max_sse_event_bytes=4096)
    await stack.faults([{"huge_event_bytes": 100_000}])
    status, events = await sse_events(stack, {**BODY, "max_tokens": 10})
    assert status == 200
    error = terminal_error(events)
    assert "4096" in str(error["message"])


async def test_client_disconnect_cancels_the_engine_request_promptly(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack("dynamo", mock={"token_delay_ms": 50, "num_tokens": 400})
    host, port = stack.pylon_address
    reader, writer = await asyncio.open_connection(host, port)
    body = json.dumps({**BODY, "stream": True, "max_tokens": 400}).encode()
    writer.write(
        (
            f"POST {CHAT} HTTP/1.1\r\nhost: x\r\nx-request-id: gone\r\nx-model: {MODEL}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode()
        + body
    )
    async with asyncio.timeout(5):
        seen = b""
        while seen.count(b"data:") < 3:
            seen += await reader.read(4096)
    writer.transport.abort()
    left_at = time.time()
    # Cancelled, not completed, within 2 token delays + slack (0.5 s) of a 20 s stream.
    await assert_cancelled_promptly(stack.client, stack.mock.base_url, "gone", left_at)


async def test_pipelined_requests_answer_in_order(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo")
    host, port = stack.pylon_address
    body = json.dumps(BODY).encode()
    one = (
        f"POST {CHAT} HTTP/1.1\r\nhost: x\r\nx-request-id: p{{}}\r\nx-model: {MODEL}\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body
    data = b"".join(one.replace(b"{}", str(i).encode()) for i in range(3))
    last = (
        f"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-request-id: p3\r\nx-model: {MODEL}\r\n"
        "connection: close\r\n\r\n"
    ).encode()
    reply = await raw_exchange(host, port, data + last)
    assert reply.count(b"HTTP/1.1 200 OK") == 4
    ids = [r["headers"] for r in (await stack.control())["requests"]]
    assert [dict((k.lower(), v) for k, v in h)["x-request-id"] for h in ids] == [
        "p0",
        "p1",
        "p2",
        "p3",
    ]


async def test_expect_100_continue(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo")
    host, port = stack.pylon_address
    body = json.dumps(BODY).encode()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(
        (
            f"POST {CHAT} HTTP/1.1\r\nhost: x\r\nx-request-id: e\r\nx-model: {MODEL}\r\n"
            f"expect: 100-continue\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode()
    )
    async with asyncio.timeout(5):
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 100 Continue")
        writer.write(body)
        assert (await reader.readuntil(b"\r\n")).startswith(b"HTTP/1.1 200")
    writer.close()
    record = await stack.last_request()
    assert not [n for n, _ in record["headers"] if n.lower() == "expect"]


async def test_http10_client_gets_a_close_delimited_stream(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo")
    host, port = stack.pylon_address
    body = json.dumps({**BODY, "stream": True}).encode()
    reply = await raw_exchange(
        host,
        port,
        (
            f"POST {CHAT} HTTP/1.0\r\nx-request-id: old\r\nx-model: {MODEL}\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode()
        + body,
    )
    assert reply.startswith(b"HTTP/1.1 200 ")
    assert b"transfer-encoding" not in reply.lower()
    assert reply.rstrip().endswith(b"data: [DONE]")


async def test_no_head_before_first_output_timeout_is_504(make_stack: StackFactory) -> None:
    engine_ms = 10_000  # the engine sends nothing, not even its head, for this long
    stack = await make_stack("dynamo", first_output_timeout=0.3)
    await stack.faults([{"delay_ms": engine_ms, "times": 1}])
    started = time.monotonic()
    reply = await stack.post(CHAT, {**BODY, "stream": True})
    # Pylon's timeout answered, far sooner than the engine would have.
    assert time.monotonic() - started < engine_ms / 1000 / 4
    assert reply.status_code == 504
    problem(504, reply.content, "upstream_timeout")


async def test_stream_that_ends_without_output_is_an_error(make_stack: StackFactory) -> None:
    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"connection: close\r\n\r\n: keep-alive comment\n\n"
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(engine, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        stack = await make_stack("dynamo", upstream=f"http://127.0.0.1:{port}", **NO_BRINGUP)
        status, events = await sse_events(stack, {**BODY})
    finally:
        server.close()
    assert status == 200
    assert events[0] == ": keep-alive comment"
    error = terminal_error(events)
    assert error["code"] == "upstream_protocol_error"
    assert "before any output" in str(error["message"])


@pytest.mark.parametrize("where", ["value", "name", "after_a_request"])
async def test_one_endless_header_line_is_refused_as_it_arrives(
    make_stack: StackFactory, where: str
) -> None:
    """httptools holds an unfinished field line whole (and copies it on every read) before any
    callback can count it: the head's bytes are counted as they are fed, so a line that never
    ends is a 431 once the head limit is passed, not a head buffered until the stall timeout."""
    stack = await make_stack("dynamo", max_header_bytes=2048, quic_listen=None)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
    endless = {"value": b"x-big: " + b"v" * 64 * 1024, "name": b"x" * 64 * 1024}
    if where == "after_a_request":
        # A whole request first, on the same connection and in the same write: the count
        # starts at the second request's first byte.
        body = json.dumps(BODY).encode()
        whole = (
            head
            + f"x-request-id: first\r\nx-model: {MODEL}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        )
        data = whole + body + head + endless["value"]
    else:
        data = head + endless[where]
    host, port = stack.pylon_address
    reply = await raw_exchange(host, port, data, timeout=5.0)
    # The line never ended: only the count of what arrived can have refused it.
    last = reply.rfind(b"HTTP/1.1 ")
    assert reply[last:].startswith(b"HTTP/1.1 431 "), reply[:200]
    problem(431, reply[reply.index(b"\r\n\r\n", last) + 4 :], "headers_too_large")
    if where == "after_a_request":
        assert reply.startswith(b"HTTP/1.1 200 ")
