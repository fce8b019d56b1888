"""HTTP/2 malformed input and limits: each bad stream gets its answer, and only that stream.

Every case runs beside a live SSE stream on the same connection (the "survivor"), which must
finish normally, and is followed by a fresh request on the same connection; the engine must
see neither the bad request nor anything from it (RFC 9113 8.1.1: never forward malformed).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from h2.errors import ErrorCodes
from h2.settings import SettingCodes

from tests.integration.conftest import MODEL, Stack, StackFactory
from tests.transport.h2client import H2Client, H2Response, request_headers

Header = tuple[bytes, bytes]
BODY = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
).encode()
SSE_BODY = json.dumps(
    {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 10,
        "stream": True,
    }
).encode()
BASE = request_headers(request_id="bad")
PSEUDO, REGULAR = BASE[:4], BASE[4:]


def without(name: bytes) -> list[Header]:
    return [field for field in BASE if field[0] != name]


def replaced(name: bytes, value: bytes) -> list[Header]:
    return [(n, value if n == name else v) for n, v in BASE]


MALFORMED: dict[str, list[Header]] = {
    "connection": [*BASE, (b"connection", b"keep-alive")],
    "keep_alive": [*BASE, (b"keep-alive", b"timeout=5")],
    "proxy_connection": [*BASE, (b"proxy-connection", b"close")],
    "transfer_encoding": [*BASE, (b"transfer-encoding", b"chunked")],
    "upgrade": [*BASE, (b"upgrade", b"h2c")],
    "te_gzip": [*BASE, (b"te", b"gzip")],
    "uppercase_name": [*BASE, (b"X-Upper", b"1")],
    "space_in_name": [*BASE, (b"x bad", b"1")],
    "colon_in_name": [*BASE, (b"x:bad", b"1")],
    "value_crlf": [*BASE, (b"x-evil", b"a\r\nx-injected: 1")],
    "value_lf": [*BASE, (b"x-evil", b"a\nb")],
    "value_nul": [*BASE, (b"x-evil", b"a\x00b")],
    "value_leading_space": [*BASE, (b"x-evil", b" a")],
    "value_trailing_tab": [*BASE, (b"x-evil", b"a\t")],
    "pseudo_after_regular": [*REGULAR, *PSEUDO],
    "repeated_path": [*PSEUDO, (b":path", b"/v1/models"), *REGULAR],
    "repeated_method": [(b":method", b"POST"), *PSEUDO, *REGULAR],
    "unknown_pseudo": [*PSEUDO, (b":protocol", b"websocket"), *REGULAR],
    "missing_method": without(b":method"),
    "missing_scheme": without(b":scheme"),
    "missing_path": without(b":path"),
    "empty_path": replaced(b":path", b""),
    "method_with_space": replaced(b":method", b"GET /x"),
    "path_with_space": replaced(b":path", b"/v1/chat/completions HTTP/1.1"),
    "path_with_crlf": replaced(b":path", b"/v1/x\r\nhost: evil"),
    "absolute_path": replaced(b":path", b"http://evil.example/v1/models"),
    "host_differs": [*BASE, (b"host", b"evil.example")],
    "authority_userinfo": replaced(b":authority", b"user@127.0.0.1"),
    "content_length_not_digits": [*BASE, (b"content-length", b"abc")],
    "content_length_conflict": [*BASE, (b"content-length", b"3"), (b"content-length", b"4")],
    "scheme_not_a_scheme": replaced(b":scheme", b"ht tp"),
    "missing_authority": without(b":authority"),
    "two_hosts_no_authority": [*without(b":authority"), (b"host", b"a"), (b"host", b"a")],
    "network_path": replaced(b":path", b"//evil.example/v1/models"),
}


@pytest.fixture
async def h2_pair(make_stack: StackFactory) -> AsyncIterator[Callable[..., Awaitable[Pair]]]:
    clients: list[H2Client] = []

    async def factory(**settings: Any) -> Pair:
        stack = await make_stack(
            "dynamo", mock={"num_tokens": 10, "token_delay_ms": 20}, **settings
        )
        client = await H2Client.connect(stack.pylon_address)
        clients.append(client)
        return Pair(stack, client)

    yield factory
    for client in clients:
        await client.close()


class Pair:
    """A stack, a connection to it, and the survivor stream on that connection."""

    def __init__(self, stack: Stack, client: H2Client) -> None:
        self.stack = stack
        self.client = client
        self.survivor = client.send(request_headers(request_id="survivor"), SSE_BODY)

    async def check_isolated(self, bad_request_ids: tuple[str, ...] = ("bad",)) -> None:
        survivor = await self.client.response(self.survivor)
        assert survivor.status == 200 and survivor.reset_code is None
        assert survivor.body.rstrip().endswith(b"data: [DONE]")
        fresh = await self.client.response(
            self.client.send(request_headers(request_id="fresh"), BODY)
        )
        assert fresh.status == 200
        assert self.client.terminated is None, "the connection was closed"
        seen = [
            dict((k.lower(), v) for k, v in record["headers"])["x-request-id"]
            for record in (await self.stack.control())["requests"]
        ]
        assert sorted(seen) == ["fresh", "survivor"], seen
        assert not set(seen) & set(bad_request_ids)


def problem_code(reply: H2Response) -> str:
    assert reply.header(b"content-type") == b"application/problem+json"
    code: str = reply.json()["code"]
    return code


# h2 itself checks content-length syntax while decoding HEADERS and drops the decoded fields, so
# pylon answers those two without the request id (documented in docs/api-contract.md).
_NO_REQUEST_ID = {"content_length_conflict", "content_length_not_digits"}


def assert_malformed_answer(reply: H2Response, case: str) -> None:
    """One fault, one answer on every transport: a 400 problem on that stream only (RFC 9113
    8.1.1 allows a response before the stream is reset; the reset, if any, is NO_ERROR)."""
    assert reply.status == 400, (reply.status, reply.reset_code)
    assert problem_code(reply) == "malformed_request"
    expected_id = None if case in _NO_REQUEST_ID else "bad"
    assert reply.json().get("request_id") == expected_id
    assert reply.reset_code in (None, ErrorCodes.NO_ERROR)


@pytest.mark.parametrize("case", sorted(MALFORMED))
async def test_malformed_header_block_is_a_400_on_that_stream_only(
    h2_pair: Callable[..., Awaitable[Pair]], case: str
) -> None:
    pair = await h2_pair()
    reply = await pair.client.response(pair.client.send(MALFORMED[case], BODY))
    assert_malformed_answer(reply, case)
    await pair.check_isolated()


@pytest.mark.parametrize(("declared", "sent"), [(b"100", BODY), (b"2", BODY)])
async def test_content_length_differing_from_data_is_a_400_on_that_stream_only(
    h2_pair: Callable[..., Awaitable[Pair]], declared: bytes, sent: bytes
) -> None:
    pair = await h2_pair()
    reply = await pair.client.response(
        pair.client.send([*BASE, (b"content-length", declared)], sent)
    )
    assert reply.status == 400, (reply.status, reply.reset_code)
    assert problem_code(reply) == "malformed_request"
    assert reply.reset_code in (None, ErrorCodes.NO_ERROR)
    await pair.check_isolated()


async def test_te_trailers_is_accepted_and_not_forwarded(
    h2_pair: Callable[..., Awaitable[Pair]],
) -> None:
    pair = await h2_pair()
    headers = [*request_headers(request_id="fresh"), (b"te", b"trailers")]
    reply = await pair.client.response(pair.client.send(headers, BODY))
    assert reply.status == 200
    record = (await pair.stack.control())["requests"][-1]
    assert "te" not in [name.lower() for name, _ in record["headers"]]


async def test_too_many_headers_is_431(h2_pair: Callable[..., Awaitable[Pair]]) -> None:
    pair = await h2_pair(max_headers=10)
    many = [*BASE, *((f"x-h{i}".encode(), b"v") for i in range(20))]
    reply = await pair.client.response(pair.client.send(many, BODY))
    assert reply.status == 431
    assert problem_code(reply) == "headers_too_large"
    await pair.check_isolated()


async def test_header_bytes_over_limit_is_431(h2_pair: Callable[..., Awaitable[Pair]]) -> None:
    pair = await h2_pair(max_header_bytes=2048)
    assert pair.client.remote_setting(SettingCodes.MAX_HEADER_LIST_SIZE) == 2048
    reply = await pair.client.response(pair.client.send([*BASE, (b"x-big", b"v" * 4000)], BODY))
    assert reply.status == 431
    # A 48 KiB :method (Envoy's CVE-2019-18801 case): refused, never forwarded.
    huge_method = replaced(b":method", b"P" * 48 * 1024)
    reply = await pair.client.response(pair.client.send(huge_method, BODY))
    assert reply.status == 431 or reply.reset_code is not None
    await pair.check_isolated()


async def test_hpack_bomb_past_the_hard_cap_is_a_connection_error(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", max_header_bytes=2048)
    client = await H2Client.connect(stack.pylon_address)
    try:
        client.send([*BASE, (b"x-huge", b"v" * 200_000)], BODY)
        async with asyncio.timeout(5):
            await client.closed.wait()
        assert client.terminated is not None
        assert client.terminated.error_code == ErrorCodes.ENHANCE_YOUR_CALM
        assert (await stack.control())["requests"] == []
    finally:
        await client.close()


async def test_declared_body_over_limit_is_413_at_headers(
    h2_pair: Callable[..., Awaitable[Pair]],
) -> None:
    pair = await h2_pair(max_body_bytes=1000)
    sid = pair.client.send([*BASE, (b"content-length", b"5000")], end=False)
    reply = await pair.client.response(sid)
    assert reply.status == 413
    assert problem_code(reply) == "body_too_large"
    assert reply.json()["request_id"] == "bad"
    # The client was told to stop sending its body, without an error (RFC 9113 8.1).
    assert reply.reset_code in (None, ErrorCodes.NO_ERROR)
    await pair.check_isolated()


async def test_streamed_body_over_limit_is_413(h2_pair: Callable[..., Awaitable[Pair]]) -> None:
    pair = await h2_pair(max_body_bytes=1000)
    sid = pair.client.send(BASE, b"x" * 600, end=False)
    pair.client.send_data(sid, b"x" * 600, end=False)
    reply = await pair.client.response(sid)
    assert reply.status == 413
    await pair.check_isolated()


async def test_contract_error_is_400_at_headers(h2_pair: Callable[..., Awaitable[Pair]]) -> None:
    pair = await h2_pair()
    sid = pair.client.send(without(b"x-request-id"), end=False)  # body never sent
    reply = await pair.client.response(sid)
    assert reply.status == 400
    assert problem_code(reply) == "missing_request_id"
    await pair.check_isolated()


async def test_streams_past_the_concurrency_limit_are_refused(make_stack: StackFactory) -> None:
    stack = await make_stack(
        "dynamo", mock={"num_tokens": 5, "token_delay_ms": 40}, h2_max_concurrent_streams=3
    )
    client = await H2Client.connect(stack.pylon_address)
    try:
        assert client.remote_setting(SettingCodes.MAX_CONCURRENT_STREAMS) == 3
        client.ignore_stream_limit()
        # A client ignoring the advertised limit: the fourth stream is refused, not the rest.
        ids = [client.send(request_headers(request_id=f"c{i}"), SSE_BODY) for i in range(4)]
        replies = [await client.response(sid) for sid in ids]
        assert [r.status for r in replies[:3]] == [200, 200, 200]
        assert replies[3].reset_code == ErrorCodes.REFUSED_STREAM
        again = await client.response(client.send(request_headers(request_id="again"), BODY))
        assert again.status == 200
        assert client.terminated is None
    finally:
        await client.close()


async def test_idle_connection_gets_goaway(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", client_idle_timeout=0.3)
    client = await H2Client.connect(stack.pylon_address)
    try:
        reply = await client.response(client.send(request_headers(request_id="i"), BODY))
        assert reply.status == 200
        async with asyncio.timeout(3):
            await client.closed.wait()
        assert client.terminated is not None
        assert client.terminated.error_code == ErrorCodes.NO_ERROR
    finally:
        await client.close()


async def test_busy_stream_outlives_the_idle_timeout(make_stack: StackFactory) -> None:
    stack = await make_stack(
        "dynamo", mock={"num_tokens": 10, "token_delay_ms": 60}, client_idle_timeout=0.2
    )
    client = await H2Client.connect(stack.pylon_address)
    try:
        reply = await client.response(client.send(request_headers(request_id="b"), SSE_BODY))
        assert reply.status == 200
        assert reply.body.rstrip().endswith(b"data: [DONE]")
    finally:
        await client.close()


async def test_silent_connection_is_closed_after_the_header_timeout(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack("dynamo", header_timeout=0.3)
    reader, writer = await asyncio.open_connection(*stack.pylon_address)
    writer.write(b"PRI * HTTP/2.0\r\n")  # half a preface, then nothing
    async with asyncio.timeout(3):
        assert await reader.read() == b""
    writer.close()


async def test_connection_silent_after_its_preface_is_closed_after_the_header_timeout(
    make_stack: StackFactory,
) -> None:
    """A whole preface and SETTINGS, then nothing: no request ever started, so neither a stream's
    stall clock nor the idle timer after a response would end it."""
    stack = await make_stack("dynamo", header_timeout=0.3, client_idle_timeout=60.0)
    client = await H2Client.connect(stack.pylon_address)
    try:
        async with asyncio.timeout(3):
            await client.closed.wait()
        assert client.terminated is not None
        assert client.terminated.error_code == ErrorCodes.NO_ERROR
    finally:
        await client.close()


async def test_stalled_request_body_is_408_on_that_stream_only(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", header_timeout=0.3)
    h2 = await H2Client.connect(stack.pylon_address)
    try:
        stalled = h2.send(request_headers(request_id="slow-body"), b'{"model"', end=False)
        healthy = h2.send(
            request_headers(request_id="fine"),
            json.dumps({"model": "mock-model", "messages": [], "max_tokens": 2}).encode(),
        )
        assert (await h2.response(healthy)).status == 200
        reply = await h2.response(stalled, timeout=3)
        assert reply.status == 408
        assert reply.json()["code"] == "request_timeout"
        assert reply.json()["request_id"] == "slow-body"
        again = h2.send(
            request_headers(request_id="after"),
            json.dumps({"model": "mock-model", "messages": [], "max_tokens": 2}).encode(),
        )
        assert (await h2.response(again)).status == 200
    finally:
        await h2.close()
