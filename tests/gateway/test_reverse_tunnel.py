"""The reverse tunnel serves the gateway's requests with the same contract as a direct request:
pylon dials the stand-in gateway, passes its handshake, and answers role-reversed HTTP/3 (or,
where parametrized over `protocol`, raw-QUIC Cap'n Proto streams) through the real intake and
mock_dynamo."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pylon.core.sanitize import DENIED_REQUEST_HEADERS
from pylon.gateway.tunnel import TunnelProtocol
from tests.gateway.tunnel_fixtures import GATEWAY, NODE, PROTOCOLS, TunnelFactory, headers
from tests.integration.test_forwarding import spoofed_body, spoofed_headers
from tests.stack import MODEL

CHAT = "/v1/chat/completions"
# Differ between any two requests whatever the transport.
VOLATILE_HEADERS = {"date", "x-pylon-request-ms", "traceparent", "x-upstream-ms"}


def chat(stream: bool = False, model: str = MODEL, **extra: Any) -> bytes:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return json.dumps({**body, "stream": stream, **extra}).encode()


BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"prompt": "hi"},
    "/v1/responses": {"input": "hi"},
}


def sse_payloads(body: bytes) -> list[bytes]:
    return [
        line[5:].strip()
        for line in body.split(b"\n")
        if line.startswith(b"data:") and line[5:].strip() != b"[DONE]"
    ]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_chat_through_the_tunnel(
    make_tunnel: TunnelFactory, protocol: TunnelProtocol
) -> None:
    tunnel = await make_tunnel(protocol=protocol)
    await tunnel.gateway.wait_live(1)
    connected = await tunnel.events.wait_for("tunnel_connected")
    assert connected["gateway"] == GATEWAY and connected["index"] == 0
    assert connected["dial"] == tunnel.gateway.address
    assert tunnel.board.tunnels(GATEWAY) == 1
    handshake, refusal = tunnel.gateway.handshakes[0]
    assert handshake.inference_server_id == NODE and handshake.auth_token is None
    assert refusal is None
    response = await tunnel.gateway.request("POST", CHAT, headers(), chat())
    assert response.status == 200, response.body
    assert response.json()["object"] == "chat.completion"
    assert response.stream_id % 4 == 1  # a server-initiated stream: the roles are reversed
    # The stream layer the dial asked for: h3 negotiated for HTTP/3, no ALPN for raw QUIC.
    negotiated = response.connection._quic.tls.alpn_negotiated
    assert negotiated == ("h3" if protocol == "http3" else None)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", sorted(BODIES))
async def test_a_tunnelled_request_is_treated_like_a_direct_one(
    make_tunnel: TunnelFactory, path: str, stream: bool, protocol: str
) -> None:
    """The same spoofed request over direct HTTP/3 and over the tunnel (either stream
    protocol): the engine sees the same stripped headers and body (priority derived alike),
    the client the same answer."""
    tunnel = await make_tunnel(stack_settings={"quic_listen": "127.0.0.1:0"}, protocol=protocol)
    stack = tunnel.stack
    wire_headers = [(name.lower(), value) for name, value in spoofed_headers()]
    body = {**spoofed_body("dynamo"), **BODIES[path], "stream": stream}
    if path != CHAT:
        body.pop("messages", None)
    raw = json.dumps(body).encode()
    direct = await stack.send("h3", path, wire_headers, raw)  # content-type added
    direct_record = await stack.last_request()
    await tunnel.gateway.wait_live(1)
    tunnelled = await tunnel.gateway.request(
        "POST", path, [*wire_headers, ("content-type", "application/json")], raw
    )
    tunnel_record = await stack.last_request()
    assert tunnelled.status == direct.status == 200, tunnelled.body
    names = [name.lower() for name, _ in tunnel_record["headers"]]
    assert not {n.decode() for n in DENIED_REQUEST_HEADERS} & set(names)
    assert not [n for n in names if n.startswith(("x-stargate-", "x-smg-", "x-override-"))]
    priority = [v for n, v in tunnel_record["headers"] if n.lower() == "x-dynamo-request-priority"]
    assert priority == ["3593"]  # x-priority 7 derived, the spoofed one dropped

    def comparable(record: dict[str, Any]) -> list[tuple[str, str]]:
        return sorted(
            (n.lower(), v) for n, v in record["headers"] if n.lower() not in VOLATILE_HEADERS
        )

    assert comparable(tunnel_record) == comparable(direct_record)
    assert tunnel_record["body"] == direct_record["body"]
    assert tunnel_record["path"] == direct_record["path"] == path
    answer = {n for n, _ in tunnelled.headers} - VOLATILE_HEADERS
    assert answer == {n for n in direct.headers} - VOLATILE_HEADERS
    if stream:
        assert sse_payloads(tunnelled.body)
        if path != "/v1/responses":  # the Responses API ends with its own last event
            assert tunnelled.body.rstrip().endswith(b"[DONE]")
        assert len(sse_payloads(tunnelled.body)) == len(sse_payloads(direct.body))
    else:
        assert tunnelled.json().keys() == json.loads(direct.body).keys()


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_streaming_arrives_as_it_is_generated(
    make_tunnel: TunnelFactory, protocol: TunnelProtocol
) -> None:
    tunnel = await make_tunnel(
        stack_settings={"mock": {"token_delay_ms": 30, "num_tokens": 6}}, protocol=protocol
    )
    await tunnel.gateway.wait_live(1)
    response = tunnel.gateway.send("POST", CHAT, headers("s-1"), chat(stream=True, max_tokens=6))
    chunks = [chunk async for chunk in response.stream()]
    assert (
        response.status == 200
        and response.header(
            "content-type",
        )
        is not None
    )
    assert len(chunks) >= 3  # token by token, not one buffered body
    assert b"[DONE]" in chunks[-1]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_model_gating_limits_and_engine_errors(
    make_tunnel: TunnelFactory, protocol: TunnelProtocol
) -> None:
    tunnel = await make_tunnel(
        stack_settings={"model": [MODEL, "extra"], "max_body_bytes": 1000}, protocol=protocol
    )
    await tunnel.gateway.wait_live(1)
    gateway = tunnel.gateway
    # Not published: pylon's own retryable 503 problem.
    unknown = await gateway.request("POST", CHAT, headers("m-1", "third"), chat(model="third"))
    assert unknown.status == 503
    problem = unknown.json()
    assert problem["code"] == "model_generation_unavailable" and problem["request_id"] == "m-1"
    assert unknown.header("x-stargate-retryable") == "true"
    # Published but not served by the engine: the engine's 404, relayed.
    extra = await gateway.request("POST", CHAT, headers("m-2", "extra"), chat(model="extra"))
    assert extra.status == 404
    # Over the body limit: 413 before the engine.
    big = await gateway.request("POST", CHAT, headers("m-3"), chat(padding="x" * 2000))
    assert big.status == 413 and big.json()["code"] == "body_too_large"
    # Missing the request id: the contract's 400.
    bad = await gateway.request("POST", CHAT, [("x-model", MODEL)], chat())
    assert bad.status == 400 and bad.json()["code"] == "missing_request_id"
    paths = [r["headers"] for r in await tunnel.stack.records()]
    assert len(paths) == 1  # only the "extra" request reached the engine
    # An engine error, relayed with the retry marking.
    await tunnel.stack.faults([{"status": 500, "retryable": True}])
    failed = await gateway.request("POST", CHAT, headers("m-4"), chat())
    assert failed.status == 500
    assert failed.header("x-stargate-retryable") == "false"
    assert failed.header("x-stargate-retry-reason") == "upstream_nonretryable_status"


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_stream_reset_by_the_gateway_cancels_the_engine_request(
    make_tunnel: TunnelFactory, protocol: TunnelProtocol
) -> None:
    tunnel = await make_tunnel(
        stack_settings={"mock": {"token_delay_ms": 200, "num_tokens": 50}}, protocol=protocol
    )
    await tunnel.gateway.wait_live(1)
    response = tunnel.gateway.send("POST", CHAT, headers("c-1"), chat(stream=True, max_tokens=50))
    await tunnel.stack.wait_record("c-1", "received")
    tunnel.gateway.reset(response)
    record = await tunnel.stack.wait_record("c-1", "cancelled")
    assert record["cancelled_at"] is not None and record["completed_at"] is None
    # The connection itself serves on.
    after = await tunnel.gateway.request("POST", CHAT, headers("c-2"), chat())
    assert after.status == 200


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_request_body_in_pieces_reaches_the_engine_whole(
    make_tunnel: TunnelFactory, protocol: TunnelProtocol
) -> None:
    """A body larger than one raw-QUIC Body message of the stand-in (16 KiB), sent in pieces
    after the head: it arrives whole, in order."""
    tunnel = await make_tunnel(protocol=protocol)
    await tunnel.gateway.wait_live(1)
    body = chat(padding="".join(f"{i:05d}" for i in range(8000)))  # ~40 KB
    cut = len(body) // 3
    response = tunnel.gateway.send("POST", CHAT, headers("p-1"), body[:cut], end=False)
    response.connection.send_body(response, body[cut : 2 * cut], end=False)
    response.connection.send_body(response, body[2 * cut :], end=False)
    response.connection.send_body(response, b"", end=True)
    await response.wait()
    assert response.status == 200, response.body
    record = await tunnel.stack.last_request()
    assert record["body"]["padding"] == json.loads(body)["padding"]
