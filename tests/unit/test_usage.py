"""Token counts from a response (`pylon.core.usage`): the engine's usage report, found wherever
the document puts it and however it is spaced, and the data-event estimate of a stream."""

from __future__ import annotations

import itertools
import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pylon.core.usage import USAGE_WINDOW, Usage, data_events, usage_at_end, usage_of

# Any JSON text, including what looks like a usage object inside a string.
_text = st.one_of(
    st.text(max_size=30),
    st.sampled_from(['"usage": {"prompt_tokens": 9}', '{"usage":{}}', "}", "{", '\\"', "\n\n"]),
)
_scalar = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), _text)
_value = st.recursive(
    _scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.text(max_size=8).filter(lambda k: k != "usage"), inner, max_size=4),
    ),
    max_leaves=12,
)
_count = st.integers(0, 10**9)


@st.composite
def usage_object(draw: st.DrawFn) -> tuple[dict[str, Any], Usage]:
    """A usage object in one of the engines' vocabularies, maybe with nested details."""
    vocabulary = draw(
        st.sampled_from([("prompt_tokens", "completion_tokens"), ("input_tokens", "output_tokens")])
    )
    usage: dict[str, Any] = {}
    expected_in = expected_out = None
    if draw(st.booleans()):
        expected_in = usage[vocabulary[0]] = draw(_count)
    if draw(st.booleans()) or expected_in is None:
        expected_out = usage[vocabulary[1]] = draw(_count)
    usage["total_tokens"] = draw(_count)
    if draw(st.booleans()):
        usage["prompt_tokens_details"] = {"cached_tokens": draw(_count), "note": draw(_text)}
    if draw(st.booleans()):
        usage["completion_tokens_details"] = None
    return usage, (expected_in, expected_out)


def dumps(value: Any, spaced: bool) -> bytes:
    if spaced:
        return json.dumps(value).encode()  # ", " and ": ", as Python's json writes them
    return orjson.dumps(value)


@settings(max_examples=400, deadline=None)
@given(
    st.dictionaries(st.text(max_size=8).filter(lambda k: k != "usage"), _value, max_size=5),
    usage_object(),
    st.booleans(),
    st.booleans(),
)
def test_the_usage_of_any_body_is_found(
    body: dict[str, Any], usage: tuple[dict[str, Any], Usage], spaced: bool, nested: bool
) -> None:
    """Top level (chat, completions, embeddings) or inside `response` (Responses API events),
    whatever else the document holds, compact or spaced."""
    document: dict[str, Any] = {**body, "usage": usage[0]}
    if nested:
        document = {"type": "response.completed", "response": document}
    assert usage_of(dumps(document, spaced)) == usage[1]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=12), max_size=8), usage_object(), st.booleans())
def test_the_last_usage_of_a_stream_wins(
    tokens: list[str], usage: tuple[dict[str, Any], Usage], spaced: bool
) -> None:
    """OpenAI streams say `"usage": null` in every chunk but the last one."""
    events = [
        b"data: " + dumps({"choices": [{"delta": {"content": t}}], "usage": None}, spaced) + b"\n\n"
        for t in tokens
    ]
    events.append(b"data: " + dumps({"choices": [], "usage": usage[0]}, spaced) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    stream = b"".join(events)
    assert usage_of(stream) == usage[1]
    cut = len(stream) // 2
    if len(stream) - cut <= USAGE_WINDOW:
        assert usage_at_end(stream[:cut], stream[cut:]) == usage[1]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=300))
def test_any_bytes_are_safe(previous: bytes, last: bytes) -> None:
    usage_of(previous + last)
    usage_at_end(previous, last)
    data_events(last)


@settings(max_examples=200, deadline=None)
@given(st.lists(_value, max_size=6))
def test_no_usage_means_none(values: list[Any]) -> None:
    assert usage_of(orjson.dumps(values)) is None


@pytest.mark.parametrize(
    "body",
    [
        b'{"usage": null}',
        b'{"usage": {}}',
        b'{"usage": {"prompt_tokens": "12"}}',
        b'{"usage": {"completion_tokens": -1}}',
        b'{"usage": {"completion_tokens": true}}',
        b'{"usage": {"completion_tokens": 1.5}}',
        b'{"usage": [1, 2]}',
        b'{"usage": {"completion_tokens": 3',  # cut before its end
        b'{"content": "\\"usage\\": {\\"completion_tokens\\": 3}"}',  # text, not a key
    ],
)
def test_no_countable_usage(body: bytes) -> None:
    assert usage_of(body) is None


def test_only_the_window_at_the_end_is_read() -> None:
    usage = b'{"usage":{"prompt_tokens":3,"completion_tokens":4}}'
    assert usage_at_end(b"", usage + b" " * (USAGE_WINDOW - len(usage))) == (3, 4)
    assert usage_at_end(b"", usage + b" " * USAGE_WINDOW) is None
    assert usage_at_end(usage, b"x" * (USAGE_WINDOW - len(usage))) == (3, 4)
    assert usage_at_end(usage + b"xx", b"x" * (USAGE_WINDOW - len(usage))) is None  # key cut


@st.composite
def sse_stream(draw: st.DrawFn) -> tuple[list[bytes], int]:
    """Whole SSE events (chat chunks, named events, comments), and how many carry data."""
    eol = draw(st.sampled_from([b"\n", b"\r\n"]))
    events: list[bytes] = []
    with_data = 0
    for _ in range(draw(st.integers(0, 12))):
        kind = draw(st.sampled_from(["chunk", "named", "comment"]))
        if kind == "comment":
            events.append(b": keep-alive" + eol + eol)
            continue
        payload = dumps({"choices": [{"delta": {"content": draw(st.text(max_size=10))}}]}, False)
        head = b"event: response.output_text.delta" + eol if kind == "named" else b""
        events.append(head + b"data: " + payload + eol + eol)
        with_data += 1
    if draw(st.booleans()):
        events.append(b"data: [DONE]" + eol + eol)
    return events, with_data


@settings(max_examples=300, deadline=None)
@given(sse_stream(), st.lists(st.integers(0, 20), max_size=5))
def test_data_events_counts_every_data_event_but_done(
    stream: tuple[list[bytes], int], cuts: list[int]
) -> None:
    """However the relay's blocks cut the stream (at event boundaries), the counts add up."""
    events, expected = stream
    bounds = sorted({0, len(events), *(c % (len(events) + 1) for c in cuts)})
    blocks = [b"".join(events[a:b]) for a, b in itertools.pairwise(bounds)]
    assert sum(data_events(block) for block in blocks) == expected
