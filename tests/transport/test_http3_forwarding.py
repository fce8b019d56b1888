"""Pylon over HTTP/3 in front of mock_dynamo: the core's contract, strip and derive, SSE relay and
cancellation, exercised through aioquic's client."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
from aioquic.quic.events import ConnectionTerminated, QuicEvent

from pylon.core.sanitize import DENIED_BODY_FIELDS, DENIED_REQUEST_HEADERS
from pylon.server.http3 import Http3Protocol
from tests.cancellation import assert_cancelled_promptly, wait_for_record
from tests.h3client import CHAT, MODEL, chat, request_headers, sse_payloads
from tests.integration.test_forwarding import spoofed_body, spoofed_headers
from tests.stack import StackFactory


def _values(record: dict[str, object], name: str) -> list[str]:
    headers = record["headers"]
    assert isinstance(headers, list)
    return [value for key, value in headers if key.lower() == name]


@pytest.mark.parametrize("backend", ["dynamo", "vllm", "sglang", "passthrough"])
async def test_strip_and_derive_over_h3(make_stack: StackFactory, backend: str) -> None:
    stack = await make_stack(backend)
    # HTTP/3 field names are lowercase on the wire (uppercase would be a malformed message).
    headers = [(name.lower(), value) for name, value in spoofed_headers()]
    async with stack.connect() as client:
        reply = await client.request(CHAT, spoofed_body(backend), headers)
    assert reply.status == 200, reply.body
    record = await stack.last_request()
    names = [name.lower() for name, _ in record["headers"]]
    for denied in DENIED_REQUEST_HEADERS:
        assert denied.decode() not in names
    assert not [n for n in names if n.startswith(("x-stargate-", "x-smg-", "x-override-"))]
    body = record["body"]
    for key in DENIED_BODY_FIELDS:
        if key != "priority":
            assert key not in body
    assert body["seed"] == 2**70
    dynamo_headers = sorted(n for n in names if n.startswith("x-dynamo-"))
    if backend == "dynamo":
        assert dynamo_headers == ["x-dynamo-request-priority", "x-dynamo-request-strict-priority"]
        assert _values(record, "x-dynamo-request-priority") == [str(3600 - 7)]
    else:
        assert dynamo_headers == []
    if backend in ("vllm", "sglang"):
        assert body["priority"] == (7 if backend == "vllm" else 3600 - 7)
    else:
        assert "priority" not in body
    assert _values(record, "x-request-id") == ["spoof-1"]


async def test_authority_becomes_host_and_pseudo_headers_do_not_leak(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack("dynamo")
    async with stack.connect() as client:
        reply = await client.request(CHAT, chat())
    assert reply.status == 200
    assert reply.json()["object"] == "chat.completion"
    names = [name for name, _ in reply.headers]
    assert names == [name.lower() for name in names]
    assert b"transfer-encoding" not in names and b"connection" not in names
    record = await stack.last_request()
    assert not [name for name, _ in record["headers"] if name.startswith(":")]


async def test_sse_is_relayed_event_by_event(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", mock={"token_delay_ms": 60, "num_tokens": 5})
    async with stack.connect() as client:
        reply = await client.request(CHAT, chat(stream=True, max_tokens=5), timeout=10)
    assert reply.status == 200
    assert (
        reply.header(
            b"content-type",
        )
        == b"text/event-stream"
    )
    assert reply.body.rstrip().endswith(b"data: [DONE]")
    assert len(sse_payloads(reply.body)) >= 5
    # Each token arrives on its own, about one token delay after the previous one.
    arrivals = [at for at, data in reply.chunks if b"data:" in data]
    assert len(arrivals) >= 5
    gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    assert sum(gap > 0.03 for gap in gaps) >= 3, gaps


async def test_contract_error_is_answered_before_the_body(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo")
    async with stack.connect() as client:
        headers = request_headers(extra=[("x-model", MODEL)])  # no x-request-id
        # Headers only, the body never comes: the answer must not wait for it.
        reply = await client.send(headers, body=None, end=False).wait(3)
    assert reply.status == 400
    assert reply.header(b"content-type") == b"application/problem+json"
    assert reply.json()["code"] == "missing_request_id"
    assert (await stack.control())["requests"] == []


async def test_health_bypasses_the_contract(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo")
    async with stack.connect() as client:
        reply = await client.request("/health", method="GET", headers=[])
    assert reply.status == 200


async def test_many_concurrent_streams_on_one_connection(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", mock={"token_delay_ms": 5, "num_tokens": 4})
    async with stack.connect() as client:
        replies = await asyncio.gather(
            *(
                client.request(
                    CHAT, chat(stream=i % 2 == 0), [("x-request-id", f"c{i}"), ("x-model", MODEL)]
                )
                for i in range(24)
            )
        )
    assert [reply.status for reply in replies] == [200] * 24
    ids = sorted(_values(r, "x-request-id")[0] for r in (await stack.control())["requests"])
    assert ids == sorted(f"c{i}" for i in range(24))


async def test_client_reset_cancels_the_engine_request_promptly(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack("dynamo", mock={"token_delay_ms": 50, "num_tokens": 400})
    async with stack.connect() as client:
        body = b'{"model": "mock-model", "stream": true, "max_tokens": 400, "messages": []}'
        extra = [("x-request-id", "h3-reset"), ("x-model", MODEL)]
        reply = client.send(request_headers(extra=extra, body=body), body)
        await client.wait_until(lambda: reply.body.count(b"data:") >= 3, what="3 SSE events")
        client.reset(reply.stream_id)
        reset_at = time.time()
        # Cancelled, not completed, within 2 token delays + slack (0.5 s) of a 20 s stream.
        await assert_cancelled_promptly(stack.client, stack.mock.base_url, "h3-reset", reset_at)
        # The connection itself stays usable.
        again = await client.request(CHAT, chat())
        assert again.status == 200


@pytest.mark.interpreted
async def test_connection_loss_cancels_the_engine_request(
    make_stack: StackFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    token_delay_ms, num_tokens = 50, 400
    stack = await make_stack(
        "dynamo", mock={"token_delay_ms": token_delay_ms, "num_tokens": num_tokens}
    )
    # When pylon learns the connection is gone: on receipt of the CONNECTION_CLOSE (see the
    # next test for the draining period aioquic would otherwise wait out).
    terminated: asyncio.Future[float] = asyncio.get_running_loop().create_future()
    forget = stack.server.forget

    def forget_and_note(protocol: Http3Protocol) -> None:
        forget(protocol)
        if not terminated.done():
            terminated.set_result(time.time())

    monkeypatch.setattr(stack.server, "forget", forget_and_note)
    async with stack.connect() as client:
        body = b'{"model": "mock-model", "stream": true, "max_tokens": 400, "messages": []}'
        extra = [("x-request-id", "h3-lost"), ("x-model", MODEL)]
        reply = client.send(request_headers(extra=extra, body=body), body)
        await client.wait_until(lambda: reply.body.count(b"data:") >= 2, what="2 SSE events")
        client.close()
        closed_at = time.time()
    async with asyncio.timeout(5):
        terminated_at = await terminated
    # The draining period is a few RTTs, far below the 20 s the stream would run.
    stream_s = num_tokens * token_delay_ms / 1000
    assert terminated_at - closed_at < stream_s / 10, "pylon heard of the close too late"
    # From there the engine sees it cancelled, not completed, within 2 token delays + slack.
    await assert_cancelled_promptly(stack.client, stack.mock.base_url, "h3-lost", terminated_at)


async def test_a_client_close_reaches_the_engine_before_the_draining_period_ends(
    make_stack: StackFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pylon cancels on receipt of the client's CONNECTION_CLOSE, not when aioquic reports it
    (ConnectionTerminated, at the end of its draining period, 3 PTO): the engine sees the
    cancel well within that period, which this test measures rather than assumes."""
    stack = await make_stack("dynamo", mock={"token_delay_ms": 2, "num_tokens": 20000})
    reported: asyncio.Future[float] = asyncio.get_running_loop().create_future()
    received = Http3Protocol.quic_event_received

    def note_terminated(protocol: Http3Protocol, event: QuicEvent) -> None:
        if isinstance(event, ConnectionTerminated) and not reported.done():
            reported.set_result(time.time())
        received(protocol, event)

    monkeypatch.setattr(Http3Protocol, "quic_event_received", note_terminated)
    async with stack.connect() as client:
        body = b'{"model": "mock-model", "stream": true, "max_tokens": 20000, "messages": []}'
        extra = [("x-request-id", "h3-close"), ("x-model", MODEL)]
        reply = client.send(request_headers(extra=extra, body=body), body)
        await client.wait_until(lambda: reply.body.count(b"data:") >= 2, what="2 SSE events")
        client.close()
        closed_at = time.time()
    async with asyncio.timeout(5):
        reported_at = await reported
    draining = reported_at - closed_at
    record = await wait_for_record(stack.client, stack.mock.base_url, "h3-close", "finished")
    assert record["cancelled_at"] is not None, record
    lag = float(record["cancelled_at"]) - closed_at
    assert lag < draining / 2, (
        f"the engine saw the cancel {lag * 1000:.0f} ms after the client's close; aioquic's "
        f"draining period was {draining * 1000:.0f} ms"
    )
