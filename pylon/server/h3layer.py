"""Pylon's HTTP/3 request layer: RFC 9114 request streams with RFC 9204 QPACK (static table only),
on aioquic's public `QuicConnection` event API.

Sans-I/O, like aioquic's own `H3Connection`: QUIC events go in through `handle_event`, HTTP/3
events come out, and `send_*` queue frames on the `QuicConnection`; the caller moves datagrams.

The layer is always the HTTP *server* (it answers requests and never sends one) whatever its QUIC
role: a request stream is a bidirectional stream opened by the peer, so a reverse tunnel (pylon
dials out as the QUIC client, the peer opens server-initiated bidirectional streams) works
unchanged. `_request_bits` is the only place the QUIC role is read.

What it leaves out, on purpose:
- No QPACK dynamic table (SETTINGS_QPACK_MAX_TABLE_CAPACITY = 0, RFC 9204 3.2.3), hence no
  encoder or decoder streams of our own (RFC 9204 4.2 lets an endpoint skip them) and no
  decompression bombs: a static-table reference decodes to a short, bounded entry.
- No header validation beyond what framing needs (content-length, pseudo-headers in trailers):
  pylon's shared normaliser checks fields for HTTP/2 and HTTP/3 alike.
- No server push, extended CONNECT, HTTP datagrams or WebTransport (none is offered in SETTINGS).

Memory per stream is bounded: at most a partial frame header (15 bytes) plus, for HEADERS, at
most `max_header_block` bytes; DATA is handed on as it arrives and unknown frames are skipped
unbuffered. Cost is proportional to the bytes received, however the peer splits them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from enum import IntEnum

import pylsqpack
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import QuicEvent, StopSendingReceived, StreamDataReceived, StreamReset

from pylon.server.quic_sink import StreamGone as StreamGone  # re-exported: raised here

# A decoded field section, as QPACK gives it (`pylon.core.http` names one field `Header`).
Fields = list[tuple[bytes, bytes]]


class H3ErrorCode(IntEnum):
    """HTTP/3 (RFC 9114 8.1) and QPACK (RFC 9204 6) application error codes."""

    H3_NO_ERROR = 0x100
    H3_GENERAL_PROTOCOL_ERROR = 0x101
    H3_INTERNAL_ERROR = 0x102
    H3_STREAM_CREATION_ERROR = 0x103
    H3_CLOSED_CRITICAL_STREAM = 0x104
    H3_FRAME_UNEXPECTED = 0x105
    H3_FRAME_ERROR = 0x106
    H3_EXCESSIVE_LOAD = 0x107
    H3_ID_ERROR = 0x108
    H3_SETTINGS_ERROR = 0x109
    H3_MISSING_SETTINGS = 0x10A
    H3_REQUEST_REJECTED = 0x10B
    H3_REQUEST_CANCELLED = 0x10C
    H3_REQUEST_INCOMPLETE = 0x10D
    H3_MESSAGE_ERROR = 0x10E
    QPACK_DECOMPRESSION_FAILED = 0x200
    QPACK_ENCODER_STREAM_ERROR = 0x201
    QPACK_DECODER_STREAM_ERROR = 0x202


class FrameType(IntEnum):
    """RFC 9114 7.2."""

    DATA = 0x0
    HEADERS = 0x1
    CANCEL_PUSH = 0x3
    SETTINGS = 0x4
    PUSH_PROMISE = 0x5
    GOAWAY = 0x7
    MAX_PUSH_ID = 0xD


class StreamType(IntEnum):
    """Unidirectional stream types, RFC 9114 6.2 and RFC 9204 4.2."""

    CONTROL = 0x0
    PUSH = 0x1
    QPACK_ENCODER = 0x2
    QPACK_DECODER = 0x3


class Setting(IntEnum):
    """RFC 9114 7.2.4.1 and RFC 9204 5."""

    QPACK_MAX_TABLE_CAPACITY = 0x1
    MAX_FIELD_SECTION_SIZE = 0x6
    QPACK_BLOCKED_STREAMS = 0x7


# Plain ints for the per-frame comparisons (IntEnum attribute lookups cost more).
_DATA = int(FrameType.DATA)
_HEADERS = int(FrameType.HEADERS)
_SETTINGS = int(FrameType.SETTINGS)
_GOAWAY = int(FrameType.GOAWAY)
# HTTP/2 frame types with no HTTP/3 equivalent: receiving one is H3_FRAME_UNEXPECTED (RFC 9114
# 7.2.8). Any other unknown type, reserved grease (0x1f * N + 0x21) included, is skipped (RFC 9114
# 9: "implementations MUST ignore unknown or unsupported values in all extensible protocol
# elements").
_HTTP2_ONLY_FRAMES = frozenset({0x2, 0x6, 0x8, 0x9})
# RFC 9114 7.2.3 to 7.2.7: control-stream frames, and PUSH_PROMISE, which only a server sends.
_NOT_ON_REQUEST_STREAMS = frozenset(
    {
        int(FrameType.CANCEL_PUSH),
        _SETTINGS,
        int(FrameType.PUSH_PROMISE),
        _GOAWAY,
        int(FrameType.MAX_PUSH_ID),
        *_HTTP2_ONLY_FRAMES,
    }
)
# RFC 9114 7.2.1, 7.2.2, 7.2.5: message frames never go on the control stream.
_NOT_ON_CONTROL_STREAM = frozenset(
    {_DATA, _HEADERS, int(FrameType.PUSH_PROMISE), *_HTTP2_ONLY_FRAMES}
)
# Control frames whose payload is a single variable-length integer (RFC 9114 7.2.3, 7.2.6, 7.2.7).
_ONE_INTEGER_FRAMES = frozenset({int(FrameType.CANCEL_PUSH), _GOAWAY, int(FrameType.MAX_PUSH_ID)})
# HTTP/2 settings with no HTTP/3 equivalent: "their receipt MUST be treated as a connection error
# of type H3_SETTINGS_ERROR" (RFC 9114 7.2.4.1).
_HTTP2_ONLY_SETTINGS = frozenset({0x2, 0x3, 0x4, 0x5})
# A SETTINGS frame is buffered whole before it is parsed; real ones are tens of bytes.
MAX_SETTINGS_FRAME = 4096
# A frame header is two variable-length integers of at most 8 bytes each (RFC 9000 16).
_MAX_FRAME_HEADER = 16
_VARINT_MASKS = (0x3F, 0x3FFF, 0x3FFF_FFFF, 0x3FFF_FFFF_FFFF_FFFF)
# content-length beyond 2**62 - 1 could never be met: a QUIC stream cannot carry more.
_MAX_CONTENT_LENGTH_DIGITS = 18


# --- events ---


class H3Event:
    """Base class of the events `H3Layer.handle_event` returns."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class HeadersReceived(H3Event):
    """The request's field section (the first HEADERS frame), decoded but not validated:
    pseudo-headers included, in the order sent."""

    stream_id: int
    headers: Fields
    stream_ended: bool


@dataclass(frozen=True, slots=True)
class DataReceived(H3Event):
    """Request content as it arrives; `DataReceived(sid, b"", True)` is a bare end of stream."""

    stream_id: int
    data: bytes
    stream_ended: bool


@dataclass(frozen=True, slots=True)
class TrailersReceived(H3Event):
    """The trailer section (a second HEADERS frame). Emitted once the stream has ended after it,
    so it also marks the end of the request (RFC 9114 4.1: trailers are the last frame)."""

    stream_id: int
    headers: Fields


@dataclass(frozen=True, slots=True)
class MessageRejected(H3Event):
    """The request is malformed (a stream error, RFC 9114 4.1.2) or its header block is too big.

    The layer ignores the rest of the stream and has asked the peer to stop sending (STOP_SENDING
    with H3_NO_ERROR, RFC 9114 4.1.1) if it had not finished; the application answers `status`.
    """

    stream_id: int
    status: int
    reason: str


@dataclass(frozen=True, slots=True)
class StreamAborted(H3Event):
    """The peer aborted a request stream the application knows about.

    `by_reset`: RESET_STREAM, the request will not be completed (not reported when the layer was
    already ignoring the stream's input, e.g. after `MessageRejected`). Otherwise STOP_SENDING,
    which makes QUIC reset our side: no response can be delivered any more.
    """

    stream_id: int
    error_code: int
    by_reset: bool


@dataclass(frozen=True, slots=True)
class GoawayReceived(H3Event):
    """GOAWAY from the peer (RFC 9114 5.2). From an HTTP client the identifier is a push ID;
    pylon never pushes, so it only says the peer is going away."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class SettingsReceived(H3Event):
    """The peer's SETTINGS (RFC 9114 7.2.4), unknown identifiers included."""

    settings: dict[int, int]


class _ConnectionError(Exception):
    """A connection error (RFC 9114 8): `handle_event` closes the QUIC connection with it."""

    def __init__(self, code: H3ErrorCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class _Malformed(Exception):
    """A malformed request (RFC 9114 4.1.2): a stream error, answered with `status`."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


# --- request stream state ---

# Where a request stream is (RFC 9114 4.1: HEADERS, then DATA, then optionally trailing HEADERS).
_AWAIT_HEADERS = 0
_BODY = 1
_AFTER_TRAILERS = 2  # trailers decoded, waiting for the end of the stream
_ENDED = 3  # the whole request was handed on
_DROPPING = 4  # rejected, aborted or forgotten: the rest of the input is discarded unparsed
_NO_FRAME = -1


class _RequestStream:
    __slots__ = (
        "block",
        "body",
        "declared",
        "forgotten",
        "frame_left",
        "frame_type",
        "head_delivered",
        "partial",
        "phase",
        "received",
        "receiving_ended",
        "stream_id",
        "trailers",
    )

    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id
        self.phase = _AWAIT_HEADERS
        self.frame_type = _NO_FRAME  # type of the frame whose payload is arriving
        self.frame_left = 0  # payload bytes of that frame still to come
        self.partial = b""  # the start of a frame header split across reads
        self.block: bytearray | None = None  # a HEADERS payload split across reads
        self.body: list[bytes] = []  # DATA payload read in this call, handed on as one event
        self.declared = -1  # content-length, -1 when absent
        self.received = 0  # DATA payload bytes so far
        self.trailers: Fields | None = None
        self.receiving_ended = False
        self.forgotten = False  # the application is done with it; the layer drops it at the end
        self.head_delivered = False  # a HeadersReceived of it was handed on

    def drop_buffers(self) -> None:
        self.partial = b""
        self.block = None
        self.body = []
        self.trailers = None
        self.frame_type = _NO_FRAME


class _UniStream:
    __slots__ = ("kind", "partial")

    def __init__(self) -> None:
        self.kind = _UNI_TYPE_PENDING
        self.partial = b""


_UNI_TYPE_PENDING = -1  # the stream type (a variable-length integer) has not fully arrived
_UNI_IGNORED = -2  # an unknown stream type: read and discarded


# --- the layer ---


class H3Layer:
    """HTTP/3 request streams on one `QuicConnection` (see the module docstring).

    :param quic: the connection; the layer opens its control stream on it at once.
    :param max_field_section_size: advertised as SETTINGS_MAX_FIELD_SECTION_SIZE (RFC 9114
        7.2.4.1: the decoded size, counting 32 bytes of overhead per field).
    :param max_header_block: the largest encoded HEADERS payload read; a larger one is refused
        unread with `MessageRejected(status=431)`.
    """

    def __init__(
        self, quic: QuicConnection, *, max_field_section_size: int, max_header_block: int
    ) -> None:
        self._quic = quic
        self._max_header_block = max_header_block
        # Request streams are bidirectional (bit 0x2 clear) and opened by the peer (bit 0x1 is the
        # initiator: 0 for a QUIC client, RFC 9000 2.1). Peer unidirectional streams add 0x2.
        self._request_bits = 1 if quic.configuration.is_client else 0
        self._peer_uni_bits = self._request_bits | 0x2
        self._requests: dict[int, _RequestStream] = {}
        self._uni: dict[int, _UniStream] = {}
        # Both QPACK halves are fixed at a zero-capacity table: no state ever changes in them.
        self._decoder = pylsqpack.Decoder(0, 0)
        self._encoder = pylsqpack.Encoder()  # never apply_settings: static table and literals
        self._closed = False
        self._peer_control_id: int | None = None
        self._peer_encoder_id: int | None = None
        self._peer_decoder_id: int | None = None
        self._control_buffer = bytearray()
        self._control_skip = 0  # payload bytes of an ignored control frame still to skip
        self._settings_received = False
        self._peer_goaway: int | None = None
        self._goaway_sent: int | None = None
        self._control_id = self._open_control_stream(max_field_section_size)

    # --- input ---

    def handle_event(self, event: QuicEvent) -> list[H3Event]:
        """Turn one QUIC event into HTTP/3 events. A connection error closes the QUIC connection
        (`QuicConnection.close`) and yields no events; the layer ignores everything after it."""
        if self._closed:
            return []
        try:
            if isinstance(event, StreamDataReceived):
                return self._receive(event.stream_id, event.data, event.end_stream)
            if isinstance(event, StreamReset):
                return self._receive_reset(event.stream_id, event.error_code)
            if isinstance(event, StopSendingReceived):
                return self._receive_stop_sending(event.stream_id, event.error_code)
        except _ConnectionError as error:
            self._close(error.code, error.reason)
        return []

    def _receive(self, stream_id: int, data: bytes, fin: bool) -> list[H3Event]:
        low_bits = stream_id & 0x3
        if low_bits == self._request_bits:
            return self._receive_request(stream_id, data, fin)
        if low_bits == self._peer_uni_bits:
            return self._receive_uni(stream_id, data, fin)
        return []  # a bidirectional stream of our own: pylon sends no requests

    def _close(self, code: H3ErrorCode, reason: str) -> None:
        self._closed = True
        self._requests.clear()
        self._uni.clear()
        self._quic.close(error_code=code, reason_phrase=reason)

    # --- request streams ---

    def _receive_request(self, stream_id: int, data: bytes, fin: bool) -> list[H3Event]:
        stream = self._requests.get(stream_id)
        if stream is None:
            stream = self._requests[stream_id] = _RequestStream(stream_id)
        if stream.phase == _DROPPING:
            if fin:
                self._input_ended_while_dropping(stream)
            return []
        events: list[H3Event] = []
        try:
            self._parse_request(stream, data, fin, events)
            if fin:
                self._request_ended(stream, events)
            elif stream.body:
                self._hand_on_body(stream, events, False)
        except _Malformed as error:
            self._reject(stream, error, fin, events)
        return events

    def _parse_request(
        self, stream: _RequestStream, data: bytes, fin: bool, events: list[H3Event]
    ) -> None:
        end = len(data)
        pos = self._complete_frame_header(stream, data, fin, events) if stream.partial else 0
        while pos < end:
            if stream.frame_type != _NO_FRAME:
                pos = self._read_payload(stream, data, pos, fin, events)
                continue
            header = _frame_header(data, pos)
            if header is None:
                stream.partial = data[pos:]
                return
            frame_type, length, pos = header
            self._start_frame(stream, frame_type, length, events, fin and pos == end)

    def _complete_frame_header(
        self, stream: _RequestStream, data: bytes, fin: bool, events: list[H3Event]
    ) -> int:
        """Finish a frame header split across reads; return where its payload starts in `data`."""
        head = stream.partial + data[:_MAX_FRAME_HEADER]
        header = _frame_header(head, 0)
        if header is None:  # still incomplete: `data` was shorter than the rest of the header
            stream.partial = head
            return len(data)
        frame_type, length, used = header
        pos = used - len(stream.partial)
        stream.partial = b""
        self._start_frame(stream, frame_type, length, events, fin and pos == len(data))
        return pos

    def _start_frame(
        self,
        stream: _RequestStream,
        frame_type: int,
        length: int,
        events: list[H3Event],
        at_end: bool,
    ) -> None:
        if frame_type == _DATA:
            if stream.phase != _BODY:
                # RFC 9114 4.1: "Receipt of an invalid sequence of frames MUST be treated as a
                # connection error of type H3_FRAME_UNEXPECTED" (DATA before HEADERS or after
                # trailers).
                raise _ConnectionError(H3ErrorCode.H3_FRAME_UNEXPECTED, "DATA frame out of order")
        elif frame_type == _HEADERS:
            if stream.phase == _AFTER_TRAILERS:
                raise _ConnectionError(H3ErrorCode.H3_FRAME_UNEXPECTED, "HEADERS after trailers")
            if length > self._max_header_block:
                # Refused unread: the payload is never buffered nor decoded.
                raise _Malformed(431, f"header block of {length} bytes exceeds the limit")
        elif frame_type in _NOT_ON_REQUEST_STREAMS:
            raise _ConnectionError(
                H3ErrorCode.H3_FRAME_UNEXPECTED, f"frame type 0x{frame_type:x} on a request stream"
            )
        if length:
            stream.frame_type = frame_type
            stream.frame_left = length
        elif frame_type == _HEADERS:
            # No payload means no field section prefix: a decoding error (RFC 9204 4.5.1).
            self._field_section(stream, b"", at_end, events)

    def _read_payload(
        self, stream: _RequestStream, data: bytes, pos: int, fin: bool, events: list[H3Event]
    ) -> int:
        """Consume what `data` holds of the current frame's payload; return the new position."""
        end = len(data)
        take = min(stream.frame_left, end - pos)
        stop = pos + take
        stream.frame_left -= take
        frame_type = stream.frame_type
        if stream.frame_left == 0:
            stream.frame_type = _NO_FRAME
        if frame_type == _DATA:
            stream.received += take
            if 0 <= stream.declared < stream.received:
                # RFC 9114 4.1.2: content-length must equal the sum of the DATA frame lengths.
                raise _Malformed(400, "request body exceeds its content-length")
            stream.body.append(data if take == end else data[pos:stop])
        elif frame_type == _HEADERS:
            self._read_field_section(stream, data, pos, stop, fin and stop == end, events)
        # Any other type is unknown here and skipped (RFC 9114 9), never buffered.
        return stop

    def _read_field_section(
        self,
        stream: _RequestStream,
        data: bytes,
        pos: int,
        stop: int,
        at_end: bool,
        events: list[H3Event],
    ) -> None:
        block = stream.block
        if stream.frame_left == 0 and block is None:
            self._field_section(stream, data[pos:stop], at_end, events)
            return
        if block is None:
            block = stream.block = bytearray()
        block += data[pos:stop]  # bounded by max_header_block (checked at the frame header)
        if stream.frame_left == 0:
            stream.block = None
            self._field_section(stream, bytes(block), at_end, events)

    def _field_section(
        self, stream: _RequestStream, block: bytes, at_end: bool, events: list[H3Event]
    ) -> None:
        """A complete HEADERS payload: the request head, or its trailers."""
        headers = self._decode(stream.stream_id, block)
        if stream.phase == _AWAIT_HEADERS:
            self._request_head(stream, headers, at_end, events)
        else:
            self._trailers(stream, headers, at_end, events)

    def _decode(self, stream_id: int, block: bytes) -> Fields:
        try:
            _, headers = self._decoder.feed_header(stream_id, block)
        except (pylsqpack.DecompressionFailed, pylsqpack.StreamBlocked) as exc:
            # RFC 9204 2.2.3: with a zero-capacity table any dynamic-table reference (or a
            # Required Insert Count above 0) is QPACK_DECOMPRESSION_FAILED.
            raise _ConnectionError(
                H3ErrorCode.QPACK_DECOMPRESSION_FAILED, "cannot decode field section"
            ) from exc
        return headers

    def _request_head(
        self, stream: _RequestStream, headers: Fields, at_end: bool, events: list[H3Event]
    ) -> None:
        stream.declared = _content_length(headers)
        if at_end and stream.declared > 0:
            raise _Malformed(400, "request body shorter than its content-length")
        stream.phase = _ENDED if at_end else _BODY
        stream.head_delivered = True
        events.append(HeadersReceived(stream.stream_id, headers, at_end))

    def _trailers(
        self, stream: _RequestStream, headers: Fields, at_end: bool, events: list[H3Event]
    ) -> None:
        for name, _ in headers:
            if name[:1] == b":":
                # RFC 9114 4.3: "Pseudo-header fields MUST NOT appear in trailer sections."
                raise _Malformed(400, "pseudo-header field in trailers")
        # No DATA may follow trailers, so the content is complete now (RFC 9114 4.1.2).
        _check_body_complete(stream)
        if stream.body:
            self._hand_on_body(stream, events, False)
        stream.phase = _AFTER_TRAILERS
        stream.trailers = headers
        if at_end:
            self._emit_trailers(stream, events)

    def _emit_trailers(self, stream: _RequestStream, events: list[H3Event]) -> None:
        assert stream.trailers is not None
        events.append(TrailersReceived(stream.stream_id, stream.trailers))
        stream.trailers = None
        stream.phase = _ENDED

    def _request_ended(self, stream: _RequestStream, events: list[H3Event]) -> None:
        """The FIN arrived: everything before it has been parsed."""
        stream.receiving_ended = True
        if stream.partial or stream.frame_type != _NO_FRAME:
            # RFC 9114 7.1: a frame truncated by the end of the stream is H3_FRAME_ERROR.
            raise _ConnectionError(H3ErrorCode.H3_FRAME_ERROR, "frame truncated by end of stream")
        phase = stream.phase
        if phase == _BODY:
            _check_body_complete(stream)
            self._hand_on_body(stream, events, True)
            stream.phase = _ENDED
        elif phase == _AFTER_TRAILERS:
            self._emit_trailers(stream, events)
        elif phase == _AWAIT_HEADERS:
            raise _Malformed(400, "request stream ended before HEADERS")

    def _hand_on_body(self, stream: _RequestStream, events: list[H3Event], ended: bool) -> None:
        body = stream.body
        if len(body) == 1:
            data = body[0]
            body.clear()
        else:
            data = b"".join(body)  # consecutive DATA in one read: one event
            stream.body = []
        events.append(DataReceived(stream.stream_id, data, ended))

    def _reject(
        self, stream: _RequestStream, error: _Malformed, fin: bool, events: list[H3Event]
    ) -> None:
        if stream.body:
            self._hand_on_body(stream, events, False)  # what was valid before the error
        stream.phase = _DROPPING
        stream.drop_buffers()
        stream.receiving_ended = stream.receiving_ended or fin
        if not stream.receiving_ended:
            # RFC 9114 4.1.1: a server may answer before the request is complete and then ask
            # the client to stop sending with H3_NO_ERROR.
            self._stop_stream(stream.stream_id, H3ErrorCode.H3_NO_ERROR)
        events.append(MessageRejected(stream.stream_id, error.status, error.reason))

    def _input_ended_while_dropping(self, stream: _RequestStream) -> None:
        stream.receiving_ended = True
        if stream.forgotten:
            del self._requests[stream.stream_id]

    def _receive_reset(self, stream_id: int, error_code: int) -> list[H3Event]:
        if stream_id & 0x3 == self._peer_uni_bits:
            self._uni_stream_reset(stream_id)
            return []
        stream = self._requests.get(stream_id)
        if stream is None:
            return []
        phase = stream.phase
        stream.receiving_ended = True
        if phase == _AWAIT_HEADERS or stream.forgotten:
            del self._requests[stream_id]  # the application never saw it, or is done with it
            return []
        # RFC 9000 3.2: after RESET_STREAM no more data arrives; drop what is buffered.
        stream.phase = _DROPPING
        stream.drop_buffers()
        if phase == _DROPPING:
            return []  # input was already ignored (often the answer to our STOP_SENDING)
        return [StreamAborted(stream_id, error_code, True)]

    def _receive_stop_sending(self, stream_id: int, error_code: int) -> list[H3Event]:
        if stream_id == self._control_id:
            # RFC 9114 6.2.1: closing a control stream is H3_CLOSED_CRITICAL_STREAM.
            raise _ConnectionError(H3ErrorCode.H3_CLOSED_CRITICAL_STREAM, "control stream stopped")
        stream = self._requests.get(stream_id)
        if stream is None or stream.forgotten:
            return []
        if stream.phase == _AWAIT_HEADERS:
            # No response can go out, and the application has not seen the request: drop it.
            stream.phase = _DROPPING
            stream.drop_buffers()
            stream.forgotten = True
            return []
        return [StreamAborted(stream_id, error_code, False)]

    # --- unidirectional streams from the peer ---

    def _receive_uni(self, stream_id: int, data: bytes, fin: bool) -> list[H3Event]:
        stream = self._uni.get(stream_id)
        if stream is None:
            stream = self._uni[stream_id] = _UniStream()
        if stream.kind == _UNI_TYPE_PENDING:
            data = self._read_stream_type(stream_id, stream, data)
            if stream.kind == _UNI_TYPE_PENDING:
                if fin:  # RFC 9114 6.2: closed before its type arrived; tolerated
                    del self._uni[stream_id]
                return []
        kind = stream.kind
        if kind == StreamType.CONTROL:
            return self._receive_control(data, fin)
        if kind == _UNI_IGNORED:
            if fin:  # forget it at its end; nothing more can arrive
                del self._uni[stream_id]
            return []
        if kind == StreamType.QPACK_ENCODER:
            self._feed_encoder_stream(data)
        else:
            self._feed_decoder_stream(data)
        if fin:
            # RFC 9204 4.2: "Closure of either unidirectional stream type MUST be treated as a
            # connection error of type H3_CLOSED_CRITICAL_STREAM."
            raise _ConnectionError(H3ErrorCode.H3_CLOSED_CRITICAL_STREAM, "QPACK stream closed")
        return []

    def _read_stream_type(self, stream_id: int, stream: _UniStream, data: bytes) -> bytes:
        """Parse the stream type; return the data after it."""
        data = stream.partial + data
        parsed = _varint(data, 0)
        if parsed is None:
            stream.partial = data  # at most 7 bytes
            return b""
        kind, pos = parsed
        stream.partial = b""
        stream.kind = self._open_uni(stream_id, kind)
        return data[pos:]

    def _open_uni(self, stream_id: int, kind: int) -> int:
        if kind == StreamType.PUSH:
            # RFC 9114 6.2.2: only servers push; the peer is always the HTTP client here.
            raise _ConnectionError(H3ErrorCode.H3_STREAM_CREATION_ERROR, "push stream from client")
        if kind == StreamType.CONTROL:
            self._peer_control_id = _only_one(self._peer_control_id, stream_id, "control")
        elif kind == StreamType.QPACK_ENCODER:
            self._peer_encoder_id = _only_one(self._peer_encoder_id, stream_id, "QPACK encoder")
        elif kind == StreamType.QPACK_DECODER:
            self._peer_decoder_id = _only_one(self._peer_decoder_id, stream_id, "QPACK decoder")
        else:
            # RFC 9114 6.2: "Recipients of unknown stream types MUST either abort reading of the
            # stream or discard incoming data"; aborting "SHOULD use H3_STREAM_CREATION_ERROR".
            self._stop_stream(stream_id, H3ErrorCode.H3_STREAM_CREATION_ERROR)
            return _UNI_IGNORED
        return kind

    def _uni_stream_reset(self, stream_id: int) -> None:
        stream = self._uni.pop(stream_id, None)
        if stream is not None and stream.kind not in (_UNI_TYPE_PENDING, _UNI_IGNORED):
            # RFC 9114 6.2.1 and RFC 9204 4.2: closing a critical stream is a connection error.
            raise _ConnectionError(H3ErrorCode.H3_CLOSED_CRITICAL_STREAM, "critical stream reset")

    def _feed_encoder_stream(self, data: bytes) -> None:
        if not data:
            return
        try:
            self._decoder.feed_encoder(data)  # blocked_streams=0: nothing to unblock
        except pylsqpack.EncoderStreamError as exc:
            # RFC 9204 4.3.1: a capacity above our SETTINGS_QPACK_MAX_TABLE_CAPACITY (0) is an
            # encoder stream error; so is any insertion into a table of capacity 0.
            raise _ConnectionError(
                H3ErrorCode.QPACK_ENCODER_STREAM_ERROR, "bad QPACK encoder stream"
            ) from exc

    def _feed_decoder_stream(self, data: bytes) -> None:
        if not data:
            return
        try:
            self._encoder.feed_decoder(data)
        except pylsqpack.DecoderStreamError as exc:
            # RFC 9204 4.4: acknowledging insertions we never made is a decoder stream error.
            raise _ConnectionError(
                H3ErrorCode.QPACK_DECODER_STREAM_ERROR, "bad QPACK decoder stream"
            ) from exc

    # --- the peer's control stream ---

    def _receive_control(self, data: bytes, fin: bool) -> list[H3Event]:
        if fin:
            raise _ConnectionError(H3ErrorCode.H3_CLOSED_CRITICAL_STREAM, "control stream closed")
        buffer = self._control_buffer
        buffer += data
        events: list[H3Event] = []
        pos = 0
        while pos < len(buffer):
            if self._control_skip:
                skipped = min(self._control_skip, len(buffer) - pos)
                self._control_skip -= skipped
                pos += skipped
                continue
            header = _frame_header(buffer, pos)
            if header is None:
                break
            frame_type, length, start = header
            self._check_control_frame(frame_type, length)
            if frame_type not in _ONE_INTEGER_FRAMES and frame_type != _SETTINGS:
                self._control_skip = length  # unknown: skipped as it arrives (RFC 9114 9)
                pos = start
                continue
            if len(buffer) - start < length:
                break  # wait for the rest (bounded by _check_control_frame)
            pos = start + length
            events.extend(self._control_frame(frame_type, bytes(buffer[start:pos])))
        del buffer[:pos]
        return events

    def _check_control_frame(self, frame_type: int, length: int) -> None:
        if not self._settings_received and frame_type != _SETTINGS:
            # RFC 9114 6.2.1: "If the first frame of the control stream is any other frame
            # type, this MUST be treated as a connection error of type H3_MISSING_SETTINGS."
            raise _ConnectionError(H3ErrorCode.H3_MISSING_SETTINGS, "first control frame")
        if frame_type == _SETTINGS and self._settings_received:
            # RFC 9114 7.2.4: a second SETTINGS frame is H3_FRAME_UNEXPECTED.
            raise _ConnectionError(H3ErrorCode.H3_FRAME_UNEXPECTED, "second SETTINGS frame")
        if frame_type in _NOT_ON_CONTROL_STREAM:
            raise _ConnectionError(
                H3ErrorCode.H3_FRAME_UNEXPECTED, f"frame type 0x{frame_type:x} on control stream"
            )
        if frame_type == _SETTINGS and length > MAX_SETTINGS_FRAME:
            raise _ConnectionError(H3ErrorCode.H3_EXCESSIVE_LOAD, "SETTINGS frame too large")
        if frame_type in _ONE_INTEGER_FRAMES and length > 8:
            # RFC 9114 7.1: a payload with more than its fields is H3_FRAME_ERROR.
            raise _ConnectionError(H3ErrorCode.H3_FRAME_ERROR, "oversized control frame")

    def _control_frame(self, frame_type: int, payload: bytes) -> list[H3Event]:
        if frame_type == _SETTINGS:
            self._settings_received = True
            return [SettingsReceived(_parse_settings(payload))]
        value = _single_integer(payload)
        if frame_type == _GOAWAY:
            if self._peer_goaway is not None and value > self._peer_goaway:
                # RFC 9114 5.2: the identifier in successive GOAWAY frames must not increase.
                raise _ConnectionError(H3ErrorCode.H3_ID_ERROR, "GOAWAY identifier increased")
            self._peer_goaway = value
            return [GoawayReceived(value)]
        return []  # MAX_PUSH_ID, CANCEL_PUSH: pylon never pushes

    # --- output ---

    def _open_control_stream(self, max_field_section_size: int) -> int:
        stream_id = self._quic.get_next_available_stream_id(is_unidirectional=True)
        # Zero capacity and zero blocked streams are the defaults (RFC 9204 5), sent anyway so
        # peers need not rely on them. No ENABLE_CONNECT_PROTOCOL, no H3_DATAGRAM.
        settings = b"".join(
            _varint_bytes(setting) + _varint_bytes(value)
            for setting, value in (
                (Setting.QPACK_MAX_TABLE_CAPACITY, 0),
                (Setting.QPACK_BLOCKED_STREAMS, 0),
                (Setting.MAX_FIELD_SECTION_SIZE, max_field_section_size),
            )
        )
        stream_type = _varint_bytes(StreamType.CONTROL)
        self._quic.send_stream_data(stream_id, stream_type + _frame(_SETTINGS, settings))
        return stream_id

    def send_headers(self, stream_id: int, headers: Fields, end_stream: bool = False) -> None:
        """Send a field section (response head or trailers) as one HEADERS frame.

        Raises `StreamGone` if the stream can no longer send.
        """
        _, block = self._encoder.encode(stream_id, headers)
        self._send(stream_id, _frame_head(_HEADERS, len(block)) + block, end_stream)

    def send_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        """Send `data` as one DATA frame; empty `data` with `end_stream` sends only the FIN.

        Raises `StreamGone` if the stream can no longer send.
        """
        if not data:
            if end_stream:
                self._send(stream_id, b"", True)
            return
        head = _frame_head(_DATA, len(data))
        if len(data) < 16384:
            self._send(stream_id, head + data, end_stream)
        else:  # large: two writes rather than copying the payload into a new bytes
            self._send(stream_id, head, False)
            self._send(stream_id, data, end_stream)

    def _send(self, stream_id: int, payload: bytes, end_stream: bool) -> None:
        try:
            self._quic.send_stream_data(stream_id, payload, end_stream)
        except (RuntimeError, ValueError) as exc:
            # aioquic: RuntimeError after a reset or the FIN, ValueError for a discarded stream.
            raise StreamGone(stream_id, str(exc)) from exc

    def send_goaway(self, stream_id: int) -> None:
        """RFC 9114 5.2: no request stream with an ID of `stream_id` or above will be processed.

        `stream_id` must be a request-stream ID, and not above one sent before.
        """
        if stream_id & 0x3 != self._request_bits:
            raise ValueError(f"GOAWAY needs a request stream ID, not {stream_id}")
        if self._goaway_sent is not None and stream_id > self._goaway_sent:
            # RFC 9114 5.2: "Endpoints MUST NOT increase the value they send in the last GOAWAY".
            raise ValueError(f"GOAWAY {stream_id} above the {self._goaway_sent} already sent")
        self._goaway_sent = stream_id
        self._quic.send_stream_data(self._control_id, _frame(_GOAWAY, _varint_bytes(stream_id)))

    def reset_stream(self, stream_id: int, error_code: int) -> None:
        """Abort sending on a stream (RESET_STREAM) and ignore what it still receives."""
        self._quic.reset_stream(stream_id, error_code)
        self._drop_input(stream_id)

    def stop_receiving(self, stream_id: int, error_code: int) -> None:
        """Ask the peer to stop sending on a stream (STOP_SENDING) and ignore what still comes."""
        self._stop_stream(stream_id, error_code)
        self._drop_input(stream_id)

    def forget(self, stream_id: int) -> None:
        """Drop the layer's state for a request stream the application is done with.

        Until the peer ends its side, a small marker remains so that late input is discarded
        instead of being read as a new request.
        """
        stream = self._requests.get(stream_id)
        if stream is None:
            return
        if stream.receiving_ended:
            del self._requests[stream_id]
        else:
            stream.forgotten = True
            stream.phase = _DROPPING
            stream.drop_buffers()

    def head_delivered(self, stream_id: int) -> bool:
        """A head of this stream was handed on (the application has, or had, the request): a
        rejection of it that comes later in the same batch is for a request already answered
        when the application forgot it meanwhile."""
        stream = self._requests.get(stream_id)
        return stream is not None and stream.head_delivered

    def _drop_input(self, stream_id: int) -> None:
        stream = self._requests.get(stream_id)
        if stream is not None:
            stream.phase = _DROPPING
            stream.drop_buffers()

    def _stop_stream(self, stream_id: int, error_code: int) -> None:
        # aioquic raises ValueError once it has discarded the stream (both sides finished); then
        # there is nothing left to stop.
        with contextlib.suppress(ValueError):
            self._quic.stop_stream(stream_id, error_code)

    @property
    def open_streams(self) -> int:
        """Request streams the layer holds state for (for tests and metrics)."""
        return len(self._requests)


# --- wire helpers ---


def _varint(data: bytes | bytearray, pos: int) -> tuple[int, int] | None:
    """RFC 9000 16: (value, position after it), or None when `data` ends inside the integer."""
    if pos >= len(data):
        return None
    first = data[pos]
    prefix = first >> 6
    if prefix == 0:
        return first, pos + 1
    end = pos + (1 << prefix)
    if end > len(data):
        return None
    if prefix == 1:
        return ((first & 0x3F) << 8) | data[pos + 1], end
    return int.from_bytes(data[pos:end], "big") & _VARINT_MASKS[prefix], end


def _frame_header(data: bytes | bytearray, pos: int) -> tuple[int, int, int] | None:
    """RFC 9114 7.1: (type, length, payload start), or None when `data` ends inside the header."""
    if pos + 2 < len(data) and data[pos] < 0x40:
        # The usual case, inline: a one-byte type and a length of one or two bytes.
        first = data[pos + 1]
        if first < 0x40:
            return data[pos], first, pos + 2
        if first < 0x80:
            return data[pos], ((first & 0x3F) << 8) | data[pos + 2], pos + 3
    parsed = _varint(data, pos)
    if parsed is None:
        return None
    frame_type, pos = parsed
    parsed = _varint(data, pos)
    if parsed is None:
        return None
    return frame_type, parsed[0], parsed[1]


def _varint_bytes(value: int) -> bytes:
    if value < 0x40:
        return bytes((value,))
    if value < 0x4000:
        return (value | 0x4000).to_bytes(2, "big")
    if value < 0x4000_0000:
        return (value | 0x8000_0000).to_bytes(4, "big")
    return (value | 0xC000_0000_0000_0000).to_bytes(8, "big")


def _frame_head(frame_type: int, length: int) -> bytes:
    if frame_type < 0x40 and length < 0x40:
        return bytes((frame_type, length))
    if frame_type < 0x40 and length < 0x4000:  # a two-byte length (RFC 9000 16)
        return bytes((frame_type, 0x40 | length >> 8, length & 0xFF))
    return _varint_bytes(frame_type) + _varint_bytes(length)


def _frame(frame_type: int, payload: bytes) -> bytes:
    return _frame_head(frame_type, len(payload)) + payload


def _single_integer(payload: bytes) -> int:
    parsed = _varint(payload, 0)
    if parsed is None or parsed[1] != len(payload):
        # RFC 9114 7.1: a payload that does not hold exactly its fields is H3_FRAME_ERROR.
        raise _ConnectionError(H3ErrorCode.H3_FRAME_ERROR, "malformed control frame")
    return parsed[0]


def _parse_settings(payload: bytes) -> dict[int, int]:
    settings: dict[int, int] = {}
    pos = 0
    while pos < len(payload):
        identifier = _varint(payload, pos)
        value = None if identifier is None else _varint(payload, identifier[1])
        if identifier is None or value is None:
            raise _ConnectionError(H3ErrorCode.H3_FRAME_ERROR, "truncated SETTINGS frame")
        key = identifier[0]
        if key in _HTTP2_ONLY_SETTINGS:
            raise _ConnectionError(H3ErrorCode.H3_SETTINGS_ERROR, f"HTTP/2 setting 0x{key:x}")
        if key in settings:
            # RFC 9114 7.2.4: "The same setting identifier MUST NOT occur more than once".
            raise _ConnectionError(H3ErrorCode.H3_SETTINGS_ERROR, f"setting 0x{key:x} repeated")
        settings[key], pos = value
    return settings


def _only_one(known: int | None, stream_id: int, name: str) -> int:
    if known is not None:
        # RFC 9114 6.2.1 and RFC 9204 4.2: a second control, encoder or decoder stream.
        raise _ConnectionError(H3ErrorCode.H3_STREAM_CREATION_ERROR, f"second {name} stream")
    return stream_id


def _content_length(headers: Fields) -> int:
    """The declared content length, -1 when absent; `_Malformed` when invalid or ambiguous."""
    declared = -1
    for name, value in headers:
        if name != b"content-length":
            continue
        # bytes.isdigit is ASCII-only, and rules out signs, spaces and underscores int() accepts.
        if not value.isdigit() or len(value) > _MAX_CONTENT_LENGTH_DIGITS:
            raise _Malformed(400, "content-length is not a valid length")
        length = int(value)
        if declared not in (-1, length):
            raise _Malformed(400, "content-length repeated with different values")
        declared = length
    return declared


def _check_body_complete(stream: _RequestStream) -> None:
    if stream.declared >= 0 and stream.received != stream.declared:
        # RFC 9114 4.1.2: content-length must equal the sum of the DATA frame lengths.
        raise _Malformed(400, "request body shorter than its content-length")
