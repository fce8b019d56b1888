"""HTTP/3 ingress (direct tunnel mode) on aioquic: QUIC + TLS 1.3, ALPN h3, no 0-RTT.

Per request stream: decoded header pairs -> limits -> `Proxy.admit` (contract and auth; a bad
request is answered at once, before any body), the body buffered up to the limit, then the
transport-neutral `Proxy.handle` as one task per stream with an HTTP/3 `ResponseSink`. A client
RESET_STREAM or STOP_SENDING, or the connection going away, cancels that stream's task, which
closes its engine connection.

aioquic's `H3Connection` treats every malformed request as a connection error and closes the
whole QUIC connection, killing every other stream on it (RFC 9114 4.1.2 asks for a *stream*
error). `PylonH3Connection` turns those into a per-stream 400 instead. aioquic also has no
decoded-header limit and no GOAWAY API; both are added here.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import pylsqpack
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer
from aioquic.buffer import encode_uint_var
from aioquic.h3.connection import (
    CONNECTION_SPECIFIC_HEADERS,
    H3_ALPN,
    ErrorCode,
    FrameType,
    H3Connection,
    H3Stream,
    HeadersState,
    MessageError,
    Setting,
    encode_frame,
)
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import (
    ConnectionTerminated,
    HandshakeCompleted,
    ProtocolNegotiated,
    QuicEvent,
    StopSendingReceived,
    StreamReset,
)

from pylon.core.contract import HealthRequest, TunnelRequest, check_header_block
from pylon.core.errors import ClientError, ContractError, LimitError, PylonError
from pylon.core.errors import ErrorCode as PylonCode
from pylon.core.flood import RateGuard
from pylon.core.http import Header
from pylon.logs import get_logger
from pylon.proxy import Proxy
from pylon.settings import Settings
from pylon.timers import Deadline
from pylon.tls import TlsIdentity

# A stream whose unacknowledged send buffer is above HIGH pauses the relay until it is below LOW.
SEND_HIGH_WATER = 1024 * 1024
SEND_LOW_WATER = 256 * 1024
DRAIN_ACK_GRACE = 2.0  # seconds a drained connection waits for its last ACKs before closing
H3_EXCESSIVE_LOAD = 0x107
ACK_COALESCE_DELAY = 0.001  # seconds an ACK may wait to share a send with a response
# QUIC CRYPTO_ERROR (0x100) + TLS alert certificate_required (116), RFC 9001 4.8.
_CERTIFICATE_REQUIRED = 0x100 + 116


@dataclass
class StreamRejected(H3Event):
    """Pylon's own event: this request stream is malformed; answer it, keep the connection."""

    stream_id: int
    status: int
    reason: str


class PylonH3Connection(H3Connection):
    """`H3Connection` with stream-level errors for malformed requests, a header-block size cap,
    no QPACK dynamic table, and GOAWAY.

    Overrides private aioquic methods (checked against aioquic 1.7); `_check_aioquic` at import
    fails loudly if a future aioquic renames them.
    """

    def __init__(
        self, quic: QuicConnection, max_header_block: int, field_section_size: int = 0
    ) -> None:
        self._max_header_block = max_header_block
        self._field_section_size = field_section_size or max_header_block
        self._discarded: set[int] = set()
        super().__init__(quic)

    def _init_connection(self) -> None:
        # No QPACK dynamic table: a 1-byte reference to a 4 KiB dynamic entry makes a small header
        # block decode to hundreds of MB (a decompression bomb no size check can catch before
        # pylsqpack has allocated it). Static-table references are bounded to short entries.
        self._max_table_capacity = 0
        self._blocked_streams = 0
        self._decoder = pylsqpack.Decoder(0, 0)
        super()._init_connection()

    def _get_local_settings(self) -> dict[int, int]:
        settings = super()._get_local_settings()
        # Tell clients our header limit up front (RFC 9114 7.2.4.1; the size counts 32 bytes of
        # overhead per field), and do not offer extended CONNECT, which pylon refuses.
        settings[Setting.MAX_FIELD_SECTION_SIZE] = self._field_section_size
        settings.pop(Setting.ENABLE_CONNECT_PROTOCOL, None)
        return settings

    def send_goaway(self, stream_id: int) -> None:
        """RFC 9114 5.2: no request stream with an id >= `stream_id` will be processed."""
        assert self._local_control_stream_id is not None
        frame = encode_frame(FrameType.GOAWAY, encode_uint_var(stream_id))
        self._quic.send_stream_data(self._local_control_stream_id, frame)

    def _receive_request_or_push_data(
        self, stream: H3Stream, data: bytes, stream_ended: bool
    ) -> list[H3Event]:
        sid = stream.stream_id
        if sid in self._discarded:
            # Rejected earlier: the parser state is abandoned, so drop input unparsed.
            stream.buffer = b""
            if stream_ended:
                stream.receiving_ended = True
                self._discarded.discard(sid)
            return []
        events = super()._receive_request_or_push_data(stream, data, stream_ended)
        if sid in self._discarded:
            return [event for event in events if isinstance(event, StreamRejected)]
        if (
            stream.frame_type == FrameType.HEADERS
            and stream.frame_size is not None
            and stream.frame_size > self._max_header_block
            and not self._is_client
        ):
            # aioquic would buffer the whole frame before decoding it; refuse it unread.
            events.append(self._reject(stream, 431, "header block too large"))
        return events

    def _handle_request_or_push_frame(
        self, frame_type: int, frame_data: bytes | None, stream: H3Stream, stream_ended: bool
    ) -> list[H3Event]:
        try:
            return super()._handle_request_or_push_frame(
                frame_type, frame_data, stream, stream_ended
            )
        except MessageError as exc:
            return self._reject_once(stream, exc)

    def _handle_request_or_push_end(self, stream: H3Stream) -> list[H3Event]:
        try:
            return super()._handle_request_or_push_end(stream)
        except MessageError as exc:
            return self._reject_once(stream, exc)

    def _reject_once(self, stream: H3Stream, exc: MessageError) -> list[H3Event]:
        if self._is_client or stream.push_id is not None:
            raise exc
        if stream.stream_id in self._discarded:
            return []
        return [self._reject(stream, 400, exc.reason_phrase or "malformed request")]

    def _reject(self, stream: H3Stream, status: int, reason: str) -> StreamRejected:
        # Make the rest of this stream's frames harmless to aioquic's state machine (DATA after a
        # refused HEADERS would otherwise be a connection error), then ignore them.
        if stream.headers_recv_state == HeadersState.INITIAL:
            stream.headers_recv_state = HeadersState.AFTER_HEADERS
        stream.expected_content_length = None
        if not stream.receiving_ended:
            self._discarded.add(stream.stream_id)
            # RFC 9114 4.1.1: a complete response may be sent before the request ends; then
            # the server asks the client to stop sending with H3_NO_ERROR.
            with contextlib.suppress(ValueError):
                self._quic.stop_stream(stream.stream_id, ErrorCode.H3_NO_ERROR)
        return StreamRejected(stream_id=stream.stream_id, status=status, reason=reason)


def _check_aioquic() -> None:
    for name in (
        "_init_connection",
        "_receive_request_or_push_data",
        "_handle_request_or_push_frame",
        "_handle_request_or_push_end",
        "_get_local_settings",
    ):
        if not callable(getattr(H3Connection, name, None)):
            raise ImportError(f"aioquic H3Connection.{name} is gone: pylon's HTTP/3 needs review")


_check_aioquic()


class _Request:
    """One request stream's state between its HEADERS and the end of its body."""

    __slots__ = ("answered", "body", "body_bytes", "progress", "request", "sink", "started", "task")

    def __init__(
        self, request: TunnelRequest | HealthRequest | None, started: float, now: float = 0.0
    ) -> None:
        self.request = request
        self.started = started
        self.progress = now  # loop time the request last moved (head or body bytes)
        self.body: list[bytes] = []
        self.body_bytes = 0
        self.answered = request is None  # answered early: later input is ignored
        self.task: asyncio.Task[None] | None = None
        self.sink: H3Responder | None = None


class Http3Protocol(QuicConnectionProtocol):
    """One QUIC connection: HTTP/3 request streams to `Proxy` tasks."""

    def __init__(self, quic: QuicConnection, server: Http3Server, **kwargs: Any) -> None:
        super().__init__(quic, **kwargs)
        self._server = server
        self._settings = server.settings
        self._http: PylonH3Connection | None = None
        self._requests: dict[int, _Request] = {}
        self._dirty: list[H3Responder] = []
        self._flush_handle: asyncio.Handle | None = None
        self._deferred_transmit: asyncio.TimerHandle | None = None
        self._resets = RateGuard(self._settings.max_stream_resets, self._settings.flood_window)
        self._body_watch = Deadline(self._loop, self._check_stalled_bodies)
        self._writers: dict[int, asyncio.Future[None]] = {}
        self._refused = False
        self._draining = False
        self._highest_stream = -4  # last accepted request stream id (for GOAWAY)
        self._log = get_logger()
        _limit_streams(quic, self._settings.quic_max_concurrent_streams)
        if server.identity.client_ca is not None:
            _request_client_certificate(quic)

    # --- aioquic ---
    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        # aioquic answers every datagram at once (mostly a bare ACK), and then the response,
        # a moment later, goes out in a second send. Once the handshake is done, wait up to
        # ACK_COALESCE_DELAY (far below the 25 ms max_ack_delay peers allow) so the ACK rides
        # with the response: half the sends, and aioquic walks every stream on each send.
        self._quic.receive_datagram(cast(bytes, data), addr, now=self._loop.time())
        self._process_events()
        if self._quic._handshake_complete and not self._refused:
            if self._deferred_transmit is None:
                self._deferred_transmit = self._loop.call_later(ACK_COALESCE_DELAY, self.transmit)
        else:
            self.transmit()
        if self._writers:
            self._wake_writers()
        if self._draining:
            self._maybe_close_drained()

    def transmit(self) -> None:
        if self._deferred_transmit is not None:
            self._deferred_transmit.cancel()
            self._deferred_transmit = None
        super().transmit()

    def quic_event_received(self, event: QuicEvent) -> None:
        if self._refused:
            return
        if isinstance(event, ProtocolNegotiated) and event.alpn_protocol in H3_ALPN:
            self._http = PylonH3Connection(
                self._quic,
                self._server.max_header_block,
                self._settings.max_header_bytes + 32 * self._settings.max_headers,
            )
            if self._draining:
                self._send_goaway()
            elif self._server.draining:
                self.drain()
        elif isinstance(event, HandshakeCompleted):
            self._check_client_certificate()
        elif isinstance(event, StreamReset | StopSendingReceived):
            # RESET_STREAM and STOP_SENDING each cancel a request; count a live one once.
            live = event.stream_id in self._requests
            if live and self._resets.hit(self._loop.time()):
                # Rapid reset (CVE-2023-44487 on QUIC): the abuser loses the connection.
                self._log.warning("h3_flood", kind="rapid_reset", streams=len(self._requests))
                self.close(H3_EXCESSIVE_LOAD, "too many stream resets")
                self._terminated()
                return
            self._cancel(event.stream_id, "client_reset")
        elif isinstance(event, ConnectionTerminated):
            self._terminated()
        if self._http is not None and not self._refused:
            for h3_event in self._http.handle_event(event):
                self._h3_event(h3_event)

    # --- HTTP/3 events ---
    def _h3_event(self, event: H3Event) -> None:
        if isinstance(event, HeadersReceived):
            state = self._requests.get(event.stream_id)
            if state is None:
                self._on_head(event)
            elif event.stream_ended:  # trailers end the body; they are not forwarded
                self._on_body_end(event.stream_id, state)
        elif isinstance(event, DataReceived):
            state = self._requests.get(event.stream_id)
            if state is not None:
                self._on_data(event, state)
        elif isinstance(event, StreamRejected):
            self._on_rejected(event)

    def _on_head(self, event: HeadersReceived) -> None:
        sid = event.stream_id
        started = time.monotonic()
        if self._draining:
            self._refuse_stream(sid)
            return
        self._highest_stream = max(self._highest_stream, sid)
        ended = event.stream_ended
        try:
            request = self._parse_head(event.headers)
        except PylonError as error:
            self._answer(sid, error, getattr(error, "request_id", None), ended, started)
            return
        declared = _content_length(event.headers)
        if declared is not None and declared > self._settings.max_body_bytes:
            self._answer(sid, _body_too_large(self._settings), request.request_id, ended, started)
            return
        self._requests[sid] = _Request(request, started, self._loop.time())
        if event.stream_ended:
            self._on_body_end(sid, self._requests[sid])
        else:
            self._body_watch.arm(self._settings.header_timeout)

    def _check_stalled_bodies(self) -> None:
        """A stream whose body stops arriving for `header_timeout` gets 408 (like HTTP/1.1)."""
        now, limit = self._loop.time(), self._settings.header_timeout
        next_check: float | None = None
        for sid, state in list(self._requests.items()):
            if state.answered or state.task is not None or state.request is None:
                continue
            idle = now - state.progress
            if idle < limit:
                next_check = min(next_check or limit, limit - idle)
                continue
            request_id = state.request.request_id
            self._log.info(
                "client_timeout", timer="body", protocol="h3", stream_id=sid, request_id=request_id
            )
            del self._requests[sid]
            error = ClientError(
                f"the request body did not arrive within {limit} s", code=PylonCode.REQUEST_TIMEOUT
            )
            self._answer(sid, error, request_id, ended=False)
        if next_check is not None:
            self._body_watch.arm(next_check)

    def _parse_head(self, fields: Sequence[Header]) -> TunnelRequest | HealthRequest:
        check_header_block(fields, self._settings.max_headers, self._settings.max_header_bytes)
        method, target, headers = _to_origin_form(fields)
        return self._server.proxy.admit(method, target, headers)

    def _on_data(self, event: DataReceived, state: _Request) -> None:
        if state.answered:
            if event.stream_ended:
                self._requests.pop(event.stream_id, None)
            return
        if event.data:
            state.progress = self._loop.time()
            state.body_bytes += len(event.data)
            if state.body_bytes > self._settings.max_body_bytes:
                request_id = state.request.request_id if state.request else None
                self._requests.pop(event.stream_id, None)
                error = _body_too_large(self._settings)
                self._answer(event.stream_id, error, request_id, event.stream_ended)
                return
            state.body.append(event.data)
        if event.stream_ended:
            self._on_body_end(event.stream_id, state)

    def _on_body_end(self, sid: int, state: _Request) -> None:
        if state.answered or state.task is not None or state.request is None:
            return
        body = b"".join(state.body) if len(state.body) != 1 else state.body[0]
        state.body = []
        state.sink = H3Responder(self, sid)
        state.task = self._loop.create_task(
            self._server.proxy.handle(state.request, body, state.sink)
        )
        state.task.add_done_callback(lambda task: self._request_done(sid, task))

    def _on_rejected(self, event: StreamRejected) -> None:
        state = self._requests.get(event.stream_id)
        if state is not None and state.answered:
            return  # pylon already answered this stream
        if state is not None and state.task is not None:
            # Already running (cannot happen for a whole-body request; be safe): reset.
            self._cancel(event.stream_id, "malformed_after_dispatch")
            return
        self._requests.pop(event.stream_id, None)
        request_id = state.request.request_id if state and state.request else None
        self._log.warning(
            "h3_stream_rejected",
            request_id=request_id,
            stream_id=event.stream_id,
            status=event.status,
            reason=event.reason,
        )
        error: PylonError
        if event.status == 431:
            error = LimitError(event.reason, code=PylonCode.HEADERS_TOO_LARGE)
        else:
            error = ContractError(
                f"malformed HTTP/3 request: {event.reason}", code=PylonCode.MALFORMED_REQUEST
            )
        # PylonH3Connection already sent STOP_SENDING and drops the rest of the stream.
        self._answer(event.stream_id, error, request_id, ended=True)

    # --- answering and finishing ---
    def _answer(
        self,
        sid: int,
        error: PylonError,
        request_id: str | None,
        ended: bool,
        started: float | None = None,
    ) -> None:
        """Answer a request pylon refuses, before (or instead of) reading its body."""
        started = time.monotonic() if started is None else started
        self._server.proxy.reject(H3Responder(self, sid), error, request_id, started)
        if ended:
            return
        # Keep ignoring what the client still sends on this stream until it ends.
        self._requests[sid] = _Request(None, started)
        with contextlib.suppress(ValueError):
            self._quic.stop_stream(sid, ErrorCode.H3_NO_ERROR)

    def _refuse_stream(self, sid: int) -> None:
        """Draining: the request was not processed, so the client may retry it elsewhere."""
        with contextlib.suppress(ValueError):
            self._quic.stop_stream(sid, ErrorCode.H3_REQUEST_REJECTED)
        self._quic.reset_stream(sid, ErrorCode.H3_REQUEST_REJECTED)
        self.transmit()

    def _request_done(self, sid: int, task: asyncio.Task[None]) -> None:
        self._requests.pop(sid, None)
        self._writers.pop(sid, None)
        if not task.cancelled() and task.exception() is not None:
            self._server.proxy.log_crash(task.exception())
            self._quic.reset_stream(sid, ErrorCode.H3_INTERNAL_ERROR)
            self.transmit()
        self._maybe_close_drained()

    def _cancel(self, sid: int, reason: str, reset: bool = True) -> None:
        state = self._requests.pop(sid, None)
        if state is None or state.answered:
            return  # nothing running; an early answer stays as sent
        sink = state.sink
        if sink is not None and sink.closed:
            return  # the response is complete
        if sink is not None:
            sink.closed = True
        if state.task is not None and not state.task.done():
            state.task.cancel()
            self._log.info(
                "h3_stream_cancelled",
                request_id=state.request.request_id if state.request else None,
                stream_id=sid,
                reason=reason,
            )
        if reset:
            self._quic.reset_stream(sid, ErrorCode.H3_REQUEST_CANCELLED)
            self._transmit_soon()

    def _terminated(self) -> None:
        self._body_watch.cancel()
        for sid in list(self._requests):
            self._cancel(sid, "connection_closed", reset=False)
        for waiter in self._writers.values():
            if not waiter.done():
                waiter.set_exception(ConnectionResetError("QUIC connection closed"))
                waiter.exception()
        self._writers.clear()
        self._server.forget(self)

    # --- drain ---
    def drain(self) -> None:
        """Stop admitting streams, send GOAWAY, let admitted streams finish, then close."""
        if self._draining:
            return
        self._draining = True
        if self._http is not None:  # else: sent once HTTP/3 is set up (ProtocolNegotiated)
            self._send_goaway()

    def _send_goaway(self) -> None:
        assert self._http is not None
        goaway_id = self._highest_stream + 4
        self._http.send_goaway(goaway_id)
        self._log.info("h3_goaway_sent", stream_id=goaway_id, in_flight=len(self._requests))
        self.transmit()
        # Bound the wait for the client to acknowledge the last bytes.
        self._loop.call_later(DRAIN_ACK_GRACE, self._close_drained)
        self._maybe_close_drained()

    def _maybe_close_drained(self) -> None:
        # Close only once every byte sent (responses, GOAWAY) is acknowledged: CONNECTION_CLOSE
        # ends retransmission, so closing earlier could lose the end of a response.
        if self._draining and not self._requests and not self._unacked_anything():
            self._loop.call_soon(self._close_drained)

    def _close_drained(self) -> None:
        if not self._closed.is_set():
            self.close(ErrorCode.H3_NO_ERROR, "drained")

    def _unacked_anything(self) -> bool:
        return any(len(stream.sender._buffer) for stream in self._quic._streams.values())

    # --- client certificates (mTLS) ---
    def _check_client_certificate(self) -> None:
        identity = self._server.identity
        if identity.client_ca is None:
            return
        tls = self._quic.tls
        refusal = identity.verify_client(tls._peer_certificate, tls._peer_certificate_chain)
        if refusal is None:
            return
        self._refused = True
        self._log.warning("quic_client_rejected", reason=refusal)
        self.close(_CERTIFICATE_REQUIRED, refusal)

    # --- used by H3Responder ---
    def schedule(self, sink: H3Responder) -> None:
        # Corked like the HTTP/1.1 ingress: what a relay writes in one loop iteration goes out
        # as one DATA frame, and all streams share one transmit.
        self._dirty.append(sink)
        if self._flush_handle is None:
            self._flush_handle = self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_handle = None
        dirty, self._dirty = self._dirty, []
        http = self._http
        if http is None:
            return
        for sink in dirty:
            sink.flush(http)
        self.transmit()

    def reset(self, sid: int, code: ErrorCode) -> None:
        self._quic.reset_stream(sid, code)
        self._transmit_soon()

    def backlog(self, sid: int) -> int:
        # aioquic keeps every unacknowledged byte of a stream in its sender's buffer and has no
        # public accessor for its size; this is what "the client is not keeping up" means here.
        stream = self._quic._streams.get(sid)
        return len(stream.sender._buffer) if stream is not None else 0

    async def wait_writable(self, sid: int) -> None:
        if self.backlog(sid) <= SEND_LOW_WATER:
            return
        waiter = self._writers[sid] = self._loop.create_future()
        try:
            await waiter
        finally:
            self._writers.pop(sid, None)

    def _wake_writers(self) -> None:
        for sid, waiter in list(self._writers.items()):
            if not waiter.done() and self.backlog(sid) <= SEND_LOW_WATER:
                waiter.set_result(None)


class H3Responder:
    """`ResponseSink` for one HTTP/3 response stream."""

    __slots__ = ("_conn", "_ended", "_head", "_parts", "_queued", "_sid", "closed")

    def __init__(self, conn: Http3Protocol, sid: int) -> None:
        self._conn = conn
        self._sid = sid
        self._head: list[Header] | None = None
        self._parts: list[bytes] = []
        self._ended = False
        self._queued = False
        self.closed = False

    @property
    def paused(self) -> bool:
        return self._conn.backlog(self._sid) > SEND_HIGH_WATER

    def start(self, status: int, headers: Sequence[Header], content_length: int | None) -> None:
        head: list[Header] = [(b":status", str(status).encode("ascii"))]
        for name, value in headers:
            lowered = name.lower()  # HTTP/3 field names are lowercase, or the message is malformed
            if lowered not in CONNECTION_SPECIFIC_HEADERS:
                head.append((lowered, value.strip(b" \t")))
        if content_length is not None:
            head.append((b"content-length", str(content_length).encode("ascii")))
        self._head = head
        self._queue()

    def write(self, data: bytes) -> None:
        if data:
            self._parts.append(data)
            self._queue()

    async def drain(self) -> None:
        await self._conn.wait_writable(self._sid)

    def end(self) -> None:
        self._ended = True
        self._queue()

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self._parts.clear()
            self._conn.reset(self._sid, ErrorCode.H3_INTERNAL_ERROR)

    def _queue(self) -> None:
        if not self._queued and not self.closed:
            self._queued = True
            self._conn.schedule(self)

    def flush(self, http: H3Connection) -> None:
        self._queued = False
        if self.closed:
            return
        ended, head, parts = self._ended, self._head, self._parts
        self._head, self._parts = None, []
        try:
            if head is not None:
                http.send_headers(self._sid, head, end_stream=ended and not parts)
            if parts:
                http.send_data(self._sid, b"".join(parts) if len(parts) > 1 else parts[0], ended)
            elif ended and head is None:
                http.send_data(self._sid, b"", True)
        except RuntimeError:
            # The client reset the stream between the write and this flush.
            self.closed = True
            return
        self.closed = ended


class Http3Server:
    """The UDP listener: one `Http3Protocol` per QUIC connection."""

    def __init__(self, settings: Settings, proxy: Proxy, identity: TlsIdentity) -> None:
        self.settings = settings
        self.proxy = proxy
        self.identity = identity
        # The encoded block is at most the decoded size plus a few bytes per field.
        self.max_header_block = settings.max_header_bytes + 1024
        self.draining = False
        self._connections: set[Http3Protocol] = set()
        self._transport: asyncio.DatagramTransport | None = None
        self._quic_server: QuicServer | None = None
        self._configuration = identity.quic_configuration(
            alpn_protocols=H3_ALPN,
            idle_timeout=settings.quic_idle_timeout,
            max_data=settings.quic_max_data,
            max_stream_data=settings.quic_max_stream_data,
        )
        # aioquic copies the pair into each connection at its first packet, so updating the
        # shared configuration switches new handshakes only.
        identity.on_change(lambda _: identity.install_quic(self._configuration))

    async def start(self, host: str, port: int) -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        # No session_ticket_fetcher/handler: no resumption, hence no 0-RTT (replayable) requests.
        transport, protocol = await loop.create_datagram_endpoint(
            lambda: QuicServer(
                configuration=self._configuration,
                create_protocol=self._create_protocol,
                retry=self.settings.quic_retry,
            ),
            local_addr=(host, port),
        )
        self._transport = transport
        self._quic_server = protocol
        bound = transport.get_extra_info("sockname")
        return str(bound[0]), int(bound[1])

    def _create_protocol(self, quic: QuicConnection, **kwargs: Any) -> Http3Protocol:
        protocol = Http3Protocol(quic, self, **kwargs)
        self._connections.add(protocol)
        return protocol

    def forget(self, protocol: Http3Protocol) -> None:
        self._connections.discard(protocol)

    @property
    def connections(self) -> int:
        return len(self._connections)

    def drain(self) -> None:
        """GOAWAY on every connection; connections that arrive later are drained at once."""
        self.draining = True
        for protocol in list(self._connections):
            protocol.drain()

    async def shutdown(self, grace: float) -> None:
        """Drain, give in-flight streams up to `grace` seconds, then close everything."""
        self.drain()
        deadline = asyncio.get_running_loop().time() + grace
        while self._connections and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        self.close()

    def close(self) -> None:
        if self._quic_server is not None:
            self._quic_server.close()
            self._quic_server = None


def _to_origin_form(fields: Sequence[Header]) -> tuple[bytes, bytes, list[Header]]:
    """Pseudo-headers -> (method, target); `:authority` becomes `host` (RFC 9114 4.3.1)."""
    method = target = authority = None
    headers: list[Header] = []
    for name, value in fields:
        if name == b":method":
            method = value
        elif name == b":path":
            target = value
        elif name == b":authority":
            authority = value
        elif name == b":protocol":
            raise ContractError(
                "extended CONNECT is not supported", code=PylonCode.MALFORMED_REQUEST
            )
        elif name == b"host":
            if authority is not None and value != authority:
                raise ContractError(
                    "host and :authority disagree", code=PylonCode.MALFORMED_REQUEST
                )
            continue  # rebuilt from :authority below
        elif name != b":scheme":  # the tunnel's scheme is not used for routing
            headers.append((name, value))
    if method is None or target is None:
        raise ContractError("request needs :method and :path", code=PylonCode.MALFORMED_REQUEST)
    if authority is not None:
        headers.insert(0, (b"host", authority))
    return method, target, headers


def _content_length(fields: Sequence[Header]) -> int | None:
    for name, value in fields:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def _body_too_large(settings: Settings) -> LimitError:
    return LimitError(
        f"request body exceeds {settings.max_body_bytes} bytes", code=PylonCode.BODY_TOO_LARGE
    )


def _limit_streams(quic: QuicConnection, count: int) -> None:
    # aioquic hard-codes 128 concurrent peer-initiated bidi streams and has no setting for it;
    # the initial limit is advertised from this value at the first packet, so set it first.
    limit = quic._local_max_streams_bidi
    limit.value = limit.sent = count


def _request_client_certificate(quic: QuicConnection) -> None:
    # aioquic's server can ask for a client certificate only through a private TLS flag; set it
    # right after the TLS context is created (at the first Initial packet). The chain itself is
    # verified on HandshakeCompleted (`Http3Protocol._check_client_certificate`).
    initialize = quic._initialize

    def initialize_and_request(peer_cid: bytes) -> None:
        initialize(peer_cid)
        quic.tls._request_client_certificate = True

    quic._initialize = initialize_and_request  # type: ignore[method-assign]
