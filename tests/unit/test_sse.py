"""SSE splitting is independent of how the bytes are cut (style P10)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pylon.core.sse import (
    SseEventTooLarge,
    SseSplitter,
    _is_output_event,
    error_event,
    is_output_event,
)

LIMIT = 1 << 20


def feed_all(pieces: list[bytes], limit: int = LIMIT) -> tuple[list[bytes], bytes]:
    splitter = SseSplitter(limit)
    events: list[bytes] = []
    for piece in pieces:
        events.extend(splitter.feed(piece))
    return events, splitter.pending


def cut(data: bytes, points: list[int]) -> list[bytes]:
    bounds = sorted({0, len(data), *(p % (len(data) + 1) for p in points)})
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


_line = st.text(
    st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)), max_size=20
).map(str.encode)


@st.composite
def event_stream(draw) -> tuple[bytes, list[bytes], bytes]:
    """(stream bytes, the events, trailing unterminated bytes)."""
    eol = draw(st.sampled_from([b"\n", b"\r\n"]))
    events = []
    for _ in range(draw(st.integers(0, 6))):
        lines = draw(
            st.lists(
                st.sampled_from([b"data: ", b"event: ", b": ", b"id: "]).flatmap(
                    lambda f: _line.map(lambda t, f=f: f + t)
                ),
                min_size=1,
                max_size=4,
            )
        )
        events.append(eol.join(lines) + eol + eol)
    tail = draw(st.sampled_from([b"", b"data: partial"]))
    return b"".join(events) + tail, events, tail


@settings(max_examples=300, deadline=None)
@given(event_stream(), st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_any_chunking_gives_identical_events(stream, points) -> None:
    data, events, tail = stream
    whole, pending = feed_all([data])
    assert (whole, pending) == (events, tail)
    assert feed_all(cut(data, points)) == (events, tail)
    assert feed_all([data[i : i + 1] for i in range(len(data))]) == (events, tail)


@pytest.mark.parametrize("eol", [b"\n", b"\r\n"])
def test_one_byte_pieces(eol: bytes) -> None:
    data = b"data: a" + eol + b"data: b" + eol + eol + b": keepalive" + eol + eol
    events, pending = feed_all([data[i : i + 1] for i in range(len(data))])
    assert events == [b"data: a" + eol + b"data: b" + eol + eol, b": keepalive" + eol + eol]
    assert pending == b""


def test_too_large_unterminated_event() -> None:
    splitter = SseSplitter(64)
    assert splitter.feed(b"data: " + b"x" * 58) == []  # exactly 64 pending: still fine
    with pytest.raises(SseEventTooLarge):
        splitter.feed(b"x")


def test_too_large_byte_by_byte() -> None:
    splitter = SseSplitter(64)
    with pytest.raises(SseEventTooLarge):
        for _ in range(100):
            splitter.feed(b"y")


def test_limit_is_per_event_not_per_stream() -> None:
    splitter = SseSplitter(64)
    total = 0
    for _ in range(1000):
        total += len(splitter.feed(b"data: " + b"z" * 40 + b"\n\n"))
    assert total == 1000


@pytest.mark.parametrize(
    ("event", "output"),
    [
        (b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n', True),
        (b"event: message\ndata: x\n\n", True),
        (b"id: 1\r\ndata: x\r\n\r\n", True),
        (b"data:x\n\n", True),
        (b": keep-alive\n\n", False),
        (b"event: ping\n\n", False),
        (b"id: 7\n\n", False),
        (b'event: response.created\ndata: {"type":"response.created"}\n\n', False),
        (b"event:response.created\ndata: {}\n\n", False),
        (b'data: {"type":"response.created","response":{}}\n\n', False),
        (b'data: {"type": "response.created"}\n\n', False),
        (b"event: response.in_progress\ndata: {}\n\n", False),
        (b'data: {"type":"response.in_progress"}\n\n', False),
        (
            b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta"}\n\n',
            True,
        ),
        (b"xdata: no\n\n", False),
        (b"data: [DONE]\n\n", False),
        (b"data:\n\n", False),
    ],
)
def test_is_output_event(event: bytes, output: bool) -> None:
    assert is_output_event(event) is output


_SSE_PIECES = st.sampled_from(
    [
        b"data:",
        b"data: ",
        b"event: ",
        b"\n",
        b"\r",
        b" ",
        b"[DONE]",
        b'"type"',
        b":",
        b'"',
        b"response.created",
        b"response.queued",
        b"x",
        b"{",
        b"}",
        b"\t",
        b"id: 1",
    ]
)


@given(st.lists(_SSE_PIECES, max_size=12))
def test_the_one_data_line_fast_path_answers_as_the_general_reading(pieces: list[bytes]) -> None:
    """`is_output_event` reads the common event without regexes; every event, whatever it
    holds, must get the general reading's answer (a blank line ends each, as the splitter
    delivers them)."""
    event = b"".join(pieces) + b"\n\n"
    assert is_output_event(event) is _is_output_event(event)


@given(st.binary(max_size=40))
def test_the_fast_path_matches_the_general_reading_on_any_data_line(value: bytes) -> None:
    event = b"data:" + value + b"\n\n"
    assert is_output_event(event) is _is_output_event(event)


def test_error_event_is_one_complete_event() -> None:
    event = error_event(b'{"code":"upstream_timeout"}')
    assert feed_all([event]) == ([event], b"")
    assert event.startswith(b"event: error\n")


@pytest.mark.parametrize(
    "name",
    [
        b"response.created",
        b"response.in_progress",
        b"response.queued",
    ],
)
def test_bookkeeping_events_in_every_spelling(name: bytes) -> None:
    spellings = [
        b"event: " + name + b"\ndata: {}\n\n",
        b"event:" + name + b"\ndata: {}\n\n",
        b'data: {"type":"' + name + b'"}\n\n',
        b'data: {"type": "' + name + b'"}\n\n',
    ]
    assert [is_output_event(e) for e in spellings] == [False] * 4


def test_an_event_in_one_byte_pieces_is_held_in_one_growing_buffer() -> None:
    """Cost follows bytes, not pieces: the unterminated part is extended in place, never
    re-copied per piece (which would make a 1 MiB event in 1-byte pieces cost ~10^12 bytes)."""
    splitter = SseSplitter(max_event_bytes=1 << 20)
    assert splitter.feed_block(b"d") == b""
    held = splitter._pending
    for byte in b"ata: " + b"x" * 10_000:
        assert splitter.feed_block(bytes([byte])) == b""
        assert splitter._pending is held
    assert splitter.feed_block(b"\n") == b""
    assert splitter.feed_block(b"\nda") == b"data: " + b"x" * 10_000 + b"\n\n"
    assert splitter.pending == b"da"


def test_three_lfs_in_a_row_end_one_event_and_begin_the_next() -> None:
    """An odd run of LFs: its blank line ends the event, its last LF opens the next one. (The
    LF-only search once ended the block after the whole run, and `iter_events` then met a
    lone LF and raised: tests/unit/test_fast_equals_slow.py holds the two searches equal.)"""
    events = [b"data: x\n\n", b"\ndata: y\n\n"]
    assert feed_all([b"data: x\n\n\n", b"data: y\n\n"]) == (events, b"")
    assert feed_all([b"data: x\n\n\n\n\n"]) == ([b"data: x\n\n", b"\n\n"], b"\n")
