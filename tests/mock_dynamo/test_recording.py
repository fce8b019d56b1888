"""Records keep what arrived on the wire: raw target, raw query, raw body bytes, HTTP version."""

from __future__ import annotations

import base64
import gzip

import httpx
import orjson

from mock_dynamo.server import MockServer
from tests.mock_dynamo.conftest import raw_exchange, snapshot

LEGACY_KEYS = {
    "method",
    "path",
    "model",
    "headers",
    "body",
    "received_at",
    "cancelled_at",
    "completed_at",
    "status",
}
NEW_KEYS = {"raw_path", "query_string", "body_b64", "body_bytes", "http_version", "kv"}


def _raw_request(
    target: bytes, body: bytes, version: bytes = b"HTTP/1.1", extra: bytes = b""
) -> bytes:
    return (
        b"POST " + target + b" " + version + b"\r\n"
        b"Host: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\n" + extra + b"Content-Length: "
        b"" + str(len(body)).encode() + b"\r\n"
        b"Connection: close\r\n\r\n" + body
    )


async def _last(client: httpx.AsyncClient) -> dict[str, object]:
    record: dict[str, object] = (await snapshot(client))["requests"][-1]
    return record


async def test_query_and_odd_body_recorded_byte_for_byte(
    mock: MockServer, client: httpx.AsyncClient
) -> None:
    # Odd spacing, escaped and raw non-ASCII, an escaped quote, trailing whitespace:
    # re-serialising the parsed body would change every one of these bytes.
    body = (
        b'{ "model" :"mock-model",\n\t"messages":[ {"role":"user",'
        b'"content":"caf\\u00e9 \\ud83d\\ude00 \\"q\\" \xc3\xa9\\/"} ] ,'
        b'  "max_tokens" : 2 }  \r\n'
    )
    target = b"/v1/chat/completions?api-version=2024%2D10&x=a+b&flag&e=%E2%9C%93&sp=%20"
    reply = await raw_exchange(mock.port, _raw_request(target, body))
    assert reply.startswith(b"HTTP/1.1 200")
    record = await _last(client)
    assert set(record) == LEGACY_KEYS | NEW_KEYS
    assert record["raw_path"] == target.decode()
    assert record["query_string"] == "api-version=2024%2D10&x=a+b&flag&e=%E2%9C%93&sp=%20"
    assert record["path"] == "/v1/chat/completions"
    assert isinstance(record["body_b64"], str)
    assert base64.b64decode(record["body_b64"], validate=True) == body
    assert record["body_bytes"] == len(body)
    assert record["body"] == {
        "model": "mock-model",
        "messages": [{"role": "user", "content": 'café \U0001f600 "q" é/'}],
        "max_tokens": 2,
    }
    assert record["http_version"] == "HTTP/1.1"
    assert record["status"] == 200 and record["model"] == "mock-model"


async def test_no_query_no_body(client: httpx.AsyncClient) -> None:
    await client.get("/v1/models")
    record = await _last(client)
    assert record["raw_path"] == "/v1/models" == record["path"]
    assert record["query_string"] == ""
    assert record["body_b64"] == "" and record["body_bytes"] == 0 and record["body"] is None


async def test_empty_query_and_encoded_path(mock: MockServer, client: httpx.AsyncClient) -> None:
    request = b"GET /v1/mod%65ls? HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    assert (await raw_exchange(mock.port, request)).startswith(b"HTTP/1.1 200")
    record = await _last(client)
    # Routed (and `path` recorded) decoded; the raw target keeps the escape and the bare `?`.
    assert record["path"] == "/v1/models" and record["raw_path"] == "/v1/mod%65ls?"
    assert record["query_string"] == ""


async def test_httpx_params_reach_the_record(client: httpx.AsyncClient) -> None:
    await client.get("/health", params={"b": "2", "a": "x y/é"})
    record = await _last(client)
    assert record["query_string"] == "b=2&a=x+y%2F%C3%A9"
    assert record["raw_path"] == "/health?b=2&a=x+y%2F%C3%A9"


async def test_http_1_0_version_recorded(mock: MockServer, client: httpx.AsyncClient) -> None:
    body = b'{"model":"mock-model","prompt":"x","max_tokens":1}'
    reply = await raw_exchange(mock.port, _raw_request(b"/v1/completions", body, b"HTTP/1.0"))
    assert reply.startswith(b"HTTP/1.1 200") or reply.startswith(b"HTTP/1.0 200")
    record = await _last(client)
    assert record["http_version"] == "HTTP/1.0"
    assert base64.b64decode(str(record["body_b64"])) == body


async def test_chunked_body_recorded_without_framing(
    mock: MockServer, client: httpx.AsyncClient
) -> None:
    body = b'{"model":"mock-model",  "prompt":"chunked","max_tokens":1}'
    head, tail = body[:10], body[10:]
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        + f"{len(head):x}\r\n".encode()
        + head
        + b"\r\n"
        + f"{len(tail):x}\r\n".encode()
        + tail
        + b"\r\n0\r\n\r\n"
    )
    assert (await raw_exchange(mock.port, request)).startswith(b"HTTP/1.1 200")
    record = await _last(client)
    assert base64.b64decode(str(record["body_b64"])) == body
    assert record["body_bytes"] == len(body)


async def test_content_encoded_body_is_not_decompressed(
    mock: MockServer, client: httpx.AsyncClient
) -> None:
    plain = orjson.dumps({"model": "mock-model", "prompt": "x", "max_tokens": 1})
    packed = gzip.compress(plain)
    request = _raw_request(b"/v1/completions", packed, extra=b"Content-Encoding: gzip\r\n")
    reply = await raw_exchange(mock.port, request)
    # An engine that does not undo Content-Encoding sees bytes that are not JSON.
    assert reply.startswith(b"HTTP/1.1 400")
    record = await _last(client)
    assert base64.b64decode(str(record["body_b64"])) == packed
    assert record["body_bytes"] == len(packed) and record["body"] is None
