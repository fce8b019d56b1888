"""RawQuicLayer: the raw-QUIC tunnel's request streams, on synthetic `StreamDataReceived` events
(any split, byte-at-a-time, property tests) and on a real in-memory QUIC pair (the response
side); `request_fields`, the head mapping, through pylon's own normaliser."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterable, Sequence

import pytest
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import StopSendingReceived, StreamDataReceived, StreamReset
from hypothesis import given, settings
from hypothesis import strategies as st

from pylon.core.errors import ClientError, ContractError, ErrorCode
from pylon.core.head import pseudo_head
from pylon.gateway.wire import FrameReader, RawBody, RawHeaders, decode_raw, encode_raw
from pylon.proxy.sink import send_problem
from pylon.server.quic_sink import SEND_HIGH_WATER, SEND_LOW_WATER
from pylon.server.rawquic import (
    MAX_MAP_ENTRIES,
    STOP_CANCELLED,
    DataReceived,
    HeadReceived,
    MessageRejected,
    RawEvent,
    RawQuicLayer,
    RawResponder,
    StreamAborted,
    StreamGone,
    TrailersReceived,
    body_frame,
    encode_head,
    request_fields,
)
from tests.unit.quic_pair import QuicPair, client_configuration

MAX_HEADER = 16 * 1024
MAX_BODY = 4 * 1024
SID = 1  # the first server-initiated bidirectional stream: a request on a reverse tunnel
Fields = list[tuple[bytes, bytes]]
REQUEST = (
    ("x-method", "POST"),
    ("x-path", "/v1/chat/completions"),
    ("content-type", "application/json"),
    ("x-request-id", "req-1"),
)


def headers(fields: Iterable[tuple[str, str]] = REQUEST, trailers: bool = False) -> bytes:
    return encode_raw(RawHeaders(tuple(fields), trailers=trailers))


def body(content: bytes) -> bytes:
    return encode_raw(RawBody(content))


def as_bytes(fields: Iterable[tuple[str, str]]) -> Fields:
    return [(name.encode(), value.encode()) for name, value in fields]


def bare_layer(max_header: int = MAX_HEADER, max_body: int = MAX_BODY) -> RawQuicLayer:
    """A layer on a client connection that never sees a packet (synthetic events only)."""
    quic = QuicConnection(configuration=client_configuration())
    return RawQuicLayer(quic, max_header_message=max_header, max_body_message=max_body)


def feed(
    layer: RawQuicLayer, chunks: Iterable[bytes], fin: bool = True, sid: int = SID
) -> list[RawEvent]:
    pieces = list(chunks)
    events: list[RawEvent] = []
    for index, piece in enumerate(pieces):
        last = index == len(pieces) - 1
        events += layer.handle_event(StreamDataReceived(piece, fin and last, sid))
    if fin and not pieces:
        events += layer.handle_event(StreamDataReceived(b"", True, sid))
    return events


def split(data: bytes, cuts: Iterable[int]) -> list[bytes]:
    points = sorted({cut for cut in cuts if 0 < cut < len(data)})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


def summary(events: Sequence[RawEvent]) -> tuple[Fields | None, bytes, Fields | None, bool]:
    head = trailers = None
    content = b""
    ended = False
    for event in events:
        if isinstance(event, HeadReceived):
            assert head is None
            head, ended = event.fields, event.stream_ended
        elif isinstance(event, DataReceived):
            assert head is not None and not ended
            content += event.data
            ended = event.stream_ended
        elif isinstance(event, TrailersReceived):
            assert not ended
            trailers, ended = event.fields, True
        else:
            raise AssertionError(f"unexpected {event}")
    return head, content, trailers, ended


# --- framing ---


def test_head_body_trailers_in_one_piece() -> None:
    wire = headers() + body(b"{}") + body(b"") + headers([("x-t", "1")], trailers=True)
    head, content, trailers, ended = summary(feed(bare_layer(), [wire]))
    assert head == as_bytes(REQUEST)
    assert content == b"{}"
    assert trailers == [(b"x-t", b"1")]
    assert ended


def test_head_alone_with_fin() -> None:
    events = feed(bare_layer(), [headers()])
    assert events == [HeadReceived(SID, as_bytes(REQUEST), True)]


def test_names_are_lowercased_values_kept() -> None:
    events = feed(bare_layer(), [headers([("X-Method", "GET"), ("Content-Type", "A/B")])])
    assert isinstance(events[0], HeadReceived)
    assert events[0].fields == [(b"x-method", b"GET"), (b"content-type", b"A/B")]


def test_multi_valued_headers_stay_separate_entries_in_order() -> None:
    fields = [("x-method", "GET"), ("x-a", "1"), ("x-b", "2"), ("x-a", "3")]
    events = feed(bare_layer(), [headers(fields)])
    assert isinstance(events[0], HeadReceived)
    assert events[0].fields == as_bytes(fields)


@st.composite
def messages(draw: st.DrawFn) -> tuple[bytes, Fields, bytes, Fields | None]:
    text = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=12)
    fields = draw(st.lists(st.tuples(text, text), max_size=6))
    chunks = draw(st.lists(st.binary(max_size=300), max_size=5))
    trailer_fields = draw(st.none() | st.lists(st.tuples(text, text), max_size=3))
    wire = headers(fields) + b"".join(body(chunk) for chunk in chunks)
    if trailer_fields is not None:
        wire += headers(trailer_fields, trailers=True)
    lowered = [(n.lower().encode(), v.encode()) for n, v in fields]
    trailers = None
    if trailer_fields is not None:
        trailers = [(n.lower().encode(), v.encode()) for n, v in trailer_fields]
    return wire, lowered, b"".join(chunks), trailers


@settings(max_examples=150, deadline=None)
@given(messages(), st.lists(st.integers(min_value=0, max_value=3000), max_size=12))
def test_any_split_gives_the_same_request(
    message: tuple[bytes, Fields, bytes, Fields | None], cuts: list[int]
) -> None:
    wire, fields, content, trailers = message
    assert summary(feed(bare_layer(), split(wire, cuts))) == (fields, content, trailers, True)


def test_byte_at_a_time_gives_the_same_request() -> None:
    wire = headers() + body(b"x" * 100) + body(b"y" * 3) + headers([("a", "b")], trailers=True)
    pieces = [wire[i : i + 1] for i in range(len(wire))]
    layer = bare_layer()
    assert summary(feed(layer, pieces)) == (
        as_bytes(REQUEST),
        b"x" * 100 + b"y" * 3,
        [(b"a", b"b")],
        True,
    )
    assert layer.buffered(SID) == 0


def test_body_arrives_as_it_comes_not_at_the_end() -> None:
    layer = bare_layer()
    assert feed(layer, [headers()], fin=False) == [HeadReceived(SID, as_bytes(REQUEST), False)]
    assert feed(layer, [body(b"abc")], fin=False) == [DataReceived(SID, b"abc", False)]
    assert feed(layer, [], fin=True) == [DataReceived(SID, b"", True)]


# --- caps: refused before anything is buffered ---


def announce(words: int) -> bytes:
    """A single-segment table announcing `words` words (no content yet)."""
    return struct.pack("<II", 0, words)


def test_oversized_headers_refused_at_the_segment_table() -> None:
    layer = bare_layer()
    events = feed(layer, [announce(MAX_HEADER // 8 + 1)], fin=False)
    assert len(events) == 1 and isinstance(events[0], MessageRejected)
    assert events[0].status == 431
    assert layer.buffered(SID) == 0
    # The rest of the stream is dropped unread.
    assert feed(layer, [b"\x00" * 100_000], fin=True) == []


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=MAX_HEADER // 8 + 1, max_value=2**32 - 1), st.integers(1, 7))
def test_any_announced_oversize_is_refused_with_nothing_held(words: int, first: int) -> None:
    layer = bare_layer()
    table = announce(words)
    events = feed(layer, [table[:first]], fin=False)
    assert events == [] and layer.buffered(SID) == first
    events = feed(layer, [table[first:] + b"\x00" * 64], fin=False)
    assert [type(e) for e in events] == [MessageRejected]
    assert layer.buffered(SID) == 0


def test_oversized_body_message_refused_413_unread() -> None:
    # After the head a message may be a body chunk or the trailers: what is announced over both
    # caps is refused before it is read.
    layer = bare_layer()
    events = feed(layer, [headers(), announce(MAX_HEADER // 8 + 8)], fin=False)
    assert isinstance(events[0], HeadReceived)
    assert isinstance(events[1], MessageRejected) and events[1].status == 413
    assert layer.buffered(SID) == 0


def test_body_message_over_its_cap_refused_413() -> None:
    layer = bare_layer()
    events = feed(layer, [headers(), body(b"x" * MAX_BODY)], fin=False)
    assert isinstance(events[1], MessageRejected) and events[1].status == 413


def test_body_chunk_at_the_cap_passes() -> None:
    content = b"z" * (MAX_BODY - 8 - 32)
    assert len(body(content)) == MAX_BODY
    assert summary(feed(bare_layer(), [headers(), body(content)]))[1] == content


def test_too_many_entries_431() -> None:
    fields = [("x-method", "GET"), ("x-path", "/")] + [("x", "")] * (MAX_MAP_ENTRIES - 1)
    layer = bare_layer(max_header=1 << 20)
    events = feed(layer, [headers(fields)])
    assert isinstance(events[0], MessageRejected) and events[0].status == 431


def test_too_many_segments_is_malformed() -> None:
    events = feed(bare_layer(), [struct.pack("<I", 100) + b"\x00" * 404])
    assert isinstance(events[0], MessageRejected) and events[0].status == 400


# --- malformed streams: a 400 on that stream ---


@pytest.mark.parametrize(
    ("wire", "why"),
    [
        (body(b"x"), "body before headers"),
        (headers([("a", "b")], trailers=True), "trailers before headers"),
        (headers() + headers(), "second headers"),
        (headers() + headers([], trailers=True) + body(b"x"), "body after trailers"),
        (headers() + headers([], trailers=True) + headers([], trailers=True), "two trailers"),
        (headers()[:-3], "truncated by the FIN"),
        (b"", "FIN before headers"),
        (struct.pack("<II", 0, 2) + b"\xff" * 16, "not a Message"),
    ],
)
def test_malformed_is_rejected_400(wire: bytes, why: str) -> None:
    events = feed(bare_layer(), [wire] if wire else [])
    assert isinstance(events[-1], MessageRejected), why
    assert events[-1].status == 400, why
    assert [e for e in events if isinstance(e, MessageRejected | TrailersReceived)][-1] == events[
        -1
    ]


def test_nothing_is_reported_after_a_rejection() -> None:
    layer = bare_layer()
    feed(layer, [body(b"x")], fin=False)
    assert feed(layer, [headers(), body(b"y")], fin=False) == []
    assert layer.handle_event(StreamReset(error_code=0, stream_id=SID)) == []


# --- aborts ---


def test_reset_is_reported_once() -> None:
    layer = bare_layer()
    feed(layer, [headers()], fin=False)
    events = layer.handle_event(StreamReset(error_code=7, stream_id=SID))
    assert events == [StreamAborted(SID, 7, True)]
    assert feed(layer, [body(b"late")], fin=True) == []


def test_stop_sending_is_reported() -> None:
    layer = bare_layer()
    feed(layer, [headers()])
    assert layer.handle_event(StopSendingReceived(error_code=1, stream_id=SID)) == [
        StreamAborted(SID, 1, False)
    ]


def test_own_streams_are_not_requests() -> None:
    layer = bare_layer()
    # Stream 0: pylon's handshake; stream 3: a gateway unidirectional stream.
    assert layer.handle_event(StreamDataReceived(headers(), True, 0)) == []
    assert layer.handle_event(StreamDataReceived(headers(), True, 3)) == []
    assert layer.open_streams == 0


def test_forget_keeps_a_marker_until_the_fin() -> None:
    layer = bare_layer()
    feed(layer, [headers()], fin=False)
    layer.forget(SID)
    assert layer.open_streams == 1
    assert feed(layer, [body(b"x")], fin=True) == []
    assert layer.open_streams == 0


# --- encoding ---


@given(st.binary(max_size=100))
def test_body_frame_is_a_standard_body_message(content: bytes) -> None:
    prefix, padding = body_frame(len(content))
    assert prefix + content + padding == encode_raw(RawBody(content))
    assert decode_raw(prefix + content + padding) == RawBody(content)


def test_head_carries_x_status_first() -> None:
    message = decode_raw(encode_head(404, [(b"content-type", b"application/problem+json")]))
    assert message == RawHeaders(
        (("x-status", "404"), ("content-type", "application/problem+json"))
    )


# --- the response side, on a real QUIC pair ---


def test_response_messages_reach_the_gateway() -> None:
    pair = QuicPair().connect()
    pylon, gateway = pair.client, pair.server
    layer = RawQuicLayer(pylon.quic, max_header_message=MAX_HEADER, max_body_message=MAX_BODY)
    sid = gateway.quic.get_next_available_stream_id()
    assert sid == SID
    gateway.quic.send_stream_data(sid, headers(), end_stream=True)
    pair.pump()
    events = [e for q in pylon.take_events() for e in layer.handle_event(q)]
    assert events == [HeadReceived(sid, as_bytes(REQUEST), True)]
    layer.send_head(sid, 200, [(b"content-type", b"text/event-stream")])
    layer.send_data(sid, b"data: 1\n\n")
    layer.send_data(sid, b"data: 2\n\n", end_stream=True)
    pair.pump()
    received = b""
    fin = False
    for event in gateway.take_events():
        if isinstance(event, StreamDataReceived) and event.stream_id == sid:
            received += event.data
            fin = fin or event.end_stream
    assert fin
    out = [decode_raw(m) for m in FrameReader(1 << 20).feed(received)]
    assert out == [
        RawHeaders((("x-status", "200"), ("content-type", "text/event-stream"))),
        RawBody(b"data: 1\n\n"),
        RawBody(b"data: 2\n\n"),
    ]
    with pytest.raises(StreamGone):
        layer.send_data(sid, b"more")
    layer.forget(sid)
    assert layer.open_streams == 0


def test_reset_stream_reaches_the_gateway() -> None:
    pair = QuicPair().connect()
    pylon, gateway = pair.client, pair.server
    layer = RawQuicLayer(pylon.quic, max_header_message=MAX_HEADER, max_body_message=MAX_BODY)
    sid = gateway.quic.get_next_available_stream_id()
    gateway.quic.send_stream_data(sid, headers(), end_stream=False)
    pair.pump()
    for event in pylon.take_events():
        layer.handle_event(event)
    layer.reset_stream(sid, STOP_CANCELLED)
    pair.pump()
    kinds = {type(e).__name__ for e in gateway.take_events()}
    assert {"StreamReset", "StopSendingReceived"} <= kinds


# --- the head mapping ---

AUTHORITY = b"tunnel.test"


def head_of(fields: Fields) -> tuple[bytes, bytes, list[tuple[bytes, bytes]]]:
    head = pseudo_head(request_fields(fields, AUTHORITY))
    return head.method, head.target, head.headers


def test_x_method_and_x_path_become_the_request_line() -> None:
    method, target, fields = head_of(as_bytes(REQUEST))
    assert (method, target) == (b"POST", b"/v1/chat/completions")
    assert fields[0] == (b"host", AUTHORITY)  # no host forwarded: the stand-in authority
    assert (b"x-method", b"POST") not in fields and not [n for n, _ in fields if n[:1] == b":"]


def test_a_forwarded_host_is_kept() -> None:
    _, _, fields = head_of([*as_bytes(REQUEST), (b"host", b"api.example")])
    assert [v for n, v in fields if n == b"host"] == [b"api.example"]


def test_pseudo_entries_may_come_anywhere() -> None:
    method, target, _ = head_of([(b"a", b"1"), (b"x-path", b"/x"), (b"x-method", b"GET")])
    assert (method, target) == (b"GET", b"/x")


@pytest.mark.parametrize(
    "fields",
    [
        [(b"x-path", b"/")],  # no x-method
        [(b"x-method", b"GET")],  # no x-path
        [(b"x-method", b"GET"), (b"x-path", b"v1/models")],  # not origin-form
        [(b"x-method", b"G T"), (b"x-path", b"/")],  # not a token
        [(b"x-method", b"GET"), (b"x-path", b"/"), (b"connection", b"close")],
        [(b"x-method", b"GET"), (b"x-path", b"/"), (b"x-a", b" padded")],
    ],
)
def test_bad_heads_are_refused_by_the_normaliser(fields: Fields) -> None:
    with pytest.raises(ContractError):
        head_of(fields)


@pytest.mark.parametrize(
    "fields",
    [
        [(b"x-method", b"GET"), (b"x-path", b"/"), (b":authority", b"a")],
        [(b":method", b"GET"), (b"x-path", b"/")],
        [(b"x-method", b"GET"), (b"x-path", b"/"), (b"a:b", b"c")],
    ],
)
def test_raw_specific_violations_are_malformed(fields: Fields) -> None:
    with pytest.raises(ContractError, match="malformed"):
        request_fields(fields, AUTHORITY)


def test_the_gateways_framing_entries_win_over_the_clients_own() -> None:
    """The gateway writes x-method and x-path first and appends the client's headers as they
    came: a client's own X-Method / X-Path never steers the request, and its X-Status is an
    ordinary header (as on every other transport)."""
    fields = [
        (b"x-method", b"POST"),
        (b"x-path", b"/v1/chat/completions"),
        (b"x-method", b"GET"),
        (b"x-path", b"/admin"),
        (b"x-status", b"200"),
    ]
    block = request_fields(fields, AUTHORITY)
    assert (b":method", b"POST") in block and (b":path", b"/v1/chat/completions") in block
    assert (b":method", b"GET") not in block and (b":path", b"/admin") not in block
    assert [name for name, _ in block].count(b"x-method") == 0
    assert (b"x-status", b"200") in block


# --- the response sink, against a stand-in of the connection ---


class StandInLayer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []

    def send_head(self, sid: int, status: int, fields: list[tuple[bytes, bytes]]) -> None:
        self.sent.append(("head", (status, dict(fields))))

    def send_data(self, sid: int, data: bytes, end_stream: bool = False) -> None:
        self.sent.append(("data", (data, end_stream)))

    def end(self, sid: int) -> None:
        self.sent.append(("end", None))


class StandInConnection:
    def __init__(self) -> None:
        self.scheduled: list[RawResponder] = []
        self.unacked = 0
        self.forgotten: list[int] = []

    def schedule(self, responder: RawResponder) -> None:
        self.scheduled.append(responder)

    def backlog(self, sid: int) -> int:
        return self.unacked

    def forget_stream(self, sid: int) -> None:
        self.forgotten.append(sid)


def test_sink_frames_head_content_and_end_in_one_flush() -> None:
    conn = StandInConnection()
    responder = RawResponder(conn, SID)  # type: ignore[arg-type]
    send_problem(responder, ClientError("no x-model", code=ErrorCode.MISSING_MODEL))
    layer = StandInLayer()
    responder.flush(layer)  # type: ignore[arg-type]
    kinds = [kind for kind, _ in layer.sent]
    assert kinds == ["head", "data"]
    status, fields = layer.sent[0][1]  # type: ignore[misc]
    data, ended = layer.sent[1][1]  # type: ignore[misc]
    assert status == 400 and int(fields[b"content-length"]) == len(data) and ended
    assert conn.forgotten == [SID] and responder.closed


def test_the_answer_to_a_head_request_has_no_content() -> None:
    conn = StandInConnection()
    responder = RawResponder(conn, SID, is_head=True)  # type: ignore[arg-type]
    send_problem(responder, ClientError("no x-model", code=ErrorCode.MISSING_MODEL))
    layer = StandInLayer()
    responder.flush(layer)  # type: ignore[arg-type]
    assert [kind for kind, _ in layer.sent] == ["head", "end"]


async def test_sink_pauses_above_the_high_water_mark_until_woken() -> None:
    conn = StandInConnection()
    responder = RawResponder(conn, SID)  # type: ignore[arg-type]
    responder.start(200, [], None)
    responder.write(b"x" * (SEND_HIGH_WATER + 1))
    conn.unacked = SEND_HIGH_WATER + 1
    assert responder.paused
    waiting = asyncio.ensure_future(responder.drain())
    await asyncio.sleep(0)
    assert not waiting.done()
    conn.unacked = SEND_LOW_WATER
    responder.wake(None)
    async with asyncio.timeout(1):
        await waiting
    assert not responder.paused


async def test_a_paused_sink_fails_when_the_connection_goes() -> None:
    conn = StandInConnection()
    responder = RawResponder(conn, SID)  # type: ignore[arg-type]
    conn.unacked = SEND_HIGH_WATER * 2
    waiting = asyncio.ensure_future(responder.drain())
    await asyncio.sleep(0)
    responder.wake(ConnectionResetError("gone"))
    with pytest.raises(ConnectionResetError):
        async with asyncio.timeout(1):
            await waiting
