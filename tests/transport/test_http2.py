"""The core's contract over HTTP/1.1 and HTTP/2 (h2c, prior knowledge, same port): one behaviour.

Happy paths use httpx (HTTP/2 via the `h2` library); cancellation and flow control use the raw
`H2Client`, and one test uses nghttp2's `nghttp` as an independent client.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from tests.cancellation import assert_cancelled_promptly
from tests.integration.conftest import MODEL, StackFactory, header_values
from tests.integration.test_forwarding import spoofed_body, spoofed_headers
from tests.transport.h2client import H2Client, H2Response, request_headers

CHAT = "/v1/chat/completions"
PROTOCOLS = ["http1", "h2"]


def chat(stream: bool = False, max_tokens: int = 4) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        "max_tokens": max_tokens,
    }


@pytest.fixture(params=PROTOCOLS)
async def client(request: pytest.FixtureRequest) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client speaking one protocol (h2: prior knowledge, no upgrade)."""
    proto = request.param
    async with httpx.AsyncClient(
        http1=proto == "http1", http2=proto == "h2", timeout=10
    ) as session:
        session.headers["x-test-protocol"] = proto
        yield session


def expect_version(reply: httpx.Response, client: httpx.AsyncClient) -> None:
    wanted = {"http1": "HTTP/1.1", "h2": "HTTP/2"}[client.headers["x-test-protocol"]]
    assert reply.http_version == wanted


@pytest.mark.parametrize("backend", ["dynamo", "vllm"])
async def test_strip_and_derive(
    make_stack: StackFactory, client: httpx.AsyncClient, backend: str
) -> None:
    stack = await make_stack(backend)
    headers = [(name.lower(), value) for name, value in spoofed_headers()]
    reply = await client.post(
        f"{stack.pylon_url}{CHAT}", json=spoofed_body(backend), headers=headers
    )
    assert reply.status_code == 200, reply.text
    expect_version(reply, client)
    record = await stack.last_request()
    names = [name.lower() for name, _ in record["headers"]]
    assert not [n for n in names if n.startswith(("x-stargate-", "x-smg-", "x-override-"))]
    assert "x-worker-instance-id" not in names
    assert header_values(record, "x-request-id") == ["spoof-1"]
    assert len(header_values(record, "host")) == 1
    body = record["body"]
    assert "cache_salt" not in body
    if backend == "dynamo":
        assert header_values(record, "x-dynamo-request-priority") == [str(3600 - 7)]
        assert header_values(record, "x-dynamo-request-strict-priority") == ["0"]
        assert "agent_hints" not in body["nvext"]
    else:
        assert not [n for n in names if n.startswith("x-dynamo-")]
        assert body["priority"] == 7


async def test_sse_arrives_event_by_event(
    make_stack: StackFactory, client: httpx.AsyncClient
) -> None:
    stack = await make_stack("dynamo", mock={"num_tokens": 8, "token_delay_ms": 40})
    arrivals: list[float] = []
    events: list[str] = []
    async with client.stream(
        "POST",
        f"{stack.pylon_url}{CHAT}",
        json=chat(stream=True, max_tokens=8),
        headers={"x-request-id": "sse-1", "x-model": MODEL},
    ) as reply:
        assert reply.status_code == 200
        expect_version(reply, client)
        assert reply.headers["content-type"].startswith("text/event-stream")
        async for line in reply.aiter_lines():
            if line.startswith("data:"):
                events.append(line)
                arrivals.append(time.monotonic())
    assert events[-1] == "data: [DONE]"
    assert len(events) >= 9
    # Relayed as produced, not buffered: most consecutive events are a token delay apart.
    gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    assert sum(gap > 0.02 for gap in gaps) >= 5, gaps


async def test_contract_error_is_400_and_never_forwarded(
    make_stack: StackFactory, client: httpx.AsyncClient
) -> None:
    stack = await make_stack("dynamo")
    reply = await client.post(
        f"{stack.pylon_url}{CHAT}",
        json=chat(),
        headers={"x-request-id": "bad", "x-model": MODEL, "x-priority": "-1"},
    )
    assert reply.status_code == 400
    assert reply.headers["content-type"] == "application/problem+json"
    assert reply.json()["code"] == "invalid_priority"
    assert reply.json()["request_id"] == "bad"
    assert (await stack.control())["requests"] == []


async def test_health_and_head(make_stack: StackFactory, client: httpx.AsyncClient) -> None:
    stack = await make_stack("dynamo")
    health = await client.get(f"{stack.pylon_url}/health")
    assert health.status_code == 200
    head = await client.head(
        f"{stack.pylon_url}/v1/models", headers={"x-request-id": "h", "x-model": MODEL}
    )
    assert head.status_code == 200
    assert head.content == b""


async def test_many_streams_on_one_connection(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", mock={"num_tokens": 6, "token_delay_ms": 5})
    async with httpx.AsyncClient(http1=False, http2=True, timeout=10) as session:

        async def one(i: int) -> httpx.Response:
            return await session.post(
                f"{stack.pylon_url}{CHAT}",
                json=chat(stream=i % 2 == 0),
                headers={"x-request-id": f"m{i}", "x-model": MODEL},
            )

        replies = await asyncio.gather(*(one(i) for i in range(40)))
    assert [r.status_code for r in replies] == [200] * 40
    assert all(r.http_version == "HTTP/2" for r in replies)
    assert len((await stack.control())["requests"]) == 40


def _data_events(response: H2Response) -> int:
    return bytes(response.body).count(b"data:")


async def test_rst_stream_cancels_the_engine_request_promptly(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", mock={"token_delay_ms": 50, "num_tokens": 400})
    h2 = await H2Client.connect(stack.pylon_address)
    try:
        body = json.dumps(chat(stream=True, max_tokens=400)).encode()
        sid = h2.send(request_headers(request_id="gone"), body)
        await h2.wait_until(lambda: _data_events(h2.responses[sid]) >= 3, what="3 SSE events")
        h2.reset(sid)
        reset_at = time.time()
        # Cancelled, not completed, within 2 token delays + slack (0.5 s) of a 20 s stream.
        await assert_cancelled_promptly(stack.client, stack.mock.base_url, "gone", reset_at)
        # The connection is untouched: the next stream on it works.
        short = json.dumps(chat()).encode()
        after = await h2.response(h2.send(request_headers(request_id="after"), short))
        assert after.status == 200
    finally:
        await h2.close()


async def test_connection_loss_cancels_every_stream(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", mock={"token_delay_ms": 50, "num_tokens": 400})
    h2 = await H2Client.connect(stack.pylon_address)
    try:
        body = json.dumps(chat(stream=True, max_tokens=400)).encode()
        ids = [h2.send(request_headers(request_id=f"lost{i}"), body) for i in range(3)]
        await h2.wait_until(
            lambda: all(_data_events(h2.responses[sid]) >= 1 for sid in ids),
            what="an SSE event on each of the 3 streams",
        )
        h2.writer.transport.abort()
        lost_at = time.time()
        # Each one cancelled, not completed, within 2 token delays + slack of a 20 s stream.
        for i in range(3):
            await assert_cancelled_promptly(stack.client, stack.mock.base_url, f"lost{i}", lost_at)
    finally:
        await h2.close()


async def test_response_respects_the_peer_flow_control_window(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", mock={"num_tokens": 300, "token_delay_ms": 0})
    h2 = await H2Client.connect(stack.pylon_address, auto_ack=False, window=1000)
    try:
        body = json.dumps(chat(max_tokens=300)).encode()
        sid = h2.send(request_headers(request_id="fc"), body)
        reply = h2.responses[sid]
        await h2.wait_until(lambda: len(reply.body) >= 1000, what="the first 1000-byte window")
        # The engine has written the whole body to pylon; a PING round trip later (every frame
        # pylon sent before its ACK has been read), nothing beyond the window has come.
        await stack.wait_record("fc", "completed")
        await h2.ping()
        assert reply.status == 200
        assert len(reply.body) == 1000
        assert not reply.done.is_set()
        total = int(reply.header(b"content-length") or 0)
        step = 200  # several WINDOW_UPDATEs before the body is complete
        assert total > 1000 + 2 * step, total

        def reached(size: int) -> Callable[[], bool]:
            return lambda: len(reply.body) >= size or reply.done.is_set()

        granted = 1000
        while not reply.done.is_set():
            h2.open_window(sid, step)
            granted += step
            await h2.wait_until(reached(min(granted, total)), what=f"{granted} bytes of the body")
            assert len(reply.body) <= granted, f"{len(reply.body)} bytes sent on a {granted} window"
        assert len(reply.body) == total
        assert reply.json()["choices"][0]["message"]["content"]
    finally:
        await h2.close()


@pytest.mark.skipif(shutil.which("nghttp") is None, reason="nghttp (Debian nghttp2-client) absent")
async def test_nghttp_independent_client(make_stack: StackFactory, tmp_path: Any) -> None:
    stack = await make_stack("dynamo")
    payload = tmp_path / "body.json"
    payload.write_text(json.dumps(chat()))
    proc = await asyncio.create_subprocess_exec(
        "nghttp",
        "--no-dep",
        "-H",
        "x-request-id: ng-1",
        "-H",
        f"x-model: {MODEL}",
        "-H",
        "content-type: application/json",
        "-d",
        str(payload),
        f"{stack.pylon_url}{CHAT}",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 10)
    assert proc.returncode == 0, err
    assert json.loads(out)["choices"][0]["message"]["content"]
    record = await stack.last_request()
    assert header_values(record, "x-request-id") == ["ng-1"]


async def test_client_goaway_mid_response_ends_streams_cleanly(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", mock={"token_delay_ms": 30, "num_tokens": 400})
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    h2 = await H2Client.connect(stack.pylon_address)
    try:
        body = json.dumps(chat(stream=True, max_tokens=400)).encode()
        ids = [h2.send(request_headers(request_id=f"ga{i}"), body) for i in range(3)]
        await h2.wait_until(
            lambda: all(_data_events(h2.responses[sid]) >= 1 for sid in ids),
            what="an SSE event on each of the 3 streams",
        )
        h2.conn.close_connection()  # GOAWAY while three responses are mid-stream
        h2._flush()
        goaway_at = time.time()
        async with asyncio.timeout(3):
            await h2.closed.wait()
        # Each one cancelled, not completed, within 2 token delays + slack of a 12 s stream.
        for i in range(3):
            await assert_cancelled_promptly(stack.client, stack.mock.base_url, f"ga{i}", goaway_at)
        assert errors == []
    finally:
        loop.set_exception_handler(None)
        await h2.close()
