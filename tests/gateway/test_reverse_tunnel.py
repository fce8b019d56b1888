"""The reverse tunnel serves the gateway's requests with the same contract as a direct request:
pylon dials the stand-in gateway, passes its handshake, and answers role-reversed HTTP/3 through
the real intake and mock_dynamo."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pylon.core.sanitize import DENIED_BODY_FIELDS, DENIED_REQUEST_HEADERS
from tests.gateway.tunnel_fixtures import GATEWAY, NODE, TunnelFactory, headers
from tests.integration.test_forwarding import spoofed_body, spoofed_headers
from tests.stack import MODEL

CHAT = "/v1/chat/completions"


def chat(stream: bool = False, **extra: Any) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return json.dumps({**body, "stream": stream, **extra}).encode()


async def test_chat_through_the_tunnel(make_tunnel: TunnelFactory) -> None:
    tunnel = await make_tunnel()
    await tunnel.gateway.wait_live(1)
    connected = await tunnel.events.wait_for("tunnel_connected")
    assert connected["gateway"] == GATEWAY and connected["index"] == 0
    assert tunnel.board.tunnels(GATEWAY) == 1
    handshake, refusal = tunnel.gateway.handshakes[0]
    assert handshake.inference_server_id == NODE and handshake.auth_token is None
    assert refusal is None
    response = await tunnel.gateway.request("POST", CHAT, headers(), chat())
    assert response.status == 200, response.body
    assert response.json()["object"] == "chat.completion"
    assert response.stream_id % 4 == 1  # a server-initiated stream: the roles are reversed
