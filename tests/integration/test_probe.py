"""pylon's own bounded GET (health gate, discovery) against raw engines on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import pytest

from pylon.core.upstream import Upstream
from pylon.upstream.probe import FetchError, fetch


@contextlib.asynccontextmanager
async def engine(reply: bytes | None, close: bool = True) -> AsyncIterator[tuple[str, list[bytes]]]:
    """Answers each connection's request head with `reply` (None: never answers)."""
    heads: list[bytes] = []
    hold = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            heads.append(await reader.readuntil(b"\r\n\r\n"))
            if reply is None:
                await hold.wait()
            else:
                writer.write(reply)
                await writer.drain()
                if not close:
                    await hold.wait()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/base", heads
    finally:
        hold.set()
        server.close()


async def test_a_sized_answer_and_the_request_line() -> None:
    reply = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"
    async with engine(reply, close=False) as (url, heads):
        got = await fetch(Upstream.from_url(url), "/health", timeout=2, max_body=10)
    assert (got.status, got.body) == (200, b"{}")
    head = heads[0].lower()
    assert head.startswith(b"get /base/health http/1.1\r\n")
    assert b"connection: close\r\n" in head


async def test_a_close_delimited_answer_ends_at_the_close() -> None:
    async with engine(b"HTTP/1.1 503 Busy\r\n\r\nnot yet") as (url, _):
        got = await fetch(Upstream.from_url(url), "/health", timeout=2, max_body=10)
    assert (got.status, got.body) == (503, b"not yet")


async def test_interim_responses_are_skipped() -> None:
    reply = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n"
    async with engine(reply) as (url, _):
        got = await fetch(Upstream.from_url(url), "/h", timeout=2, max_body=10)
    assert got.status == 204


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        (b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + b"x" * 100, "too_large"),
        (b"HTTP/1.1 200 OK\r\n" + b"x-big: " + b"y" * 70_000 + b"\r\n\r\n", "too_large"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nab", "closed"),
        (b"NOT HTTP AT ALL\r\n\r\n", "protocol"),
        (b"", "closed"),
    ],
)
async def test_bad_answers_are_fetch_errors(reply: bytes, reason: str) -> None:
    async with engine(reply) as (url, _):
        with pytest.raises(FetchError) as failed:
            await fetch(Upstream.from_url(url), "/h", timeout=2, max_body=10)
    assert failed.value.reason == reason and failed.value.detail


async def test_an_engine_that_never_answers_is_a_timeout() -> None:
    async with engine(None) as (url, _):
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(FetchError) as failed:
            await fetch(Upstream.from_url(url), "/h", timeout=0.1, max_body=10)
    assert failed.value.reason == "timeout"
    assert loop.time() - started < 2


async def test_nothing_listening_is_a_connect_error() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    with pytest.raises(FetchError) as failed:
        await fetch(Upstream.from_url(f"http://127.0.0.1:{port}"), "/h", timeout=2, max_body=1)
    assert failed.value.reason == "connect"
    assert failed.value.detail.startswith("cannot connect: ")
