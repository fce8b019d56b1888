"""HTTP/1.1 client for the engines: keep-alive connections per target, capped, on httptools.

Why not aiohttp or httpx: measured side by side (docs/benchmarks.md), their per-request CPU cost
dominated pylon's. Parsing stays in llhttp (httptools); this module only frames requests, pools
connections and hands body chunks to one consumer with back-pressure.

Per target (an engine or a worker URL) the pool keeps at most `max_connections` sockets open.
A request above the cap waits, first come first served, for a connection to come free, for at
most `queue_timeout` seconds; then it fails with `UpstreamBusy` (pylon answers 503, retryable:
the engine never saw the request). Waiting rather than refusing at once: engines queue anyway,
and a short burst above the cap should cost latency, not errors.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import httptools

from pylon.core.http import Header, field_names
from pylon.core.target import UpstreamTarget

if TYPE_CHECKING:
    from pylon.core.plan import ForwardPlan

_BODYLESS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS"})
_HIGH_WATER = 256 * 1024  # buffered, unconsumed response bytes before we stop reading
# The engine's response head (status line and fields), as Envoy bounds it (60 KiB): a larger one
# is a broken or hostile engine, answered 502 instead of being buffered and relayed.
MAX_RESPONSE_HEAD = 60 * 1024
# Linux only; elsewhere None and the delayed-ACK push below is skipped.
_TCP_QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)


class UpstreamConnectError(Exception):
    """The engine could not be reached at all (refused, unreachable, connect timeout)."""


class UpstreamBusy(UpstreamConnectError):
    """Every connection to the target stayed busy for the whole queue timeout."""


class UpstreamBroken(Exception):
    """The engine broke the exchange after the request was sent."""


class UpstreamTimeout(Exception):
    """Pylon gave up waiting on the engine (set by the caller's watchdog)."""


class _HeadTooLarge(Exception):
    """Stops llhttp from parsing an engine response head over the limit."""


class _Surplus(Exception):
    """Stops llhttp from parsing bytes beyond the response pylon asked for."""


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
        "names",
        "status",
    )

    def __init__(self, conn: _Connection, is_head: bool) -> None:
        self._conn = conn
        self.is_head = is_head
        self.status = 0
        self.headers: list[Header] = []
        # The names of `headers`, lower-cased once (as they arrive) for every reader of them.
        self.names: list[bytes] = []
        self._head_waiter: asyncio.Future[None] = conn.loop.create_future()
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._done = False
        self._error: BaseException | None = None

    @property
    def head(self) -> asyncio.Future[None]:
        """Done when the response head arrived (raises what broke the exchange). Awaited as it
        is: a coroutine wrapped around it would cost a frame per request."""
        return self._head_waiter

    @property
    def ready(self) -> bool:
        """`next_chunk` would return at once (bytes buffered, or the body ended or broke)."""
        return bool(self._chunks) or self._done or self._error is not None

    async def next_chunk(self) -> bytes | None:
        """All body bytes received so far and not yet read; None at the end of the body.

        Raises if the exchange broke (after the bytes that did arrive were read).
        """
        while not self.ready:
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.take()

    def take(self) -> bytes | None:
        """`next_chunk` without the wait, for when `ready` says it would not wait: a small body
        usually arrives with its head, and then the relay needs no coroutine to read it."""
        chunks = self._chunks
        if chunks:
            # Everything that has arrived, as one piece: the relay then writes once per
            # wake-up instead of once per engine chunk (one syscall, not twenty).
            chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
            chunks.clear()
            self._buffered = 0
            conn = self._conn
            if conn._paused:  # (checked here: this runs per relayed block)
                conn.resume_reading()
            return chunk
        if self._error is not None:
            raise self._error
        assert self._done, "take() is only called when the exchange is ready"
        return None

    def fail(self, error: BaseException) -> None:
        """Break the exchange (engine went away, or the caller's timeout fired)."""
        if self._error is None and not self._done:
            self._error = error
        if not self._head_waiter.done():
            self._head_waiter.set_exception(error)
            self._head_waiter.exception()  # retrieved: the waiter may already be gone
        self._wake()

    @property
    def stale_connection(self) -> bool:
        """The request went into a kept-alive connection that the engine closed before a single
        response byte: the engine never read it, so sending it again is safe."""
        conn = self._conn
        return conn.reused and not conn.received and self.status == 0

    # --- called by the connection protocol ---
    def _head_complete(self) -> None:
        if not self._head_waiter.done():
            self._head_waiter.set_result(None)

    def _complete(self) -> None:
        self._done = True
        waiter = self._waiter  # `_wake`, inlined: once per response
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    @property
    def complete(self) -> bool:
        return self._done and self._error is None and not self._chunks


class _Connection(asyncio.Protocol):
    __slots__ = (
        "_final",
        "_head_bytes",
        "_parser",
        "_paused",
        "_sock",
        "_until_close",
        "closed",
        "exchange",
        "idle_since",
        "keep_alive",
        "loop",
        "received",
        "reused",
        "target",
        "transport",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, target: UpstreamTarget) -> None:
        self.loop = loop
        self.target = target
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.exchange: Exchange | None = None
        self.closed = False
        self.keep_alive = False
        self.idle_since = 0.0
        self.reused = False  # the current exchange runs on a connection taken from the idle set
        self.received = False  # any byte arrived for the current exchange
        self._paused = False
        self._until_close = False
        self._head_bytes = 0
        self._final = False  # the current exchange's final (non-1xx) response has ended
        self._sock: socket.socket | None = None  # for the delayed-ACK push (Linux)

    # --- asyncio.Protocol ---
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        if _TCP_QUICKACK is not None:
            self._sock = transport.get_extra_info("socket")

    def data_received(self, data: bytes) -> None:
        first = not self.received
        self.received = True
        if self.exchange is None or self._final:
            # Bytes nobody asked for (after the response, or on an idle connection): the engine
            # is out of step, and whatever it says next cannot be trusted as an answer.
            self.abort()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._break(UpstreamBroken("engine switched protocols (101), which pylon never asks"))
        except httptools.HttpParserError as exc:
            self._break(UpstreamBroken(f"engine sent a malformed response: {exc}"))
        else:
            if first and not self._final and self._sock is not None:
                self._ack_now()

    def _ack_now(self) -> None:
        """The response goes on after its first read (a stream): acknowledge now what arrived,
        and leave delayed-ACK "ping-pong" mode for the rest of it.

        An engine that leaves Nagle's algorithm on (the Dynamo 1.6.1 frontend does: no
        TCP_NODELAY on its HTTP sockets) holds each small write until everything it sent before
        is acknowledged. Linux delays the ACK of a small segment by at least 40 ms on a
        connection where pylon's last send answered a receive (a kept-alive connection's next
        request), so the SSE event written after the head waited ~40 ms on every cache hit.
        TCP_QUICKACK sends the pending ACK at once and leaves ping-pong mode; only a send of
        pylon's re-enters it, and pylon sends nothing on this connection until the response
        ends, so every later read of the stream is acknowledged at once too. One syscall per
        streamed response; a response complete in its first read (the small, non-streamed one)
        costs none.
        """
        assert self._sock is not None and _TCP_QUICKACK is not None
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, _TCP_QUICKACK, 1)
        except OSError:
            self._sock = None  # not a TCP socket after all, or already gone: never again

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
        if self._final:
            # A second response after the real one, in the same read: never relayed (it would
            # answer the gateway's next request); the connection is not reused.
            self.abort()
            raise _Surplus
        self._head_bytes = 0
        if self.exchange is not None:
            self.exchange.headers = []
            self.exchange.names = []

    def on_status(self, status: bytes) -> None:
        self._count_head(len(status))

    def on_header(self, name: bytes, value: bytes) -> None:
        # Once per field of every response: the byte count is inlined (see `_count_head`).
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > MAX_RESPONSE_HEAD:
            self._count_head(0)
        exchange = self.exchange
        if exchange is not None:
            exchange.headers.append((name, value))
            # llhttp refuses whitespace in a field name: lower-casing is the whole normalisation.
            exchange.names.append(name.lower())

    def on_headers_complete(self) -> None:
        exchange = self.exchange
        if exchange is None:
            return
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            return  # an interim response; the real one follows
        exchange.status = status
        self.keep_alive = self._parser.should_keep_alive()
        self._until_close = delimited_by_close(status, exchange.headers, exchange.names)
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
            self._final = True
            exchange._complete()

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > MAX_RESPONSE_HEAD:
            # Raised inside llhttp's callback: parsing stops, feed_data raises, we break.
            self._break(UpstreamBroken(f"engine response head over {MAX_RESPONSE_HEAD} bytes"))
            raise _HeadTooLarge

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


def delimited_by_close(
    status: int, headers: list[Header], names: Sequence[bytes] | None = None
) -> bool:
    """RFC 9112 6.3: without Content-Length or chunked coding, the body runs to the close.
    `names`: the names of `headers`, stripped and lower-cased (`field_names`)."""
    if status in (204, 304):
        return False
    if names is None:
        names = field_names(headers)
    for index, name in enumerate(names):
        if name == b"content-length" or (
            name == b"transfer-encoding" and headers[index][1].lower().find(b"chunked") >= 0
        ):
            return False
    return True


class _TargetPool:
    """One target's connections: the idle ones, how many are open, who waits for one."""

    __slots__ = ("idle", "open", "target", "waiters")

    def __init__(self, target: UpstreamTarget) -> None:
        self.target = target
        self.idle: list[_Connection] = []  # oldest first; reuse takes the newest
        self.open = 0  # connections open or being opened (idle ones included)
        self.waiters: collections.deque[asyncio.Future[_Connection | None]] = collections.deque()


@dataclass(frozen=True, slots=True)
class PoolOptions:
    """How many engine connections the pool opens and keeps, and how long it waits for them."""

    connect_timeout: float
    """Seconds to open one connection (`--upstream-connect-timeout`)."""
    idle_timeout: float
    """Seconds an idle kept-alive connection stays open (`--upstream-idle-timeout`)."""
    max_idle: int
    """Idle connections kept per target (`--upstream-max-idle`)."""
    max_connections: int = 1024
    """Open connections per target; requests above it wait (`--upstream-max-connections`)."""
    queue_timeout: float | None = None
    """Seconds a request waits for a free connection (`--upstream-queue-timeout`); None: the
    connect timeout."""


class UpstreamPool:
    def __init__(
        self, options: PoolOptions, *, loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        self.loop = loop or asyncio.get_running_loop()
        self._connect_timeout = options.connect_timeout
        self._idle_timeout = options.idle_timeout
        self._max_idle = options.max_idle
        self._max_connections = options.max_connections
        queue_timeout = options.queue_timeout
        self._queue_timeout = options.connect_timeout if queue_timeout is None else queue_timeout
        # Keyed by the target's label (one per host, port and base path): a str hashes in C, an
        # UpstreamTarget in Python, and the pool looks targets up twice per request.
        self._targets: dict[str, _TargetPool] = {}
        self._reaper: asyncio.TimerHandle | None = None

    def send_idle(self, plan: ForwardPlan) -> Exchange | None:
        """Write `plan` on an idle kept-alive connection to its target and return the exchange;
        None when there is no idle connection (then `send` opens or waits for one). Not a
        coroutine: under load almost every request finds an idle connection."""
        pool = self._target_pool(plan)
        conn = self._take_idle(pool)
        return None if conn is None else self._start(conn, plan, pool.target)

    async def send(self, plan: ForwardPlan, *, fresh: bool = False) -> Exchange:
        """Write `plan` to its target; returns once written. Raises `UpstreamConnectError`.

        `fresh`: use a new connection, never an idle one (the retry of a stale-connection race).
        """
        pool = self._target_pool(plan)
        conn = None if fresh else self._take_idle(pool)
        if conn is None:
            conn = await self._open(pool)
        return self._start(conn, plan, pool.target)

    def _target_pool(self, plan: ForwardPlan) -> _TargetPool:
        assert plan.upstream is not None, "a plan is routed before it is sent"
        target = plan.upstream
        pool = self._targets.get(target.label)
        if pool is None:
            pool = self._targets[target.label] = _TargetPool(target)
        return pool

    @staticmethod
    def _start(conn: _Connection, plan: ForwardPlan, target: UpstreamTarget) -> Exchange:
        exchange = Exchange(conn, plan.method == "HEAD")  # is_head
        conn.exchange = exchange
        conn.received = False
        conn._final = False
        assert conn.transport is not None
        conn.transport.write(_frame(plan, target))
        return exchange

    def finish(self, exchange: Exchange) -> None:
        """Return the connection to its pool if the exchange ended cleanly, else close it."""
        conn = exchange._conn
        conn.exchange = None
        if conn._paused:
            conn.resume_reading()
        pool = self._targets[conn.target.label]
        if exchange.complete and conn.keep_alive and not conn.closed:
            self._hand_over(pool, conn)
            return
        conn.abort()
        self._closed(pool)

    def close(self) -> None:
        for pool in self._targets.values():
            for conn in pool.idle:
                conn.abort()
            pool.open -= len(pool.idle)
            pool.idle.clear()
            while pool.waiters:
                waiter = pool.waiters.popleft()
                if not waiter.done():
                    waiter.set_result(None)
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None

    def open_connections(self, target: UpstreamTarget) -> int:
        pool = self._targets.get(target.label)
        return pool.open if pool is not None else 0

    def idle_connections(self, target: UpstreamTarget) -> int:
        pool = self._targets.get(target.label)
        return len(pool.idle) if pool is not None else 0

    # --- connections ---
    def _take_idle(self, pool: _TargetPool) -> _Connection | None:
        # Engines behind uvicorn close idle connections after 5 s; never reuse one near that age,
        # so a request is rarely written into a connection the engine is closing (and the
        # stale-connection retry covers the rest).
        now = time.monotonic()
        idle = pool.idle
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self._idle_timeout:
                return conn
            conn.abort()
            pool.open -= 1
        return None

    async def _open(self, pool: _TargetPool) -> _Connection:
        if pool.open >= self._max_connections:
            handed = await self._wait_for_connection(pool)
            if handed is not None:
                return handed
        pool.open += 1
        target = pool.target
        try:
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(
                    lambda: _Connection(self.loop, target), target.host, target.port
                ),
                self._connect_timeout,
            )
        except (TimeoutError, OSError) as exc:
            self._closed(pool)
            raise UpstreamConnectError(
                f"cannot connect to engine at {target.label}: {exc.__class__.__name__}"
            ) from exc
        except BaseException:
            self._closed(pool)
            raise
        return conn

    async def _wait_for_connection(self, pool: _TargetPool) -> _Connection | None:
        """Queue for a connection: a kept-alive one handed over, or None = room to open one."""
        waiter: asyncio.Future[_Connection | None] = self.loop.create_future()
        pool.waiters.append(waiter)
        try:
            async with asyncio.timeout(self._queue_timeout):
                handed = await waiter
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():
                # Served in the same instant the clock ran out: pass what we got on.
                late = waiter.result()
                if late is not None:
                    self._hand_over(pool, late)
                else:
                    self._closed(pool)
            raise UpstreamBusy(
                f"all {self._max_connections} connections to {pool.target.label} stayed busy "
                f"for {self._queue_timeout} s"
            ) from None
        finally:
            if waiter in pool.waiters:
                pool.waiters.remove(waiter)
        if handed is None:
            # A connection closed, so there is room: this waiter opens its own.
            pool.open -= 1  # `_closed` kept the slot for us; `_open` takes it again
        return handed

    def _hand_over(self, pool: _TargetPool, conn: _Connection) -> None:
        """A kept-alive connection goes to the first waiter, else back to the idle set."""
        while pool.waiters:
            waiter = pool.waiters.popleft()
            if not waiter.done():
                conn.reused = True
                waiter.set_result(conn)
                return
        if len(pool.idle) < self._max_idle:
            conn.idle_since = time.monotonic()
            conn.reused = True
            pool.idle.append(conn)
            if self._reaper is None:
                self._arm_reaper()
            return
        conn.abort()
        self._closed(pool)

    def _closed(self, pool: _TargetPool) -> None:
        """A connection is gone: its slot goes to the first waiter, if any, else is freed."""
        while pool.waiters:
            waiter = pool.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the waiter keeps the slot and opens a connection
                return
        pool.open -= 1

    # --- idle reaping ---
    def _arm_reaper(self) -> None:
        if self._reaper is None:
            self._reaper = self.loop.call_later(self._idle_timeout, self._reap)

    def _reap(self) -> None:
        """Close connections idle for the idle timeout, so a burst's leftovers do not linger."""
        self._reaper = None
        cutoff = time.monotonic() - self._idle_timeout
        remaining = False
        for pool in self._targets.values():
            idle = pool.idle
            stale = 0
            while stale < len(idle) and (idle[stale].idle_since <= cutoff or idle[stale].closed):
                idle[stale].abort()
                stale += 1
            if stale:
                del idle[:stale]
                pool.open -= stale
            remaining = remaining or bool(idle)
        if remaining:
            self._arm_reaper()


def _frame(plan: ForwardPlan, target: UpstreamTarget) -> bytes:
    method = plan.method
    parts = [
        method.encode("ascii"),
        b" ",
        target.path_prefix,
        plan.target.encode("ascii"),
        b" HTTP/1.1\r\nhost: ",
        target.host_header,
        b"\r\n",
    ]
    for name, value in plan.headers:
        parts += (name, b": ", value, b"\r\n")
    body = plan.body
    if body or method not in _BODYLESS:
        parts.append(b"content-length: %d\r\n" % len(body))
    parts += (b"\r\n", body)
    return b"".join(parts)
