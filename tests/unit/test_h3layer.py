"""H3Layer: pylon's HTTP/3 request layer, on real in-memory QUIC connections and on synthetic
`StreamDataReceived` events (exact splits, byte-at-a-time delivery, property tests)."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterable, Sequence

import pylsqpack
import pytest
from aioquic.buffer import encode_uint_var
from aioquic.h3 import events as aioquic_events
from aioquic.h3.connection import H3Connection
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import (
    ConnectionTerminated,
    QuicEvent,
    StopSendingReceived,
    StreamDataReceived,
    StreamReset,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from pylon.server.h3layer import (
    DataReceived,
    GoawayReceived,
    H3ErrorCode,
    H3Event,
    H3Layer,
    HeadersReceived,
    MessageRejected,
    SettingsReceived,
    StreamAborted,
    StreamGone,
    TrailersReceived,
    _frame_head,
    _frame_header,
)
from tests.unit.quic_pair import QuicPair, Side, server_configuration

MAX_BLOCK = 8192
FIELD_SECTION = 16384
Headers = list[tuple[bytes, bytes]]
REQUEST: Headers = [
    (b":method", b"POST"),
    (b":scheme", b"https"),
    (b":authority", b"pylon.test"),
    (b":path", b"/v1/chat/completions"),
    (b"content-type", b"application/json"),
    (b"x-request-id", b"req-1"),
]
GREASE = 0x1F * 3 + 0x21  # a reserved frame / stream / setting type (RFC 9114 7.2.8, 6.2.3)

# --- wire builders (aioquic's encoder and pylsqpack, not the code under test) ---


def frame(frame_type: int, payload: bytes) -> bytes:
    return encode_uint_var(frame_type) + encode_uint_var(len(payload)) + payload


def block(headers: Headers) -> bytes:
    return pylsqpack.Encoder().encode(0, headers)[1]


def headers_frame(headers: Headers) -> bytes:
    return frame(0x1, block(headers))


def data_frame(payload: bytes) -> bytes:
    return frame(0x0, payload)


def with_length(length: int, headers: Headers = REQUEST) -> Headers:
    return [*headers, (b"content-length", str(length).encode())]


def request_bytes(body: bytes = b"", trailers: Headers | None = None) -> bytes:
    wire = headers_frame(with_length(len(body))) + (data_frame(body) if body else b"")
    return wire + (headers_frame(trailers) if trailers else b"")


def control_stream(*frames: bytes, settings: bytes | None = None) -> bytes:
    """A peer control stream: type 0x00, SETTINGS (empty unless given), then `frames`."""
    return b"\x00" + frame(0x4, settings or b"") + b"".join(frames)


def settings_payload(*pairs: tuple[int, int]) -> bytes:
    return b"".join(encode_uint_var(key) + encode_uint_var(value) for key, value in pairs)


# --- synthetic events: a layer on a QuicConnection that never sees a packet ---


def bare_layer(max_header_block: int = MAX_BLOCK) -> H3Layer:
    quic = QuicConnection(
        configuration=server_configuration(), original_destination_connection_id=b"\x01" * 8
    )
    return H3Layer(quic, max_field_section_size=FIELD_SECTION, max_header_block=max_header_block)


def feed(
    layer: H3Layer, stream_id: int, chunks: Iterable[bytes], fin: bool = True
) -> list[H3Event]:
    """Deliver `chunks` as one StreamDataReceived each, the FIN on the last (or alone)."""
    pieces = list(chunks)
    events: list[H3Event] = []
    for index, piece in enumerate(pieces):
        last = index == len(pieces) - 1
        events += layer.handle_event(StreamDataReceived(piece, fin and last, stream_id))
    if fin and not pieces:
        events += layer.handle_event(StreamDataReceived(b"", True, stream_id))
    return events


def split(data: bytes, cuts: Iterable[int]) -> list[bytes]:
    points = sorted({cut for cut in cuts if 0 < cut < len(data)})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


def summary(events: Sequence[H3Event]) -> tuple[Headers | None, bytes, Headers | None, bool]:
    """What a request stream carried: (headers, body, trailers, ended), however it was split."""
    head = trailers = None
    body = b""
    ended = False
    for event in events:
        if isinstance(event, HeadersReceived):
            head, ended = event.headers, event.stream_ended
        elif isinstance(event, DataReceived):
            body += event.data
            ended = ended or event.stream_ended
        elif isinstance(event, TrailersReceived):
            trailers, ended = event.headers, True
        else:
            raise AssertionError(f"unexpected {event}")
    return head, body, trailers, ended


# --- real connections ---


class Harness:
    """A connected QuicPair with an H3Layer on one side and a peer on the other.

    The peer is driven by raw `send_stream_data` calls or, with `peer_h3`, by aioquic's own
    client `H3Connection` (only meaningful when the peer is the QUIC client).
    """

    def __init__(
        self, *, layer_on_client: bool = False, peer_h3: bool = False, **pair_options: object
    ) -> None:
        self.pair = QuicPair(**pair_options).connect()  # type: ignore[arg-type]
        sides = (self.pair.client, self.pair.server)
        self.layer_side, self.peer_side = sides if layer_on_client else sides[::-1]
        self.layer = H3Layer(
            self.layer_side.quic,
            max_field_section_size=FIELD_SECTION,
            max_header_block=MAX_BLOCK,
        )
        self.peer_h3 = H3Connection(self.peer.quic) if peer_h3 else None
        self.events: list[H3Event] = []
        self.peer_log: list[QuicEvent] = []
        self.peer_h3_events: list[aioquic_events.H3Event] = []
        self.pump()

    @property
    def peer(self) -> Side:
        return self.peer_side

    def pump(self) -> list[H3Event]:
        """Move datagrams and hand QUIC events to the layer (and the peer's H3Connection)."""
        new: list[H3Event] = []
        for _ in range(50):
            self.pair.pump()
            layer_input = self.layer_side.take_events()
            peer_input = self.peer_side.take_events()
            for event in layer_input:
                new += self.layer.handle_event(event)
            for event in peer_input:
                self.peer_log.append(event)
                if self.peer_h3 is not None:
                    self.peer_h3_events += self.peer_h3.handle_event(event)
            if not layer_input and not peer_input:
                break
        self.events += new
        return new

    def send(self, stream_id: int, data: bytes, fin: bool = False) -> list[H3Event]:
        self.peer.quic.send_stream_data(stream_id, data, fin)
        return self.pump()

    def next_request_stream(self) -> int:
        return self.peer.quic.get_next_available_stream_id()

    def next_uni_stream(self) -> int:
        return self.peer.quic.get_next_available_stream_id(is_unidirectional=True)

    def closed_with(self) -> int | None:
        """The error code the peer saw the connection closed with, if it was."""
        closes = [e for e in self.peer_log if isinstance(e, ConnectionTerminated)]
        return closes[0].error_code if closes else None

    def stop_sending_seen(self, stream_id: int) -> int | None:
        stops = [
            e
            for e in self.peer_log
            if isinstance(e, StopSendingReceived) and e.stream_id == stream_id
        ]
        return stops[0].error_code if stops else None

    def peer_bytes(self, stream_id: int) -> bytes:
        return b"".join(
            e.data
            for e in self.peer_log
            if isinstance(e, StreamDataReceived) and e.stream_id == stream_id
        )

    def of_stream(self, stream_id: int) -> list[H3Event]:
        return [e for e in self.events if getattr(e, "stream_id", None) == stream_id]

    def complete_request(self, body: bytes = b"ping") -> int:
        """A well-formed request on a new stream, answered by the layer; returns its stream ID."""
        sid = self.next_request_stream()
        self.send(sid, request_bytes(body), fin=True)
        assert summary(self.of_stream(sid)) == (with_length(len(body)), body, None, True)
        self.layer.send_headers(sid, [(b":status", b"200")])
        self.layer.send_data(sid, b"pong", end_stream=True)
        self.pump()
        return sid


def parse_frames(data: bytes) -> list[tuple[int, bytes]]:
    frames, pos = [], 0
    while pos < len(data):
        frame_type, pos = _pull_varint(data, pos)
        length, pos = _pull_varint(data, pos)
        frames.append((frame_type, data[pos : pos + length]))
        pos += length
    return frames


def _pull_varint(data: bytes, pos: int) -> tuple[int, int]:
    size = 1 << (data[pos] >> 6)
    value = int.from_bytes(data[pos : pos + size], "big") & ((1 << (8 * size - 2)) - 1)
    return value, pos + size


# === requests ===


def test_request_with_headers_body_and_fin_interoperates_with_aioquic() -> None:
    h = Harness(peer_h3=True)
    assert h.peer_h3 is not None
    sid = h.next_request_stream()
    h.peer_h3.send_headers(sid, with_length(11))
    h.peer_h3.send_data(sid, b"hello world", end_stream=True)
    h.pump()
    assert summary(h.of_stream(sid)) == (with_length(11), b"hello world", None, True)
    assert any(isinstance(e, SettingsReceived) for e in h.events)

    h.layer.send_headers(sid, [(b":status", b"200"), (b"content-type", b"text/plain")])
    h.layer.send_data(sid, b"hi ", end_stream=False)
    h.layer.send_data(sid, b"there", end_stream=True)
    h.pump()
    answer = [e for e in h.peer_h3_events if getattr(e, "stream_id", None) == sid]
    assert isinstance(answer[0], aioquic_events.HeadersReceived)
    assert answer[0].headers == [(b":status", b"200"), (b"content-type", b"text/plain")]
    body = b"".join(e.data for e in answer if isinstance(e, aioquic_events.DataReceived))
    assert body == b"hi there"
    assert answer[-1].stream_ended  # type: ignore[attr-defined]
    assert h.closed_with() is None


def test_layer_settings_are_static_qpack_and_field_section_size_only() -> None:
    h = Harness(peer_h3=True)
    assert h.peer_h3 is not None
    assert h.peer_h3.received_settings == {0x1: 0, 0x7: 0, 0x6: FIELD_SECTION}


def test_large_response_body_and_headers_only_response() -> None:
    h = Harness(peer_h3=True)
    assert h.peer_h3 is not None
    first, second = h.next_request_stream(), h.next_request_stream() + 4
    for sid in (first, second):
        h.peer_h3.send_headers(sid, REQUEST, end_stream=True)
    h.pump()
    big = bytes(range(256)) * 400  # 100 KiB: sent as frame header + payload, two writes
    h.layer.send_headers(first, [(b":status", b"200")])
    h.layer.send_data(first, big, end_stream=True)
    h.layer.send_headers(second, [(b":status", b"204")], end_stream=True)
    h.pump()
    got = b"".join(
        e.data
        for e in h.peer_h3_events
        if isinstance(e, aioquic_events.DataReceived) and e.stream_id == first
    )
    assert got == big
    heads = [e for e in h.peer_h3_events if isinstance(e, aioquic_events.HeadersReceived)]
    assert [(e.stream_id, e.stream_ended) for e in heads] == [(first, False), (second, True)]


def test_headers_only_request_ends_on_the_headers_event() -> None:
    layer = bare_layer()
    events = feed(layer, 0, [headers_frame(REQUEST)])
    assert events == [HeadersReceived(0, REQUEST, True)]


def test_fin_in_a_later_read_is_an_empty_data_event() -> None:
    layer = bare_layer()
    events = feed(layer, 0, [request_bytes(b"abc")], fin=False)
    events += feed(layer, 0, [], fin=True)
    assert events == [
        HeadersReceived(0, with_length(3), False),
        DataReceived(0, b"abc", False),
        DataReceived(0, b"", True),
    ]


def test_every_byte_separately_gives_the_same_request() -> None:
    wire = request_bytes(b"0123456789" * 30, trailers=[(b"x-checksum", b"abc")])
    whole = summary(feed(bare_layer(), 0, [wire]))
    bytewise = summary(feed(bare_layer(), 0, [wire[i : i + 1] for i in range(len(wire))]))
    assert (
        bytewise == whole == (with_length(300), b"0123456789" * 30, [(b"x-checksum", b"abc")], True)
    )


def test_consecutive_data_frames_in_one_read_are_one_event() -> None:
    layer = bare_layer()
    wire = headers_frame(REQUEST) + b"".join(data_frame(bytes([i]) * 10) for i in range(5))
    events = feed(layer, 0, [wire])
    assert events[1:] == [DataReceived(0, b"".join(bytes([i]) * 10 for i in range(5)), True)]


def test_a_large_data_frame_is_handed_on_piecewise() -> None:
    layer = bare_layer()
    payload = b"x" * 1_000_000
    wire = headers_frame(REQUEST) + data_frame(payload)
    chunks = split(wire, range(0, len(wire), 65536))
    events = feed(layer, 0, chunks)
    data_events = [e for e in events if isinstance(e, DataReceived)]
    assert len(data_events) == len(chunks)
    assert max(len(e.data) for e in data_events) <= 65536
    assert b"".join(e.data for e in data_events) == payload


@st.composite
def request_streams(draw: st.DrawFn) -> tuple[bytes, Headers, bytes, Headers | None]:
    """A valid request stream: HEADERS, DATA frames (some empty), unknown frames anywhere,
    optional trailers; and what it should decode to."""
    extra = draw(
        st.lists(
            st.tuples(st.sampled_from([b"x-a", b"accept", b"x-long"]), st.binary(max_size=40)),
            max_size=6,
        )
    )
    headers = [*REQUEST, *extra]
    parts = draw(st.lists(st.binary(max_size=300), max_size=5))
    body = b"".join(parts)
    if draw(st.booleans()):
        headers.append((b"content-length", str(len(body)).encode()))
    unknown = frame(GREASE, draw(st.binary(max_size=20)))
    wire = [headers_frame(headers)]
    for part in parts:
        wire.append(unknown if draw(st.booleans()) else b"")
        wire.append(data_frame(part))
    trailers = [(b"x-trailer", draw(st.binary(max_size=20)))] if draw(st.booleans()) else None
    if trailers:
        wire.append(headers_frame(trailers))
    if draw(st.booleans()):
        wire.append(unknown)
    return b"".join(wire), headers, body, trailers


@settings(max_examples=150, deadline=None)
@given(stream=request_streams(), cuts=st.lists(st.integers(min_value=1, max_value=3000)))
def test_any_split_of_a_valid_request_decodes_the_same(
    stream: tuple[bytes, Headers, bytes, Headers | None], cuts: list[int]
) -> None:
    wire, headers, body, trailers = stream
    events = feed(bare_layer(), 0, split(wire, cuts))
    assert summary(events) == (headers, body, trailers, True)


def test_byte_at_a_time_holds_no_more_than_a_frame_header() -> None:
    """Cost follows bytes, not pieces: fed one byte per read, the layer hands each body byte on
    at once and never holds more than a partial frame header (or the HEADERS block it must
    decode), so nothing is re-copied as the stream grows. (A count, not a timing.)"""
    body = b"y" * 5_000
    wire = request_bytes(body)
    layer = bare_layer()
    emitted = 0
    for i in range(len(wire)):
        events = layer.handle_event(StreamDataReceived(wire[i : i + 1], i == len(wire) - 1, 0))
        emitted += sum(len(e.data) for e in events if isinstance(e, DataReceived))
        state = layer._requests.get(0)
        if state is not None:
            held = len(state.partial) + sum(len(piece) for piece in state.body)
            assert held <= 16, f"{held} bytes held after byte {i}"
            assert state.block is None or len(state.block) <= len(wire) - len(body)
    assert emitted == len(body)


def test_headers_split_bytewise_are_buffered_up_to_the_block_only() -> None:
    layer = bare_layer()
    wire = headers_frame([*REQUEST, (b"x-big", b"v" * 4000)])
    events = feed(layer, 0, [wire[i : i + 1] for i in range(len(wire))])
    assert events == [HeadersReceived(0, [*REQUEST, (b"x-big", b"v" * 4000)], True)]


# === message errors: stream errors, the connection lives on ===

MALFORMED = {
    "content-length not a number": (
        headers_frame([*REQUEST, (b"content-length", b"abc")]),
        True,
        400,
    ),
    "content-length negative": (headers_frame([*REQUEST, (b"content-length", b"-1")]), True, 400),
    "content-length with a plus sign": (
        headers_frame([*REQUEST, (b"content-length", b"+4")]),
        True,
        400,
    ),
    "content-length repeated with different values": (
        headers_frame([*REQUEST, (b"content-length", b"4"), (b"content-length", b"5")]),
        True,
        400,
    ),
    "body longer than content-length": (
        headers_frame(with_length(3)) + data_frame(b"abcd"),
        False,
        400,
    ),
    "body shorter than content-length at the FIN": (
        headers_frame(with_length(5)) + data_frame(b"abcd"),
        True,
        400,
    ),
    "content-length but no body": (headers_frame(with_length(5)), True, 400),
    "stream ends before HEADERS": (b"", True, 400),
    "stream ends after only an unknown frame": (frame(GREASE, b"zz"), True, 400),
    "pseudo-header in trailers": (
        headers_frame(REQUEST) + data_frame(b"ab") + headers_frame([(b":path", b"/x")]),
        True,
        400,
    ),
    "body shorter than content-length before trailers": (
        headers_frame(with_length(5)) + data_frame(b"ab") + headers_frame([(b"x-t", b"1")]),
        False,
        400,
    ),
    "header block over the limit": (
        headers_frame([*REQUEST, (b"x-big", b"v" * (2 * MAX_BLOCK))]),  # Huffman: 7 bits a "v"
        False,
        431,
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_request_is_a_stream_error_and_others_keep_working(case: str) -> None:
    wire, fin, status = MALFORMED[case]
    h = Harness()
    sid = h.next_request_stream()
    h.send(sid, wire, fin=fin)
    rejected = [e for e in h.of_stream(sid) if isinstance(e, MessageRejected)]
    assert [e.status for e in rejected] == [status], h.of_stream(sid)
    assert h.of_stream(sid)[-1] == rejected[0]  # nothing after the rejection
    # RFC 9114 4.1.1: the rest of the request is not wanted.
    assert h.stop_sending_seen(sid) == (None if fin else H3ErrorCode.H3_NO_ERROR)
    # Later input on the rejected stream is discarded unparsed, even garbage. (The peer's QUIC
    # has reset its side in answer to STOP_SENDING, so deliver it synthetically.)
    assert h.layer.handle_event(StreamDataReceived(b"\x04\x00" * 10, True, sid)) == []
    # The application answers it, and the connection carries on.
    h.layer.send_headers(sid, [(b":status", str(status).encode())], end_stream=True)
    h.complete_request()
    assert h.closed_with() is None


def test_repeated_equal_content_lengths_are_accepted() -> None:
    layer = bare_layer()
    headers = [*REQUEST, (b"content-length", b"2"), (b"content-length", b"02")]
    events = feed(layer, 0, [headers_frame(headers) + data_frame(b"ok")])
    assert summary(events) == (headers, b"ok", None, True)


def test_body_over_content_length_is_caught_when_exceeded_not_at_the_end() -> None:
    layer = bare_layer()
    partial_frame = data_frame(b"abcdefgh")[:7]  # 5 of 8 payload bytes: over the declared 4
    events = feed(layer, 0, [headers_frame(with_length(4)), partial_frame], fin=False)
    assert events[-1] == MessageRejected(0, 400, "request body exceeds its content-length")


def test_oversized_header_block_is_refused_unread_with_bounded_memory() -> None:
    layer = bare_layer()
    declared = 10_000_000
    header = encode_uint_var(0x1) + encode_uint_var(declared)
    chunk = b"\xff" * 65536  # garbage: decoding any of it would fail the connection
    tracemalloc.start()
    try:
        events = feed(layer, 0, [header], fin=False)
        for _ in range(declared // len(chunk)):
            events += layer.handle_event(StreamDataReceived(chunk, False, 0))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert events == [
        MessageRejected(0, 431, f"header block of {declared} bytes exceeds the limit")
    ]
    assert peak < 256 * 1024, peak  # ~150 ignored reads: nothing buffered, nothing decoded


def test_rejected_stream_state_goes_when_forgotten_after_the_fin() -> None:
    layer = bare_layer()
    feed(layer, 0, [headers_frame([*REQUEST, (b"content-length", b"x")])], fin=False)
    layer.forget(0)
    assert layer.open_streams == 1  # a marker until the peer ends its side
    assert feed(layer, 0, [b"more"], fin=True) == []
    assert layer.open_streams == 0


def test_forgotten_stream_is_not_read_as_a_new_request() -> None:
    layer = bare_layer()
    feed(layer, 0, [headers_frame(REQUEST)], fin=False)
    layer.forget(0)
    assert feed(layer, 0, [headers_frame(REQUEST)], fin=False) == []
    layer2 = bare_layer()
    feed(layer2, 0, [headers_frame(REQUEST)], fin=True)
    layer2.forget(0)
    assert layer2.open_streams == 0


# === connection errors ===


def _request(wire: bytes, fin: bool = True) -> list[tuple[str, bytes, bool]]:
    return [("request", wire, fin)]


def _uni(wire: bytes, fin: bool = False) -> list[tuple[str, bytes, bool]]:
    return [("uni", wire, fin)]


def _dynamic_table_block() -> bytes:
    encoder = pylsqpack.Encoder()
    encoder.apply_settings(4096, 16)
    encoder.encode(0, [(b"x-foo", b"bar")])
    _, dynamic = encoder.encode(4, [(b"x-foo", b"bar")])
    return dynamic


def _set_capacity(capacity: int) -> bytes:
    encoder = pylsqpack.Encoder()
    return encoder.apply_settings(capacity, 0)


CONNECTION_ERRORS = {
    # request streams (RFC 9114 4.1, 7.2)
    "DATA before HEADERS": (_request(data_frame(b"x")), H3ErrorCode.H3_FRAME_UNEXPECTED),
    **{
        f"frame 0x{t:x} on a request stream": (
            _request(headers_frame(REQUEST) + frame(t, b"\x00")),
            H3ErrorCode.H3_FRAME_UNEXPECTED,
        )
        for t in (0x3, 0x4, 0x5, 0x7, 0xD, 0x2, 0x6, 0x8, 0x9)
    },
    "HEADERS after trailers": (
        _request(headers_frame(REQUEST) + headers_frame([(b"x", b"1")]) + headers_frame(REQUEST)),
        H3ErrorCode.H3_FRAME_UNEXPECTED,
    ),
    "DATA after trailers": (
        _request(headers_frame(REQUEST) + headers_frame([(b"x", b"1")]) + data_frame(b"z")),
        H3ErrorCode.H3_FRAME_UNEXPECTED,
    ),
    "frame truncated by the FIN": (
        _request(headers_frame(REQUEST) + data_frame(b"abcdef")[:-2]),
        H3ErrorCode.H3_FRAME_ERROR,
    ),
    "frame header truncated by the FIN": (
        _request(headers_frame(REQUEST) + b"\x00\x7f"),
        H3ErrorCode.H3_FRAME_ERROR,
    ),
    "QPACK dynamic table reference": (
        _request(frame(0x1, _dynamic_table_block())),
        H3ErrorCode.QPACK_DECOMPRESSION_FAILED,
    ),
    "QPACK garbage": (
        _request(frame(0x1, b"\x00\x00\xff\xff")),
        H3ErrorCode.QPACK_DECOMPRESSION_FAILED,
    ),
    # control stream (RFC 9114 6.2.1, 7.2.4)
    "first control frame not SETTINGS": (
        _uni(b"\x00" + frame(0x7, encode_uint_var(0))),
        H3ErrorCode.H3_MISSING_SETTINGS,
    ),
    "first control frame unknown": (
        _uni(b"\x00" + frame(GREASE, b"")),
        H3ErrorCode.H3_MISSING_SETTINGS,
    ),
    "DATA on the control stream": (
        _uni(control_stream(data_frame(b"x"))),
        H3ErrorCode.H3_FRAME_UNEXPECTED,
    ),
    "HEADERS on the control stream": (
        _uni(control_stream(headers_frame(REQUEST))),
        H3ErrorCode.H3_FRAME_UNEXPECTED,
    ),
    "second SETTINGS": (_uni(control_stream(frame(0x4, b""))), H3ErrorCode.H3_FRAME_UNEXPECTED),
    "second control stream": (
        _uni(control_stream()) + _uni(control_stream()),
        H3ErrorCode.H3_STREAM_CREATION_ERROR,
    ),
    "push stream from the peer": (_uni(b"\x01\x00"), H3ErrorCode.H3_STREAM_CREATION_ERROR),
    "second QPACK encoder stream": (
        _uni(b"\x02") + _uni(b"\x02"),
        H3ErrorCode.H3_STREAM_CREATION_ERROR,
    ),
    "control stream closed": (
        _uni(control_stream(), fin=True),
        H3ErrorCode.H3_CLOSED_CRITICAL_STREAM,
    ),
    "QPACK encoder stream closed": (_uni(b"\x02", fin=True), H3ErrorCode.H3_CLOSED_CRITICAL_STREAM),
    "repeated setting": (
        _uni(control_stream(settings=settings_payload((0x6, 1), (0x6, 1)))),
        H3ErrorCode.H3_SETTINGS_ERROR,
    ),
    **{
        f"HTTP/2 setting 0x{key:x}": (
            _uni(control_stream(settings=settings_payload((key, 1)))),
            H3ErrorCode.H3_SETTINGS_ERROR,
        )
        for key in (0x2, 0x3, 0x4, 0x5)
    },
    "truncated SETTINGS payload": (
        _uni(b"\x00" + frame(0x4, b"\x06")),
        H3ErrorCode.H3_FRAME_ERROR,
    ),
    "SETTINGS frame absurdly long": (
        _uni(b"\x00" + encode_uint_var(0x4) + encode_uint_var(1 << 30)),
        H3ErrorCode.H3_EXCESSIVE_LOAD,
    ),
    "GOAWAY frame absurdly long": (
        _uni(control_stream(encode_uint_var(0x7) + encode_uint_var(1 << 40))),
        H3ErrorCode.H3_FRAME_ERROR,
    ),
    "GOAWAY with trailing bytes": (
        _uni(control_stream(frame(0x7, b"\x04\x00"))),
        H3ErrorCode.H3_FRAME_ERROR,
    ),
    "GOAWAY identifier increased": (
        _uni(control_stream(frame(0x7, b"\x04"), frame(0x7, b"\x08"))),
        H3ErrorCode.H3_ID_ERROR,
    ),
    # QPACK streams (RFC 9204 4.2, 4.3, 4.4)
    "encoder stream sets a capacity": (
        _uni(b"\x02" + _set_capacity(4096)),
        H3ErrorCode.QPACK_ENCODER_STREAM_ERROR,
    ),
    "decoder stream acknowledges an unknown section": (
        _uni(b"\x03\x80"),
        H3ErrorCode.QPACK_DECODER_STREAM_ERROR,
    ),
}


@pytest.mark.parametrize("case", list(CONNECTION_ERRORS))
def test_connection_error_closes_with_the_right_code(case: str) -> None:
    sends, code = CONNECTION_ERRORS[case]
    h = Harness()
    emitted: list[H3Event] = []
    for kind, wire, fin in sends:
        sid = h.next_request_stream() if kind == "request" else h.next_uni_stream()
        emitted += h.send(sid, wire, fin)
    assert h.closed_with() == code, case
    assert not [e for e in emitted if not isinstance(e, SettingsReceived | HeadersReceived)]
    # Closed: nothing more comes out of the layer.
    assert h.layer.handle_event(StreamDataReceived(headers_frame(REQUEST), True, 0)) == []


def test_connection_error_mid_read_emits_nothing_for_that_read() -> None:
    layer = bare_layer()
    assert feed(layer, 0, [headers_frame(REQUEST) + frame(0x4, b"")], fin=False) == []


def test_control_stream_reset_and_stop_sending_are_critical() -> None:
    h = Harness()
    sid = h.next_uni_stream()
    h.send(sid, control_stream())
    h.peer.quic.reset_stream(sid, 0x100)
    h.pump()
    assert h.closed_with() == H3ErrorCode.H3_CLOSED_CRITICAL_STREAM

    h = Harness()
    layer_control = h.layer_side.quic.get_next_available_stream_id(is_unidirectional=True) - 4
    h.peer.quic.stop_stream(layer_control, 0x100)
    h.pump()
    assert h.closed_with() == H3ErrorCode.H3_CLOSED_CRITICAL_STREAM


def test_zero_capacity_on_the_encoder_stream_and_stream_cancellation_are_fine() -> None:
    h = Harness()
    h.send(h.next_uni_stream(), b"\x02" + _set_capacity(0))
    h.send(h.next_uni_stream(), b"\x03\x40")  # Stream Cancellation for stream 0
    h.complete_request()
    assert h.closed_with() is None


# === unknown and reserved types are skipped ===


def test_unknown_frames_are_skipped_on_request_and_control_streams() -> None:
    h = Harness()
    h.send(h.next_uni_stream(), control_stream(frame(GREASE, b"g" * 100), frame(0x21, b"")))
    sid = h.next_request_stream()
    wire = (
        frame(GREASE, b"1")
        + headers_frame(with_length(4))
        + frame(0x21, b"")
        + data_frame(b"ab")
        + frame(GREASE, b"x" * 70000)
        + data_frame(b"cd")
        + headers_frame([(b"x-t", b"1")])
        + frame(GREASE, b"")
    )
    h.send(sid, wire, fin=True)
    assert summary(h.of_stream(sid)) == (with_length(4), b"abcd", [(b"x-t", b"1")], True)
    assert h.closed_with() is None


def test_large_unknown_frame_is_never_buffered() -> None:
    layer = bare_layer()
    size = 5_000_000
    chunk = b"\x00" * 65536
    tracemalloc.start()
    try:
        events = feed(layer, 0, [encode_uint_var(GREASE) + encode_uint_var(size)], fin=False)
        for _ in range(size // len(chunk)):
            events += layer.handle_event(StreamDataReceived(chunk, False, 0))
        rest = size % len(chunk)
        events += feed(layer, 0, [b"\x00" * rest + headers_frame(REQUEST)])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert events == [HeadersReceived(0, REQUEST, True)]
    assert peak < 256 * 1024, peak


def test_unknown_uni_stream_type_is_stopped_and_discarded() -> None:
    h = Harness()
    sid = h.next_uni_stream()
    h.send(sid, encode_uint_var(GREASE) + b"whatever" * 100)
    assert h.stop_sending_seen(sid) == H3ErrorCode.H3_STREAM_CREATION_ERROR
    h.complete_request()
    assert h.closed_with() is None


def test_uni_stream_type_split_across_reads_and_closed_early() -> None:
    layer = bare_layer()
    control = 2  # the client's first unidirectional stream
    wire = encode_uint_var(GREASE)  # two bytes
    assert feed(layer, 6, [wire[:1]], fin=True) == []  # closed before its type: tolerated
    events = feed(layer, control, split(control_stream(), [1]), fin=False)
    assert events == [SettingsReceived({})]


# === GOAWAY, SETTINGS ===


def test_goaway_sent_on_the_control_stream_parses_in_aioquic() -> None:
    h = Harness(peer_h3=True)
    h.complete_request()
    h.layer.send_goaway(4)
    h.layer.send_goaway(4)  # repeating the same limit is allowed
    h.pump()
    control = h.layer_side.quic.get_next_available_stream_id(is_unidirectional=True) - 4
    frames = parse_frames(h.peer_bytes(control)[1:])
    assert frames[0][0] == 0x4
    assert frames[1:] == [(0x7, b"\x04"), (0x7, b"\x04")]
    assert h.closed_with() is None


def test_goaway_refuses_ids_that_are_not_request_streams_or_increase() -> None:
    layer = bare_layer()
    with pytest.raises(ValueError, match="request stream"):
        layer.send_goaway(3)
    layer.send_goaway(8)
    with pytest.raises(ValueError, match="above"):
        layer.send_goaway(12)


def test_goaway_and_settings_received() -> None:
    h = Harness()
    h.send(
        h.next_uni_stream(),
        control_stream(
            frame(0x7, b"\x08"),
            frame(0x7, b"\x04"),
            settings=settings_payload((0x6, 99), (GREASE, 1)),
        ),
    )
    assert [e for e in h.events if not isinstance(e, HeadersReceived)] == [
        SettingsReceived({0x6: 99, GREASE: 1}),
        GoawayReceived(8),
        GoawayReceived(4),
    ]


def test_control_frames_split_bytewise() -> None:
    layer = bare_layer()
    wire = control_stream(
        frame(GREASE, b"skip me"),
        frame(0xD, encode_uint_var(10)),
        frame(0x3, encode_uint_var(1)),
        frame(0x7, encode_uint_var(400)),
        settings=settings_payload((0x1, 0), (0x6, 4096)),
    )
    events = feed(layer, 2, [wire[i : i + 1] for i in range(len(wire))], fin=False)
    assert events == [SettingsReceived({0x1: 0, 0x6: 4096}), GoawayReceived(400)]


# === aborts ===


def test_reset_stream_from_the_peer_is_stream_aborted_and_later_data_ignored() -> None:
    h = Harness()
    sid = h.next_request_stream()
    h.send(sid, headers_frame(with_length(10)) + data_frame(b"abc"))
    h.peer.quic.reset_stream(sid, H3ErrorCode.H3_REQUEST_CANCELLED)
    h.pump()
    assert h.of_stream(sid)[-1] == StreamAborted(sid, H3ErrorCode.H3_REQUEST_CANCELLED, True)
    assert h.layer.handle_event(StreamDataReceived(data_frame(b"zz"), False, sid)) == []
    h.complete_request()


def test_stop_sending_from_the_peer_is_stream_aborted_and_sending_raises_stream_gone() -> None:
    h = Harness()
    sid = h.next_request_stream()
    h.send(sid, headers_frame(REQUEST), fin=True)
    h.peer.quic.stop_stream(sid, H3ErrorCode.H3_REQUEST_CANCELLED)
    h.pump()
    assert h.of_stream(sid)[-1] == StreamAborted(sid, H3ErrorCode.H3_REQUEST_CANCELLED, False)
    with pytest.raises(StreamGone) as caught:
        h.layer.send_headers(sid, [(b":status", b"200")])
    assert caught.value.stream_id == sid
    h.complete_request()


def test_abort_before_headers_is_silent_and_leaves_no_state() -> None:
    layer = bare_layer()
    feed(layer, 0, [b"\x01"], fin=False)  # half a frame header
    assert layer.handle_event(StreamReset(error_code=0x10C, stream_id=0)) == []
    assert layer.open_streams == 0
    feed(layer, 4, [b"\x01"], fin=False)
    assert layer.handle_event(StopSendingReceived(error_code=0x10C, stream_id=4)) == []
    assert feed(layer, 4, [b"\x05" + block(REQUEST)[:5]], fin=True) == []
    assert layer.open_streams == 0


def test_our_reset_drops_input_and_later_sends_raise_stream_gone() -> None:
    h = Harness()
    sid = h.next_request_stream()
    h.send(sid, headers_frame(REQUEST))
    h.layer.reset_stream(sid, H3ErrorCode.H3_REQUEST_REJECTED)
    assert h.send(sid, data_frame(b"late"), fin=True) == []
    with pytest.raises(StreamGone):
        h.layer.send_data(sid, b"x", end_stream=True)
    resets = [e for e in h.peer_log if isinstance(e, StreamReset) and e.stream_id == sid]
    assert [e.error_code for e in resets] == [H3ErrorCode.H3_REQUEST_REJECTED]


def test_stop_receiving_sends_stop_sending_and_drops_input() -> None:
    h = Harness()
    sid = h.next_request_stream()
    h.send(sid, headers_frame(REQUEST))
    h.layer.stop_receiving(sid, H3ErrorCode.H3_NO_ERROR)
    assert h.send(sid, frame(0x4, b""), fin=True) == []  # would be a connection error if read
    assert h.stop_sending_seen(sid) == H3ErrorCode.H3_NO_ERROR
    h.layer.send_headers(sid, [(b":status", b"200")], end_stream=True)
    h.layer.forget(sid)
    assert h.layer.open_streams == 0
    h.complete_request()
    assert h.closed_with() is None


def test_sending_after_the_fin_raises_stream_gone() -> None:
    h = Harness()
    sid = h.complete_request()
    with pytest.raises(StreamGone):
        h.layer.send_data(sid, b"more", end_stream=False)


# === role independence ===


def test_layer_on_the_quic_client_serves_server_initiated_streams() -> None:
    h = Harness(layer_on_client=True)
    h.send(h.next_uni_stream(), control_stream(frame(0x7, b"\x05")))
    sid = h.next_request_stream()
    assert sid & 0x3 == 1  # a server-initiated bidirectional stream
    h.send(sid, request_bytes(b"reverse"), fin=True)
    assert summary(h.of_stream(sid)) == (with_length(7), b"reverse", None, True)
    assert GoawayReceived(5) in h.events

    h.layer.send_headers(sid, [(b":status", b"201")])
    h.layer.send_data(sid, b"done", end_stream=True)
    h.layer.send_goaway(sid + 4)
    h.pump()
    frames = parse_frames(h.peer_bytes(sid))
    assert frames[0][0] == 0x1
    assert pylsqpack.Decoder(0, 0).feed_header(sid, frames[0][1])[1] == [(b":status", b"201")]
    assert frames[1] == (0x0, b"done")
    control = h.layer_side.quic.get_next_available_stream_id(is_unidirectional=True) - 4
    assert control & 0x3 == 2  # the client's unidirectional stream
    assert parse_frames(h.peer_bytes(control)[1:])[-1] == (0x7, encode_uint_var(sid + 4))
    with pytest.raises(ValueError):
        h.layer.send_goaway(0)  # a client-initiated ID is not a request stream here
    assert h.closed_with() is None


def test_bidirectional_streams_of_our_own_role_are_not_requests() -> None:
    layer = bare_layer()  # a QUIC server: stream 1 would be one it opened itself
    assert feed(layer, 1, [request_bytes(b"x")]) == []
    assert layer.open_streams == 0


# === wire helpers ===

VARINTS = st.one_of(
    st.integers(0, 0x3F),
    st.integers(0, 0x3FFF),
    st.integers(0, 2**30 - 1),
    st.integers(0, 2**62 - 1),
)


@given(frame_type=VARINTS, length=VARINTS, tail=st.binary(max_size=3))
def test_frame_header_round_trips_every_integer_size(
    frame_type: int, length: int, tail: bytes
) -> None:
    wire = encode_uint_var(frame_type) + encode_uint_var(length)
    assert _frame_head(frame_type, length) == wire
    assert _frame_header(wire + tail, 0) == (frame_type, length, len(wire))
    assert _frame_header(b"\xff" + wire + tail, 1) == (frame_type, length, len(wire) + 1)
    for cut in range(len(wire)):
        assert _frame_header(wire[:cut], 0) is None


def test_non_minimal_integer_encodings_are_accepted() -> None:
    # RFC 9000 16 does not require the shortest encoding.
    assert _frame_header(b"\x00\x80\x00\x00\x05", 0) == (0, 5, 5)
    assert _frame_header(b"\x40\x01\x05", 0) == (1, 5, 3)
    layer = bare_layer()
    wire = b"\x40\x01" + b"\x80\x00\x00" + bytes([len(block(REQUEST))]) + block(REQUEST)
    wire += b"\x00\xc0" + b"\x00" * 6 + b"\x02" + b"ok"
    assert summary(feed(layer, 0, [wire])) == (REQUEST, b"ok", None, True)


def test_empty_frames() -> None:
    layer = bare_layer()
    wire = headers_frame(REQUEST) + data_frame(b"") + frame(GREASE, b"") + data_frame(b"a")
    assert summary(feed(layer, 0, [wire])) == (REQUEST, b"a", None, True)
    h = Harness()
    h.send(h.next_request_stream(), frame(0x1, b""), fin=True)
    assert h.closed_with() == H3ErrorCode.QPACK_DECOMPRESSION_FAILED
