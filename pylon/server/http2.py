"""HTTP/2 framing: asyncio.Protocol + the sans-IO `h2` library, beside HTTP/1.1 on the TCP port.

h2 turns bytes into frames and events; this module maps each request stream's header block to a
`RequestHead` (`pylon.core.head.pseudo_head`, shared with HTTP/3), feeds the connection's
`StreamTable` (the shared intake, tasks, cancel, stall watcher, rapid-reset guard), and frames
responses within the peer's flow-control windows. A stream reset or a lost connection cancels
that stream's task, which closes the engine connection at once.

Why we validate headers ourselves (`validate_inbound_headers=False`): h2 turns every malformed
header block into a *connection* error, so one bad request would kill every stream the gateway
multiplexes over the connection; RFC 9113 8.1.1 makes it a *stream* error, and pylon answers it
like every transport does: a 400 problem on that stream, then RST_STREAM if the client is still
sending. h2 also accepts spaces in `:method` and `:path`, which become request-line injection on
the HTTP/1.1 engine hop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import ClassVar, cast

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    Event,
    PingReceived,
    PriorityUpdated,
    RemoteSettingsChanged,
    RequestReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
    UnknownFrameReceived,
    WindowUpdated,
)
from h2.exceptions import InvalidBodyLengthError, ProtocolError, StreamClosedError
from h2.settings import SettingCodes, Settings
from hyperframe.frame import DataFrame, Frame, GoAwayFrame, HeadersFrame

from pylon.core.flood import RateGuard
from pylon.core.head import malformed
from pylon.core.http import Header
from pylon.core.intake import AdmittedRequest
from pylon.lifecycle import Lifecycle
from pylon.proxy import ResponseSink
from pylon.server.streams import CLIENT_GONE, SHUTDOWN, Ingress, Stream, StreamTable
from pylon.timers import Deadline

KiB = 1024
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# Input h2 parses in one loop turn. h2 turns a whole read into events before pylon sees the
# first, and one read can hold thousands of tiny frames (1-byte DATA frames, PINGs): a larger
# read is parsed a piece at a time, the rest on the next loop turns with reading paused, so a
# flood guard trips after one piece and no connection holds the loop for a whole read.
FEED_BYTES = 8192
# A stream's unsent response bytes above this pause the proxy until the peer opens its window.
_HIGH_WATER = 64 * KiB
# WINDOW_UPDATE frames a peer may send beyond two per DATA frame pylon sent.
_WINDOW_UPDATE_ALLOWANCE = 1000


class MalformedStream(Event):
    """Pylon's own event: h2 found a message error (content-length) on this stream.

    A plain class, not a dataclass: mypyc (the optional build) cannot rebuild a dataclass whose
    base is an interpreted class."""

    def __init__(self, stream_id: int, reason: str) -> None:
        self.stream_id = stream_id
        self.reason = reason


class _H2Connection(H2Connection):
    """h2, with its two content-length checks demoted from connection to stream errors.

    h2 checks `content-length` (syntax at HEADERS, and against the DATA total) before we see the
    headers, and raises a connection-level ProtocolError. RFC 9113 8.1.1 calls both a malformed
    *message*: answer that stream, keep the others. Both checks run after HPACK decoding, so the
    connection's header table is intact when we recover. This overrides a private h2 method;
    h2 is pinned to the minor version tested, and `tests/unit/test_private_canaries.py` fails if
    h2 changes it.
    """

    def _receive_frame(self, frame: Frame) -> list[Event]:
        try:
            return super()._receive_frame(frame)
        except InvalidBodyLengthError:
            assert isinstance(frame, DataFrame)
            # The connection window was debited for this frame; give it back.
            self.acknowledge_received_data(frame.flow_controlled_length, frame.stream_id)
            return [MalformedStream(frame.stream_id, "content-length disagrees with the body")]
        except ProtocolError as exc:
            if not (
                type(exc) is ProtocolError
                and isinstance(frame, HeadersFrame)
                and "content-length" in str(exc)
            ):
                raise
            return [MalformedStream(frame.stream_id, "invalid content-length")]


class H2Stream:
    """One stream's response side (its `ResponseSink`), paced by the peer's windows."""

    __slots__ = (
        "_conn",
        "closed",
        "ending",
        "id",
        "is_head",
        "pending",
        "pending_bytes",
        "remote_ended",
        "started",
        "trailers",
        "waiter",
    )

    def __init__(self, conn: Http2Connection, stream_id: int) -> None:
        self._conn = conn
        self.id = stream_id
        self.is_head = False
        self.pending: deque[bytes] = deque()
        self.pending_bytes = 0
        self.ending = False  # the proxy called end(); END_STREAM goes with the last pending byte
        self.started = False
        self.closed = False
        self.remote_ended = False
        self.trailers: list[Header] | None = None  # held until h2's StreamEnded that follows
        self.waiter: asyncio.Future[None] | None = None

    # --- ResponseSink ---
    @property
    def paused(self) -> bool:
        return self.pending_bytes > _HIGH_WATER or self._conn.write_paused

    def start(self, status: int, headers: Sequence[Header], content_length: int | None) -> None:
        if not self.closed:
            self.started = True
            self._conn.send_head(self, status, headers, content_length)

    def write(self, data: bytes) -> None:
        if self.closed or self.is_head or not data:
            return
        self.pending.append(data)
        self.pending_bytes += len(data)
        self._conn.mark(self)

    async def drain(self) -> None:
        while self.paused and not self.closed:
            self.waiter = self._conn.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    def end(self) -> None:
        if not self.closed:
            self.ending = True
            self._conn.mark(self)

    def abort(self) -> None:
        self._conn.reset(self, ErrorCodes.INTERNAL_ERROR)

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done() and not self.paused:
            self.waiter.set_result(None)


class Http2Connection(asyncio.Protocol):
    def __init__(self, ingress: Ingress) -> None:
        limits = self._limits = ingress.limits
        self._lifecycle = ingress.lifecycle
        self.loop = asyncio.get_running_loop()
        self._observer = ingress.proxy.observer
        self._table = StreamTable("h2", self, ingress, self.loop)
        self._init_codec()
        self._transport: asyncio.Transport | None = None
        self._streams: dict[int, H2Stream] = {}  # streams with a response still to send
        self._flush_scheduled = False
        self._dirty: dict[int, H2Stream] = {}
        self._write_paused = False
        self._closed = False
        self._unparsed: memoryview | None = None  # the rest of a read, parsed on later turns
        self._timer = Deadline(self.loop, self._idle)
        self._goaway_sent: int | None = None  # last stream id named in our graceful GOAWAY
        # Flood guards (CVE-2019-9512/9513/9514/9515/9518, CVE-2023-44487): frames that cost us
        # work and carry no request progress, counted per window; past the limit the abusive
        # connection (only it) gets GOAWAY ENHANCE_YOUR_CALM.
        self._control = RateGuard(limits.max_control_frames, limits.flood_window)
        self._empty = RateGuard(limits.max_control_frames, limits.flood_window)
        self._refused = RateGuard(limits.max_stream_resets, limits.flood_window)
        # WINDOW_UPDATEs are legitimate in proportion to the DATA frames we send (Envoy's rule).
        self._data_frames_sent = 0
        self._window_updates = 0

    # --- asyncio.Protocol ---
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._start_h2()
        self._timer.arm(self._limits.stall_timeout)
        self._flush()
        self._lifecycle.on_drain(self.graceful_close)

    def data_received(self, data: bytes) -> None:
        if self._closed:
            return
        if self._unparsed is not None:  # reading is paused, but a transport may hand some over
            self._unparsed = memoryview(bytes(self._unparsed) + data)
            return
        if len(data) > FEED_BYTES:
            self._unparsed = memoryview(data)
            if self._transport is not None:
                self._transport.pause_reading()
            self._receive_piece()
            return
        self._receive(data)

    def _receive_piece(self) -> None:
        """One `FEED_BYTES` piece of a large read; the rest on the next loop turn."""
        rest = self._unparsed
        if rest is None or self._closed:
            self._unparsed = None
            return
        piece, rest = rest[:FEED_BYTES], rest[FEED_BYTES:]
        self._unparsed = rest if len(rest) else None
        self._receive(bytes(piece))
        if self._closed:
            self._unparsed = None
        elif self._unparsed is not None:
            self.loop.call_soon(self._receive_piece)
        elif self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()

    def _receive(self, data: bytes) -> None:
        try:
            events = self._h2.receive_data(data)
        except ProtocolError as exc:
            # A connection error (h2 has queued GOAWAY): bad framing, HPACK, flow control.
            self._observer.transport_event("h2_connection_error", "h2", detail=str(exc)[:200])
            self._shutdown()
            return
        for event in events:
            self._handle_event(event)
        self._schedule_flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lifecycle.forget(self.graceful_close)
        self._close_streams(CLIENT_GONE)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        for stream in list(self._streams.values()):
            stream.wake()

    @property
    def write_paused(self) -> bool:
        return self._write_paused

    # --- the codec: h2 here; `pylon.server.http2_ngh2.Ngh2Connection` overrides each hook ---
    codec: ClassVar[str] = "h2"
    # What a send to the codec raises in a state we did not foresee (the stream fails alone).
    _SEND_ERRORS: ClassVar[tuple[type[Exception], ...]] = (ProtocolError,)

    def _init_codec(self) -> None:
        self._h2 = _H2Connection(
            H2Configuration(
                client_side=False,
                header_encoding=None,
                validate_inbound_headers=False,
                normalize_inbound_headers=False,
                # What we send is pylon's own head or the engine's, already sanitized (no
                # connection-specific fields) and lowercased here; httptools has already
                # refused CR/LF/NUL in the engine's values. h2's re-check costs per response.
                validate_outbound_headers=False,
                normalize_outbound_headers=False,
            )
        )

    def _send_room(self, stream_id: int) -> int:
        """Bytes one DATA frame of this stream may carry now (the windows, the frame size)."""
        h2 = self._h2
        return min(h2.local_flow_control_window(stream_id), h2.max_outbound_frame_size)

    def _send_data(self, stream_id: int, chunk: bytes, end: bool) -> None:
        self._h2.send_data(stream_id, chunk, end_stream=end)

    def _send_end(self, stream_id: int) -> None:
        self._h2.end_stream(stream_id)

    def _submit_head(self, stream_id: int, fields: list[Header]) -> None:
        self._h2.send_headers(stream_id, fields)

    def _terminate(self, error_code: int = 0, last_stream_id: int | None = None) -> None:
        """The final GOAWAY (the codec sends nothing after it)."""
        self._h2.close_connection(error_code=error_code, last_stream_id=last_stream_id)

    def _highest_inbound(self) -> int:
        return self._h2.highest_inbound_stream_id

    def _output(self) -> bytes:
        return self._h2.data_to_send()

    # --- setup ---
    def _start_h2(self) -> None:
        limits = self._limits
        advertised = {
            SettingCodes.MAX_CONCURRENT_STREAMS: limits.max_streams,
            SettingCodes.MAX_HEADER_LIST_SIZE: limits.max_header_bytes,
            SettingCodes.INITIAL_WINDOW_SIZE: limits.h2_stream_window,
        }
        h2 = self._h2
        h2.local_settings = Settings(client=False, initial_values=advertised)
        h2.initiate_connection()
        # h2 enforces its settings as connection errors. Past the SETTINGS frame just queued,
        # give it looser ones so that *we* answer first, per stream: a stream over our cap gets
        # REFUSED_STREAM, a header block over our limit 431. The looser values still bound
        # memory (an HPACK bomb stops at `hard_headers`).
        enforced = dict(advertised)
        # h2 would make a stream past its limit a connection error; pylon refuses the stream
        # itself (REFUSED_STREAM) and never kills the streams already running on the connection.
        enforced[SettingCodes.MAX_CONCURRENT_STREAMS] = 2**31 - 1
        hard_headers = max(64 * KiB, 2 * (limits.max_header_bytes + 32 * limits.max_headers))
        enforced[SettingCodes.MAX_HEADER_LIST_SIZE] = hard_headers
        h2.local_settings = Settings(client=False, initial_values=enforced)
        h2.decoder.max_header_list_size = hard_headers
        # Request bodies are buffered whole (bounded by max_body), so a wide connection window
        # costs nothing extra and saves round trips on large prompts.
        h2.increment_flow_control_window(max(0, 4 * limits.h2_stream_window - 65535))

    # --- events ---
    def _handle_event(self, event: Event) -> None:
        if isinstance(event, DataReceived):
            self._on_data(event)
        elif isinstance(event, RequestReceived):
            self._on_request(event.stream_id, event.headers, event.stream_ended is not None)
        elif isinstance(event, StreamEnded):
            self._on_end(event.stream_id)
        elif isinstance(event, WindowUpdated):
            self._window_updates += 1
            if self._window_updates > 2 * self._data_frames_sent + _WINDOW_UPDATE_ALLOWANCE:
                self._enhance_your_calm("window_update_flood")
                return
            self._on_window(event.stream_id)
        elif isinstance(event, StreamReset):
            self._on_reset(event.stream_id)
        elif isinstance(event, MalformedStream):
            self._on_malformed(event)
        elif isinstance(event, PingReceived):
            if self._control.hit(self.loop.time()):
                self._enhance_your_calm("ping_flood")
        elif isinstance(event, PriorityUpdated | UnknownFrameReceived):
            if self._control.hit(self.loop.time()):
                self._enhance_your_calm("control_frame_flood")
        elif isinstance(event, TrailersReceived):
            stream = self._streams.get(event.stream_id)
            if stream is not None:
                stream.trailers = list(event.headers)
        elif isinstance(event, RemoteSettingsChanged):
            if self._control.hit(self.loop.time()):
                self._enhance_your_calm("settings_flood")
                return
            self._on_window(0)
        elif isinstance(event, ConnectionTerminated):
            self._shutdown()

    def _on_request(self, sid: int, headers: Sequence[Header], ended: bool) -> None:
        if self._goaway_sent is not None and sid > self._goaway_sent:
            # Opened after our GOAWAY: refused, so the client retries it elsewhere (RFC 9113 6.8).
            self._reset_quietly(sid, ErrorCodes.REFUSED_STREAM)
            return
        if len(self._streams) >= self._limits.max_streams:
            # Over the advertised limit: refuse this stream, keep the connection and the
            # streams already running on it. A client that keeps doing it is flooding.
            self._reset_quietly(sid, ErrorCodes.REFUSED_STREAM)
            if self._refused.hit(self.loop.time()):
                self._enhance_your_calm("refused_stream_flood")
            return
        self._timer.disarm()
        response = self._streams[sid] = H2Stream(self, sid)
        response.remote_ended = ended
        self._table.header_block(sid, headers, ended)

    def _on_data(self, event: DataReceived) -> None:
        sid = event.stream_id
        # Bodies are buffered whole and bounded by max_body: hand the window back at once.
        self._h2.acknowledge_received_data(event.flow_controlled_length, sid)
        if not event.data and event.stream_ended is None and self._empty.hit(self.loop.time()):
            self._enhance_your_calm("empty_frame_flood")  # CVE-2019-9518
            return
        self._table.data(sid, event.data, ended=False)

    def _on_end(self, sid: int) -> None:
        stream = self._streams.get(sid)
        if stream is None or stream.remote_ended:
            return  # ended with its HEADERS: the table already knows
        stream.remote_ended = True
        if stream.trailers is not None:
            self._table.trailers(sid, stream.trailers)
            stream.trailers = None
        else:
            self._table.end(sid)

    def _on_malformed(self, event: MalformedStream) -> None:
        sid = event.stream_id
        if sid not in self._streams:
            # h2 refused the HEADERS itself: pylon never saw the request; answer it all the same.
            if len(self._streams) >= self._limits.max_streams:
                self._reset_quietly(sid, ErrorCodes.PROTOCOL_ERROR)
                return
            self._streams[sid] = H2Stream(self, sid)
            self._table.open(sid)
        self._observer.transport_event(
            "stream_malformed",
            "h2",
            stream_id=sid,
            request_id=self._table.request_id(sid),
            detail=event.reason,
        )
        self._table.malformed(sid, malformed(event.reason))

    def _on_reset(self, sid: int) -> None:
        request_id = self._table.request_id(sid)
        stream = self._streams.pop(sid, None)
        if stream is not None:
            self._cancel(stream)
        if self._table.peer_reset(sid):
            self._enhance_your_calm("rapid_reset")
            return
        self._observer.transport_event(
            "stream_reset_by_client", "h2", stream_id=sid, request_id=request_id
        )
        self._maybe_idle()

    def _on_window(self, sid: int) -> None:
        if sid:
            stream = self._streams.get(sid)
            if stream is not None:
                self.pump(stream)
            return
        for stream in list(self._streams.values()):
            if stream.pending or stream.ending:
                self.pump(stream)

    # --- Framing (used by the table) ---
    def response_sink(self, stream: Stream, request: AdmittedRequest) -> ResponseSink:
        return self._sink(stream)

    def reject_sink(self, stream: Stream) -> ResponseSink:
        # The response ends the stream; `_finish` then resets it with NO_ERROR if the client is
        # still sending (RFC 9113 8.1), so the rest of the body is never read.
        return self._sink(stream)

    def _sink(self, stream: Stream) -> H2Stream:
        response = self._streams.get(stream.id) or _closed_sink(self, stream.id)
        response.is_head = stream.is_head
        return response

    def stream_done(self, stream: Stream, crashed: bool) -> None:
        response = self._streams.get(stream.id)
        if response is not None and (crashed or not response.ending):
            # A bug, or a task that ended without ending its response: reset rather than leave
            # the stream hanging.
            self.reset(response, ErrorCodes.INTERNAL_ERROR)

    # --- used by the streams ---
    def send_head(
        self, stream: H2Stream, status: int, headers: Sequence[Header], length: int | None
    ) -> None:
        fields = [(b":status", str(status).encode("ascii"))]
        fields += headers  # normalised by the sender (`pylon.proxy.sink.ResponseSink.start`)
        if length is not None:
            fields.append((b"content-length", str(length).encode("ascii")))
        try:
            self._submit_head(stream.id, fields)
        except self._SEND_ERRORS as exc:
            # A state we did not foresee: fail this stream only.
            self._observer.transport_event(
                "h2_response_head_refused",
                "h2",
                stream_id=stream.id,
                request_id=self._table.request_id(stream.id),
                detail=str(exc),
            )
            self._fail(stream)
        self._schedule_flush()

    def mark(self, stream: H2Stream) -> None:
        """The stream has output; it is framed at the next flush, with everything else written
        in this loop iteration (so head, body and END_STREAM of a small response share frames
        and one socket write)."""
        self._dirty[stream.id] = stream
        self._schedule_flush()

    def pump(self, stream: H2Stream) -> None:
        """Send what the peer's windows allow, in frames no larger than it accepts."""
        if stream.closed or self._closed:
            return
        pending = stream.pending
        ended = False
        while pending:
            room = self._send_room(stream.id)
            if room <= 0:
                break
            chunk = pending[0]
            if len(chunk) <= room:
                pending.popleft()
            else:
                pending[0] = chunk[room:]
                chunk = chunk[:room]
            stream.pending_bytes -= len(chunk)
            ended = stream.ending and not pending
            self._send_data(stream.id, chunk, ended)
            self._data_frames_sent += 1
        if not pending and stream.ending:
            if not ended:
                self._send_end(stream.id)
            self._finish(stream)
        else:
            stream.wake()

    def reset(self, stream: H2Stream, code: int) -> None:
        """Reset a stream pylon cannot finish (the proxy's abort, a crash)."""
        if stream.closed:
            return
        self._reset_quietly(stream.id, code)
        self._streams.pop(stream.id, None)
        self._cancel(stream)
        self._schedule_flush()
        self._maybe_idle()

    def _fail(self, stream: H2Stream) -> None:
        """Sending failed: reset the stream and stop its request."""
        self.reset(stream, ErrorCodes.INTERNAL_ERROR)
        self._table.cancel(stream.id, "send_failed")

    def _finish(self, stream: H2Stream) -> None:
        stream.closed = True
        if not stream.remote_ended:
            # RFC 9113 8.1: the response is complete; tell the client to stop sending its body.
            self._reset_quietly(stream.id, ErrorCodes.NO_ERROR)
        self._streams.pop(stream.id, None)
        self._table.forget(stream.id)
        self._maybe_idle()

    def _reset_quietly(self, stream_id: int, code: int) -> None:
        # Our events can lag h2's state (one read may carry HEADERS, DATA and END_STREAM), so the
        # stream may already be closed at h2's level; then there is nothing left to reset.
        if not self._closed:
            with contextlib.suppress(StreamClosedError):
                self._h2.reset_stream(stream_id, code)

    def _cancel(self, stream: H2Stream) -> None:
        stream.closed = True
        stream.pending.clear()
        stream.wake()

    def _maybe_idle(self) -> None:
        self._close_if_drained()
        if not self._streams and not self._closed:
            self._timer.arm(self._limits.idle_timeout)

    # --- shutdown ---
    def graceful_close(self) -> None:
        """Graceful GOAWAY: streams already open finish; the connection closes when they have.

        h2 only offers a final GOAWAY (after which it sends nothing), so this first one, which
        keeps the connection usable for the streams it names, is framed here.
        """
        if self._closed or self._goaway_sent is not None:
            return
        last = self._highest_inbound()
        self._goaway_sent = last
        self._flush()
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(GoAwayFrame(0, last_stream_id=last, error_code=0).serialize())
        self._observer.transport_event(
            "h2_draining", "h2", last_stream_id=last, streams=len(self._streams)
        )
        self._close_if_drained()

    def close_now(self) -> None:
        """The grace period is over: stop what still runs (outcome `shutdown`) and close."""
        if not self._closed:
            self._terminate()
            self._shutdown(SHUTDOWN)

    def _close_if_drained(self) -> None:
        if self._goaway_sent is not None and not self._streams and not self._closed:
            self._terminate(last_stream_id=self._goaway_sent)
            self._shutdown(SHUTDOWN)

    @property
    def busy(self) -> bool:
        return bool(self._streams) and not self._closed

    @property
    def in_progress(self) -> int:
        """Requests on this connection that have started and are not answered yet."""
        return 0 if self._closed else len(self._streams)

    def _enhance_your_calm(self, kind: str) -> None:
        """CVE-2023-44487 and kin: a peer abusing cheap frames loses the whole connection."""
        if self._closed:
            return
        self._observer.transport_event("h2_flood", "h2", kind=kind, streams=len(self._streams))
        self._terminate(ErrorCodes.ENHANCE_YOUR_CALM)
        self._shutdown()

    def _idle(self) -> None:
        if self._streams or self._closed:
            return
        self._observer.transport_event("client_timeout", "h2", timer="idle")
        self._terminate()
        self._shutdown()

    def _shutdown(self, reason: str = CLIENT_GONE) -> None:
        """GOAWAY sent or received: h2 will send nothing more, so every stream ends now."""
        self._closed = True  # no more stream output; only what h2 has queued (GOAWAY) goes
        self._flush()
        self._close_streams(reason)
        if self._transport is not None:
            self._transport.close()

    def _close_streams(self, reason: str) -> None:
        self._closed = True
        self._timer.cancel()
        streams = list(self._streams.values())
        self._streams.clear()
        for stream in streams:
            self._cancel(stream)
        self._table.cancel_all(reason)

    def _schedule_flush(self) -> None:
        # Corked: every frame produced in one loop iteration goes out in one write.
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._dirty:
            dirty, self._dirty = self._dirty, {}
            for stream in dirty.values():
                try:
                    self.pump(stream)
                except self._SEND_ERRORS as exc:  # a state we did not foresee: fail the stream only
                    self._observer.transport_event(
                        "h2_send_failed",
                        "h2",
                        stream_id=stream.id,
                        request_id=self._table.request_id(stream.id),
                        detail=str(exc),
                    )
                    self._fail(stream)
        data = self._output()
        if data and self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)


def _closed_sink(conn: Http2Connection, stream_id: int) -> H2Stream:
    """A sink for a stream already gone (reset by the client meanwhile): writes go nowhere."""
    stream = H2Stream(conn, stream_id)
    stream.closed = True
    return stream


class ProtocolSwitch(asyncio.Protocol):
    """The TCP listener's first protocol: picks HTTP/2 or HTTP/1.1, then hands the transport over.

    TLS: ALPN decides. Cleartext (or TLS without ALPN): HTTP/2 with prior knowledge starts with
    the 24-byte preface, which no HTTP/1.1 request line can; the first bytes that stop matching
    it mean HTTP/1.1. The bytes read so far go to the chosen protocol unchanged.
    """

    def __init__(
        self,
        make_h1: Callable[[], asyncio.Protocol],
        make_h2: Callable[[], asyncio.Protocol],
        header_timeout: float,
        lifecycle: Lifecycle,
    ) -> None:
        self._make_h1 = make_h1
        self._make_h2 = make_h2
        self._header_timeout = header_timeout
        self._lifecycle = lifecycle
        self._transport: asyncio.Transport | None = None
        self._buffer = b""
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        alpn = _alpn(self._transport)
        if alpn == "h2":
            self._switch(self._make_h2, b"")
        elif alpn == "http/1.1":
            self._switch(self._make_h1, b"")
        else:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self._header_timeout, self._transport.abort)
            self._lifecycle.on_drain(self.graceful_close)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer + data
        seen = min(len(buffer), len(PREFACE))
        if buffer[:seen] != PREFACE[:seen]:
            self._switch(self._make_h1, buffer)
        elif seen == len(PREFACE):
            self._switch(self._make_h2, buffer)
        else:
            self._buffer = buffer

    def connection_lost(self, exc: Exception | None) -> None:
        self._lifecycle.forget(self.graceful_close)
        if self._timer is not None:
            self._timer.cancel()

    def graceful_close(self) -> None:
        """Shutting down before the client said a word: nothing to finish."""
        if self._transport is not None and self._transport.get_protocol() is self:
            self._transport.close()

    def _switch(self, factory: Callable[[], asyncio.Protocol], data: bytes) -> None:
        self._lifecycle.forget(self.graceful_close)
        if self._timer is not None:
            self._timer.cancel()
        assert self._transport is not None
        protocol = factory()
        self._transport.set_protocol(protocol)
        protocol.connection_made(self._transport)
        if data:
            protocol.data_received(data)


def _alpn(transport: asyncio.Transport) -> str | None:
    ssl_object = transport.get_extra_info("ssl_object")
    if ssl_object is None:
        return None
    selected = ssl_object.selected_alpn_protocol()
    return selected if isinstance(selected, str) else None
