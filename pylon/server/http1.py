"""HTTP/1.1 ingress: asyncio.Protocol + httptools (llhttp). Parsing is llhttp's, never ours.

Per connection: parse a request head, check limits, run the tunnel contract at once (so a bad
request is answered before its body is read), buffer the body up to the limit, then hand the
request to the transport-neutral `Proxy` as one task. Pipelined requests queue in order.
Client disconnect cancels the task, which closes the engine connection at once.

Framing hardening (RFC 9112): llhttp already rejects Content-Length with Transfer-Encoding,
invalid or repeated Content-Length, invalid Transfer-Encoding, obs-fold, whitespace before the
colon, bare CR/LF and NUL; we add what it lets through: a missing or repeated Host, and
Transfer-Encoding on HTTP/1.0. Each answer is 400 and a close. Two timers bound idle clients: a
head must arrive within `header_timeout` (slowloris), and a kept-alive connection with nothing
in flight is closed after `idle_timeout`.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any, cast

import httptools

from pylon.core.contract import HealthRequest, TunnelRequest
from pylon.core.errors import ClientError, ContractError, ErrorCode, LimitError, PylonError
from pylon.core.http import Header
from pylon.logs import get_logger
from pylon.proxy import Proxy
from pylon.timers import Deadline

_REASONS = {status.value: status.phrase.encode("ascii") for status in HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class _StopParsing(Exception):
    """Raised inside an httptools callback to stop parsing this connection's input."""


class Http1Connection(asyncio.Protocol):
    def __init__(
        self,
        proxy: Proxy,
        max_header_bytes: int,
        max_headers: int,
        max_body: int,
        header_timeout: float = 30.0,
        idle_timeout: float = 300.0,
    ) -> None:
        self._proxy = proxy
        self._header_timeout = header_timeout
        self._idle_timeout = idle_timeout
        self._max_header_bytes = max_header_bytes
        self._max_headers = max_headers
        self._max_body = max_body
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        # current request being parsed
        self._url = b""
        self._headers: list[Header] = []
        self._head_bytes = 0
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._request: TunnelRequest | HealthRequest | None = None
        self._keep_alive = True
        self._http10 = False
        # requests parsed and waiting to run, and the one running
        self._queue: collections.deque[tuple[Any, bytes, bool]] = collections.deque()
        self._task: asyncio.Task[None] | None = None
        self._error: tuple[PylonError, str | None] | None = None
        self._closing = False
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._out: list[bytes] = []
        self._timer = Deadline(self._loop, self._timed_out)
        self._in_head = False
        self._in_body = False
        self._draining = False

    # --- asyncio.Protocol ---
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)
        # A new connection owes us a request head: the slowloris clock starts now.
        self._timer.arm(self._header_timeout)

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            pass  # one of our callbacks stopped parsing; self._error says why
        except httptools.HttpParserUpgrade:
            self._error = (ContractError("protocol upgrade is not supported"), None)
        except httptools.HttpParserError as exc:
            self._error = (ContractError(f"malformed HTTP/1.1 request: {exc}"), None)
        if self._error is not None:
            self._fail_connection(*self._error)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._timer.cancel()
        self._queue.clear()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_exception(ConnectionResetError("client went away"))
            self._drain_waiter.exception()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)

    # --- httptools callbacks ---
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._head_bytes = 0
        self._body = []
        self._body_bytes = 0
        self._request = None
        self._in_head = True
        self._timer.arm(self._header_timeout)

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))
        self._count_head(len(name) + len(value) + 4)
        if len(self._headers) > self._max_headers:
            self._stop(
                LimitError(
                    f"more than {self._max_headers} header fields", code=ErrorCode.HEADERS_TOO_LARGE
                )
            )

    def on_headers_complete(self) -> None:
        parser = self._parser
        self._in_head = False
        # The body owes us bytes too: a client that stops mid-body is timed out like one that
        # stops mid-head (each body chunk moves the deadline; the message end disarms it).
        self._in_body = True
        self._timer.arm(self._header_timeout)
        self._keep_alive = parser.should_keep_alive()
        self._http10 = parser.get_http_version() == "1.0"
        framing = _framing_error(self._headers, self._http10)
        if framing is not None:
            self._stop(ContractError(framing))
        try:
            self._request = self._proxy.admit(parser.get_method(), self._url, self._headers)
        except PylonError as error:
            self._stop(error, error.request_id)
        declared = _declared_length(self._headers)
        if declared is not None and declared > self._max_body:
            self._stop(self._too_large(), self._request_id())
        if _expects_continue(self._headers) and self._transport is not None:
            self._transport.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self._max_body:
            self._stop(self._too_large(), self._request_id())
        self._body.append(body)
        self._timer.arm(self._header_timeout)

    def on_message_complete(self) -> None:
        self._in_body = False
        self._timer.disarm()
        body = b"".join(self._body) if len(self._body) != 1 else self._body[0]
        self._body = []
        assert self._request is not None
        # HTTP/1.0 has no chunked framing: its streamed responses end by closing.
        self._queue.append((self._request, body, self._keep_alive and not self._http10))
        if self._task is None:
            self._run_next()
        elif self._transport is not None:
            # Pipelined request: stop reading until the queue drains.
            self._transport.pause_reading()

    # --- running requests ---
    def _run_next(self) -> None:
        request, body, keep_alive = self._queue.popleft()
        responder = Http1Responder(self, keep_alive, request.method == "HEAD")
        self._task = self._loop.create_task(self._proxy.handle(request, body, responder))
        self._task.add_done_callback(self._request_done)

    def _request_done(self, task: asyncio.Task[None]) -> None:
        self._task = None
        if not task.cancelled() and task.exception() is not None:
            # A bug, not a client error: log it, and close rather than leave the client hanging.
            self._proxy.log_crash(task.exception())
            self.close()
            return
        if self._closing:
            return
        if self._draining:
            # Shutting down: the response in flight is done; pipelined requests behind it were
            # never started, so the client may retry them on another connection.
            self.close()
            return
        if self._queue:
            self._run_next()
        elif self._transport is not None:
            self._transport.resume_reading()
            self._timer.arm(self._header_timeout if self._in_head else self._idle_timeout)

    # --- shutdown ---
    def graceful_close(self) -> None:
        """Finish the request in flight, start no other, then close (idle: close now)."""
        self._draining = True
        if self._task is None and not self._in_head and not self._in_body:
            self.close()

    @property
    def busy(self) -> bool:
        return self._task is not None and not self._closing

    # --- helpers ---
    def _timed_out(self) -> None:
        if self._task is not None or self._closing:
            return  # a request is running: its own timeouts apply, not the connection's
        if self._in_head or self._in_body:
            # A request was started and not finished: tell the client why (408), then close,
            # since the rest of its bytes can no longer be framed.
            timer = "header" if self._in_head else "body"
            get_logger().info("client_timeout", timer=timer, request_id=self._request_id())
            error = ClientError(
                f"the request {'head' if self._in_head else 'body'} did not arrive within "
                f"{self._header_timeout} s",
                code=ErrorCode.REQUEST_TIMEOUT,
            )
            self._closing = True
            responder = Http1Responder(self, keep_alive=False, is_head=False)
            self._proxy.reject(responder, error, self._request_id(), time.monotonic())
            return
        get_logger().info("client_timeout", timer="idle")
        self.abort()

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > self._max_header_bytes:
            self._stop(
                LimitError(
                    f"request head exceeds {self._max_header_bytes} bytes",
                    code=ErrorCode.HEADERS_TOO_LARGE,
                )
            )

    def _too_large(self) -> LimitError:
        return LimitError(
            f"request body exceeds {self._max_body} bytes", code=ErrorCode.BODY_TOO_LARGE
        )

    def _request_id(self) -> str | None:
        return self._request.request_id if self._request is not None else None

    def _stop(self, error: PylonError, request_id: str | None = None) -> None:
        self._error = (error, request_id)
        raise _StopParsing

    def _fail_connection(self, error: PylonError, request_id: str | None) -> None:
        """Answer a request we will not read to its end, then close the connection."""
        self._closing = True
        self._queue.clear()
        if self._task is not None:
            # An earlier pipelined request is still running; it finishes, this one is dropped.
            self._task.add_done_callback(lambda _: self.close())
            return
        responder = Http1Responder(self, keep_alive=False, is_head=False)
        self._proxy.reject(responder, error, request_id, time.monotonic())

    # --- used by the responder ---
    def write(self, data: bytes) -> None:
        # Corked: everything written in one loop iteration (head, body, chunk terminator) goes
        # out in one send, flushed right after the current callbacks.
        if not self._out:
            self._loop.call_soon(self._flush)
        self._out.append(data)

    def _flush(self) -> None:
        out = self._out
        if not out:
            return
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    async def drain(self) -> None:
        if not self._write_paused:
            return
        self._drain_waiter = self._loop.create_future()
        try:
            await self._drain_waiter
        finally:
            self._drain_waiter = None

    @property
    def write_paused(self) -> bool:
        return self._write_paused

    def close(self) -> None:
        self._closing = True
        self._flush()
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        self._closing = True
        self._out.clear()
        if self._transport is not None:
            self._transport.abort()


class Http1Responder:
    """`ResponseSink` for one HTTP/1.1 response: content-length or chunked framing."""

    __slots__ = ("_chunked", "_conn", "_is_head", "_keep_alive")

    def __init__(self, conn: Http1Connection, keep_alive: bool, is_head: bool) -> None:
        self._conn = conn
        self._keep_alive = keep_alive
        self._is_head = is_head
        self._chunked = False

    @property
    def paused(self) -> bool:
        return self._conn.write_paused

    def start(self, status: int, headers: Sequence[Header], content_length: int | None) -> None:
        parts = [
            b"HTTP/1.1 ",
            str(status).encode("ascii"),
            b" ",
            _REASONS.get(status, b"Unknown"),
            b"\r\n",
        ]
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        if content_length is not None:
            parts += (b"content-length: ", str(content_length).encode("ascii"), b"\r\n")
        elif not self._is_head and status not in (204, 304) and self._keep_alive:
            # (Not kept alive, e.g. HTTP/1.0: the body simply ends when the connection does.)
            self._chunked = True
            parts.append(b"transfer-encoding: chunked\r\n")
        if not self._keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        self._conn.write(b"".join(parts))

    def write(self, data: bytes) -> None:
        if self._is_head or not data:
            return
        if self._chunked:
            self._conn.write(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            self._conn.write(data)

    async def drain(self) -> None:
        await self._conn.drain()

    def end(self) -> None:
        if self._chunked:
            self._conn.write(b"0\r\n\r\n")
        if not self._keep_alive:
            self._conn.close()

    def abort(self) -> None:
        self._conn.abort()


def _framing_error(headers: list[Header], http10: bool) -> str | None:
    """What llhttp lets through but RFC 9112 forbids; None when the head is fine."""
    hosts = 0
    for name, _ in headers:
        if len(name) == 4 and name.lower() == b"host":
            hosts += 1
        elif http10 and len(name) == 17 and name.lower() == b"transfer-encoding":
            # RFC 9112 6.1: HTTP/1.0 framing with Transfer-Encoding is faulty by definition.
            return "Transfer-Encoding is not allowed in an HTTP/1.0 request"
    # RFC 9112 3.2: exactly one Host on HTTP/1.1; HTTP/1.0 clients may omit it.
    if hosts > 1 or (hosts == 0 and not http10):
        return "an HTTP/1.1 request needs exactly one Host header"
    return None


def _declared_length(headers: list[Header]) -> int | None:
    for name, value in headers:
        if len(name) == 14 and name.lower() == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def _expects_continue(headers: list[Header]) -> bool:
    return any(
        name.lower() == b"expect" and value.strip().lower() == b"100-continue"
        for name, value in headers
    )
