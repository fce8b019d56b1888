"""HTTP/1.1 client for the engine: a keep-alive connection pool on asyncio.Protocol + httptools.

Why not aiohttp or httpx: measured side by side (docs/benchmarks.md), their per-request CPU cost
dominated pylon's. Parsing stays in llhttp (httptools); this module only frames requests, pools
connections and hands body chunks to one consumer with back-pressure.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass
from typing import cast

import httptools

from pylon.core.http import Header

_BODYLESS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS"})
_HIGH_WATER = 256 * 1024  # buffered, unconsumed response bytes before we stop reading


class UpstreamConnectError(Exception):
    """The engine could not be reached at all (refused, unreachable, connect timeout)."""


class UpstreamBroken(Exception):
    """The engine broke the exchange after the request was sent."""


class UpstreamTimeout(Exception):
    """Pylon gave up waiting on the engine (set by the caller's watchdog)."""


@dataclass(frozen=True, slots=True)
class UpstreamTarget:
    host: str
    port: int
    base_path: str  # "" or "/prefix" without a trailing slash

    @property
    def host_header(self) -> bytes:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}".encode("ascii")


class Exchange:
    """One request/response on one pooled connection, consumed by exactly one task."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_done",
        "_error",
        "_head_waiter",
        "_waiter",
        "headers",
        "is_head",
        "reason",
        "status",
    )

    def __init__(self, conn: _Connection, is_head: bool) -> None:
        self._conn = conn
        self.is_head = is_head
        self.status = 0
        self.headers: list[Header] = []
        self._head_waiter: asyncio.Future[None] = conn.loop.create_future()
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._done = False
        self._error: BaseException | None = None

    async def wait_head(self) -> None:
        await self._head_waiter

    async def next_chunk(self) -> bytes | None:
        """All body bytes received so far and not yet read; None at the end of the body.

        Raises if the exchange broke (after the bytes that did arrive were read).
        """
        while True:
            if self._chunks:
                # Everything that has arrived, as one piece: the relay then writes once per
                # wake-up instead of once per engine chunk (one syscall, not twenty).
                chunks = self._chunks
                chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._buffered = 0
                self._conn.resume_reading()
                return chunk
            if self._error is not None:
                raise self._error
            if self._done:
                return None
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def fail(self, error: BaseException) -> None:
        """Break the exchange (engine went away, or the caller's timeout fired)."""
        if self._error is None and not self._done:
            self._error = error
        if not self._head_waiter.done():
            self._head_waiter.set_exception(error)
            self._head_waiter.exception()  # retrieved: the waiter may already be gone
        self._wake()

    # --- called by the connection protocol ---
    def _head_complete(self) -> None:
        if not self._head_waiter.done():
            self._head_waiter.set_result(None)

    def _complete(self) -> None:
        self._done = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    @property
    def complete(self) -> bool:
        return self._done and self._error is None and not self._chunks


class _Connection(asyncio.Protocol):
    def __init__(self, pool: UpstreamPool) -> None:
        self.loop = pool.loop
        self._pool = pool
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.exchange: Exchange | None = None
        self.closed = False
        self.keep_alive = False
        self.idle_since = 0.0
        self._paused = False
        self._until_close = False

    # --- asyncio.Protocol ---
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._break(UpstreamBroken(f"engine sent a malformed response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.exchange is None:
            return
        if self._until_close and exc is None:
            # A close-delimited body (no length, not chunked) ends exactly here.
            self.exchange._complete()
        else:
            self.exchange.fail(UpstreamBroken("engine closed the connection mid-response"))

    # --- httptools callbacks ---
    def on_message_begin(self) -> None:
        if self.exchange is not None:
            self.exchange.headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.exchange is not None:
            self.exchange.headers.append((name, value))

    def on_headers_complete(self) -> None:
        exchange = self.exchange
        if exchange is None:
            return
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            return  # an interim response; the real one follows
        exchange.status = status
        self.keep_alive = self._parser.should_keep_alive()
        self._until_close = _delimited_by_close(status, exchange.headers)
        exchange._head_complete()
        if exchange.is_head:
            # llhttp cannot be told the request was HEAD; the body it expects never comes.
            self.keep_alive = False
            exchange._complete()

    def on_body(self, body: bytes) -> None:
        # Hot path (once per engine chunk, i.e. per token): inlined on purpose.
        exchange = self.exchange
        if exchange is None or exchange.is_head:
            return
        exchange._chunks.append(body)
        exchange._buffered += len(body)
        if exchange._buffered > _HIGH_WATER:
            self.pause_reading()
        waiter = exchange._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def on_message_complete(self) -> None:
        exchange = self.exchange
        if exchange is not None and exchange.status >= 200:
            exchange._complete()

    # --- flow control, used by Exchange ---
    def pause_reading(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    def _break(self, error: BaseException) -> None:
        if self.exchange is not None:
            self.exchange.fail(error)
        self.abort()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


def _delimited_by_close(status: int, headers: list[Header]) -> bool:
    """RFC 9112 6.3: without Content-Length or chunked coding, the body runs to the close."""
    if status in (204, 304):
        return False
    for name, value in headers:
        lowered = name.lower()
        if lowered == b"content-length" or (
            lowered == b"transfer-encoding" and b"chunked" in value.lower()
        ):
            return False
    return True


class UpstreamPool:
    def __init__(
        self,
        target: UpstreamTarget,
        *,
        connect_timeout: float,
        idle_timeout: float,
        max_idle: int,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.target = target
        self.loop = loop or asyncio.get_running_loop()
        self._connect_timeout = connect_timeout
        self._idle_timeout = idle_timeout
        self._max_idle = max_idle
        self._idle: list[_Connection] = []
        self._host_header = target.host_header

    async def send(
        self, method: str, target: str, headers: tuple[Header, ...], body: bytes
    ) -> Exchange:
        """Send one request; returns once it is written. Raises UpstreamConnectError."""
        conn = self._take_idle() or await self._connect()
        exchange = Exchange(conn, is_head=method == "HEAD")
        conn.exchange = exchange
        assert conn.transport is not None
        conn.transport.write(self._frame(method, target, headers, body))
        return exchange

    def finish(self, exchange: Exchange) -> None:
        """Return the connection to the pool if the exchange ended cleanly, else close it."""
        conn = exchange._conn
        conn.exchange = None
        conn.resume_reading()
        if (
            exchange.complete
            and conn.keep_alive
            and not conn.closed
            and len(self._idle) < self._max_idle
        ):
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.abort()

    def close(self) -> None:
        for conn in self._idle:
            conn.abort()
        self._idle.clear()

    def _take_idle(self) -> _Connection | None:
        # Engines behind uvicorn close idle connections after 5 s; never reuse one near that age,
        # so a request is never written into a connection the engine is closing.
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and now - conn.idle_since < self._idle_timeout:
                return conn
            conn.abort()
        return None

    async def _connect(self) -> _Connection:
        try:
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(
                    lambda: _Connection(self), self.target.host, self.target.port
                ),
                self._connect_timeout,
            )
        except (TimeoutError, OSError) as exc:
            raise UpstreamConnectError(
                f"cannot connect to engine at {self.target.host}:{self.target.port}: "
                f"{exc.__class__.__name__}"
            ) from exc
        return conn

    def _frame(self, method: str, target: str, headers: tuple[Header, ...], body: bytes) -> bytes:
        parts = [
            method.encode("ascii"),
            b" ",
            self.target.base_path.encode("ascii"),
            target.encode("ascii"),
            b" HTTP/1.1\r\nhost: ",
            self._host_header,
            b"\r\n",
        ]
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        if body or method not in _BODYLESS:
            parts += (b"content-length: ", str(len(body)).encode("ascii"), b"\r\n")
        parts += (b"\r\n", body)
        return b"".join(parts)
