"""One fault, one answer, on every transport (the table in docs/api-contract.md, section 6.1).

Each case sends the same fault over HTTP/1.1 (raw bytes), HTTP/2 and HTTP/3 (clients that send
exactly what they are given, no client-side checks) to one pylon, and checks pylon's answer and
that nothing reached the engine. The expected answers are written out here, per fault.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pylon import auth
from tests.integration.conftest import raw_exchange
from tests.stack import MODEL, Stack, StackFactory
from tests.transport.h2client import H2Client

CHAT = b"/v1/chat/completions"
BODY = json.dumps({"model": MODEL, "messages": [], "max_tokens": 2}).encode()
Header = tuple[bytes, bytes]
PROTOCOLS = ("http1", "h2", "h3")


@dataclass
class Answer:
    status: int | None
    problem: dict[str, Any] | None


async def send(
    stack: Stack,
    protocol: str,
    fields: list[Header],
    body: bytes,
    path: bytes = CHAT,
    end: bool = True,
) -> Answer:
    """`fields` are regular header fields (lower-case); the request is POST `path`.

    `end=False` leaves the request open after `body` (HTTP/1.1: a content-length in `fields`
    then says how much is still to come)."""
    if protocol == "http1":
        return await _send_http1(stack, fields, body, path)
    pseudo = [(b":method", b"POST"), (b":scheme", b"https"), (b":path", path)]
    pseudo.append((b":authority", b"localhost"))
    if protocol == "h2":
        client = await H2Client.connect(stack.pylon_address)
        try:
            sid = client.send([*pseudo, *fields], body if end or body else None, end=end)
            reply = await client.response(sid)
            status, payload = reply.status, bytes(reply.body)
        finally:
            await client.close()
    else:
        async with stack.connect() as h3:
            response = await h3.send([*pseudo, *fields], body, end=end).wait(5)
            status, payload = response.status, response.body
    return Answer(status, json.loads(payload) if status is not None and payload else None)


async def _send_http1(stack: Stack, fields: list[Header], body: bytes, path: bytes) -> Answer:
    lines = [b"POST " + path + b" HTTP/1.1", b"host: localhost", b"connection: close"]
    lines += [name + b": " + value for name, value in fields]
    if not any(name == b"content-length" for name, _ in fields):
        lines.append(b"content-length: " + str(len(body)).encode())
    raw = await raw_exchange(*stack.pylon_address, b"\r\n".join(lines) + b"\r\n\r\n" + body)
    head, _, payload = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else None
    return Answer(status, json.loads(payload) if payload.startswith(b"{") else None)


async def send_with_trailers(
    stack: Stack, protocol: str, fields: list[Header], body: bytes, trailers: list[Header]
) -> Answer:
    """A request whose body ends with a trailer section (HTTP/1.1: chunked)."""
    if protocol == "http1":
        lines = [b"POST " + CHAT + b" HTTP/1.1", b"host: localhost", b"connection: close"]
        lines += [name + b": " + value for name, value in fields]
        lines.append(b"transfer-encoding: chunked")
        chunked = b"%x\r\n%b\r\n0\r\n" % (len(body), body)
        chunked += b"".join(name + b": " + value + b"\r\n" for name, value in trailers) + b"\r\n"
        raw = await raw_exchange(*stack.pylon_address, b"\r\n".join(lines) + b"\r\n\r\n" + chunked)
        head, _, payload = raw.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else None
        return Answer(status, json.loads(payload) if payload.startswith(b"{") else None)
    pseudo = [(b":method", b"POST"), (b":scheme", b"https"), (b":path", CHAT)]
    pseudo.append((b":authority", b"localhost"))
    if protocol == "h2":
        client = await H2Client.connect(stack.pylon_address)
        try:
            sid = client.send([*pseudo, *fields], body, end=False)
            client.conn.send_headers(sid, trailers, end_stream=True)
            client._flush()
            reply = await client.response(sid)
            status, payload = reply.status, bytes(reply.body)
        finally:
            await client.close()
    else:
        async with stack.connect() as h3:
            response = h3.send([*pseudo, *fields], body, end=False)
            h3.http.send_headers(response.stream_id, trailers, end_stream=True)
            h3.transmit()
            await response.wait(5)
            status, payload = response.status, response.body
    return Answer(status, json.loads(payload) if status is not None and payload else None)


def tunnel(request_id: bytes = b"fault-1", *extra: Header) -> list[Header]:
    return [(b"x-request-id", request_id), (b"x-model", MODEL.encode()), *extra]


async def assert_answer(
    stack: Stack, answer: Answer, status: int, code: str, request_id: str | None = "fault-1"
) -> None:
    assert answer.status == status, answer
    assert answer.problem is not None and answer.problem["code"] == code, answer
    assert answer.problem.get("request_id") == request_id, answer
    assert (await stack.records()) == [], "the faulty request reached the engine"


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("value", [b"a\x01b", b"a\x7fb", b"a\x1fb"])
async def test_control_character_in_a_field_value_is_400(
    make_stack: StackFactory, protocol: str, value: bytes
) -> None:
    stack = await make_stack()
    answer = await send(stack, protocol, tunnel(b"fault-1", (b"x-a", value)), BODY)
    await assert_answer(stack, answer, 400, "malformed_request")


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_connection_specific_or_conflicting_framing_is_400(
    make_stack: StackFactory, protocol: str
) -> None:
    # HTTP/1.1: Transfer-Encoding with Content-Length (RFC 9112 6.3); HTTP/2 and HTTP/3: a
    # connection-specific field (RFC 9113 8.2.2, RFC 9114 4.2). The same fault: framing the
    # engine hop could read differently from pylon.
    stack = await make_stack()
    extra = (b"transfer-encoding", b"chunked")
    answer = await send(stack, protocol, tunnel(b"fault-1", extra), BODY)
    await assert_answer(stack, answer, 400, "malformed_request")


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_too_many_header_fields_is_431(make_stack: StackFactory, protocol: str) -> None:
    stack = await make_stack(max_headers=10)
    many = [(f"x-h{i}".encode(), b"v") for i in range(20)]
    answer = await send(stack, protocol, tunnel(b"fault-1", *many), BODY)
    assert answer.status == 431 and answer.problem is not None
    assert answer.problem["code"] == "headers_too_large"
    assert (await stack.records()) == []


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_trailers_over_the_header_limits_are_431(
    make_stack: StackFactory, protocol: str
) -> None:
    """Trailers are never forwarded, but they are read: they count against the same limits."""
    stack = await make_stack(max_headers=10)
    many = [(f"x-t{i}".encode(), b"v") for i in range(20)]
    answer = await send_with_trailers(stack, protocol, tunnel(), BODY, many)
    await assert_answer(stack, answer, 431, "headers_too_large")


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_pseudo_header_in_trailers_is_400(make_stack: StackFactory, protocol: str) -> None:
    stack = await make_stack()
    answer = await send_with_trailers(stack, protocol, tunnel(), BODY, [(b":path", b"/other")])
    await assert_answer(stack, answer, 400, "malformed_request")


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_body_over_the_limit_is_413_with_the_request_id(
    make_stack: StackFactory, protocol: str
) -> None:
    stack = await make_stack(max_body_bytes=100)
    answer = await send(stack, protocol, tunnel(), b"{" + b" " * 200 + b"}")
    await assert_answer(stack, answer, 413, "body_too_large")


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_missing_tunnel_token_is_401_on_every_transport(
    make_stack: StackFactory, protocol: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(auth, "RECHECK_SECONDS", 0.0)
    token = tmp_path / "token"
    token.write_text("s3cret")
    stack = await make_stack(tunnel_token_file=str(token))
    answer = await send(stack, protocol, tunnel(), BODY)
    await assert_answer(stack, answer, 401, "unauthorized")
    wrong = await send(stack, protocol, tunnel(b"fault-1", (b"authorization", b"Bearer x")), BODY)
    await assert_answer(stack, wrong, 401, "unauthorized")
    right = await send(stack, protocol, tunnel(b"ok-1", (b"authorization", b"Bearer s3cret")), BODY)
    assert right.status == 200
    record = (await stack.records())[-1]
    assert "authorization" not in [name.lower() for name, _ in record["headers"]]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_missing_token_is_answered_before_the_declared_body_length(
    make_stack: StackFactory, protocol: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Section 8's order: the token (401) before the declared body length (413), so a caller
    without the token learns nothing about the body limit and makes pylon read nothing."""
    monkeypatch.setattr(auth, "RECHECK_SECONDS", 0.0)
    token = tmp_path / "token"
    token.write_text("s3cret")
    stack = await make_stack(tunnel_token_file=str(token), max_body_bytes=100)
    declared = (b"content-length", b"5000")  # over the limit; the body itself never comes
    anonymous = await send(stack, protocol, tunnel(b"fault-1", declared), b"", end=False)
    await assert_answer(stack, anonymous, 401, "unauthorized")
    # With the token, the same head meets the body limit: the 401 above was not a fluke.
    bearer = (b"authorization", b"Bearer s3cret")
    known = await send(stack, protocol, tunnel(b"fault-1", bearer, declared), b"", end=False)
    await assert_answer(stack, known, 413, "body_too_large")


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_cookie_crumbs_reach_the_engine_as_one_field(
    make_stack: StackFactory, protocol: str
) -> None:
    stack = await make_stack()
    if protocol == "http1":
        crumbs = [(b"cookie", b"a=1; b=2")]  # HTTP/1.1 carries one cookie field already
    else:
        crumbs = [(b"cookie", b"a=1"), (b"cookie", b"b=2")]
    answer = await send(stack, protocol, tunnel(b"ok-1", *crumbs), BODY)
    assert answer.status == 200
    record = (await stack.records())[-1]
    cookies = [value for name, value in record["headers"] if name.lower() == "cookie"]
    assert cookies == ["a=1; b=2"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_body_model_other_than_x_model_is_400(
    make_stack: StackFactory, protocol: str
) -> None:
    stack = await make_stack()
    other = json.dumps({"model": "other-model", "messages": [], "max_tokens": 2}).encode()
    await assert_answer(stack, await send(stack, protocol, tunnel(), other), 400, "model_mismatch")
    twice = b'{"model":"other-model","messages":[],"model":"mock-model"}'
    await assert_answer(stack, await send(stack, protocol, tunnel(), twice), 400, "model_mismatch")


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("coding", [b"gzip", b"deflate", b"br", b"GZIP, identity"])
async def test_a_content_encoded_body_is_415(
    make_stack: StackFactory, protocol: str, coding: bytes
) -> None:
    stack = await make_stack()
    answer = await send(stack, protocol, tunnel(b"fault-1", (b"content-encoding", coding)), BODY)
    await assert_answer(stack, answer, 415, "content_encoding_not_supported")


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(
    "path",
    [
        b"/v1//chat/completions",
        b"/v1/./chat/completions",
        b"/v1/x/../chat/completions",
        b"/v1/chat%2Fcompletions",
        b"/v1/%2e%2e/chat/completions",
        b"/v1/chat/completions#frag",
        b"/v1/chat/completions%00",
    ],
)
async def test_an_ambiguous_request_path_is_400(
    make_stack: StackFactory, protocol: str, path: bytes
) -> None:
    stack = await make_stack()
    answer = await send(stack, protocol, tunnel(), BODY, path)
    await assert_answer(stack, answer, 400, "malformed_request")


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_percent_encoded_route_gets_the_same_priority_write(
    make_stack: StackFactory, protocol: str
) -> None:
    """pylon decides by the route the engine will see, and forwards the client's spelling."""
    stack = await make_stack("vllm")
    spelled = b"/v1/%63hat/completions"
    answer = await send(stack, protocol, tunnel(b"ok-1", (b"x-priority", b"7")), BODY, spelled)
    assert answer.status == 200, answer
    record = (await stack.records())[-1]
    assert record["raw_path"] == spelled.decode()
    assert record["body"]["priority"] == 7


def send_in_frames(h2: H2Client, sid: int, data: bytes) -> None:
    for start in range(0, len(data), 16_000):
        h2.send_data(sid, data[start : start + 16_000], end=False)


async def test_one_connection_cannot_hold_more_than_its_body_budget(
    make_stack: StackFactory,
) -> None:
    """Many streams each under the body limit, on one HTTP/2 connection: past the connection's
    budget a stream is answered 503 (retryable) while the others carry on."""
    stack = await make_stack(max_body_bytes=40_000, max_connection_body_bytes=100_000)
    h2 = await H2Client.connect(stack.pylon_address)
    try:
        pseudo = [(b":method", b"POST"), (b":scheme", b"https"), (b":path", CHAT)]
        pseudo.append((b":authority", b"localhost"))
        chunk = b" " * 30_000
        sids = [h2.send([*pseudo, *tunnel(b"b-%d" % i)], None, end=False) for i in range(4)]
        for sid in sids:
            send_in_frames(h2, sid, b"{" + chunk)  # 4 x 30 KB buffered: over 100 KB
        answers = {sid: await h2.response(sid) for sid in sids[3:]}
        refused = answers[sids[3]]
        assert refused.status == 503
        assert refused.json()["code"] == "body_budget_exceeded"
        assert refused.header(b"x-stargate-retryable") == b"true"
        for sid in sids[:3]:
            h2.send_data(sid, b'"model": "mock-model", "messages": []}', end=True)
        assert [(await h2.response(sid)).status for sid in sids[:3]] == [200, 200, 200]
    finally:
        await h2.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_the_process_body_budget_bounds_every_transport(
    make_stack: StackFactory, protocol: str
) -> None:
    stack = await make_stack(
        max_body_bytes=40_000, max_connection_body_bytes=40_000, max_total_body_bytes=50_000
    )
    # One request holds 30 KB of the 50 KB budget: a second one of 30 KB does not fit.
    holder = await H2Client.connect(stack.pylon_address)
    try:
        pseudo = [(b":method", b"POST"), (b":scheme", b"https"), (b":path", CHAT)]
        pseudo.append((b":authority", b"localhost"))
        sid = holder.send([*pseudo, *tunnel(b"holder")], None, end=False)
        send_in_frames(holder, sid, b"{" + b" " * 30_000)
        await holder.ping()  # pylon has read it
        body = b'{"model": "mock-model", "messages": [], "pad": "' + b"x" * 30_000 + b'"}'
        answer = await send(stack, protocol, tunnel(), body)
        await assert_answer(stack, answer, 503, "body_budget_exceeded")
        holder.send_data(sid, b'"model": "mock-model", "messages": []}', end=True)
        assert (await holder.response(sid)).status == 200
    finally:
        await holder.close()
    # Given back: the same request now fits.
    assert (await send(stack, protocol, tunnel(b"after"), body)).status == 200
