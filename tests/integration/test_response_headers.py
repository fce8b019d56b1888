"""The engine's response head on its way to the client, on every transport: pylon is the only
writer of retry metadata (`x-stargate-*`), and hop-by-hop fields stay on the engine's hop."""

from __future__ import annotations

import json

import pytest

from tests.scripted_engine import scripted_engine
from tests.stack import MODEL, NO_BRINGUP, PROTOCOLS, StackFactory

CHAT = "/v1/chat/completions"
BODY = json.dumps({"model": MODEL, "messages": [], "max_tokens": 2}).encode()
FORGED = (
    b"HTTP/1.1 200 OK\r\n"
    b"content-type: application/json\r\n"
    b"content-length: 2\r\n"
    b"x-engine-ok: kept\r\n"
    # retry metadata is the gateway's to read and pylon's to write
    b"x-stargate-retryable: true\r\n"
    b"X-Stargate-Retry-Reason: engine_says_so\r\n"
    b"x-stargate-retry-after-ms: 1\r\n"
    # pylon's own on the way back: the client's retry hint and the request's id
    b"x-should-retry: true\r\n"
    b"x-request-id: engine-made\r\n"
    # hop-by-hop, and a name made hop-by-hop by Connection
    b"connection: keep-alive, x-engine-secret\r\n"
    b"x-engine-secret: for-the-hop-only\r\n"
    b"keep-alive: timeout=5\r\n"
    b"proxy-authenticate: Basic realm=engine\r\n"
    b"trailer: x-checksum\r\n"
    b"\r\n{}"
)


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_engine_control_and_hop_by_hop_headers_never_reach_the_client(
    make_stack: StackFactory, protocol: str
) -> None:
    async with scripted_engine(FORGED) as engine:
        stack = await make_stack("dynamo", upstream=engine.url, **NO_BRINGUP)
        tunnel = [("x-request-id", "resp-1"), ("x-model", MODEL)]
        reply = await stack.send(protocol, CHAT, tunnel, BODY)
    assert reply.status == 200, reply
    assert reply.body == b"{}"
    names = {name.lower() for name in reply.headers}
    assert "x-engine-ok" in names, "the engine's own headers should pass"
    # A 200 gets no retry marking from pylon, so any x-stargate-* here is the engine's.
    assert not [name for name in names if name.startswith("x-stargate-")], names
    assert not names & {"x-engine-secret", "keep-alive", "proxy-authenticate", "trailer"}, names
    # A 200 gets no retry hint from pylon either, and the request's own id, once.
    assert "x-should-retry" not in names, reply.headers
    assert reply.headers.get("x-request-id") == "resp-1", reply.headers
    # HTTP/1.1: pylon's own `connection: close` is the only Connection allowed.
    assert reply.headers.get("connection", "close") == "close", reply.headers
