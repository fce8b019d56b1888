"""The admin listener: /live, /ready (through start, readiness and drain), /metrics content
negotiation, and its bounds (methods, paths, head size, bodies, timeouts, connections)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)

from pylon import admin
from pylon.admin import AdminConnection, AdminRoutes, AdminServer
from pylon.lifecycle import Lifecycle
from pylon.metrics import MetricsObserver
from pylon.observe import LogObserver
from pylon.run import start
from pylon.settings import load_settings
from pylon.startup import StartupError
from tests.integration.conftest import raw_exchange
from tests.stack import Stack, StackFactory


def admin_url(stack: Stack) -> str:
    assert stack.running.admin_url is not None
    return stack.running.admin_url


def problem_of(raw: bytes) -> tuple[int, dict[str, str], dict[str, object]]:
    """(status, headers, JSON body) of one raw HTTP/1.1 answer."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    fields = dict(line.lower().split(": ", 1) for line in lines[1:])
    return status, fields, json.loads(body)


@contextlib.asynccontextmanager
async def bare_admin(lifecycle: Lifecycle) -> AsyncIterator[AdminServer]:
    server = AdminServer(AdminRoutes(lifecycle, MetricsObserver("dynamo").registry))
    await server.start("127.0.0.1:0")
    try:
        yield server
    finally:
        server.close()


async def test_live_and_ready_then_drain(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", quic_listen=None)
    url = admin_url(stack)
    live = await stack.client.get(f"{url}/live")
    assert (live.status_code, live.json()) == (200, {"live": True})
    ready = await stack.client.get(f"{url}/ready")
    assert (ready.status_code, ready.json()) == (200, {"ready": True, "reason": "ready"})
    stack.drain()  # what SIGTERM does first
    ready = await stack.client.get(f"{url}/ready")
    assert (ready.status_code, ready.json()) == (503, {"ready": False, "reason": "draining"})
    assert ready.headers["content-type"] == "application/json"
    assert (await stack.client.get(f"{url}/live")).status_code == 200  # still alive


async def test_not_ready_while_starting() -> None:
    lifecycle = Lifecycle()
    async with bare_admin(lifecycle) as server, httpx.AsyncClient(timeout=5) as client:
        ready = await client.get(f"http://{server.address}/ready")
        assert (ready.status_code, ready.json()) == (
            503,
            {"ready": False, "reason": "engine_not_ready"},
        )
        lifecycle.mark_ready()  # the engine passed its gate, but no model is published yet
        ready = await client.get(f"http://{server.address}/ready")
        assert (ready.status_code, ready.json()) == (503, {"ready": False, "reason": "no_models"})
        lifecycle.models.apply(["m"])
        assert (await client.get(f"http://{server.address}/ready")).status_code == 200


async def test_metrics_in_text_or_openmetrics(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", quic_listen=None)
    url = f"{admin_url(stack)}/metrics"
    text = await stack.client.get(url)
    assert text.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "# TYPE pylon_build_info gauge" in text.text
    accept = "application/openmetrics-text; version=1.0.0; charset=utf-8,text/plain;q=0.5"
    reply = await stack.client.get(url, headers={"accept": accept})
    assert reply.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert reply.text.endswith("# EOF\n")
    families = {f.name: f.type for f in openmetrics_families(reply.text)}
    assert families["pylon_build"] == "info"
    assert families["pylon_requests"] == "counter"
    assert families["pylon_request_duration_seconds"] == "histogram"
    # An Accept header the client library cannot parse: plain text, not an error.
    odd = await stack.client.get(url, headers={"accept": "application/openmetrics-text; version=x"})
    assert odd.status_code == 200 and "pylon_build_info" in odd.text


async def test_head_unknown_paths_and_other_methods(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", quic_listen=None)
    url = admin_url(stack)
    head = await stack.client.head(f"{url}/live")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-length"] == str(len(b'{"live":true}'))
    missing = await stack.client.get(f"{url}/v1/chat/completions")
    assert missing.status_code == 404
    assert missing.headers["content-type"] == "application/problem+json"
    assert missing.json()["code"] == "not_found"
    for method in ("POST", "PUT", "DELETE", "OPTIONS"):
        refused = await stack.client.request(method, f"{url}/metrics")
        assert refused.status_code == 405, method
        assert refused.headers["allow"] == "GET, HEAD"
        assert refused.json()["code"] == "method_not_allowed"
    # No tunnel request ever reached the engine through the admin port.
    assert await stack.records() == []


async def test_keep_alive_answers_pipelined_requests_in_order() -> None:
    async with bare_admin(Lifecycle()) as server:
        host, port = server.address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /live HTTP/1.1\r\nhost: x\r\n\r\nGET /ready HTTP/1.1\r\nhost: x\r\n\r\n")
        first = await reader.readuntil(b"}")
        second = await reader.readuntil(b"}")
        assert first.startswith(b"HTTP/1.1 200 OK") and first.endswith(b'{"live":true}')
        assert second.startswith(b"HTTP/1.1 503 Service Unavailable")
        writer.close()


async def test_bounded_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    async with bare_admin(Lifecycle()) as server:
        host, port = server.address.rsplit(":", 1)
        address = (host, int(port))
        huge = (
            b"GET /live HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * admin.MAX_HEAD_BYTES + b"\r\n\r\n"
        )
        status, fields, body = problem_of(await raw_exchange(*address, huge))
        assert (status, body["code"], fields["connection"]) == (431, "headers_too_large", "close")
        many = b"GET /live HTTP/1.1\r\n" + b"x-h: 1\r\n" * (admin.MAX_HEADERS + 1) + b"\r\n"
        status, _, body = problem_of(await raw_exchange(*address, many))
        assert (status, body["code"]) == (431, "headers_too_large")
        with_body = b"GET /live HTTP/1.1\r\ncontent-length: 3\r\n\r\nabc"
        status, _, body = problem_of(await raw_exchange(*address, with_body))
        assert (status, body["code"]) == (413, "body_not_allowed")
        status, _, body = problem_of(
            await raw_exchange(*address, b"GET /live HTTP/1.1\r\nbad\r\n\r\n")
        )
        assert (status, body["code"]) == (400, "malformed_request")
        # A request that stops half-way is answered 408 and closed, not kept forever.
        monkeypatch.setattr(admin, "REQUEST_TIMEOUT", 0.2)
        status, _, body = problem_of(await raw_exchange(*address, b"GET /live HTTP/1.1\r\nho"))
        assert (status, body["code"]) == (408, "request_timeout")


@pytest.mark.parametrize("where", ["value", "name", "after_a_request"])
async def test_one_endless_header_line_is_refused_as_it_arrives(where: str) -> None:
    """httptools holds an unfinished field line whole before `on_header` can count it: the
    head's raw bytes are counted as they are fed, so a line that never ends is a 431 at once
    (before the fix: 155 MiB buffered in 10 s, RSS +190 MiB, then a 408)."""
    async with bare_admin(Lifecycle()) as server:
        host, port = server.address.rsplit(":", 1)
        endless = {"value": b"x-pad: " + b"a" * 4 * admin.MAX_HEAD_BYTES}
        endless["name"] = b"x" * 4 * admin.MAX_HEAD_BYTES
        endless["after_a_request"] = b"host: x\r\n\r\nGET /metrics HTTP/1.1\r\n" + endless["value"]
        data = b"GET /live HTTP/1.1\r\n" + endless[where]
        # The line never ends: only the count of what arrived can answer before the timeout.
        reply = await raw_exchange(host, int(port), data, timeout=admin.REQUEST_TIMEOUT / 2)
        if where == "after_a_request":
            assert reply.startswith(b"HTTP/1.1 200 OK")
            reply = reply[reply.index(b"HTTP/1.1 ", 1) :]
        status, fields, body = problem_of(reply)
        assert (status, body["code"], fields["connection"]) == (431, "headers_too_large", "close")


async def test_silent_connections_at_the_cap_never_starve_the_probes() -> None:
    """The cap's worth of connections that never speak: `/live` and `/ready` still answer at
    once (the least recently active connection is evicted for the new one)."""
    lifecycle = Lifecycle()
    lifecycle.mark_ready()
    lifecycle.models.apply(["m"])
    async with bare_admin(lifecycle) as server:
        host, port = server.address.rsplit(":", 1)
        held = [
            await asyncio.open_connection(host, int(port)) for _ in range(admin.MAX_CONNECTIONS)
        ]
        async with asyncio.timeout(5):
            while server.connections < admin.MAX_CONNECTIONS:  # accepted on the loop
                await asyncio.sleep(0)
        async with httpx.AsyncClient(timeout=5) as client:
            for path in ("/live", "/ready", "/live", "/ready"):
                reply = await client.get(f"http://{server.address}{path}")
                assert reply.status_code == 200, (path, reply.text)
        assert server.connections <= admin.MAX_CONNECTIONS
        assert server.evicted >= 1
        # The evicted ones are the oldest silent ones: their reads end.
        reader, _ = held[0]
        async with asyncio.timeout(5):
            assert await reader.read() == b""
        for _, writer in held:
            writer.close()


class CountingRoutes(AdminRoutes):
    """Counts the answers, to see how many one loop turn computes."""

    answers = 0

    def answer(self, method: str, target: str, accept: str) -> admin.Answer:
        self.answers += 1
        return super().answer(method, target, accept)


async def test_pipelined_flood_that_never_reads_holds_neither_the_loop_nor_memory() -> None:
    """2,000 pipelined `GET /metrics` in one write, never read: one request answered per loop
    turn, nothing parsed while the write buffer is over its high-water mark, and what the
    connection holds stays bounded (not 2,000 answers)."""
    routes = CountingRoutes(Lifecycle(), MetricsObserver("dynamo").registry)
    one_answer = len(routes.metrics("").body) + 256
    server = AdminServer(routes)
    await server.start("127.0.0.1:0")
    loop = asyncio.get_running_loop()
    most_per_turn = 0
    longest_gap = 0.0
    stop = asyncio.Event()

    async def probe() -> None:  # a tick every loop turn: answers and time between two ticks
        nonlocal most_per_turn, longest_gap
        seen, at = routes.answers, loop.time()
        while not stop.is_set():
            await asyncio.sleep(0)
            now = loop.time()
            most_per_turn = max(most_per_turn, routes.answers - seen)
            longest_gap = max(longest_gap, now - at)
            seen, at = routes.answers, now

    ticking = asyncio.create_task(probe())
    try:
        host, port = server.address.rsplit(":", 1)
        flood = b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n" * 2000
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(flood)
        connection = next(iter(server._connections), None)
        async with asyncio.timeout(20):  # until the client's unread answers pause the writes
            while connection is None or not connection._writing_paused:
                await asyncio.sleep(0.005)
                connection = next(iter(server._connections), None)
        answered = routes.answers
        for _ in range(50):  # paused means paused: no more answers are computed
            await asyncio.sleep(0)
        assert routes.answers == answered < 2000
        assert most_per_turn == 1, most_per_turn
        # What the stuck connection holds: the high-water mark, one answer, the unread requests.
        high = connection._transport.get_write_buffer_limits()[1]  # type: ignore[union-attr]
        assert server.buffered() <= high + one_answer + len(flood)
        # The longest loop gap is a few answers' work, not the flood's (2,000 answers).
        started = loop.time()
        for _ in range(20):
            routes.metrics("")
        per_answer = (loop.time() - started) / 20
        assert longest_gap < max(100 * per_answer, 0.25), (longest_gap, per_answer)
        writer.close()
        async with asyncio.timeout(5):
            while server.connections:
                await asyncio.sleep(0.005)
        assert server.buffered() == 0
    finally:
        stop.set()
        await ticking
        server.close()


async def test_an_empty_admin_listen_disables_it(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", quic_listen=None, admin_listen="")
    assert stack.running.listeners.admin is None and stack.running.listeners.admin_address is None
    assert stack.running.core.metrics is None
    assert isinstance(stack.running.core.observer, LogObserver)  # no fan-out, no metrics cost
    reply = await stack.post("/v1/chat/completions", {"model": "mock-model", "messages": []})
    assert reply.status_code == 200


async def test_an_admin_port_in_use_refuses_the_start() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = load_settings(
            {
                "listen": "127.0.0.1:0",
                "admin_listen": f"127.0.0.1:{port}",
                "upstream": "http://127.0.0.1:9",
            }
        )
        with pytest.raises(StartupError, match=rf"--admin-listen 127\.0\.0\.1:{port}: cannot"):
            async with start(settings):
                pytest.fail("started without its admin listener")


async def test_a_failing_collector_is_a_500_not_a_hang() -> None:
    class Broken:
        armed = False

        def collect(self) -> list[object]:
            if self.armed:
                raise RuntimeError("a bug")
            return []

    metrics = MetricsObserver("dynamo")
    broken = Broken()
    metrics.registry.register(broken)  # type: ignore[arg-type]
    broken.armed = True
    server = AdminServer(AdminRoutes(Lifecycle(), metrics.registry))
    await server.start("127.0.0.1:0")
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            reply = await client.get(f"http://{server.address}/metrics")
        assert reply.status_code == 500
        assert reply.json()["code"] == "internal_error"
    finally:
        server.close()


class FakeTransport(asyncio.Transport):
    """What `AdminConnection` sees of a socket: the bytes written, reading paused or not."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.paused = False
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written.append(bytes(data))

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def get_write_buffer_size(self) -> int:
        return 0

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


@pytest.mark.parametrize("piece", [1, 3, 7, 30, 31, 33, 64, 1000])
async def test_one_request_per_loop_turn_however_the_reads_cut_the_heads(piece: int) -> None:
    """Pipelined heads arriving in reads of any size, a head's end split across two reads
    included: each loop turn answers at most one, and every one is answered, in order."""
    server = AdminServer(AdminRoutes(Lifecycle(), MetricsObserver("dynamo").registry))
    connection = AdminConnection(server)
    transport = FakeTransport()
    connection.connection_made(transport)
    one = b"GET /live HTTP/1.1\r\nhost: x\r\n\r\n"  # 31 bytes: the cuts fall everywhere
    data = one * 40
    reads = [data[i : i + piece] for i in range(0, len(data), piece)]
    most = 0
    async with asyncio.timeout(10):
        while reads or len(transport.written) < 80:
            before = len(transport.written)
            if reads and not transport.paused:
                connection.data_received(reads.pop(0))  # a read: its own loop turn
            most = max(most, len(transport.written) - before)
            before = len(transport.written)
            await asyncio.sleep(0)  # one loop turn: the connection's next `_advance`
            most = max(most, len(transport.written) - before)
    assert most <= 2  # one answer: its head and its body
    answers = b"".join(transport.written)
    assert answers.count(b"HTTP/1.1 200 OK") == 40 and answers.endswith(b'{"live":true}')
    connection.connection_lost(None)
