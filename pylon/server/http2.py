"""HTTP/2 ingress: asyncio.Protocol + the sans-IO `h2` library, beside HTTP/1.1 on the TCP port.

Per stream: headers -> our own RFC 9113 8.2/8.3 checks -> limits -> the tunnel contract (400 at
once) -> body buffered up to the limit -> `Proxy.handle` as one task, with this module's
`ResponseSink`, which honours the peer's flow-control windows. A stream reset or a lost
connection cancels that stream's task, which closes the engine connection at once.

Why we validate headers ourselves (`validate_inbound_headers=False`): h2 turns every malformed
header block into a *connection* error, so one bad request would kill every stream the gateway
multiplexes over the connection; RFC 9113 8.1.1 makes it a *stream* error. And h2 accepts spaces
in `:method` and `:path`, which become request-line injection on the HTTP/1.1 engine hop.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    Event,
    PingReceived,
    RemoteSettingsChanged,
    RequestReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
    WindowUpdated,
)
from h2.exceptions import InvalidBodyLengthError, ProtocolError, StreamClosedError
from h2.settings import SettingCodes, Settings
from hyperframe.frame import DataFrame, Frame, GoAwayFrame, HeadersFrame

from pylon.core.contract import HealthRequest, TunnelRequest, check_header_block
from pylon.core.errors import ClientError, ErrorCode, LimitError, PylonError
from pylon.core.flood import RateGuard
from pylon.core.http import Header
from pylon.logs import get_logger
from pylon.proxy import Proxy
from pylon.timers import Deadline

KiB = 1024
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# A stream's unsent response bytes above this pause the core until the peer opens its window.
_HIGH_WATER = 64 * KiB
# RFC 9110 token; `:method` must be one, field names must be one in lowercase (RFC 9113 8.2.1).
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_FIELD_NAME = re.compile(rb"[!#$%&'*+\-.^_`|~0-9a-z]+")
# Origin-form only, visible ASCII: a space or CR/LF here is request-line injection upstream.
_PATH = re.compile(rb"/[\x21-\x7e]*")
_SCHEME = re.compile(rb"[a-z][a-z0-9+.\-]*")
# NUL/CR/LF are forbidden by RFC 9113 8.2.1; other controls by RFC 9110 5.5; and no leading or
# trailing whitespace.
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]|\A[ \t]|[ \t]\Z")
_CONNECTION_SPECIFIC = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"}
)
_PSEUDO = frozenset({b":method", b":scheme", b":path", b":authority"})


@dataclass(frozen=True, slots=True)
class H2Limits:
    max_header_bytes: int
    max_headers: int
    max_body: int
    max_streams: int
    stream_window: int
    header_timeout: float
    idle_timeout: float
    max_stream_resets: int = 1000
    max_control_frames: int = 200
    flood_window: float = 10.0


class Malformed(Exception):
    """RFC 9113 8.1.1: a malformed request is a stream error and must not be forwarded."""


@dataclass(frozen=True, slots=True)
class RequestHead:
    method: bytes
    path: bytes
    headers: list[Header]  # regular fields, plus `host` built from `:authority`


def split_request_headers(fields: Sequence[Header]) -> RequestHead:
    """RFC 9113 8.2 and 8.3 for one request header block; raises `Malformed`."""
    pseudo: dict[bytes, bytes] = {}
    regular: list[Header] = []
    for name, value in fields:
        if _BAD_VALUE.search(value):
            raise Malformed("a field value contains a control character or edge whitespace")
        if name[:1] == b":":
            _add_pseudo(pseudo, name, value, after_regular=bool(regular))
        else:
            _check_regular(name, value)
            regular.append((name, value))
    method, scheme, path = (pseudo.get(n) for n in (b":method", b":scheme", b":path"))
    if method is None or scheme is None or path is None:
        raise Malformed(":method, :scheme and :path are required")
    if not _TOKEN.fullmatch(method):
        raise Malformed(":method is not a token")
    if not _SCHEME.fullmatch(scheme):
        raise Malformed(":scheme is not a URI scheme")
    if not _PATH.fullmatch(path) and not (path == b"*" and method == b"OPTIONS"):
        raise Malformed(":path is not an origin-form path")
    _check_authority(pseudo.get(b":authority"), regular)
    _check_content_length(regular)
    return RequestHead(method, path, regular)


def _add_pseudo(pseudo: dict[bytes, bytes], name: bytes, value: bytes, after_regular: bool) -> None:
    if after_regular:
        raise Malformed("pseudo-header after a regular field")
    if name not in _PSEUDO:
        raise Malformed("unknown pseudo-header")
    if name in pseudo:
        raise Malformed("repeated pseudo-header")
    pseudo[name] = value


def _check_regular(name: bytes, value: bytes) -> None:
    if not _FIELD_NAME.fullmatch(name):
        raise Malformed("field name is not a lowercase token")
    if name in _CONNECTION_SPECIFIC:
        raise Malformed(f"connection-specific field {name.decode('ascii')}")
    if name == b"te" and value != b"trailers":
        raise Malformed("te other than trailers")


def _check_authority(authority: bytes | None, regular: list[Header]) -> None:
    hosts = [value for name, value in regular if name == b"host"]
    if authority is None:
        if len(hosts) > 1:
            raise Malformed("repeated host")
        return
    if not authority or b"@" in authority:
        raise Malformed(":authority is empty or carries userinfo")
    if any(host != authority for host in hosts):
        raise Malformed("host differs from :authority")
    if not hosts:
        # RFC 9113 8.3.1: a proxy converting to HTTP/1.1 builds Host from :authority.
        regular.append((b"host", authority))


def _check_content_length(regular: list[Header]) -> None:
    lengths = {value for name, value in regular if name == b"content-length"}
    if len(lengths) > 1 or any(not value.isdigit() for value in lengths):
        raise Malformed("invalid content-length")


def declared_length(headers: list[Header]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            return int(value)
    return None


class _H2Connection(H2Connection):
    """h2, with its two content-length checks demoted from connection to stream errors.

    h2 checks `content-length` (syntax at HEADERS, and against the DATA total) before we see the
    headers, and raises a connection-level ProtocolError. RFC 9113 8.1.1 calls both a malformed
    *message*: reset that stream, keep the others. Both checks run after HPACK decoding, so the
    connection's header table is intact when we recover.
    """

    def _receive_frame(self, frame: Frame) -> list[Event]:
        try:
            return super()._receive_frame(frame)
        except InvalidBodyLengthError:
            assert isinstance(frame, DataFrame)
            self.reset_stream(frame.stream_id, ErrorCodes.PROTOCOL_ERROR)
            # The connection window was debited for this frame; give it back.
            self.acknowledge_received_data(frame.flow_controlled_length, frame.stream_id)
            return [_malformed_event(frame.stream_id)]
        except ProtocolError as exc:
            if not (
                type(exc) is ProtocolError
                and isinstance(frame, HeadersFrame)
                and "content-length" in str(exc)
            ):
                raise
            self.reset_stream(frame.stream_id, ErrorCodes.PROTOCOL_ERROR)
            return [_malformed_event(frame.stream_id)]


def _malformed_event(stream_id: int) -> StreamReset:
    return StreamReset(
        stream_id=stream_id, error_code=ErrorCodes.PROTOCOL_ERROR, remote_reset=False
    )


class H2Stream:
    """One request stream; also its `ResponseSink`."""

    __slots__ = (
        "_conn",
        "body_bytes",
        "chunks",
        "closed",
        "ending",
        "id",
        "is_head",
        "pending",
        "pending_bytes",
        "progress",
        "remote_ended",
        "request",
        "started",
        "task",
        "waiter",
    )

    def __init__(self, conn: Http2Connection, stream_id: int, is_head: bool) -> None:
        self._conn = conn
        self.id = stream_id
        self.is_head = is_head
        self.request: TunnelRequest | HealthRequest | None = None
        self.chunks: list[bytes] = []
        self.body_bytes = 0
        self.task: asyncio.Task[None] | None = None
        self.pending: deque[bytes] = deque()
        self.pending_bytes = 0
        self.ending = False  # the core called end(); END_STREAM goes with the last pending byte
        self.started = False
        self.closed = False
        self.remote_ended = False
        self.progress = conn.loop.time()  # when the request last moved (head or body bytes)
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
    def __init__(self, proxy: Proxy, limits: H2Limits) -> None:
        self._proxy = proxy
        self._limits = limits
        self.loop = asyncio.get_running_loop()
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
        self._transport: asyncio.Transport | None = None
        self._streams: dict[int, H2Stream] = {}
        self._flush_scheduled = False
        self._dirty: dict[int, H2Stream] = {}
        self._write_paused = False
        self._closed = False
        self._timer = Deadline(self.loop, self._idle)
        self._body_watch = Deadline(self.loop, self._check_stalled_bodies)
        self._goaway_sent: int | None = None  # last stream id named in our graceful GOAWAY
        self._resets = RateGuard(limits.max_stream_resets, limits.flood_window)
        self._control = RateGuard(limits.max_control_frames, limits.flood_window)
        self._log = get_logger()

    # --- asyncio.Protocol ---
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._start_h2()
        self._timer.arm(self._limits.header_timeout)
        self._flush()

    def data_received(self, data: bytes) -> None:
        if self._closed:
            return
        try:
            events = self._h2.receive_data(data)
        except ProtocolError as exc:
            # A connection error (h2 has queued GOAWAY): bad framing, HPACK, flow control.
            self._log.info("h2_connection_error", detail=str(exc)[:200])
            self._shutdown()
            return
        for event in events:
            self._dispatch(event)
        self._schedule_flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self._close_streams()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        for stream in list(self._streams.values()):
            stream.wake()

    @property
    def write_paused(self) -> bool:
        return self._write_paused

    # --- setup ---
    def _start_h2(self) -> None:
        limits = self._limits
        advertised = {
            SettingCodes.MAX_CONCURRENT_STREAMS: limits.max_streams,
            SettingCodes.MAX_HEADER_LIST_SIZE: limits.max_header_bytes,
            SettingCodes.INITIAL_WINDOW_SIZE: limits.stream_window,
        }
        h2 = self._h2
        h2.local_settings = Settings(client=False, initial_values=advertised)
        h2.initiate_connection()
        # h2 enforces its settings as connection errors. Past the SETTINGS frame just queued,
        # give it looser ones so that *we* answer first, per stream: a stream over our cap gets
        # REFUSED_STREAM, a header block over our limit 431. The looser values still bound
        # memory (an HPACK bomb stops at `hard_headers`).
        enforced = dict(advertised)
        enforced[SettingCodes.MAX_CONCURRENT_STREAMS] = limits.max_streams + 16
        hard_headers = max(64 * KiB, 2 * (limits.max_header_bytes + 32 * limits.max_headers))
        enforced[SettingCodes.MAX_HEADER_LIST_SIZE] = hard_headers
        h2.local_settings = Settings(client=False, initial_values=enforced)
        h2.decoder.max_header_list_size = hard_headers
        # Request bodies are buffered whole (bounded by max_body), so a wide connection window
        # costs nothing extra and saves round trips on large prompts.
        h2.increment_flow_control_window(max(0, 4 * limits.stream_window - 65535))

    # --- events ---
    def _dispatch(self, event: Event) -> None:
        if isinstance(event, DataReceived):
            self._on_data(event)
        elif isinstance(event, RequestReceived):
            self._on_request(event)
        elif isinstance(event, StreamEnded):
            self._on_end(event.stream_id)
        elif isinstance(event, WindowUpdated):
            self._on_window(event.stream_id)
        elif isinstance(event, StreamReset):
            if event.remote_reset and self._resets.hit(self.loop.time()):
                self._enhance_your_calm("rapid_reset")
                return
            self._on_reset(event)
        elif isinstance(event, PingReceived):
            if self._control.hit(self.loop.time()):
                self._enhance_your_calm("ping_flood")
        elif isinstance(event, TrailersReceived):
            self._on_trailers(event)
        elif isinstance(event, RemoteSettingsChanged):
            if self._control.hit(self.loop.time()):
                self._enhance_your_calm("settings_flood")
                return
            self._on_window(0)
        elif isinstance(event, ConnectionTerminated):
            self._shutdown()

    def _on_request(self, event: RequestReceived) -> None:
        sid = event.stream_id
        if self._goaway_sent is not None and sid > self._goaway_sent:
            # Opened after our GOAWAY: refused, so the client retries it elsewhere (RFC 9113 6.8).
            self._h2.reset_stream(sid, ErrorCodes.REFUSED_STREAM)
            return
        if len(self._streams) >= self._limits.max_streams:
            self._h2.reset_stream(sid, ErrorCodes.REFUSED_STREAM)
            return
        fields = event.headers
        try:
            head = split_request_headers(fields)
        except Malformed as exc:
            self._h2.reset_stream(sid, ErrorCodes.PROTOCOL_ERROR)
            self._log.info("h2_stream_malformed", stream_id=sid, detail=str(exc))
            return
        stream = H2Stream(self, sid, head.method == b"HEAD")
        stream.remote_ended = event.stream_ended is not None
        self._streams[sid] = stream
        self._timer.disarm()
        try:
            stream.request = self._admit(fields, head)
        except PylonError as error:
            self._reject(stream, error)
            return
        if stream.remote_ended:
            self._run(stream)
        else:
            self._body_watch.arm(self._limits.header_timeout)

    def _check_stalled_bodies(self) -> None:
        """A stream whose body stops arriving for `header_timeout` gets 408 (like HTTP/1.1)."""
        now, limit = self.loop.time(), self._limits.header_timeout
        next_check: float | None = None
        for stream in list(self._streams.values()):
            if stream.task is not None or stream.started or stream.remote_ended:
                continue
            idle = now - stream.progress
            if idle >= limit:
                request_id = stream.request.request_id if stream.request else None
                self._log.info(
                    "client_timeout",
                    timer="body",
                    protocol="h2",
                    stream_id=stream.id,
                    request_id=request_id,
                )
                error = ClientError(
                    f"the request body did not arrive within {limit} s",
                    code=ErrorCode.REQUEST_TIMEOUT,
                )
                error.request_id = request_id
                self._reject(stream, error)
            else:
                next_check = min(next_check or limit, limit - idle)
        if next_check is not None:
            self._body_watch.arm(next_check)
        self._schedule_flush()

    def _admit(self, fields: list[Header], head: RequestHead) -> TunnelRequest | HealthRequest:
        """Limits and the tunnel contract, at headers time: a bad request is answered at once."""
        limits = self._limits
        check_header_block(fields, limits.max_headers, limits.max_header_bytes)
        request = self._proxy.admit(head.method, head.path, head.headers)
        declared = declared_length(head.headers)
        if declared is not None and declared > limits.max_body:
            raise _too_large(limits.max_body, request.request_id)
        return request

    def _on_data(self, event: DataReceived) -> None:
        sid = event.stream_id
        # Bodies are buffered whole and bounded by max_body: hand the window back at once.
        self._h2.acknowledge_received_data(event.flow_controlled_length, sid)
        stream = self._streams.get(sid)
        if stream is None or stream.started or stream.task is not None:
            return
        stream.body_bytes += len(event.data)
        stream.progress = self.loop.time()
        if stream.body_bytes > self._limits.max_body:
            request_id = stream.request.request_id if stream.request else None
            self._reject(stream, _too_large(self._limits.max_body, request_id))
            return
        stream.chunks.append(event.data)

    def _on_end(self, sid: int) -> None:
        stream = self._streams.get(sid)
        if stream is None:
            return
        stream.remote_ended = True
        if stream.task is None and not stream.started:
            self._run(stream)

    def _on_trailers(self, event: TrailersReceived) -> None:
        # Trailers are never forwarded, but they count against the same limits.
        stream = self._streams.get(event.stream_id)
        fields = event.headers
        size = sum(len(name) + len(value) + 4 for name, value in fields)
        if (
            stream is not None
            and not stream.started
            and (len(fields) > self._limits.max_headers or size > self._limits.max_header_bytes)
        ):
            self._reject(
                stream,
                LimitError("request trailers too large", code=ErrorCode.HEADERS_TOO_LARGE),
            )

    def _on_reset(self, event: StreamReset) -> None:
        stream = self._streams.pop(event.stream_id, None)
        if stream is not None:
            if event.remote_reset:
                self._log.debug("h2_stream_reset_by_client", stream_id=event.stream_id)
            else:
                self._log.info("h2_stream_malformed", stream_id=event.stream_id)
            self._cancel(stream)
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

    # --- running requests ---
    def _run(self, stream: H2Stream) -> None:
        assert stream.request is not None
        body = b"".join(stream.chunks) if len(stream.chunks) != 1 else stream.chunks[0]
        stream.chunks = []
        stream.task = self.loop.create_task(self._proxy.handle(stream.request, body, stream))
        stream.task.add_done_callback(lambda task: self._task_done(stream, task))

    def _task_done(self, stream: H2Stream, task: asyncio.Task[None]) -> None:
        if task.cancelled() or stream.closed:
            return
        if task.exception() is not None:
            # A bug, not a client error: log it, and reset rather than leave the stream hanging.
            self._proxy.log_crash(task.exception())
            self.reset(stream, ErrorCodes.INTERNAL_ERROR)
        elif not stream.ending:
            self.reset(stream, ErrorCodes.INTERNAL_ERROR)

    def _reject(self, stream: H2Stream, error: PylonError) -> None:
        """Answer with pylon's own problem; the rest of the request body is refused."""
        stream.chunks = []
        self._proxy.reject(stream, error, error.request_id, time.monotonic())

    # --- used by the streams ---
    def send_head(
        self, stream: H2Stream, status: int, headers: Sequence[Header], length: int | None
    ) -> None:
        fields = [(b":status", str(status).encode("ascii"))]
        fields += [(name.lower(), value) for name, value in headers]
        if length is not None:
            fields.append((b"content-length", str(length).encode("ascii")))
        try:
            self._h2.send_headers(stream.id, fields)
        except ProtocolError as exc:
            # An engine header h2 will not carry (h2 validates what we send): fail this stream.
            self._log.warning("h2_response_head_refused", stream_id=stream.id, detail=str(exc))
            self.reset(stream, ErrorCodes.INTERNAL_ERROR)
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
        h2 = self._h2
        pending = stream.pending
        ended = False
        while pending:
            room = min(h2.local_flow_control_window(stream.id), h2.max_outbound_frame_size)
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
            h2.send_data(stream.id, chunk, end_stream=ended)
        if not pending and stream.ending:
            if not ended:
                h2.end_stream(stream.id)
            self._finish(stream)
        else:
            stream.wake()

    def reset(self, stream: H2Stream, code: ErrorCodes) -> None:
        if stream.closed:
            return
        self._reset_quietly(stream.id, code)
        self._streams.pop(stream.id, None)
        self._cancel(stream)
        self._schedule_flush()
        self._maybe_idle()

    def _finish(self, stream: H2Stream) -> None:
        stream.closed = True
        if not stream.remote_ended:
            # RFC 9113 8.1: the response is complete; tell the client to stop sending its body.
            self._reset_quietly(stream.id, ErrorCodes.NO_ERROR)
        self._streams.pop(stream.id, None)
        self._maybe_idle()

    def _reset_quietly(self, stream_id: int, code: ErrorCodes) -> None:
        # Our events can lag h2's state (one read may carry HEADERS, DATA and END_STREAM), so the
        # stream may already be closed at h2's level; then there is nothing left to reset.
        if not self._closed:
            with contextlib.suppress(StreamClosedError):
                self._h2.reset_stream(stream_id, code)

    def _cancel(self, stream: H2Stream) -> None:
        stream.closed = True
        stream.pending.clear()
        stream.chunks = []
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()

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
        last = self._h2.highest_inbound_stream_id
        self._goaway_sent = last
        self._flush()
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(GoAwayFrame(0, last_stream_id=last, error_code=0).serialize())
        self._log.info("h2_draining", last_stream_id=last, streams=len(self._streams))
        self._close_if_drained()

    def _close_if_drained(self) -> None:
        if self._goaway_sent is not None and not self._streams and not self._closed:
            self._h2.close_connection(last_stream_id=self._goaway_sent)
            self._shutdown()

    @property
    def busy(self) -> bool:
        return bool(self._streams) and not self._closed

    def _enhance_your_calm(self, kind: str) -> None:
        """CVE-2023-44487 and kin: a peer abusing cheap frames loses the whole connection."""
        if self._closed:
            return
        self._log.warning("h2_flood", kind=kind, streams=len(self._streams))
        self._h2.close_connection(error_code=ErrorCodes.ENHANCE_YOUR_CALM)
        self._shutdown()

    def _idle(self) -> None:
        if self._streams or self._closed:
            return
        self._log.info("client_timeout", timer="idle", protocol="h2")
        self._h2.close_connection()
        self._shutdown()

    def _shutdown(self) -> None:
        """GOAWAY sent or received: h2 will send nothing more, so every stream ends now."""
        self._closed = True  # no more stream output; only what h2 has queued (GOAWAY) goes
        self._flush()
        self._close_streams()
        if self._transport is not None:
            self._transport.close()

    def _close_streams(self) -> None:
        self._closed = True
        self._timer.cancel()
        self._body_watch.cancel()
        streams = list(self._streams.values())
        self._streams.clear()
        for stream in streams:
            self._cancel(stream)

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
                except ProtocolError as exc:  # a state we did not foresee: fail the stream only
                    self._log.warning("h2_send_failed", stream_id=stream.id, detail=str(exc))
                    self.reset(stream, ErrorCodes.INTERNAL_ERROR)
        data = self._h2.data_to_send()
        if data and self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)


def _too_large(limit: int, request_id: str | None) -> LimitError:
    return LimitError(
        f"request body exceeds {limit} bytes", code=ErrorCode.BODY_TOO_LARGE, request_id=request_id
    )


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
    ) -> None:
        self._make_h1 = make_h1
        self._make_h2 = make_h2
        self._header_timeout = header_timeout
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
        if self._timer is not None:
            self._timer.cancel()

    def graceful_close(self) -> None:
        """Shutting down before the client said a word: nothing to finish."""
        if self._transport is not None and self._transport.get_protocol() is self:
            self._transport.close()

    @property
    def busy(self) -> bool:
        return False

    def _switch(self, factory: Callable[[], asyncio.Protocol], data: bytes) -> None:
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
