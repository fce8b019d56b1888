"""Errors speak the clients' language, on HTTP/1.1, HTTP/2 and HTTP/3 alike.

- pylon's problem bodies keep RFC 9457 and carry an OpenAI-style `error` member (what OpenAI
  SDKs show as the reason);
- every response pylon sends, its own and the engine's it relays, echoes the request's valid
  `x-request-id` exactly once (the engine's copy never makes a second);
- `x-should-retry` (the OpenAI SDKs' retry switch) says what `x-stargate-retryable` says,
  wherever that is set, and an engine's own `x-should-retry` never passes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.stack import MODEL, NO_BRINGUP, PROTOCOLS, Reply, StackFactory

CHAT = "/v1/chat/completions"


def chat(**extra: Any) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return json.dumps({**body, **extra}).encode()


def assert_problem(reply: Reply, status: int, code: str, request_id: str | None) -> None:
    assert reply.status == status, reply.body
    assert reply.headers["content-type"] == "application/problem+json"
    body = reply.json()
    # RFC 9457, as before.
    assert body["status"] == status and body["code"] == code
    assert body["type"].endswith("/" + code) and body["title"] and body["detail"]
    assert body.get("request_id") == request_id
    # The OpenAI-style member.
    openai_type = (
        "invalid_request_error"
        if status < 500
        else "service_unavailable"
        if status == 503
        else "server_error"
    )
    expected = {"message": body["detail"], "type": openai_type, "code": code}
    if request_id is not None:
        expected["request_id"] = request_id
    assert body["error"] == expected
    # The request's id, once; the retry switch beside pylon's own marking.
    assert reply.values("x-request-id") == ([request_id] if request_id else [])
    assert reply.values("x-should-retry") == reply.values("x-stargate-retryable")
    assert len(reply.values("x-should-retry")) == 1


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(
    ("headers", "status", "code", "request_id"),
    [
        (
            [("x-request-id", "req-1"), ("x-model", MODEL), ("x-priority", "-1")],
            400,
            "invalid_priority",
            "req-1",
        ),
        ([("x-request-id", "req-2")], 400, "missing_model", "req-2"),
        ([("x-model", MODEL)], 400, "missing_request_id", None),
        ([("x-request-id", "a b"), ("x-model", MODEL)], 400, "invalid_request_id", None),
    ],
)
async def test_problem_bodies_speak_openai_and_echo_the_request_id(
    make_stack: StackFactory,
    protocol: str,
    headers: list[tuple[str, str]],
    status: int,
    code: str,
    request_id: str | None,
) -> None:
    stack = await make_stack("dynamo")
    reply = await stack.send(protocol, CHAT, headers, chat())
    assert_problem(reply, status, code, request_id)
    assert reply.values("x-should-retry") == ["false"]
    assert await stack.records() == []


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_server_side_problem_is_a_service_unavailable_error(
    make_stack: StackFactory, protocol: str
) -> None:
    """The engine cannot be reached: 503 upstream_unavailable, OpenAI type service_unavailable."""
    stack = await make_stack("dynamo", upstream="http://127.0.0.1:9", **NO_BRINGUP)
    reply = await stack.send(protocol, CHAT, [("x-request-id", "down"), ("x-model", MODEL)], chat())
    assert_problem(reply, 503, "upstream_unavailable", "down")


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_relayed_engine_answers_echo_the_request_id_once(
    make_stack: StackFactory, protocol: str
) -> None:
    stack = await make_stack("dynamo")
    headers = [("x-request-id", f"ok-{protocol}"), ("x-model", MODEL)]
    reply = await stack.send(protocol, CHAT, headers, chat())
    assert reply.status == 200
    assert reply.values("x-request-id") == [f"ok-{protocol}"]
    assert reply.values("x-should-retry") == []  # no retry marking on a success
    streamed = await stack.send(protocol, CHAT, headers, chat(stream=True))
    assert streamed.status == 200 and streamed.body.rstrip().endswith(b"data: [DONE]")
    assert streamed.values("x-request-id") == [f"ok-{protocol}"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_engine_error_status_gets_the_retry_switch(
    make_stack: StackFactory, protocol: str
) -> None:
    stack = await make_stack("dynamo")
    await stack.faults([{"status": 503, "retryable": True, "times": 1}])
    headers = [("x-request-id", "busy"), ("x-model", MODEL)]
    reply = await stack.send(protocol, CHAT, headers, chat())
    assert reply.status == 503
    assert reply.values("x-stargate-retryable") == reply.values("x-should-retry") == ["true"]
    assert reply.values("x-request-id") == ["busy"]
    await stack.faults([{"status": 500, "times": 1}])
    reply = await stack.send(protocol, CHAT, headers, chat())
    assert reply.status == 500
    assert reply.values("x-stargate-retryable") == reply.values("x-should-retry") == ["false"]


# An engine that sets the headers pylon owns on the way back: its own request id and retry
# switch (both spellings), on a success and on a retryable 503.
ENGINE_HEADERS = (
    b"x-request-id: engine-made-id\r\nx-should-retry: true\r\nx_should_retry: true\r\n"
    b"X-Request-Id: another\r\n"
)


@pytest.fixture
async def meddling_engine() -> AsyncIterator[str]:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        await reader.readexactly(length)
        busy = b"x-app-case: busy" in head.lower()
        status = b"503 Service Unavailable" if busy else b"200 OK"
        retry = b"x-stargate-upstream-retryable: true\r\nx-should-retry: false\r\n" if busy else b""
        body = b'{"ok": true}'
        framing = b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
        start = b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
        writer.write(start + ENGINE_HEADERS + retry + framing + body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_the_engines_own_request_id_and_retry_switch_never_pass(
    make_stack: StackFactory, meddling_engine: str, protocol: str
) -> None:
    stack = await make_stack("dynamo", upstream=meddling_engine, **NO_BRINGUP)
    headers = [("x-request-id", "mine"), ("x-model", MODEL)]
    reply = await stack.send(protocol, CHAT, headers, chat())
    assert reply.status == 200
    assert reply.values("x-request-id") == ["mine"]
    assert reply.values("x-should-retry") == reply.values("x_should_retry") == []
    busy = await stack.send(protocol, CHAT, [*headers, ("x-app-case", "busy")], chat())
    assert busy.status == 503
    assert busy.values("x-request-id") == ["mine"]
    assert busy.values("x-should-retry") == busy.values("x-stargate-retryable") == ["true"]
