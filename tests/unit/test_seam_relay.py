"""The relays on their own: `relay_sse` and `relay_raw` reading a real `Attempt` (fed through
the real parser by a scripted engine connection), writing to a recording sink, telling a real
`Exchange`, with a clock the test moves (the watchdog's timeouts fire without sleeping).

What is pinned: events reach the client byte for byte whatever the engine's chunking, only as
whole events; the first output is told once; the output counts per block are the block's data
events; the usage at the end goes into the record, `[DONE]` is never counted; the event-size
limit; the first-output and gap timeouts; back-pressure both ways; and the raw relay's ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pylon.adapters import AdapterOptions, build_adapter
from pylon.core.errors import PylonError
from pylon.core.http import Header
from pylon.core.plan import Planner
from pylon.core.sanitize import ResponseHead, sanitize_response_head
from pylon.proxy.exchange import Exchange
from pylon.proxy.relay import AlreadyAnswered, ClientStalled, RelayLimits, relay_raw, relay_sse
from pylon.upstream import UpstreamBroken

from .fakes import (
    SSE_HEAD,
    UPSTREAM,
    ClockedLoop,
    Moments,
    RecordingHooks,
    RecordingObserver,
    RecordingSink,
    ScriptedEngine,
    settle,
    whole_response,
)
from .helpers import tunnel

LIMITS = RelayLimits(
    first_output_timeout=30.0,
    output_gap_timeout=5.0,
    max_sse_event_bytes=1024,
    client_send_timeout=10.0,
)
DONE = b"data: [DONE]\n\n"
ADAPTER = build_adapter("vllm", AdapterOptions(3600), derive=True)


def delta(text: str, newline: bytes = b"\n") -> bytes:
    data = orjson.dumps({"choices": [{"delta": {"content": text}}]})
    return b"data: " + data + newline + newline


class Relay:
    """One exchange whose head arrived, its relay about to run: a real `Exchange` (with a
    subscriber that counts output), a scripted engine behind its attempt, a recording sink."""

    def __init__(self, limits: RelayLimits = LIMITS, counts_output: bool = True) -> None:
        loop = asyncio.get_running_loop()
        self.loop = loop
        self.limits = limits
        self.clock = ClockedLoop(loop)
        self.log = Moments()
        request = tunnel()
        exchange = self.exchange = Exchange(
            "h2",
            1,
            self.clock.time(),
            RecordingObserver(self.log),
            self.clock,  # type: ignore[arg-type]
        )
        exchange.admitted(request)
        exchange.subscribe(RecordingHooks(self.log, "counter"), counts_output=counts_output)
        self.sink = exchange.sink = RecordingSink()
        plan = Planner(ADAPTER).plan(request, b'{"model":"m","stream":true}').routed(UPSTREAM)
        self.engine = ScriptedEngine(loop)
        attempt = self.engine.begin(plan)
        exchange.dispatched(attempt)
        exchange.clock()  # the engine-side clock, on the test's loop (the exchange's)

    def response_head(self) -> ResponseHead:
        """The engine's head as the proxy reads it (what `relay_raw` frames)."""
        attempt = self.exchange.attempt
        return sanitize_response_head(attempt.status, attempt.headers)

    async def head(self, status: int = 200, headers: Sequence[Header] = SSE_HEAD) -> None:
        self.engine.respond(status, headers)
        await self.exchange.attempt.head
        self.exchange.response_head(status, None)

    async def sse(self) -> asyncio.Task[PylonError | None]:
        """The engine's event-stream head arrives, and the relay runs."""
        await self.head()
        self.sink.start(200, [], None)  # as the proxy does before relaying events
        task = self.loop.create_task(relay_sse(self.exchange, self.limits))
        await settle()
        return task

    def send(self, *pieces: bytes) -> None:
        for piece in pieces:
            self.engine.chunk(piece)

    @property
    def outputs(self) -> list[int]:
        """The counts the output-counting subscriber was told, one per block."""
        heard = self.log.of("counter")
        return [int(line[len("output(") : -1]) for line in heard if line.startswith("output(")]

    def heard(self, moment: str) -> int:
        return self.log.of("counter").count(moment)


def data_events_in(block: bytes) -> int:
    """The block's data events, [DONE] excepted, read event by event (the test's own count)."""
    events = [event for event in block.replace(b"\r\n", b"\n").split(b"\n\n") if event]
    return sum(1 for event in events if event.startswith(b"data:") and b"[DONE]" not in event)


# --- byte for byte, whatever the chunking ---------------------------------------------------------

text = st.text(st.characters(codec="utf-8", exclude_characters="\r\n"), max_size=16)
stream_events = st.lists(
    st.one_of(text.map(lambda t: ("delta", t)), st.just(("comment", ""))), max_size=8
).map(lambda events: [("delta", "first"), *events])


@settings(max_examples=100, deadline=None)
@given(events=stream_events, crlf=st.booleans(), done=st.booleans(), data=st.data())
@example(events=[("delta", "a"), ("comment", ""), ("delta", "b")], crlf=False, done=True, data=None)
async def test_events_are_relayed_byte_for_byte_whatever_the_chunking(
    events: list[tuple[str, str]], crlf: bool, done: bool, data: st.DataObject | None
) -> None:
    newline = b"\r\n" if crlf else b"\n"
    wire = [delta(t, newline) if kind == "delta" else b": ping" + newline * 2 for kind, t in events]
    if done:
        wire.append(b"data: [DONE]" + newline * 2)
    stream = b"".join(wire)
    if data is None:  # the @example: one byte at a time
        cuts = list(range(1, len(stream)))
    else:
        cuts = sorted(data.draw(st.sets(st.integers(1, len(stream) - 1), max_size=40)))
    relay = Relay()
    task = await relay.sse()
    start = 0
    for cut in [*cuts, len(stream)]:
        relay.send(stream[start:cut])
        start = cut
        await settle(2)
    relay.engine.end()
    assert await task is None  # no failure

    sink = relay.sink
    assert sink.body == stream and sink.events[-1] == "end" and sink.events.count("end") == 1
    boundary = newline * 2
    assert all(write.endswith(boundary) for write in sink.writes)  # whole events only
    if data is None:  # a byte at a time: each event went out the moment it was whole
        assert sink.writes == wire
    assert relay.heard("first_output") == 1
    # One count per block from the block with the first output on: its data events.
    deltas = sum(1 for kind, _ in events if kind == "delta")
    counted = sink.writes[len(sink.writes) - len(relay.outputs) :]
    assert relay.outputs and relay.outputs == [data_events_in(write) for write in counted]
    assert sum(relay.outputs) == deltas
    record = relay.exchange
    assert (record.output_tokens, record.output_tokens_source) == (deltas, "estimate")


async def test_the_first_output_is_the_first_block_with_model_output() -> None:
    relay = Relay()
    task = await relay.sse()
    relay.send(
        b": keep-alive\n\n", b'event: response.created\ndata: {"type":"response.created"}\n\n'
    )
    await settle()
    assert relay.heard("first_output") == 0 and relay.exchange.first_output_at is None
    relay.clock.advance(2.0)
    relay.send(delta("a"))
    await settle()
    relay.send(delta("b"))
    relay.engine.end()
    await task

    assert relay.heard("first_output") == 1
    assert relay.exchange.first_output_at == relay.exchange.dispatched_at + 2.0  # type: ignore[operator]
    assert relay.exchange.ends_prefill
    assert relay.outputs == [1, 1]  # the bookkeeping before it was no output
    assert relay.sink.writes[0].startswith(b": keep-alive")  # but it was relayed, as it came


async def test_no_subscriber_counting_output_means_no_output_moments() -> None:
    relay = Relay(counts_output=False)
    task = await relay.sse()
    relay.send(delta("a"), delta("b"))
    relay.engine.end()
    await task
    assert relay.log.of("counter") == ["dispatched", "response_head:200", "first_output"]
    assert relay.exchange.output_tokens == 2  # the record is counted all the same


# --- the token counts -----------------------------------------------------------------------------


@pytest.mark.parametrize("split", [False, True], ids=["usage-in-the-last-block", "usage-before"])
async def test_the_engines_usage_at_the_end_goes_into_the_record(split: bool) -> None:
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7}}\n\n'
    relay = Relay()
    task = await relay.sse()
    relay.send(delta("a"))
    await settle()
    if split:
        relay.send(usage)
        await settle()
        relay.send(DONE)
    else:
        relay.send(usage + DONE)
    relay.engine.end()
    await task
    record = relay.exchange
    assert (record.input_tokens, record.input_tokens_source) == (5, "usage")
    assert (record.output_tokens, record.output_tokens_source) == (7, "usage")


async def test_without_usage_the_data_events_are_counted_and_done_is_not() -> None:
    relay = Relay()
    task = await relay.sse()
    relay.send(delta("a"), delta("b"), delta("c") + DONE)
    relay.engine.end()
    await task
    assert (relay.exchange.output_tokens, relay.exchange.output_tokens_source) == (3, "estimate")
    assert relay.exchange.input_tokens is None


# --- the event-size limit -------------------------------------------------------------------------


async def test_an_event_of_exactly_the_limit_is_relayed() -> None:
    event = b"data: " + b"x" * (LIMITS.max_sse_event_bytes - 6)
    relay = Relay()
    task = await relay.sse()
    relay.send(event)  # the whole limit, still unterminated
    await settle()
    relay.send(b"\n\n")
    relay.engine.end()
    assert await task is None
    assert relay.sink.body == event + b"\n\n"


@pytest.mark.parametrize("pieces", [1, 11], ids=["in-one-read", "in-many-reads"])
async def test_an_event_over_the_limit_fails_the_stream_and_the_attempt(pieces: int) -> None:
    event = b"data: " + b"x" * (LIMITS.max_sse_event_bytes - 5)  # one byte over
    relay = Relay()
    task = await relay.sse()
    relay.send(delta("a"))
    await settle()
    size = -(-len(event) // pieces)
    for start in range(0, len(event), size):
        relay.send(event[start : start + size])
        await settle()
    failure = await task

    assert failure is not None and failure.code.value == "upstream_protocol_error"
    error = relay.sink.sse_error()
    assert (
        error["message"]
        == f"an SSE event exceeded {LIMITS.max_sse_event_bytes} bytes without ending"
    )
    assert relay.sink.events[-1] == "end" and relay.sink.body.startswith(delta("a"))
    assert not relay.exchange.attempt.complete  # broken: its connection is never reused
    with pytest.raises(UpstreamBroken):
        relay.exchange.attempt.take()


# --- the watchdog's timeouts ----------------------------------------------------------------------


async def test_the_gap_timeout_moves_with_every_output_and_fires_once_it_is_over() -> None:
    relay = Relay()
    task = await relay.sse()
    gap = LIMITS.output_gap_timeout
    relay.send(delta("a"))
    await settle()
    for text in "bc":  # each event comes just in time
        relay.clock.advance(gap - 0.1)
        await settle()
        relay.send(delta(text))
        await settle()
    relay.clock.advance(gap - 0.1)
    await settle()
    assert not task.done()
    relay.clock.advance(0.1)
    failure = await task

    assert failure is not None and failure.code.value == "upstream_timeout"
    assert relay.sink.sse_error()["message"] == "gap between events too long"
    assert relay.sink.body.startswith(delta("a") + delta("b") + delta("c"))
    assert relay.exchange.output_tokens == 3


async def test_comments_do_not_hold_off_the_first_output_timeout() -> None:
    relay = Relay()
    task = await relay.sse()
    relay.clock.advance(LIMITS.first_output_timeout - 1)
    relay.send(b": keep-alive\n\n")
    await settle()
    relay.clock.advance(1)
    failure = await task
    assert failure is not None and failure.code.value == "upstream_timeout"
    assert relay.sink.sse_error()["message"] == "no output before the first-output timeout"
    assert relay.heard("first_output") == 0


@pytest.mark.parametrize(
    ("tail", "message"),
    [
        (b"", "the engine ended the stream before any output"),
        (b": ping\n\n", "the engine ended the stream before any output"),
        (delta("a") + b"data: {", "the engine ended the stream inside an event"),
    ],
)
async def test_a_stream_that_ends_wrong_ends_with_an_error_event(tail: bytes, message: str) -> None:
    relay = Relay()
    task = await relay.sse()
    if tail:
        relay.send(tail)
    relay.engine.end()
    failure = await task
    assert failure is not None and failure.code.value == "upstream_protocol_error"
    error = relay.sink.sse_error()
    assert (error["message"], error["request_id"]) == (message, "req-1")


async def test_an_engine_that_breaks_mid_stream_ends_it_with_an_error_event() -> None:
    relay = Relay()
    task = await relay.sse()
    relay.send(delta("a"))
    await settle()
    relay.engine.close()
    failure = await task
    assert failure is not None and failure.code.value == "upstream_protocol_error"
    assert relay.sink.sse_error()["message"] == "engine closed the connection mid-response"
    assert relay.sink.events[-1] == "end" and relay.exchange.output_tokens == 1


# --- back-pressure --------------------------------------------------------------------------------


async def test_a_slow_client_pauses_the_engine_clock_and_then_the_engine() -> None:
    relay = Relay()
    task = await relay.sse()
    relay.sink.paused = True
    relay.send(delta("a"))
    await settle()
    assert relay.sink.events[-1] == "drain"
    relay.clock.advance(LIMITS.output_gap_timeout * 10)  # a slow client is not a slow engine
    filler = b": " + b"f" * 1000 + b"\n\n"
    for _ in range(300):  # 300 KB the client cannot take: over the attempt's high water
        relay.send(filler)
    await settle()
    assert not task.done()
    assert not relay.engine.transport.reading  # pylon stopped reading the engine
    relay.sink.resume()
    await settle()
    assert relay.engine.transport.reading  # everything buffered was relayed
    assert relay.sink.body == delta("a") + filler * 300
    relay.clock.advance(LIMITS.output_gap_timeout)  # and the engine's clock runs again
    failure = await task
    assert failure is not None and failure.code.value == "upstream_timeout"


async def test_a_client_that_reads_nothing_for_the_send_timeout_is_cut() -> None:
    relay = Relay(RelayLimits(30.0, 5.0, 1024, client_send_timeout=0.0))
    task = await relay.sse()
    relay.sink.paused = True
    relay.send(delta("a"))
    with pytest.raises(ClientStalled):
        await task
    assert relay.sink.events == ["start", "write", "drain", "abort"]


# --- the raw relay --------------------------------------------------------------------------------


async def test_a_whole_body_with_its_head_is_relayed_without_a_timer() -> None:
    body = b'{"usage":{"prompt_tokens":2,"completion_tokens":3}}'
    relay = Relay()
    relay.engine.send(whole_response(200, body))
    await relay.exchange.attempt.head
    relay.exchange.response_head(200, None)
    await relay_raw(relay.exchange, relay.response_head(), LIMITS)

    assert relay.sink.events == ["start", "write", "end"] and relay.sink.body == body
    assert relay.sink.content_length == len(body)
    assert relay.clock.armed == []
    assert (relay.exchange.input_tokens, relay.exchange.output_tokens) == (2, 3)


async def test_a_body_in_pieces_is_relayed_as_it_comes() -> None:
    relay = Relay()
    await relay.head(200, ((b"transfer-encoding", b"chunked"),))
    task = relay.loop.create_task(relay_raw(relay.exchange, relay.response_head(), LIMITS))
    await settle()
    for piece in (b"[1,", b"2,", b"3]"):
        relay.clock.advance(LIMITS.output_gap_timeout - 0.1)  # each piece just in time
        relay.send(piece)
        await settle()
    relay.engine.end()
    await task
    assert relay.sink.writes == [b"[1,", b"2,", b"3]"] and relay.sink.events[-1] == "end"
    assert relay.sink.content_length is None


async def test_a_body_that_stops_arriving_is_cut_as_an_upstream_timeout() -> None:
    relay = Relay()
    await relay.head(200, ((b"content-length", b"10"),))
    task = relay.loop.create_task(relay_raw(relay.exchange, relay.response_head(), LIMITS))
    relay.engine.send(b"12345")
    await settle()
    relay.clock.advance(LIMITS.output_gap_timeout)
    with pytest.raises(AlreadyAnswered) as cut:
        await task
    assert cut.value.outcome == "upstream_timeout"
    assert cut.value.error.detail == "the response body stopped arriving"
    assert relay.sink.events == ["start", "write", "abort"]


async def test_a_body_that_breaks_is_cut_as_broken_mid_body() -> None:
    relay = Relay()
    await relay.head(200, ((b"content-length", b"10"),))
    task = relay.loop.create_task(relay_raw(relay.exchange, relay.response_head(), LIMITS))
    relay.engine.send(b"12345")
    await settle()
    relay.engine.close()
    with pytest.raises(AlreadyAnswered) as cut:
        await task
    assert cut.value.outcome == "upstream_broken_mid_body"
    assert relay.sink.events == ["start", "write", "abort"]
