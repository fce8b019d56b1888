"""One contract suite, the same cases over HTTP/1.1, HTTP/2 (h2c) and HTTP/3, through one pylon.

A single pylon process-in-the-loop serves TCP (HTTP/1.1 and h2c on one port) and QUIC; every case
below runs once per protocol and asserts on what reached mock_dynamo's /test-control.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from pylon.core.sanitize import DENIED_BODY_FIELDS, DENIED_REQUEST_HEADERS
from tests.integration.test_forwarding import spoofed_body, spoofed_headers
from tests.stack import MODEL, StackFactory

CHAT = "/v1/chat/completions"
PROTOCOLS = ["http1", "h2", "h3"]


@pytest.fixture
def pylon(make_stack: StackFactory) -> StackFactory:
    """One pylon serving TCP (HTTP/1.1, h2c) and QUIC (HTTP/3), in front of mock_dynamo."""
    return make_stack


def chat(**extra: Any) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return json.dumps({**body, **extra}).encode()


def tunnel(**extra: str) -> list[tuple[str, str]]:
    return [("x-request-id", "req-1"), ("x-model", MODEL), *extra.items()]


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("backend", ["dynamo", "vllm", "sglang", "passthrough"])
async def test_spoofed_controls_never_reach_the_engine(
    pylon: StackFactory, protocol: str, backend: str
) -> None:
    stack = await pylon(backend)
    # HTTP/2 and HTTP/3 forbid upper-case names on the wire; case variety is HTTP/1.1's.
    headers = [(n.lower() if protocol != "http1" else n, v) for n, v in spoofed_headers()]
    reply = await stack.send(protocol, CHAT, headers, json.dumps(spoofed_body(backend)).encode())
    assert reply.status == 200, reply.body
    record = (await stack.records())[-1]
    names = [name.lower() for name, _ in record["headers"]]
    assert not {n.decode() for n in DENIED_REQUEST_HEADERS} & set(names)
    assert not [n for n in names if n.startswith(("x-stargate-", "x-smg-", "x-override-"))]
    dynamo = sorted(n for n in names if n.startswith("x-dynamo-"))
    body = record["body"]
    assert not (set(DENIED_BODY_FIELDS) - {"priority"}) & set(body)
    assert body["seed"] == 2**70
    if backend == "dynamo":
        assert dynamo == ["x-dynamo-request-priority", "x-dynamo-request-strict-priority"]
        priority = [v for n, v in record["headers"] if n.lower() == "x-dynamo-request-priority"]
        assert priority == ["3593"]
    else:
        assert dynamo == []
    expected_body_priority = {"vllm": 7, "sglang": 3593}.get(backend)
    assert body.get("priority") == expected_body_priority


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(
    ("headers", "body", "status", "code"),
    [
        ([("x-model", MODEL)], chat(), 400, "missing_request_id"),
        ([("x-request-id", "r")], chat(), 400, "missing_model"),
        (tunnel(**{"x-priority": "-1"}), chat(), 400, "invalid_priority"),
        (tunnel(**{"x-priority": "4294967296"}), chat(), 400, "invalid_priority"),
        (tunnel(**{"x-input-tokens": "x"}), chat(), 400, "invalid_input_tokens"),
        (tunnel(), b"[1]", 400, "body_not_json_object"),
        (tunnel(), b"{", 400, "body_not_json_object"),
        (tunnel(), b'{"nvext": []}', 400, "body_not_json_object"),
    ],
)
async def test_bad_input_gets_a_problem_and_never_reaches_the_engine(
    pylon: StackFactory,
    protocol: str,
    headers: list[tuple[str, str]],
    body: bytes,
    status: int,
    code: str,
) -> None:
    stack = await pylon()
    reply = await stack.send(protocol, CHAT, headers, body)
    assert reply.status == status
    assert reply.headers["content-type"] == "application/problem+json"
    problem = reply.json()
    assert (problem["status"], problem["code"]) == (status, code)
    assert await stack.records() == []


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_body_limit_is_413(pylon: StackFactory, protocol: str) -> None:
    stack = await pylon(max_body_bytes=1000)
    reply = await stack.send(protocol, CHAT, tunnel(), chat(pad="x" * 2000))
    assert reply.status == 413
    assert reply.json()["code"] == "body_too_large"
    assert await stack.records() == []


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_sse_reaches_the_client_whole(pylon: StackFactory, protocol: str) -> None:
    stack = await pylon()
    reply = await stack.send(protocol, CHAT, tunnel(), chat(stream=True, max_tokens=6))
    assert reply.status == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = [e for e in reply.body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert all(e.startswith(b"data: ") for e in events)


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_health_bypasses_the_contract(pylon: StackFactory, protocol: str) -> None:
    stack = await pylon()
    reply = await stack.send(protocol, "/health", [], b"", method="GET")
    assert reply.status == 200
    assert (await stack.records())[-1]["path"] == "/health"


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_engine_sees_only_pylons_host_and_content_length(
    pylon: StackFactory, protocol: str
) -> None:
    """The client's framing never reaches the engine: a second Host or Content-Length beside
    pylon's would let the engine read the request differently (the body below is re-encoded, so
    the client's length is wrong for it)."""
    stack = await pylon("dynamo")
    body = chat(cache_salt="tenant-b")  # stripped: the forwarded body is shorter
    headers = tunnel()
    if protocol == "h3":  # httpx writes its own for HTTP/1.1 and HTTP/2
        headers.append(("content-length", str(len(body))))
    reply = await stack.send(protocol, CHAT, headers, body)
    assert reply.status == 200, reply.body
    record = (await stack.records())[-1]
    hosts = [value for name, value in record["headers"] if name.lower() == "host"]
    lengths = [value for name, value in record["headers"] if name.lower() == "content-length"]
    assert hosts == [str(stack.mock.base_url).split("://", 1)[1].rstrip("/")]
    assert "cache_salt" not in record["body"]
    assert len(lengths) == 1 and int(lengths[0]) < len(body), (lengths, len(body))
