"""HTTP/1.1 framing hardening (RFC 9112 3.2, 5, 6) and the connection timers.

tests/integration/test_errors_and_limits.py::test_malformed_http_is_400_and_closes already covers
CL+TE, whitespace before the colon, obs-fold, differing Content-Lengths and absolute-form; these
are the rest of the smuggling table (reliability-cases F1-F12), each answered 400 and closed.
`raw_exchange` reads until the server closes, so getting a reply at all proves the close.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time

import pytest

from tests.integration.conftest import MODEL, StackFactory, raw_exchange
from tests.observers import SeenObserver

CHAT = "/v1/chat/completions"
HEAD = f"POST {CHAT} HTTP/1.1\r\nx-request-id: r\r\nx-model: {MODEL}\r\n"
BODY = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
).encode()

# pylon's connection timers (pylon.timers.Deadline) may fire up to 1 ms before their deadline.
TIMER_EARLY_S = 0.001


def request(extra: str, body: bytes = b"", head: str = HEAD) -> bytes:
    return (head + extra + "\r\n").encode() + body


@pytest.mark.parametrize(
    "raw",
    [
        # F10 / RFC 9112 3.2: exactly one Host
        request(f"host: a\r\nhost: b\r\ncontent-length: {len(BODY)}\r\n", BODY),
        request(f"content-length: {len(BODY)}\r\n", BODY),
        # F3, F4: Content-Length lists, signs, repeats of the same value, empty
        request("host: x\r\ncontent-length: 5, 5\r\n", b"hello"),
        request("host: x\r\ncontent-length: 5\r\ncontent-length: 5\r\n", b"hello"),
        request("host: x\r\ncontent-length: -1\r\n"),
        request("host: x\r\ncontent-length: +5\r\n", b"hello"),
        request("host: x\r\ncontent-length: \r\n"),
        # F5: transfer codings other than a final chunked, and TE on HTTP/1.0
        request("host: x\r\ntransfer-encoding: xchunked\r\n", b"0\r\n\r\n"),
        request("host: x\r\ntransfer-encoding: chunked, identity\r\n", b"0\r\n\r\n"),
        request("host: x\r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n"),
        request(
            "host: x\r\ntransfer-encoding: chunked\r\n",
            b"%x\r\n%b\r\n0\r\n\r\n" % (len(BODY), BODY),
            head=HEAD.replace("HTTP/1.1", "HTTP/1.0"),
        ),
        # F8, F9: bare LF line ends, NUL / bare CR / control bytes in a value
        request("host: x\r\n").replace(b"\r\n", b"\n"),
        request("host: x\r\nx-a: 1\x002\r\n"),
        request("host: x\r\nx-a: 1\r2\r\n"),
        request("host: x\r\nx-a: a\x01b\r\n"),
        # whitespace or a tab inside a field name
        request("host: x\r\nx\ta: 1\r\n"),
        # a target naming another host: absolute form, or a network-path reference
        request(
            f"host: x\r\ncontent-length: {len(BODY)}\r\n",
            BODY,
            head=HEAD.replace(CHAT, f"http://evil.example{CHAT}"),
        ),
        request(
            f"host: x\r\ncontent-length: {len(BODY)}\r\n",
            BODY,
            head=HEAD.replace(CHAT, f"//evil.example{CHAT}"),
        ),
    ],
    ids=[
        "two_hosts",
        "no_host",
        "cl_list",
        "cl_repeated_same",
        "cl_negative",
        "cl_plus",
        "cl_empty",
        "te_xchunked",
        "te_chunked_identity",
        "te_repeated",
        "te_on_http10",
        "bare_lf",
        "nul_in_value",
        "bare_cr_in_value",
        "ctl_in_value",
        "tab_in_name",
        "absolute_form_target",
        "network_path_target",
    ],
)
async def test_smuggling_shapes_are_400_and_close(make_stack: StackFactory, raw: bytes) -> None:
    stack = await make_stack("dynamo")
    # A valid pipelined request behind the bad one must never be read (F13).
    follow = request(f"host: x\r\ncontent-length: {len(BODY)}\r\n", BODY)
    reply = await raw_exchange(*stack.pylon_address, raw + follow)
    assert reply.startswith(b"HTTP/1.1 400 "), reply[:120]
    assert b"HTTP/1.1 200" not in reply
    assert b"connection: close" in reply
    assert (await stack.control())["requests"] == []


async def test_http10_without_host_is_fine(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo")
    raw = request(f"content-length: {len(BODY)}\r\n", BODY, head=HEAD.replace("1.1", "1.0"))
    reply = await raw_exchange(*stack.pylon_address, raw)
    assert reply.startswith(b"HTTP/1.1 200 ")


async def test_slowloris_head_is_closed_after_the_header_timeout(make_stack: StackFactory) -> None:
    header_timeout, trickle_s = 0.3, 0.02
    stack = await make_stack("dynamo", header_timeout=header_timeout)
    # A head that never ends, one byte per 20 ms: never idle for long, always making progress.
    # Only a deadline for the whole head (not one reset by each byte) can stop it.
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 1000
    started = time.monotonic()  # before pylon can have started its clock
    reader, writer = await asyncio.open_connection(*stack.pylon_address)
    sent = 0
    reply = b""
    try:
        async with asyncio.timeout(5):
            while not reply:
                assert sent < len(head), "the whole padded head went out unanswered"
                writer.write(head[sent : sent + 1])
                sent += 1
                # Pace the trickle by waiting for the answer: it ends the loop the moment it comes.
                with contextlib.suppress(TimeoutError):
                    reply = await asyncio.wait_for(reader.read(65536), trickle_s)
            elapsed = time.monotonic() - started
            with contextlib.suppress(ConnectionResetError):  # we may have sent after its close
                while chunk := await reader.read(65536):
                    reply += chunk
        assert reply.startswith(b"HTTP/1.1 408 "), reply[:80]
        assert b'"code":"request_timeout"' in reply
        # Not before the deadline (pylon's timers may fire up to 1 ms early), and the head was
        # still incomplete when it came.
        assert elapsed >= header_timeout - TIMER_EARLY_S
        assert sent < len(head)
    finally:
        writer.close()
    assert (await stack.control())["requests"] == []


async def test_stalled_body_is_408_after_the_header_timeout(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", header_timeout=0.3)
    reader, writer = await asyncio.open_connection(*stack.pylon_address)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-request-id: slow-body\r\n"
            b'x-model: mock-model\r\ncontent-length: 100\r\n\r\n{"model"'
        )
        async with asyncio.timeout(3):
            reply = await reader.read()
        assert reply.startswith(b"HTTP/1.1 408 "), reply[:80]
        assert b'"request_id":"slow-body"' in reply
    finally:
        writer.close()
    assert (await stack.control())["requests"] == []


async def test_silent_client_is_closed_after_the_header_timeout(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", header_timeout=0.3)
    reader, writer = await asyncio.open_connection(*stack.pylon_address)
    try:
        async with asyncio.timeout(3):
            assert await reader.read() == b""
    finally:
        writer.close()


async def test_idle_keep_alive_connection_is_closed(make_stack: StackFactory) -> None:
    idle_timeout, header_timeout = 0.3, 5.0
    stack = await make_stack(
        "dynamo", client_idle_timeout=idle_timeout, header_timeout=header_timeout
    )
    reader, writer = await asyncio.open_connection(*stack.pylon_address)
    try:
        sent_at = time.monotonic()  # pylon cannot have armed its idle timer before this
        writer.write(request(f"host: x\r\ncontent-length: {len(BODY)}\r\n", BODY))
        async with asyncio.timeout(3):
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 ")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            assert await reader.read() == b""
        # The idle timer closed it: not before the idle timeout, and before the header timeout,
        # the other timer that could close a connection left silent.
        assert idle_timeout - TIMER_EARLY_S <= time.monotonic() - sent_at < header_timeout
    finally:
        writer.close()


async def test_long_response_outlives_the_idle_and_header_timeouts(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(
        "dynamo",
        mock={"num_tokens": 10, "token_delay_ms": 60},
        client_idle_timeout=0.2,
        header_timeout=0.2,
    )
    body = json.dumps({"model": MODEL, "messages": [], "max_tokens": 10, "stream": True}).encode()
    raw = request(f"host: x\r\nconnection: close\r\ncontent-length: {len(body)}\r\n", body)
    reply = await raw_exchange(*stack.pylon_address, raw)
    assert reply.startswith(b"HTTP/1.1 200 ")
    assert b"data: [DONE]" in reply


async def test_interim_100_continue_waits_for_the_response_before_it(
    make_stack: StackFactory,
) -> None:
    """RFC 9110 15.2: a pipelined request's 100 Continue belongs after the previous response,
    never in the middle of it."""
    stack = await make_stack("dynamo", mock={"token_delay_ms": 10, "num_tokens": 5})
    first = json.dumps({"model": MODEL, "messages": [], "max_tokens": 5, "stream": True}).encode()
    second = json.dumps({"model": MODEL, "messages": [], "max_tokens": 2}).encode()
    host, port = stack.pylon_address
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-request-id: p-1\r\n"
        b"x-model: mock-model\r\ncontent-length: %d\r\n\r\n%b"
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-request-id: p-2\r\n"
        b"x-model: mock-model\r\nexpect: 100-continue\r\ncontent-length: %d\r\n\r\n"
        % (len(first), first, len(second))
    )
    received = b""
    async with asyncio.timeout(5):
        while b"100 Continue" not in received:
            received += await reader.read(65536)
    before, _, _ = received.partition(b"HTTP/1.1 100 Continue")
    assert before.endswith(b"0\r\n\r\n"), "100 Continue came before the first response ended"
    assert b"data: [DONE]" in before
    writer.write(second)
    async with asyncio.timeout(5):
        while received.count(b"HTTP/1.1 200 OK") < 2 or not received.endswith(b"}"):
            received += await reader.read(65536)
    writer.close()
    assert [r["path"] for r in await stack.records()] == ["/v1/chat/completions"] * 2


async def test_a_body_in_tiny_chunks_costs_its_bytes_not_its_pieces(
    make_stack: StackFactory,
) -> None:
    """A 512 KiB body sent as 2-byte HTTP/1.1 chunks reaches the engine byte for byte (what it
    costs in memory, its bytes and not its pieces, is pinned in tests/unit/test_intake.py)."""
    stack = await make_stack("dynamo")
    pad = b"x" * (512 * 1024)
    body = b'{"model": "mock-model", "messages": [], "max_tokens": 1, "pad": "' + pad + b'"}'
    pieces = [body[i : i + 2] for i in range(0, len(body), 2)]
    chunked = b"".join(b"%x\r\n%b\r\n" % (len(piece), piece) for piece in pieces)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-request-id: tiny-1\r\n"
        b"x-model: mock-model\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
    )
    reply = await raw_exchange(*stack.pylon_address, head + chunked + b"0\r\n\r\n", timeout=30)
    assert reply.startswith(b"HTTP/1.1 200 ")
    record = await stack.wait_record("tiny-1", "finished")
    assert base64.b64decode(record["body_b64"]) == body


def valid(request_id: str) -> bytes:
    return request(f"host: x\r\ncontent-length: {len(BODY)}\r\n", BODY).replace(
        b"x-request-id: r", f"x-request-id: {request_id}".encode()
    )


@pytest.mark.parametrize(
    "refused",
    [
        # answered at the head: admission (the contract: no x-model) refuses it; no body
        b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-request-id: r\r\n\r\n",
        # answered at the head: the declared body is over the limit; the body follows anyway
        request("host: x\r\ncontent-length: 300\r\n", b"{" + b" " * 298 + b"}"),
        # answered inside the body: chunked, so the size is only known as it arrives
        request(
            "host: x\r\ntransfer-encoding: chunked\r\n",
            b"12c\r\n{" + b" " * 298 + b"}\r\n0\r\n\r\n",
        ),
    ],
    ids=["contract_error", "declared_body_over_limit", "streamed_body_over_limit"],
)
async def test_nothing_behind_a_refused_request_is_read(
    make_stack: StackFactory, refused: bytes
) -> None:
    """Once pylon has answered a request it did not take, it reads nothing more from the
    connection: the bytes that follow (here a well-formed request) never become a request."""
    observer = SeenObserver()
    stack = await make_stack("dynamo", max_body_bytes=100, observer=observer)
    reply = await raw_exchange(*stack.pylon_address, refused + valid("behind"))
    assert reply.startswith((b"HTTP/1.1 400 ", b"HTTP/1.1 413 ")), reply[:120]
    assert reply.count(b"HTTP/1.1 ") == 1, reply
    # Not even read: the close that follows would cancel it before it reached the engine, so
    # only the intake's record can show it was.
    assert "behind" not in observer.ids(), observer.seen
    assert (await stack.control())["requests"] == []


async def test_upgrade_ends_the_connection(make_stack: StackFactory) -> None:
    """pylon speaks no other protocol on the connection: after an Upgrade request nothing more is
    read from it (the bytes that follow would be the new protocol's), and it is closed."""
    stack = await make_stack("dynamo", client_idle_timeout=60.0, header_timeout=60.0)
    raw = (
        b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-request-id: up\r\nx-model: mock-model\r\n"
        b"connection: upgrade\r\nupgrade: websocket\r\n\r\n" + valid("tunnelled")
    )
    reply = await raw_exchange(*stack.pylon_address, raw)  # returns at pylon's close
    assert reply.startswith(b"HTTP/1.1 "), reply[:120]
    assert reply.count(b"HTTP/1.1 200 ") <= 1
    paths = [(r["method"], r["path"]) for r in await stack.records()]
    assert ("POST", CHAT) not in paths, "bytes after the Upgrade were read as a request"
    assert b"upgrade" not in b"".join(
        name.lower().encode() for r in await stack.records() for name, _ in r["headers"]
    )
