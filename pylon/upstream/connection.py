"""One upstream connection and the attempts it runs: HTTP/1.1 on httptools (llhttp).

An `Attempt` is one try of an exchange on one connection: `UpstreamConnection.begin` writes the
request and the connection's parser feeds the response into the attempt (head, body chunks with
back-pressure, end or failure) for the one task that consumes it. The pool
(`pylon.upstream.pool`) decides which connection an attempt runs on.

The parser callbacks run once per engine chunk (per token, streaming): they touch the attempt's
fields directly, which is why `Attempt` and `UpstreamConnection` share this module.
"""

from __future__ import annotations

import asyncio
import collections
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import httptools

from pylon.core.http import Header
from pylon.timers import Deadline

if TYPE_CHECKING:
    from pylon.core.plan import ForwardPlan
    from pylon.core.upstream import Upstream

_OWS = b" \t"
_BODYLESS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS"})
_HIGH_WATER = 256 * 1024  # buffered, unconsumed response bytes before we stop reading
# The engine's response head (status line and fields), as Envoy bounds it (60 KiB): a larger one
# is a broken or hostile engine, answered 502 instead of being buffered and relayed. The same cap
# bounds the bytes between two body pieces (chunk framing, trailers): llhttp's callbacks deliver
# a field only once it has ended (httptools buffers a value until then), so the cap is counted
# on the bytes as they arrive, per read, not on what the callbacks deliver.
MAX_RESPONSE_HEAD = 60 * 1024
# Fields in one engine response head (Envoy's `max_headers_count` is 100; an engine sends a
# handful): each field is a Python tuple of two objects, so tiny fields under the byte cap
# would still cost ~100 bytes of memory per 6 bytes received, tens of thousands per read.
MAX_RESPONSE_FIELDS = 256
# Linux only; elsewhere None and the delayed-ACK push below is skipped.
_TCP_QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)


class UpstreamConnectError(Exception):
    """The engine could not be reached at all (refused, unreachable, connect timeout)."""


class UpstreamBusy(UpstreamConnectError):
    """Every connection to the upstream stayed busy for the whole queue timeout."""


class UpstreamBroken(Exception):
    """The engine broke the attempt after the request was sent."""


class UpstreamTimeout(Exception):
    """Pylon gave up waiting on the engine (set by the caller's watchdog)."""


class _HeadTooLarge(Exception):
    """Stops llhttp from parsing an engine response head over the limit."""


class _Surplus(Exception):
    """Stops llhttp from parsing bytes beyond the response pylon asked for."""


class Attempt:
    """One try of an exchange on one upstream connection: the request written, the response
    read, consumed by exactly one task. A stale-connection retry is a second `Attempt` of the
    same exchange (`pylon.proxy.exchange.Exchange`)."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_done",
        "_error",
        "_head_waiter",
        "_waiter",
        "connection",
        "headers",
        "is_head",
        "status",
    )

    def __init__(self, conn: UpstreamConnection, is_head: bool) -> None:
        self.connection = conn  # the connection it runs on
        self.is_head = is_head
        self.status = 0
        # The response's fields as every reader compares them: names lower case, values without
        # surrounding whitespace (`pylon.core.sanitize.sanitize_response_head` reads them so).
        self.headers: list[Header] = []
        self._head_waiter: asyncio.Future[None] = conn.loop.create_future()
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._done = False
        self._error: BaseException | None = None

    @property
    def head(self) -> asyncio.Future[None]:
        """Done when the response head arrived (raises what broke the attempt). Awaited as it
        is: a coroutine wrapped around it would cost a frame per request."""
        return self._head_waiter

    @property
    def ready(self) -> bool:
        """`next_chunk` would return at once (bytes buffered, or the body ended or broke)."""
        return bool(self._chunks) or self._done or self._error is not None

    async def next_chunk(self) -> bytes | None:
        """All body bytes received so far and not yet read; None at the end of the body.

        Raises if the attempt broke (after the bytes that did arrive were read).
        """
        while not self.ready:
            self._waiter = self.connection.loop.create_future()
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
            conn = self.connection
            if conn._paused:  # (checked here: this runs per relayed block)
                conn.resume_reading()
            return chunk
        if self._error is not None:
            raise self._error
        assert self._done, "take() is only called when the attempt is ready"
        return None

    def fail(self, error: BaseException) -> None:
        """Break the attempt (engine went away, or the caller's timeout fired)."""
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
        conn = self.connection
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


class UpstreamConnection(asyncio.Protocol):
    """One kept-alive HTTP/1.1 connection to an upstream, running one attempt at a time."""

    __slots__ = (
        "_final",
        "_head_bytes",
        "_head_clock",
        "_head_timeout",
        "_parser",
        "_paused",
        "_sock",
        "_stray",
        "_until_close",
        "attempt",
        "closed",
        "idle_since",
        "keep_alive",
        "loop",
        "received",
        "reused",
        "transport",
        "upstream",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        upstream: Upstream,
        head_timeout: float | None = None,
    ) -> None:
        self.loop = loop
        self.upstream = upstream
        # Every attempt's response head is due within `head_timeout` of its request: one
        # movable deadline per connection (arming stores a float), not a timer per request.
        self._head_timeout = head_timeout or 0.0
        self._head_clock = None if head_timeout is None else Deadline(loop, self._head_overdue)
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.attempt: Attempt | None = None
        self.closed = False
        self.keep_alive = False
        self.idle_since = 0.0
        self.reused = False  # the current attempt runs on a connection taken from the idle set
        self.received = False  # any byte arrived for the current attempt
        self._paused = False
        self._until_close = False
        self._head_bytes = 0
        # Bytes received since the current attempt's last body piece (its head, interim heads,
        # chunk framing, trailers): what llhttp may be holding; over MAX_RESPONSE_HEAD, a 502.
        self._stray = 0
        self._final = False  # the current attempt's final (non-1xx) response has ended
        self._sock: socket.socket | None = None  # for the delayed-ACK push (Linux)

    # --- attempts, for the pool ---
    def begin(self, plan: ForwardPlan) -> Attempt:
        """Write `plan` (bound for this connection's upstream) and return its attempt."""
        attempt = Attempt(self, plan.method == "HEAD")  # is_head
        self.attempt = attempt
        self.received = False
        self._final = False
        self._stray = 0
        assert self.transport is not None
        self.transport.write(frame_request(plan, self.upstream))
        if self._head_clock is not None:
            self._head_clock.arm(self._head_timeout)
        return attempt

    def end_attempt(self) -> bool:
        """The consumer is done with the current attempt; True when the connection can run
        another (the response ended cleanly and both sides keep it alive)."""
        attempt, self.attempt = self.attempt, None
        if self._paused:
            self.resume_reading()
        # `attempt.complete`, inlined: once per request.
        return (
            attempt is not None
            and attempt._done
            and attempt._error is None
            and not attempt._chunks
            and self.keep_alive
            and not self.closed
        )

    # --- asyncio.Protocol ---
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        if _TCP_QUICKACK is not None:
            self._sock = transport.get_extra_info("socket")

    def data_received(self, data: bytes) -> None:
        first = not self.received
        self.received = True
        if self.attempt is None or self._final:
            # Bytes nobody asked for (after the response, or on an idle connection): the engine
            # is out of step, and whatever it says next cannot be trusted as an answer.
            self.abort()
            return
        attempt = self.attempt
        body_before = attempt._buffered
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._break(UpstreamBroken("engine switched protocols (101), which pylon never asks"))
            return
        except httptools.HttpParserError as exc:
            self._break(UpstreamBroken(f"engine sent a malformed response: {exc}"))
            return
        if attempt._buffered != body_before:  # (`take` does not run inside `feed_data`)
            self._stray = 0
        else:
            self._stray += len(data)
            if self._stray > MAX_RESPONSE_HEAD and not self._final:
                self._over_cap(attempt)
                return
        if first and not self._final and self._sock is not None:
            self._ack_now()

    def _over_cap(self, attempt: Attempt) -> None:
        """More than MAX_RESPONSE_HEAD bytes arrived without a body byte: a head (or chunk
        framing, or trailers) that llhttp would go on buffering. Cut the engine off."""
        where = "head" if attempt.status == 0 else "framing between body pieces"
        self._break(UpstreamBroken(f"engine response {where} over {MAX_RESPONSE_HEAD} bytes"))

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
        if self._head_clock is not None:
            self._head_clock.cancel()
            self._head_clock = None  # it refers back to this connection: no cycle left
        if self.attempt is None:
            return
        if self._until_close and exc is None:
            # A close-delimited body (no length, not chunked) ends exactly here.
            self.attempt._complete()
        else:
            self.attempt.fail(UpstreamBroken("engine closed the connection mid-response"))

    # --- httptools callbacks ---
    def on_message_begin(self) -> None:
        if self._final:
            # A second response after the real one, in the same read: never relayed (it would
            # answer the gateway's next request); the connection is not reused.
            self.abort()
            raise _Surplus
        self._head_bytes = 0
        if self.attempt is not None:
            self.attempt.headers = []

    def on_status(self, status: bytes) -> None:
        self._count_head(len(status))

    def on_header(self, name: bytes, value: bytes) -> None:
        # Once per field of every response: the byte count is inlined (see `_count_head`).
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > MAX_RESPONSE_HEAD:
            self._count_head(0)
        attempt = self.attempt
        if attempt is not None:
            fields = attempt.headers
            if len(fields) >= MAX_RESPONSE_FIELDS:
                self._break(
                    UpstreamBroken(f"engine response head over {MAX_RESPONSE_FIELDS} fields")
                )
                raise _HeadTooLarge
            # llhttp refuses whitespace in a field name and drops a value's leading whitespace,
            # not its trailing: lower-casing and `rstrip` are the whole normalisation.
            fields.append((name.lower(), value.rstrip(_OWS)))

    def on_headers_complete(self) -> None:
        attempt = self.attempt
        if attempt is None:
            return
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            return  # an interim response; the real one follows
        attempt.status = status
        if self._head_clock is not None:
            self._head_clock.disarm()
        self.keep_alive = self._parser.should_keep_alive()
        self._until_close = delimited_by_close(status, attempt.headers)
        attempt._head_complete()
        if attempt.is_head:
            # llhttp cannot be told the request was HEAD; the body it expects never comes.
            self.keep_alive = False
            attempt._complete()

    def on_body(self, body: bytes) -> None:
        # Hot path (once per engine chunk, i.e. per token): inlined on purpose.
        attempt = self.attempt
        if attempt is None or attempt.is_head:
            return
        attempt._chunks.append(body)
        attempt._buffered += len(body)
        if attempt._buffered > _HIGH_WATER:
            self.pause_reading()
        waiter = attempt._waiter
        if waiter is not None:
            # Woken once: the other chunks of this read need not ask the future again (the
            # consumer takes them all together when it runs).
            attempt._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def on_message_complete(self) -> None:
        attempt = self.attempt
        if attempt is not None and attempt.status >= 200:
            self._final = True
            attempt._complete()

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > MAX_RESPONSE_HEAD:
            # Raised inside llhttp's callback: parsing stops, feed_data raises, we break.
            self._break(UpstreamBroken(f"engine response head over {MAX_RESPONSE_HEAD} bytes"))
            raise _HeadTooLarge

    def _head_overdue(self) -> None:
        attempt = self.attempt
        if attempt is not None and attempt.status == 0:
            # The engine still has the request: closing the connection is how it hears that
            # pylon gave up (the stale-connection retry does not apply: not an UpstreamBroken).
            self._break(UpstreamTimeout(f"no response head within {self._head_timeout:g} s"))

    # --- flow control, used by Attempt ---
    def pause_reading(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    def _break(self, error: BaseException) -> None:
        if self.attempt is not None:
            self.attempt.fail(error)
        self.abort()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


def delimited_by_close(status: int, fields: Sequence[Header]) -> bool:
    """RFC 9112 6.3: without Content-Length or chunked coding, the body runs to the close.
    `fields`: names lower case (as `Attempt.headers`)."""
    if status in (204, 304):
        return False
    for name, value in fields:
        if name == b"content-length" or (
            name == b"transfer-encoding" and value.lower().find(b"chunked") >= 0
        ):
            return False
    return True


def frame_request(plan: ForwardPlan, upstream: Upstream) -> bytes:
    """The request line, `host`, the plan's fields, `content-length` and the body, as bytes."""
    method = plan.method
    parts = [
        method.encode("ascii"),
        b" ",
        upstream.path_prefix,
        plan.target.encode("ascii"),
        b" HTTP/1.1\r\nhost: ",
        upstream.host_header,
        b"\r\n",
    ]
    for name, value in plan.headers:
        parts += (name, b": ", value, b"\r\n")
    body = plan.body
    if body or method not in _BODYLESS:
        parts.append(b"content-length: %d\r\n" % len(body))
    parts += (b"\r\n", body)
    return b"".join(parts)
