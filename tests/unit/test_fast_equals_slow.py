"""Every measured fast path beside a general one answers as the general one (issue 16).

Each test is named `test_<fast path>_is_<general reading>` and drives both on generated inputs.
Pairs held equal elsewhere (not repeated here):
- `pylon.core.body._plain_view` vs the key census:
  test_body.py::test_plain_view_is_the_census_reading
- `pylon.core.sse.is_output_event`'s one-data-line read vs `_is_output_event`:
  test_sse.py::test_the_one_data_line_fast_path_answers_as_the_general_reading (and the next one)
- `SseSplitter.feed_block` without pending bytes vs with them: test_sse.py::
  test_any_chunking_gives_identical_events (whole stream, random cuts, byte by byte)
- `pylon.core.http.wire_unsafe`'s joined-regex pass vs a field-by-field check:
  test_transport_heads.py::test_wire_unsafe_agrees_with_a_field_by_field_check
- the tokenizer's segment cache vs one encode: test_tokenize.py::
  test_piecewise_encoding_equals_one_encode; `encode_batch_fast` vs transformers' encode:
  test_tokenize.py::test_generated_conversations_and_prompts_equal_transformers
- the intake keeping a single body piece as it came vs joining pieces: test_intake.py::
  IntakeMachine (every dispatched body is the bytes received, however they were cut)
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable
from typing import Any

import pytest
from aioquic.buffer import Buffer, BufferReadError
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pylon.adapters import AdapterOptions, build_adapter
from pylon.core import body as body_module
from pylon.core import contract
from pylon.core.body import _check_utf8, _top_level_keys, inspect_body, rewrite_body
from pylon.core.contract import (
    MAX_REQUEST_ID_CHARS,
    REQUEST_ID,
    _parse_request_id,
    _single,
    parse_request,
)
from pylon.core.errors import BodyError, ClientError, ContractError, ErrorCode, UpstreamError
from pylon.core.head import declared_length, http1_head, pseudo_head
from pylon.core.http import field_names
from pylon.core.plan import ForwardPlan, Planner
from pylon.core.priority import PriorityWrite
from pylon.core.queue import QueueDecision, Result
from pylon.core.record import RequestRecord
from pylon.core.retry import RetryMark
from pylon.core.sanitize import normalised_fields
from pylon.core.sse import _BOUNDARY, _last_boundary_end, iter_events
from pylon.core.upstream import Upstream
from pylon.core.usage import _USAGE, USAGE_KEY, USAGE_WINDOW, _counts, usage_at_end, usage_of
from pylon.metrics import BATCH, MetricsObserver
from pylon.observe import OBSERVER_EVENTS, Observers, quiet
from pylon.server.h3layer import _frame_header, _varint
from pylon.upstream.connection import MAX_RESPONSE_HEAD, UpstreamBroken, UpstreamConnection

from .helpers import TRACEPARENT, tunnel
from .test_sanitize_body import body_text

# --- pylon.core.body -----------------------------------------------------------------------------


# Up to twice the small census (32 members), repeated keys included.
_member = st.tuples(
    st.sampled_from(["a", "nvext", "k", "model", "é", "x y"]),
    st.sampled_from([b"1", b"{}", b'{"a":[1]}', b'"s"']),
)
_wide_members = st.integers(0, 70).flatmap(lambda n: st.lists(_member, min_size=n, max_size=n))


@settings(max_examples=300, deadline=None)
@given(_wide_members)
def test_the_small_census_first_is_the_full_census(members: list[tuple[str, bytes]]) -> None:
    """`_top_level_keys` counts a small object with the 32-member census first, and only past
    32 members with the full one."""
    body = b"{" + b",".join(json.dumps(key).encode() + b":" + value for key, value in members)
    body += b"}"
    fast = _top_level_keys(body)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(body_module, "_SMALL_OBJECT_BYTES", 0)  # every object: the full census
        general = _top_level_keys(body)
    assert fast == general == [key for key, _ in members]


_UTF8_PIECES = st.sampled_from(
    [b"a", b"\xc3\xa9", b"\xe2\x82\xac", b"\xf0\x9f\x98\x80", b"\xc3", b"\xed\xa0\x80", b"\xff"]
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(_UTF8_PIECES, max_size=12).map(b"".join) | st.binary(max_size=20), st.integers(1, 5)
)
def test_the_ascii_skip_and_the_chunked_decode_are_one_decode(body: bytes, chunk: int) -> None:
    """`_check_utf8` skips ASCII and decodes the rest in chunks (a multi-byte character may be
    cut at a chunk boundary): it refuses exactly what one decode of the whole body refuses."""
    try:
        body.decode("utf-8")
        valid = True
    except UnicodeDecodeError:
        valid = False
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(body_module, "_UTF8_CHUNK", chunk)
        try:
            _check_utf8(body)
            checked = True
        except BodyError:
            checked = False
    assert checked is valid


# --- pylon.core.plan: the verbatim body --------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(body_text(), st.none() | st.integers(0, 2**32 - 1))
def test_the_verbatim_body_with_priority_appended_is_the_rewritten_body(
    body: bytes, rank: int | None
) -> None:
    """The common body goes out as the client's bytes with pylon's priority appended; it must
    read as `rewrite_body`'s re-emitted object (the general way), with the same priority."""
    adapter = build_adapter("vllm", AdapterOptions(3600), derive=True)  # a body `priority`
    request = tunnel(*(() if rank is None else ((b"x-priority", str(rank).encode()),)))
    try:
        plan = Planner(adapter).plan(request, body)
    except BodyError:
        return  # refused either way: the planner reads `inspect_body` first
    view = inspect_body(body)
    general = rewrite_body(body, view, adapter.derive(request.priority).body_priority)
    assert json.loads(plan.body) == json.loads(general)


# --- pylon.core.head ---------------------------------------------------------------------------

_NAMES = [b"host", b"Host", b"content-length", b"Content-Length", b"x-model", b"X-A", b"te"]
_VALUES = [b"gw", b"0", b"5", b" 5 ", b"05", b"-1", b"5, 5", b"", b"a", b"trailers", b"\t7"]
_fields = st.lists(
    st.tuples(st.sampled_from(_NAMES) | st.binary(max_size=6), st.sampled_from(_VALUES)),
    max_size=6,
)


@settings(max_examples=400, deadline=None)
@given(_fields, st.booleans())
def test_the_http1_names_lowered_in_place_are_field_names(
    fields: list[tuple[bytes, bytes]], http10: bool
) -> None:
    """`http1_head` only lower-cases names (llhttp let no whitespace through, the wire check
    refuses any): for every head it admits, the names are `field_names`'s."""
    try:
        head = http1_head(b"POST", b"/x", [(b"host", b"gw"), *fields], http10)
    except ContractError:
        return
    assert head.names == field_names(head.headers)


_PSEUDO = [(b":method", b"POST"), (b":scheme", b"https"), (b":path", b"/x"), (b":authority", b"gw")]


@settings(max_examples=400, deadline=None)
@given(_fields)
def test_the_pseudo_head_names_taken_as_they_are_are_field_names(
    fields: list[tuple[bytes, bytes]],
) -> None:
    """`pseudo_head` takes regular names as they are (it checked each is a lowercase token)."""
    try:
        head = pseudo_head([*_PSEUDO, *fields])
    except ContractError:
        return
    assert head.names == field_names(head.headers)


@settings(max_examples=400, deadline=None)
@given(_fields)
def test_the_normaliser_one_pass_length_is_declared_length(
    fields: list[tuple[bytes, bytes]],
) -> None:
    """The normaliser reads Content-Length in its one pass over the names; `declared_length` is
    the one general parser: the same value, and a length one refuses the other refuses."""
    fields = [(b"host", b"gw"), *fields]
    general: int | str | None
    try:
        general = declared_length(fields)
    except ContractError:
        general = "refused"
    try:
        head = http1_head(b"POST", b"/x", fields, http10=False)
    except ContractError as error:
        assert general == "refused" or "content-length" not in str(error)
        return
    assert head.content_length == general


# --- pylon.core.contract -----------------------------------------------------------------------

_CONTRACT_NAMES = [
    b"x-request-id",
    b"X-Request-ID",
    b"x-model",
    b"x-input-tokens",
    b"x-priority",
    b"x-routing-key",
    b"x-stargate-expected-queue-ms",
    b"traceparent",
    b"tracestate",
    b"content-type",
]
_CONTRACT_VALUES = [
    b"r-1",
    b"r-2",
    b"",
    b"m",
    b"model b",
    b"7",
    b" 7 ",
    b"-1",
    b"4294967296",
    b"18446744073709551616",
    TRACEPARENT,
    b"00-" + b"0" * 32 + b"-b7ad6b7169203331-01",
    b"a=1",
    b"k\x01",
    b"\xff",
    b"x" * 300,
]
_TARGETS = [
    b"/v1/chat/completions",
    b"/v1/chat/completions?x=1",
    b"/health",
    b"/health?probe=1",
    b"/v1/a%2Fb",
    b"/v1/%41",
    b"/a/../b",
    b"/x y",
    b"*",
]
_BASE = [(b"x-request-id", b"r-1"), (b"x-model", b"m")]
_contract_heads = st.tuples(
    st.sampled_from([b"POST", b"GET", b"HEAD", b"PUT", b"BREW"]),
    st.sampled_from(_TARGETS) | st.binary(max_size=12).map(lambda tail: b"/" + tail),
    st.lists(st.tuples(st.sampled_from(_CONTRACT_NAMES), st.sampled_from(_CONTRACT_VALUES))).map(
        lambda extra: [*_BASE, *extra]
    )
    | st.lists(st.tuples(st.sampled_from(_CONTRACT_NAMES), st.sampled_from(_CONTRACT_VALUES))),
)


def _contract_outcome(method: bytes, target: bytes, headers: list[tuple[bytes, bytes]]) -> object:
    try:
        return parse_request(method, target, headers)
    except ContractError as error:
        return (error.code, error.request_id, str(error))


@settings(max_examples=500, deadline=None)
@given(_contract_heads)
def test_the_contract_caches_and_optional_skip_are_the_general_parse(
    head: tuple[bytes, bytes, list[tuple[bytes, bytes]]],
) -> None:
    """Three cuts: a head with no optional header skips their five parsers, a target and an
    `x-model` seen before come from their caches. Parsed twice with the caches live (the second
    parse hits them) and once with all three off, a head reads the same."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(contract, "_CHECKED_MODELS", {})
        patch.setattr(contract, "_ROUTES", {})
        first = _contract_outcome(*head)
        cached = _contract_outcome(*head)
        patch.setattr(contract, "_CHECKED_MODELS", {})
        patch.setattr(contract, "_ROUTES", {})
        patch.setattr(contract, "_CHECKED_MODELS_LIMIT", 0)
        patch.setattr(contract, "_ROUTES_KEPT", 0)
        patch.setattr(contract, "_REQUIRED_HEADERS", frozenset())  # never skip the five
        general = _contract_outcome(*head)
    assert first == cached == general


def _request_id_by_single(values: dict[bytes, list[bytes]]) -> object:
    """The request id read the general way: `_single`, then the checks."""
    try:
        raw = _single(values, REQUEST_ID, ErrorCode.INVALID_REQUEST_ID)
    except ContractError as error:
        return error.code
    if not raw:
        return ErrorCode.MISSING_REQUEST_ID
    if len(raw) > MAX_REQUEST_ID_CHARS or not all(0x21 <= byte <= 0x7E for byte in raw):
        return ErrorCode.INVALID_REQUEST_ID  # not 1-MAX_REQUEST_ID_CHARS visible ASCII characters
    return raw.decode("ascii")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_CONTRACT_VALUES) | st.binary(max_size=8), max_size=3))
def test_the_single_request_id_read_without_the_helper_is_the_helper_reading(
    found: list[bytes],
) -> None:
    values = {REQUEST_ID: found} if found else {}
    try:
        fast: object = _parse_request_id(values)
    except ContractError as error:
        fast = error.code
    assert fast == _request_id_by_single(values)


# --- pylon.core.sse: the boundary search --------------------------------------------------------


_LF_PIECES = [b"\n", b"\n\n", b"\n\n\n", b"x", b"data: y"]


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.sampled_from(_LF_PIECES), max_size=14)
    | st.lists(st.sampled_from([*_LF_PIECES, b"\r", b"\r\n"]), max_size=14),
    st.integers(0, 60),
)
@example([b"data: y", b"\n\n\n"], 0)  # a chunk ending in three LFs: the crash this test found
@example([b"data: y", b"\n\n", b"\n\n"], 0)
def test_the_lf_only_boundary_search_is_the_regex_search(pieces: list[bytes], old: int) -> None:
    """Without a CR, `_last_boundary_end` finds the last blank line with `rfind`; the general
    search runs the boundary regex from the same start (and `iter_events` reads a block as that
    regex does, so the block must end where the regex says)."""
    buffer = b"".join(pieces)
    old = min(old, len(buffer))
    end = 0
    for match in _BOUNDARY.finditer(buffer, max(0, old - 3)):
        end = match.end()
    assert _last_boundary_end(buffer, old) == end


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.sampled_from(_LF_PIECES), max_size=14)
    | st.lists(st.sampled_from([*_LF_PIECES, b"\r", b"\r\n"]), max_size=14)
)
@example([b"data: y", b"\n\n\n", b"x", b"\n\n"])
def test_events_are_cut_where_the_boundary_regex_cuts_them(pieces: list[bytes]) -> None:
    """`iter_events` cuts a block without CR with `find`; any block as the boundary regex
    does (events up to the last blank line: the complete ones a splitter hands on)."""
    buffer = b"".join(pieces)
    end = 0
    for match in _BOUNDARY.finditer(buffer):
        end = match.end()
    block = buffer[:end]
    expected, consumed = [], 0
    while consumed < len(block):
        match = _BOUNDARY.search(block, consumed)
        assert match is not None
        expected.append(block[consumed : match.end()])
        consumed = match.end()
    assert list(iter_events(block)) == expected


# --- pylon.core.usage -------------------------------------------------------------------------


def _usage_by_the_general_reading(data: bytes, start: int = 0) -> object:
    """The last usage object with counts, each read by the nested-object pattern."""
    end = len(data)
    while (found := data.rfind(USAGE_KEY, start, end)) >= 0:
        match = _USAGE.match(data, found)
        usage = _counts(match.group(1)) if match is not None else None
        if usage is not None:
            return usage
        end = found
    return None


_text = st.text(max_size=10) | st.sampled_from(['"usage": {"prompt_tokens": 9}', "}", "{", '\\"'])
_count = st.integers(0, 10**6) | st.sampled_from([-1, "3", None, True, 1.5])


@st.composite
def usage_object(draw: st.DrawFn) -> dict[str, Any] | None:
    """A usage object, flat or with nested details, counts valid or not; or null."""
    if draw(st.booleans()):
        return None
    usage: dict[str, Any] = {}
    names = ["prompt_tokens", "completion_tokens", "input_tokens", "output_tokens", "note"]
    for name in draw(st.lists(st.sampled_from(names), min_size=1)):
        usage[name] = draw(_text) if name == "note" else draw(_count)
    if draw(st.booleans()):
        usage["prompt_tokens_details"] = {"cached_tokens": draw(_count), "note": draw(_text)}
    return usage


@st.composite
def usage_document(draw: st.DrawFn) -> bytes:
    """A response (a body, or SSE events with a usage in any of them, as vLLM's continuous
    usage stats write it) with usage objects flat or nested, null or missing."""
    chunks = [
        {"text": draw(_text), "usage": draw(usage_object())} for _ in range(draw(st.integers(0, 3)))
    ]
    documents = [*chunks, {"choices": [{"text": draw(_text)}], "usage": draw(usage_object())}]
    if draw(st.booleans()):
        documents = [{"type": "response.completed", "response": d} for d in documents]
    style = draw(st.sampled_from([{}, {"separators": (",", ":")}, {"indent": 2}]))
    texts = [json.dumps(d, **style).encode() for d in documents]
    if draw(st.booleans()):
        return b"".join(b"data: " + text.replace(b"\n", b"") + b"\n\n" for text in texts)
    return texts[-1]


@settings(max_examples=500, deadline=None)
@given(usage_document())
@example(b'{"usage":{"note":"}","prompt_tokens":1}}')  # a brace in a string: the cut fails
def test_the_flat_usage_cut_is_the_nested_pattern_reading(data: bytes) -> None:
    assert usage_of(data) == _usage_by_the_general_reading(data)


@settings(max_examples=500, deadline=None)
@given(usage_document() | st.binary(max_size=40), st.integers(0, 700), st.binary(max_size=600))
@example(b'data: {"usage":{"prompt_tokens":1}}\n\ndata: {"usage":{"prompt_tokens":2}}\n\n', 0, b"")
def test_the_inline_usage_at_the_end_is_usage_of_the_window(
    document: bytes, cut: int, padding: bytes
) -> None:
    """`usage_at_end` reads a compact flat object at the end inline, anything else through
    `usage_of`: as `usage_of` on the response's last `USAGE_WINDOW` bytes, however cut."""
    response = padding + document
    cut = min(cut, len(response))
    previous, last = response[: len(response) - cut], response[len(response) - cut :]
    start = max(0, len(response) - USAGE_WINDOW)
    assert usage_at_end(previous, last) == usage_of(response, start)


# --- pylon.upstream.connection: the inlined parser callbacks, and the relay's `take` ---------


class FakeTransport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.paused = False
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def abort(self) -> None:
        self.aborted = True

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default


PLAN = ForwardPlan("POST", "/v1/x", (), b"{}", "r-1", "m", False, (), PriorityWrite())
UPSTREAM = Upstream("127.0.0.1", 8000, "")


def connection() -> tuple[UpstreamConnection, FakeTransport]:
    conn = UpstreamConnection(asyncio.get_running_loop(), UPSTREAM)
    transport = FakeTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    return conn, transport


@st.composite
def engine_response(draw: st.DrawFn) -> tuple[list[bytes], bool, str, bytes]:
    """(the response's bytes in pieces, whether it is cut short, its framing, its body)."""
    body = draw(st.binary(max_size=300) | st.just(b"x" * (300 * 1024)))  # over the high water
    framing = draw(st.sampled_from(["length", "chunked", "close"]))
    head = b"HTTP/1.1 200 OK\r\n"
    if framing == "length":
        wire = head + b"content-length: %d\r\n\r\n" % len(body) + body
    elif framing == "chunked":
        sizes = draw(st.lists(st.integers(1, 64), max_size=8))
        parts, pos = [], 0
        for size in [*sizes, len(body)]:
            piece = body[pos : pos + size]
            pos += len(piece)
            if piece:
                parts.append(b"%x\r\n" % len(piece) + piece + b"\r\n")
        wire = head + b"transfer-encoding: chunked\r\n\r\n" + b"".join(parts) + b"0\r\n\r\n"
    else:
        wire = head + b"connection: close\r\n\r\n" + body
    bounds = sorted({0, len(wire), *draw(st.lists(st.integers(0, len(wire)), max_size=8))})
    pieces = [wire[a:b] for a, b in itertools.pairwise(bounds)]
    broken = draw(st.booleans()) and len(pieces) > 1
    kept = pieces[: draw(st.integers(1, len(pieces) - 1))] if broken else pieces
    return kept, broken, framing, body


async def _read(
    pieces: list[bytes], broken: bool, framing: str, yields: list[int], relay_style: bool
) -> tuple[bytes, str, bool]:
    """Feed `pieces` to a connection while one task reads its attempt; (bytes read, how the
    read ended, whether reading is paused at the end)."""
    conn, transport = connection()
    attempt = conn.begin(PLAN)

    async def feed() -> None:
        for index, piece in enumerate(pieces):
            conn.data_received(piece)
            for _ in range(yields[index % len(yields)] if yields else 0):
                await asyncio.sleep(0)
        if broken:
            conn.connection_lost(ConnectionResetError())
        elif framing == "close":
            conn.connection_lost(None)

    feeder = asyncio.ensure_future(feed())
    read = b""
    ended = "end"
    try:
        while True:
            if relay_style and attempt.ready:
                chunk = attempt.take()  # `relay_raw`: no coroutine when bytes are there
            else:
                chunk = await attempt.next_chunk()
            if chunk is None:
                break
            read += chunk
            if relay_style and attempt.complete:
                # `relay_raw` stops here: asking for the end would have said None.
                assert await attempt.next_chunk() is None
                break
    except UpstreamBroken:
        ended = "broken"
    await feeder
    paused = transport.paused
    # `end_attempt` inlines `attempt.complete`: its answer must be the property's.
    reusable = attempt.complete and conn.keep_alive and not conn.closed
    assert conn.end_attempt() is reusable
    return read, ended, paused


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(engine_response(), st.lists(st.integers(0, 2), max_size=4))
def test_the_relays_take_when_ready_is_next_chunk(
    response: tuple[list[bytes], bool, str, bytes], yields: list[int]
) -> None:
    """`relay_raw` takes what is buffered without a coroutine (and stops once the attempt is
    complete); the general read awaits `next_chunk` until None. Both read the same bytes (the
    body, or its start when the engine broke off) and end the same way, and neither leaves the
    connection paused (the parser's inlined `on_body` buffers, pauses above the high water and
    wakes the reader as `_wake` would); `end_attempt`'s inlined `complete` is the property."""
    pieces, broken, framing, body = response
    general = asyncio.run(_read(pieces, broken, framing, yields, relay_style=False))
    fast = asyncio.run(_read(pieces, broken, framing, yields, relay_style=True))
    assert fast == general
    read, ended, paused = general
    assert ended == ("broken" if broken else "end")
    assert read == body if not broken else body.startswith(read)
    assert paused is False


async def _head_read(head: bytes) -> list[tuple[bytes, bytes]] | None:
    """The fields the connection read from the response `head`; None when it refused it."""
    conn, _ = connection()
    attempt = conn.begin(PLAN)
    conn.data_received(head)
    assert attempt.head.done()
    return None if attempt.head.exception() is not None else attempt.headers


_header_name = st.sampled_from([b"X-A", b"x-b", b"Content-Type", b"SERVER", b"x-Long"])


@settings(max_examples=200, deadline=None)
@given(
    st.text("OK Accepted", max_size=8).map(str.encode),
    st.lists(st.tuples(_header_name, st.integers(0, 40_000)), min_size=1, max_size=4),
    st.integers(-3, 3),
)
def test_the_inlined_head_byte_count_is_count_head(
    reason: bytes, fields: list[tuple[bytes, int]], over: int
) -> None:
    """`on_header` adds each field's bytes itself and calls `_count_head` only past the limit;
    the limit is `_count_head`'s: the status reason and every name and value, at most
    `MAX_RESPONSE_HEAD` bytes. Sizes land on both sides of it."""
    # The last field is sized so that the whole head lands `over` bytes off the limit.
    used = len(reason) + sum(len(name) + size for name, size in fields) + len(b"content-length0")
    last_name, last_size = fields[-1]
    fill = max(0, last_size + MAX_RESPONSE_HEAD + over - used)
    fields = [*fields[:-1], (last_name, fill)]
    total = used - last_size + fill
    head = b"HTTP/1.1 200 " + reason + b"\r\n"
    head += b"".join(name + b": " + b"v" * size + b"\r\n" for name, size in fields)
    head += b"content-length: 0\r\n\r\n"
    assert (asyncio.run(_head_read(head)) is not None) is (total <= MAX_RESPONSE_HEAD)


_padding = st.sampled_from([b"", b" ", b"\t", b"  \t"])
_raw_field = st.tuples(
    _header_name, _padding, st.sampled_from([b"", b"v", b"a b", b"text/event-stream"]), _padding
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_raw_field, max_size=6))
def test_the_connections_fields_as_read_are_normalised_fields(
    raw: list[tuple[bytes, bytes, bytes, bytes]],
) -> None:
    """`on_header` normalises each engine field in place (llhttp drops a value's leading
    whitespace and refuses any in a name: lower-casing and `rstrip` are left); the response head
    normaliser takes them as they are, and `normalised_fields` is the general reading."""
    sent = [(name, lead + value + trail) for name, lead, value, trail in raw]
    head = b"HTTP/1.1 200 OK\r\n" + b"".join(n + b":" + v + b"\r\n" for n, v in sent)
    read = asyncio.run(_head_read(head + b"content-length: 0\r\n\r\n"))
    assert read == [*normalised_fields(sent), (b"content-length", b"0")]


# --- pylon.observe.Observers: direct dispatch vs fan-out -----------------------------------------


def _event_args(event: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    # Values of the declared types: the compiled build checks them.
    record = RequestRecord("h2", 1, 0.0)
    error = ClientError("x", code=ErrorCode.MISSING_MODEL)
    if event == "transport_event":
        return ("h2_flood", "h2"), {"kind": "ping"}
    if event == "process_event":
        return ("listening",), {"port": 1}
    extra = {
        "output": (3,),
        "upstream_failed": (error, True),
        "rejected": (error,),
        "queue_gate": (QueueDecision(Result.ACCEPTED, "m", 0, 100, 10, 200),),
        "upstream_status": (RetryMark(True, "engine_overloaded"),),
        "crashed": (RuntimeError("bug"),),
    }
    return (record, *extra.get(event, ())), {}


def _observer_class(handled: frozenset[str]) -> type:
    """An observer handling `handled` (recording each call) and quiet for every other event."""

    def recorder(event: str) -> Callable[..., None]:
        def handle(self: Any, *args: Any, **fields: Any) -> None:
            self.heard.append((self.name, event, args, fields))

        return handle

    def ignore(self: Any, *args: Any, **fields: Any) -> None:
        return None

    methods = {e: recorder(e) if e in handled else quiet(ignore) for e in OBSERVER_EVENTS}
    return type("Generated", (), methods)


_observers = st.lists(st.frozensets(st.sampled_from(OBSERVER_EVENTS)), min_size=0, max_size=4)


@settings(max_examples=200, deadline=None)
@given(_observers, st.lists(st.sampled_from(OBSERVER_EVENTS), max_size=10))
def test_the_direct_dispatch_is_the_fan_out(
    handled_by: list[frozenset[str]], events: list[str]
) -> None:
    """`Observers` binds an event one observer handles straight to it (and one none handles to
    nothing); the fan-out method calls every non-quiet handler in order. For any observers and
    events, the bound attribute, the fan-out method and calling each observer agree."""
    heard: list[tuple[str, str, tuple[Any, ...], dict[str, Any]]] = []
    members = []
    for index, handled in enumerate(handled_by):
        member = _observer_class(handled)()
        member.name, member.heard = f"o{index}", heard
        members.append(member)
    observers = Observers(*members)
    for event in events:
        args, fields = _event_args(event)
        getattr(observers, event)(*args, **fields)  # as the callers call it
        bound = heard[:]
        heard.clear()
        getattr(Observers, event)(observers, *args, **fields)  # the fan-out, unshadowed
        fanned = heard[:]
        heard.clear()
        for member, handled in zip(members, handled_by, strict=True):
            if event in handled:
                getattr(member, event)(*args, **fields)
        assert bound == fanned == heard
        heard.clear()


# --- pylon.server.h3layer: QUIC integers and frame headers ---------------------------------------


def _aioquic_varint(data: bytes, pos: int) -> tuple[int, int] | None:
    buffer = Buffer(data=data)
    buffer.seek(pos)
    try:
        value = buffer.pull_uint_var()
    except BufferReadError:
        return None
    return value, buffer.tell()


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=12), st.data())
def test_the_one_and_two_byte_varints_inline_are_aioquics_reading(data: bytes, draw: Any) -> None:
    pos = draw.draw(st.integers(0, len(data)))
    assert _varint(data, pos) == _aioquic_varint(data, pos)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=12), st.data())
def test_the_inline_frame_header_is_two_varint_reads(data: bytes, draw: Any) -> None:
    """Any bytes, non-minimal encodings and cut headers included."""
    pos = draw.draw(st.integers(0, len(data)))
    frame_type = _aioquic_varint(data, pos)
    length = None if frame_type is None else _aioquic_varint(data, frame_type[1])
    general = None if frame_type is None or length is None else (frame_type[0], *length)
    assert _frame_header(data, pos) == general


# --- pylon.metrics: counted a batch at a time vs one request at a time -------------------------


def _exposition(metrics: MetricsObserver) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            if not sample.name.startswith("pylon_process_"):  # this process's CPU and memory
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


@st.composite
def request_lives(draw: st.DrawFn) -> list[tuple[str, RequestRecord, Any]]:
    """Requests' events, interleaved: each dispatched then completed, or rejected unsent."""
    records: list[RequestRecord] = []
    for index in range(draw(st.integers(0, 150))):
        record = RequestRecord(draw(st.sampled_from(["http1", "h2", "h3"])), index, 10.0)
        record.model = draw(st.sampled_from(["a", "b", None]))
        record.status = draw(st.sampled_from([200, 429, 503]))
        record.engine_priority = draw(st.none() | st.integers(0, 4000))
        record.stripped = tuple(draw(st.lists(st.sampled_from(["x-dynamo-a", "nvext.x"]))))
        if draw(st.booleans()):
            record.input_tokens, record.input_tokens_source = draw(st.integers(0, 10**6)), "usage"
        records.append(record)
    events: list[tuple[str, RequestRecord, Any]] = []
    sent: list[RequestRecord] = []
    for record in records:
        if draw(st.booleans()):
            events.append(("rejected", record, ClientError("x", code=ErrorCode.MISSING_MODEL)))
            continue
        record.dispatched_at = 10.0 + draw(st.floats(0, 1))
        record.done_at = record.dispatched_at + draw(st.floats(0, 100))
        record.first_output_at = record.first_byte_at = record.dispatched_at
        events.append(("dispatched", record, None))
        sent.append(record)
        if draw(st.booleans()):
            events.append(("complete", sent.pop(draw(st.integers(0, len(sent) - 1))), None))
    events += [("complete", record, None) for record in sent]
    refused = UpstreamError("x", code=ErrorCode.UPSTREAM_UNAVAILABLE)
    events.append(("upstream_failed", RequestRecord("h2", 0, 0.0), refused))
    return events


def _replay(events: list[tuple[str, RequestRecord, Any]], flush_each: bool) -> MetricsObserver:
    metrics = MetricsObserver("vllm")
    for event, record, extra in events:
        if event == "upstream_failed":
            metrics.upstream_failed(record, extra, after_head=False)
        elif extra is None:
            getattr(metrics, event)(record)
        else:
            getattr(metrics, event)(record, extra)
        if flush_each:
            metrics.flush()
    return metrics


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request_lives())
def test_the_batched_counts_are_the_counts_one_request_at_a_time(
    events: list[tuple[str, RequestRecord, Any]],
) -> None:
    """`MetricsObserver` counts finished requests a batch (`BATCH`) at a time; counted one at a
    time, the scrape is the same."""
    batched = _exposition(_replay(events, flush_each=False))
    one_by_one = _exposition(_replay(events, flush_each=True))
    assert batched == one_by_one


def test_the_batched_counts_are_the_counts_one_request_at_a_time_across_batches() -> None:
    """Past `BATCH` requests a batch is counted before the scrape (the property above draws
    fewer requests most of the time)."""
    records = [RequestRecord("h2", index, 10.0) for index in range(3 * BATCH + 5)]
    events: list[tuple[str, RequestRecord, Any]] = []
    for index, record in enumerate(records):
        record.model, record.status, record.engine_priority = "m", 200, index
        record.dispatched_at, record.done_at = 10.5, 11.0 + index
        events.append(("dispatched", record, None))
        if index % 3 == 0:
            events.append(("complete", records[index // 2], None))
    done = {id(record) for event, record, _ in events if event == "complete"}
    events += [("complete", record, None) for record in records if id(record) not in done]
    batched = _exposition(_replay(events, flush_each=False))
    assert batched == _exposition(_replay(events, flush_each=True))
    assert batched[
        (
            "pylon_requests_total",
            (("backend", "vllm"), ("model", "m"), ("status_class", "2xx"), ("transport", "h2")),
        )
    ] == len(records)


# --- the watchdog's inlined arm vs Deadline.arm ---------------------------------------------------


class _StillLoop:
    """A loop whose clock the test sets, and which records what is scheduled (nothing runs)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.scheduled: list[float] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], None]) -> _Handle:
        self.scheduled.append(when)
        return _Handle(self, when)


class _Handle:
    def __init__(self, loop: _StillLoop, when: float) -> None:
        self.loop, self.when = loop, when

    def cancel(self) -> None:
        self.loop.scheduled.append(-self.when)  # a cancel, recorded in order


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0.001, 50)), min_size=1, max_size=12))
def test_the_watchdogs_inlined_arm_is_deadline_arm(steps: list[tuple[float, float]]) -> None:
    from pylon.proxy.exchange import Exchange, Watchdog
    from pylon.timers import Deadline

    fast_loop, slow_loop = _StillLoop(), _StillLoop()
    exchange = Exchange("http1", 1, 0.0, None, fast_loop)  # type: ignore[arg-type]
    fast, slow = Watchdog(exchange), Deadline(slow_loop)  # type: ignore[arg-type]
    now = 0.0
    for advance, seconds in steps:
        now += advance
        fast_loop.now = slow_loop.now = now
        fast.arm_for(seconds, "reason")
        slow.arm(seconds)
        assert (fast._deadline, fast._due) == (slow._deadline, slow._due)
        assert fast_loop.scheduled == slow_loop.scheduled
