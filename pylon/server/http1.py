"""HTTP/1.1 framing: asyncio.Protocol + httptools (llhttp). Parsing is llhttp's, never ours.

llhttp turns bytes into a request head and body pieces; this module counts the head against the
limits as it arrives (so a huge head is refused before it is buffered), maps it to a
`RequestHead`, and feeds the connection's `StreamTable`, which runs the shared intake and the
proxy tasks. Responses go out in order, one at a time (RFC 9112 9.3.2); pipelined requests wait
their turn with reading paused. Writes are corked: one send per loop iteration.

Framing hardening (RFC 9112): llhttp refuses Content-Length with Transfer-Encoding, invalid or
repeated Content-Length, invalid Transfer-Encoding, obs-fold, whitespace before the colon, bare
CR/LF and NUL; `pylon.core.head.http1_head` adds the rest. A request pylon refuses before reading
it whole gets its problem response and a close, since the rest of its bytes cannot be framed.
Two timers bound idle clients: a head must arrive within the stall timeout (slowloris), and a
kept-alive connection with nothing in flight is closed after the idle timeout.

A response the proxy cannot complete (the engine cut its body) must never read as complete: a
body of unknown length goes chunked to every HTTP/1.1 client, `connection: close` or not, so a
cut one lacks its last chunk; a known length stays declared, so a cut one is short of it. Only an
HTTP/1.0 client gets a body that ends with the connection, and a cut one ends in a reset (RST),
not a FIN.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Sequence
from http import HTTPStatus
from typing import NoReturn, cast

import httptools

from pylon.core.errors import ClientError, ContractError, ErrorCode, LimitError, PylonError
from pylon.core.head import http1_head
from pylon.core.http import Header
from pylon.core.intake import AWAITING_HEAD, RECEIVING, REJECTED, AdmittedRequest
from pylon.lifecycle import Phase
from pylon.proxy import ResponseSink
from pylon.server.streams import CLIENT_GONE, SHUTDOWN, Ingress, Stream, StreamTable
from pylon.timers import Deadline

DRAINING = Phase.DRAINING
# Every status line built once: framing a response head is per request.
_STATUS_LINES = {
    status.value: b"HTTP/1.1 %d %b\r\n" % (status.value, status.phrase.encode("ascii"))
    for status in HTTPStatus
}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# After refusing a request whose body is still arriving: how long, and how many bytes, pylon
# keeps reading (and dropping) after its answer, so the client sees the answer instead of a
# reset (closing a socket with unread input sends RST, which can destroy the answer in flight).
LINGER_SECONDS = 2.0
LINGER_BYTES = 1024 * 1024
# SO_LINGER on, timeout 0: closing the socket sends RST instead of FIN (a cut, not an end).
_RESET_ON_CLOSE = struct.pack("ii", 1, 0)
# How much input llhttp parses at a time. One read can hold thousands of small pipelined
# requests; after each piece, a request that must wait its turn stops the parsing, and the rest
# of the read waits unparsed (reading paused) until that request runs. So a connection holds at
# most one piece's worth of parsed requests, and one read's worth of bytes, whatever it sends.
# A declared body is parsed in one go (its size is known, its cost is per byte).
FEED_BYTES = 4096
# llhttp delivers a header field only once it has ended, and httptools buffers its name and value
# until then (growing them piece by piece): one endless header line would be buffered whole, and
# copied again on every piece, before `on_header` could count it. So the bytes of a head are
# also counted as they are fed, at most one piece past the head limit.
_HEAD_SLACK = FEED_BYTES


class _StopParsing(Exception):
    """Raised inside an httptools callback to stop parsing this connection's input."""


class Http1Connection(asyncio.Protocol):
    def __init__(self, ingress: Ingress) -> None:
        self._limits = limits = ingress.limits
        self._max_head_bytes = limits.max_header_bytes
        self._max_fields = limits.max_headers
        self._lifecycle = ingress.lifecycle
        self._loop = asyncio.get_running_loop()
        self._table = StreamTable("http1", self, ingress, self._loop, serial=True)
        self._observer = ingress.proxy.observer
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        # the request being parsed
        self._stream: Stream | None = None
        self._next_id = 0
        self._url = b""
        self._headers: list[Header] = []
        self._head_bytes = 0
        self._in_head = False  # between a request's first byte and the end of its head
        self._head_fed = 0  # bytes fed since the request's first byte, while in its head
        # Body bytes the head declared and not yet received (None: not declared, e.g. chunked);
        # the piece that completes them ends the request (`_ended`), as END_STREAM does in h2.
        self._body_left: int | None = None
        self._ended = False
        self._continue_owed = False
        # per admitted request, until its response starts: (keep-alive, HEAD, HTTP/1.0)
        self._framing: dict[int, tuple[bool, bool, bool]] = {}
        self._closing = False
        self._refused = False  # parsing stopped: the answer is out or waits its turn
        self._lingering = -1  # bytes dropped since the lingering close began; -1 = not lingering
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._out: list[bytes] = []
        self._timer = Deadline(self._loop, self._timed_out)
        self._unparsed = b""  # input held back while a pipelined request waits its turn

    # --- asyncio.Protocol ---
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)
        # A new connection owes us a request head: the slowloris clock starts now.
        self._timer.arm(self._limits.stall_timeout)
        self._lifecycle.on_drain(self.graceful_close)

    def data_received(self, data: bytes) -> None:
        if self._lingering >= 0:
            self._lingering += len(data)
            if self._lingering > LINGER_BYTES:
                self.abort()
            return
        if self._closing or self._refused:
            return
        if self._unparsed:  # reading is paused, but a transport may hand over what it has
            self._unparsed += data
            return
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        """Parse `data` piece by piece (`FEED_BYTES`); keep the rest unparsed once a pipelined
        request waits its turn (`on_message_complete` has paused reading then)."""
        size = len(data)
        if size <= FEED_BYTES:
            self._parse(data)
            return
        view = memoryview(data)
        start = 0
        while start < size:
            left = self._body_left
            end = start + (left if left is not None and left > FEED_BYTES else FEED_BYTES)
            self._parse(view[start:end])
            start = end
            if start < size and self._table.queued and not (self._closing or self._refused):
                self._unparsed = bytes(view[start:])
                return
            if self._closing or self._refused:
                return

    def _parse(self, data: bytes | memoryview) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            pass  # one of our callbacks stopped parsing; the table has answered
        except httptools.HttpParserUpgrade:
            self._refuse(ContractError("protocol upgrade is not supported"))
        except httptools.HttpParserError as exc:
            self._refuse(ContractError(f"malformed HTTP/1.1 request: {exc}"))
        if self._in_head:
            self._count_fed(len(data))

    def _count_fed(self, size: int) -> None:
        """`size` more bytes of a head went into the parser (which holds an unfinished field
        line whole): past the head limit, the head is refused (431) before it is buffered."""
        self._head_fed += size
        limit = self._max_head_bytes
        if self._head_fed > limit + _HEAD_SLACK:
            error = LimitError(
                f"request head exceeds {limit} bytes", code=ErrorCode.HEADERS_TOO_LARGE
            )
            self._refuse(error)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._timer.cancel()
        self._lifecycle.forget(self.graceful_close)
        self._table.cancel_all(CLIENT_GONE)
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
        self._stream = self._table.open(self._next_id)
        self._next_id += 1
        self._url = b""
        self._headers = []
        self._head_bytes = 0
        self._in_head = True
        self._head_fed = 0
        self._ended = False
        self._timer.arm(self._limits.stall_timeout)

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        if self._head_bytes > self._max_head_bytes:
            self._head_over_limits()

    def on_header(self, name: bytes, value: bytes) -> None:
        # Once per field of every request: one cheap test here, the detail in the rare branch.
        self._headers.append((name, value))
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > self._max_head_bytes or len(self._headers) > self._max_fields:
            self._head_over_limits()

    def on_headers_complete(self) -> None:
        self._in_head = False
        stream = self._stream
        assert stream is not None, "llhttp calls on_message_begin first"
        parser = self._parser
        http10 = parser.get_http_version() == "1.0"
        try:
            head = http1_head(parser.get_method(), self._url, self._headers, http10)
        except PylonError as error:
            self._stop(error)
        # HTTP/1.0 has no chunked framing: its streamed responses end by closing.
        keep_alive = parser.should_keep_alive() and not http10
        self._framing[stream.id] = (keep_alive, head.method == b"HEAD", http10)
        self._body_left = head.content_length
        self._table.head(stream, head, ended=False)
        if stream.intake.state is REJECTED:
            self._stop_reading()
            raise _StopParsing
        if stream.intake.state is RECEIVING and head.expects_continue:
            # RFC 9110 15.2: an interim response belongs to its own request, after every
            # response before it; a pipelined request gets its 100 when its turn comes.
            self._continue_owed = True
            self._send_owed_continue()

    def on_body(self, body: bytes) -> None:
        stream = self._stream
        assert stream is not None, "llhttp calls on_message_begin first"
        left = self._body_left
        if left is not None:
            # llhttp passes no byte beyond the declared length: at zero, this piece is the last.
            left = self._body_left = left - len(body)
            self._ended = left == 0
        self._table.data(stream.id, body, ended=self._ended)
        if stream.intake.state is REJECTED:
            self._stop_reading()
            raise _StopParsing

    def on_message_complete(self) -> None:
        stream = self._stream
        assert stream is not None, "llhttp calls on_message_begin first"
        self._stream = None
        self._continue_owed = False
        self._timer.disarm()
        if not self._ended:  # else the last body piece has ended the request already
            self._table.end(stream.id)
        if self._table.queued and self._transport is not None and not self._closing:
            # Pipelined: this request waits for the response before it. Read no further until
            # it runs, so pipelined requests cannot pile up in memory. (Reading is not paused
            # for the request that runs: a paused socket would not notice the client leave.)
            self._transport.pause_reading()

    # --- Framing (used by the table) ---
    def response_sink(self, stream: Stream, request: AdmittedRequest) -> ResponseSink:
        keep_alive, is_head, http10 = self._framing.pop(stream.id, (False, False, False))
        # Draining: this response is the connection's last (it says `connection: close`).
        keep_alive = keep_alive and self._lifecycle.phase is not DRAINING
        return Http1Responder(self, keep_alive, is_head, http10)

    def reject_sink(self, stream: Stream) -> ResponseSink:
        # The rest of this request cannot be framed any more: answer, then close.
        self._framing.pop(stream.id, None)
        self._closing = True
        return Http1Responder(self, keep_alive=False, is_head=False, http10=False)

    def stream_done(self, stream: Stream, crashed: bool) -> None:
        if crashed:
            self.close()  # rather than leave the client waiting for a response that will not come
            return
        if self._closing:
            return
        if self._lifecycle.phase is DRAINING:
            # Shutting down: pipelined requests behind this response were never started, so
            # the client may send them again on another connection.
            self._table.cancel_all(SHUTDOWN)
            self.close()
            return
        if self._table.busy or self._transport is None:
            return
        if self._unparsed:  # the next pipelined requests, held back until now
            data, self._unparsed = self._unparsed, b""
            self._feed(data)
            if self._unparsed or self._closing or self._refused or self._table.queued:
                return  # still its turn to wait (reading stays paused), or the end
        self._transport.resume_reading()
        self._send_owed_continue()
        in_request = self._stream is not None
        self._timer.arm(self._limits.stall_timeout if in_request else self._limits.idle_timeout)

    # --- shutdown ---
    def close_now(self) -> None:
        """The grace period is over: stop what still runs (outcome `shutdown`) and close."""
        self._table.cancel_all(SHUTDOWN)
        self.abort()

    def graceful_close(self) -> None:
        """Finish the response in flight, start no other, then close (idle: close now)."""
        if not self._table.busy and self._stream is None:
            self.close()

    @property
    def busy(self) -> bool:
        return self._table.busy and not self._closing

    @property
    def in_progress(self) -> int:
        """Requests on this connection that have started and are not answered yet."""
        return 0 if self._closing else len(self._table)

    # --- helpers ---
    def _current(self) -> Stream:
        assert self._stream is not None, "llhttp calls on_message_begin first"
        return self._stream

    def _send_owed_continue(self) -> None:
        if self._continue_owed and not self._table.busy and self._transport is not None:
            self._continue_owed = False
            self._transport.write(_CONTINUE)

    def _timed_out(self) -> None:
        if self._table.busy or self._closing:
            return  # a request is running: its own timeouts apply, not the connection's
        stream = self._stream
        if stream is not None and stream.intake.state is AWAITING_HEAD:
            # A head was started and not finished: tell the client why (408), then close.
            self._observer.transport_event("client_timeout", "http1", timer="header")
            self._table.malformed(
                stream.id,
                ClientError(
                    f"the request head did not arrive within {self._limits.stall_timeout} s",
                    code=ErrorCode.REQUEST_TIMEOUT,
                ),
            )
            return
        if stream is None:
            self._observer.transport_event("client_timeout", "http1", timer="idle")
            self.abort()

    def _head_over_limits(self) -> None:
        """Refuse the head being parsed if it is over the header limits (431)."""
        if self._head_bytes > self._limits.max_header_bytes:
            self._stop(
                LimitError(
                    f"request head exceeds {self._limits.max_header_bytes} bytes",
                    code=ErrorCode.HEADERS_TOO_LARGE,
                )
            )
        if len(self._headers) > self._limits.max_headers:
            self._stop(
                LimitError(
                    f"more than {self._limits.max_headers} header fields",
                    code=ErrorCode.HEADERS_TOO_LARGE,
                )
            )

    def _stop(self, error: PylonError) -> NoReturn:
        self._table.malformed(self._current().id, error, self._headers)
        self._stop_reading()
        raise _StopParsing

    def _stop_reading(self) -> None:
        """The request being parsed was refused: its remaining bytes cannot be framed."""
        self._refused = True
        if self._transport is not None and not self._transport.is_closing():
            self._transport.pause_reading()

    def _refuse(self, error: PylonError) -> None:
        """llhttp gave up on the input: answer the request it was parsing (or a new one)."""
        if self._closing or self._refused:
            return
        stream = self._stream or self._table.open(self._next_id)
        self._table.malformed(stream.id, error, self._headers if self._stream else None)
        self._stop_reading()

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
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if self._refused and self._lingering < 0 and transport.can_write_eof():
            # Lingering close: FIN after the answer, then drop what the client still sends
            # for a bounded time, so the answer is not lost to a reset.
            self._lingering = 0
            transport.write_eof()
            transport.resume_reading()
            self._loop.call_later(LINGER_SECONDS, self.abort)
            return
        transport.close()

    def abort(self) -> None:
        self._closing = True
        self._out.clear()
        if self._transport is not None:
            self._transport.abort()

    def reset(self) -> None:
        """Abort with a reset (RST): for a body that ends with the connection, whose FIN would
        read as its complete end."""
        transport = self._transport
        sock = None if transport is None else transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # already gone: nothing more to tell
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
        self.abort()


class Http1Responder:
    """`ResponseSink` for one HTTP/1.1 response: content-length or chunked framing (HTTP/1.0:
    a body of unknown length ends with the connection)."""

    __slots__ = ("_chunked", "_conn", "_http10", "_is_head", "_keep_alive", "_length")

    def __init__(
        self, conn: Http1Connection, keep_alive: bool, is_head: bool, http10: bool
    ) -> None:
        self._conn = conn
        self._keep_alive = keep_alive
        self._is_head = is_head
        self._http10 = http10
        self._chunked = False
        self._length = False  # a content-length was declared

    @property
    def paused(self) -> bool:
        return self._conn._write_paused  # read per relayed block: one property call, not two

    def start(self, status: int, headers: Sequence[Header], content_length: int | None) -> None:
        parts = [_STATUS_LINES.get(status) or b"HTTP/1.1 %d Unknown\r\n" % status]
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        if content_length is not None:
            self._length = True
            parts.append(b"content-length: %d\r\n" % content_length)
        elif not self._is_head and status not in (204, 304) and not self._http10:
            # Chunked also when the connection closes after it: only a last chunk tells a
            # complete body from a cut one. (HTTP/1.0 has no chunked: its body ends with the
            # connection, and `abort` resets it.)
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
        if self._chunked or self._length or self._is_head:
            self._conn.abort()  # a missing last chunk, or bytes short of the length, say it
        else:
            self._conn.reset()  # the body ends with the connection: a FIN would complete it
