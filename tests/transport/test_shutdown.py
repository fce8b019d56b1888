"""Graceful stop (SIGTERM): no new work on any listener, requests in flight finish within the
grace period, then pylon exits (reliability case F68)."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from aioquic.asyncio.client import connect

from mock_dynamo.config import MockConfig
from mock_dynamo.server import start_mock
from pylon.logs import configure_logging
from pylon.observe import LogObserver
from pylon.run import serve
from pylon.settings import load_settings
from tests.cancellation import wait_for_record
from tests.h3client import H3Client, client_configuration, request_headers
from tests.h3client import chat as h3_chat
from tests.integration.conftest import MODEL

CHAT = "/v1/chat/completions"


@dataclass
class Running:
    address: tuple[str, int]
    stop: asyncio.Event
    task: asyncio.Task[None]
    mock_url: str

    async def wait_record(
        self, request_id: str, event: str, timeout: float = 10.0
    ) -> dict[str, Any]:
        """mock_dynamo's record of `request_id` once `event` happened (a long poll)."""
        async with httpx.AsyncClient() as client:
            return await wait_for_record(client, self.mock_url, request_id, event, timeout)


@pytest.fixture
async def running() -> AsyncIterator[Callable[..., Any]]:
    configure_logging("json", "warning")
    cleanups: list[Any] = []

    async def start(**settings: Any) -> Running:
        engine = await start_mock(MockConfig(models=(MODEL,), token_delay_ms=30, num_tokens=400))
        cleanups.append(engine.stop)
        config = load_settings(
            {
                "listen": "127.0.0.1:0",
                "upstream": engine.base_url,
                "log_level": "warning",
                **settings,
            }
        )
        ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        stop = asyncio.Event()
        task = asyncio.create_task(
            serve(config, on_ready=ready.set_result, stop=stop, handle_signals=False)
        )
        cleanups.append(lambda: asyncio.wait_for(task, 10))
        cleanups.append(stop.set)
        host, port = (await asyncio.wait_for(ready, 5)).rsplit(":", 1)
        return Running((host, int(port)), stop, task, str(engine.base_url))

    yield start
    for cleanup in reversed(cleanups):
        result = cleanup()
        if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
            await result


def stream_request(request_id: str, tokens: int) -> bytes:
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "max_tokens": tokens,
        }
    ).encode()
    head = (
        f"POST {CHAT} HTTP/1.1\r\nhost: x\r\nx-request-id: {request_id}\r\n"
        f"x-model: {MODEL}\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def test_http1_stream_in_flight_finishes_and_new_connections_are_refused(
    running: Callable[..., Any],
) -> None:
    pylon = await running(shutdown_grace=10)
    reader, writer = await asyncio.open_connection(*pylon.address)
    idle_reader, idle_writer = await asyncio.open_connection(*pylon.address)
    writer.write(stream_request("in-flight", 15))
    async with asyncio.timeout(5):
        first = await reader.readuntil(b"\n\n")
    assert first.startswith(b"HTTP/1.1 200 ")
    pylon.stop.set()
    async with asyncio.timeout(5):
        rest = await reader.read()  # to the close, after the last chunk
        assert await idle_reader.read() == b""  # the idle keep-alive was closed at once
    body = first + rest
    assert body.count(b"data: {") == 17  # role chunk, 15 tokens, finish chunk
    assert body.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    writer.close()
    idle_writer.close()
    async with asyncio.timeout(5):
        await pylon.task
    with pytest.raises(OSError):
        await asyncio.open_connection(*pylon.address)


@pytest.mark.skipif(shutil.which("nghttp") is None, reason="nghttp (nghttp2-client) not installed")
async def test_http2_goaway_lets_open_streams_finish(
    running: Callable[..., Any], tmp_path: Path
) -> None:
    """nghttp, an independent HTTP/2 client, sees GOAWAY and still gets its whole stream.

    (The `h2` library, as a client, drops every stream on a GOAWAY, so it cannot show this.)
    """
    pylon = await running(shutdown_grace=10)
    payload = tmp_path / "body.json"
    payload.write_bytes(stream_request("h2", 15).split(b"\r\n\r\n", 1)[1])
    proc = await asyncio.create_subprocess_exec(
        "nghttp",
        "-v",
        "--no-dep",
        "-H",
        "x-request-id: h2-in-flight",
        "-H",
        f"x-model: {MODEL}",
        "-d",
        str(payload),
        f"http://{pylon.address[0]}:{pylon.address[1]}{CHAT}",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    # In flight: the engine has the request and is streaming 15 tokens x 30 ms back.
    await pylon.wait_record("h2-in-flight", "received")
    pylon.stop.set()
    out, err = await asyncio.wait_for(proc.communicate(), 10)
    assert proc.returncode == 0, err
    assert b"recv GOAWAY frame" in out
    assert b"error_code=NO_ERROR(0x00)" in out
    assert out.count(b"data: {") == 17
    assert b"data: [DONE]" in out
    async with asyncio.timeout(5):
        await pylon.task


async def test_grace_period_bounds_the_shutdown(running: Callable[..., Any]) -> None:
    grace_s, stream_s = 0.3, 400 * 30 / 1000  # 400 tokens x 30 ms: far past the grace period
    pylon = await running(shutdown_grace=grace_s)
    reader, writer = await asyncio.open_connection(*pylon.address)
    writer.write(stream_request("too-long", 400))
    async with asyncio.timeout(5):
        await reader.readuntil(b"\n\n")
    started = time.monotonic()
    pylon.stop.set()
    async with asyncio.timeout(5):
        await pylon.task
    # The grace period, not the 12 s stream, decided when pylon exited.
    assert time.monotonic() - started < grace_s + stream_s / 10
    # And what was still running was stopped, not left behind: the engine saw it cancelled.
    record = await pylon.wait_record("too-long", "finished")
    assert record["cancelled_at"] is not None and record["completed_at"] is None
    writer.close()


class ProcessEvents(LogObserver):
    """Keeps the process events (and logs them as usual); `wait_for` is event-driven."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._changed = asyncio.Event()

    def process_event(self, kind: str, /, **fields: Any) -> None:
        super().process_event(kind, **fields)
        self.events.append((kind, fields))
        self._changed.set()

    async def wait_for(self, kind: str, timeout: float = 5.0) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            while True:
                for seen, fields in self.events:
                    if seen == kind:
                        return fields
                self._changed.clear()
                await self._changed.wait()


async def test_drain_reports_what_runs_per_transport_and_can_be_forced() -> None:
    """The drain says what is still running on each transport; `force` (what a second signal
    sets) ends it at once, long before the grace period."""
    configure_logging("json", "warning")
    engine = await start_mock(MockConfig(models=(MODEL,), token_delay_ms=30, num_tokens=2000))
    observer = ProcessEvents()
    config = load_settings(
        {
            "listen": "127.0.0.1:0",
            "quic_listen": "127.0.0.1:0",
            "upstream": engine.base_url,
            "shutdown_grace": 60,
        }
    )
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    quic: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    stop, force = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(
        serve(
            config,
            on_ready=ready.set_result,
            on_quic_ready=quic.set_result,
            stop=stop,
            force=force,
            handle_signals=False,
            observer=observer,
        )
    )
    writer: asyncio.StreamWriter | None = None
    try:
        host, port = (await asyncio.wait_for(ready, 5)).rsplit(":", 1)
        quic_host, quic_port = (await asyncio.wait_for(quic, 5)).rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(stream_request("tcp-long", 2000))
        async with asyncio.timeout(5):
            await reader.readuntil(b"data: {")
        async with connect(
            quic_host,
            int(quic_port),
            configuration=client_configuration(),
            create_protocol=H3Client,
            wait_connected=True,
        ) as client:
            assert isinstance(client, H3Client)
            body = json.dumps(h3_chat(True, max_tokens=2000)).encode()
            response = client.send(
                request_headers(
                    "POST", CHAT, [("x-request-id", "h3-long"), ("x-model", MODEL)], body
                ),
                body,
            )
            await client.wait_until(lambda: bool(response.chunks), what="the first h3 output")
            async with (
                httpx.AsyncClient(http1=False, http2=True, timeout=10) as h2,
                h2.stream(
                    "POST",
                    f"http://{host}:{port}{CHAT}",
                    headers={"x-request-id": "h2-long", "x-model": MODEL},
                    content=body,
                ) as streamed,
            ):
                assert streamed.http_version == "HTTP/2"
                async for _ in streamed.aiter_raw():
                    break  # the first output: in flight
                stop.set()
                draining = await observer.wait_for("draining")
                assert (draining["http1"], draining["h2"], draining["h3"]) == (1, 1, 1)
                started = time.monotonic()
                force.set()
                async with asyncio.timeout(5):
                    assert await task == 1  # forced, not by a signal
                assert time.monotonic() - started < 5
            forced = await observer.wait_for("forced_stop")
            assert forced["signal"] is None
            assert (forced["http1"], forced["h2"], forced["h3"]) == (1, 1, 1)
            assert "drained" not in {kind for kind, _ in observer.events}
    finally:
        stop.set()
        force.set()
        if writer is not None:
            writer.close()
        await asyncio.wait_for(task, 10)
        await engine.stop()
