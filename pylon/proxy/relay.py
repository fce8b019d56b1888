"""Engine response -> client: the SSE relay (event by event, with output timeouts) and the raw one.

Each relay writes one block per wake-up (everything the engine sent since the last one), waits on
the client's back-pressure, and turns engine failures into what the client can still be told: a
problem response before the head, a terminal SSE error event after it, or a cut connection.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson

from pylon.core.errors import ErrorCode, PylonError, UpstreamError, openai_error
from pylon.core.sanitize import ResponseHead
from pylon.core.sse import SseEventTooLarge, SseSplitter, error_event, is_output_event, iter_events
from pylon.core.usage import data_events
from pylon.proxy.sink import ResponseSink
from pylon.upstream import UpstreamBroken, UpstreamTimeout

if TYPE_CHECKING:
    from pylon.proxy.exchange import Exchange, Watchdog


@dataclass(frozen=True, slots=True)
class RelayLimits:
    first_output_timeout: float  # seconds from dispatch to the first output event
    output_gap_timeout: float  # seconds allowed between events once output started
    max_sse_event_bytes: int  # largest event that may arrive without ending
    client_send_timeout: float = 30.0  # seconds a client may leave the response unread


class ClientStalled(Exception):
    """The client stopped reading for the whole send timeout; its stream was reset."""


async def drain_within(
    sink: ResponseSink, watchdog: Watchdog, limits: RelayLimits, reason: str
) -> None:
    """Wait for a client that is not keeping up, but not forever.

    The engine's clock is paused meanwhile (a slow client is not a stalled engine) and re-armed
    for the output gap afterwards. A client that reads nothing for `client_send_timeout` has its
    stream reset (HTTP/1.1: the connection closed), and the engine request is cancelled: a GPU
    sequence must not run for a reader that is gone.
    """
    watchdog.disarm()
    try:
        async with asyncio.timeout(limits.client_send_timeout):
            await sink.drain()
    except TimeoutError:
        sink.abort()
        raise ClientStalled(f"the client read nothing for {limits.client_send_timeout} s") from None
    watchdog.arm_for(limits.output_gap_timeout, reason)


class AlreadyAnswered(UpstreamBroken):
    """The client already got a head; only the connection can tell it something went wrong.

    `outcome`: what happened, for the request's record (`upstream_timeout` or
    `upstream_broken_mid_body`); `error`: the failure, for the observers."""

    def __init__(self, outcome: str, error: PylonError) -> None:
        super().__init__(outcome)
        self.outcome = outcome
        self.error = error


async def relay_sse(exchange: Exchange, limits: RelayLimits) -> PylonError | None:
    """Relay the event stream of the exchange's attempt, whose head was sent; returns the
    failure told to the client (a terminal SSE `error` event).

    Tells the exchange its first output and, when a subscriber counts output, how many data
    events each block relayed from then on held (engines stream a token per event: the routers'
    decode accounting); counts the output on the way (also when the stream is cut short): the
    engine's usage when its last events carry one, else the data events relayed.
    """
    attempt, sink = exchange.attempt, exchange.sink
    watchdog = exchange.watchdog or exchange.clock()  # made already when a stream was asked
    splitter = SseSplitter(limits.max_sse_event_bytes)
    watchdog.arm_for(limits.first_output_timeout, "no output before the first-output timeout")
    counting = exchange.counts_output
    seen_output = False
    failure: PylonError | None = None
    events = sent = 0
    previous = last = b""  # the last two blocks: where a usage report is
    try:
        while (chunk := await attempt.next_chunk()) is not None:
            block = splitter.feed_block(chunk)
            if not block:
                continue
            sink.write(block)
            sent += len(block)
            count = data_events(block)
            events += count
            previous, last = last, block
            if seen_output or any(map(is_output_event, iter_events(block))):
                if not seen_output:
                    seen_output = True
                    exchange.first_output(True)
                if counting:
                    exchange.output(count)
                watchdog.arm_for(limits.output_gap_timeout, "gap between events too long")
            if sink.paused:
                await drain_within(sink, watchdog, limits, "gap between events too long")
        if not seen_output:
            failure = UpstreamError(
                "the engine ended the stream before any output",
                code=ErrorCode.UPSTREAM_PROTOCOL_ERROR,
            )
        elif splitter.pending.strip():
            failure = UpstreamError(
                "the engine ended the stream inside an event",
                code=ErrorCode.UPSTREAM_PROTOCOL_ERROR,
            )
    # One name per handler (not `exc` in each): a mypyc build (docs/mypyc-notes.md) gives a
    # local of an async function one type, so a reused name would refuse the second type.
    except UpstreamTimeout as timeout:
        failure = UpstreamError(str(timeout), code=ErrorCode.UPSTREAM_TIMEOUT)
    except UpstreamBroken as broken:
        failure = UpstreamError(str(broken), code=ErrorCode.UPSTREAM_PROTOCOL_ERROR)
    except SseEventTooLarge as too_large:
        failure = UpstreamError(str(too_large), code=ErrorCode.UPSTREAM_PROTOCOL_ERROR)
        attempt.fail(UpstreamBroken(str(too_large)))  # the connection cannot be reused
    finally:
        exchange.count_tokens(previous, last, events)
        exchange.sent(sent)
    if failure is not None:
        failure.request_id = exchange.request_id
        event = error_event(sse_error_payload(failure))
        sink.write(event)
        exchange.sent(len(event))
    sink.end()
    return failure


async def relay_raw(exchange: Exchange, head: ResponseHead, limits: RelayLimits) -> None:
    """Relay any other response of the exchange's attempt as it comes; a break after the head
    cuts the stream.

    The body must keep coming: the output-gap timeout runs between pieces, so an engine that
    stalls after its head cannot hold the request (and the client) forever. A usage report at
    the body's end gives the record its token counts.
    """
    attempt, sink = exchange.attempt, exchange.sink
    sink.start(head.status, head.fields, head.content_length)
    gap = limits.output_gap_timeout
    previous = last = b""  # the last two pieces of the body: where a usage report is
    sent = 0
    try:
        while True:
            if attempt.ready:
                # A small body that came with its head (the common case): no clock, no wait.
                chunk = attempt.take()
            else:
                exchange.clock().arm_for(gap, "the response body stopped arriving")
                chunk = await attempt.next_chunk()
            if chunk is None:
                break
            sink.write(chunk)
            sent += len(chunk)
            previous, last = last, chunk
            if sink.paused:
                reason = "the response body stopped arriving"
                await drain_within(sink, exchange.clock(), limits, reason)
            if attempt.complete:
                break  # the whole body is relayed (no need to ask for its end)
    except UpstreamTimeout as timeout:  # (one name per handler: see relay_sse)
        # The head is out; a half body cannot be signalled in HTTP/1.1 except by closing.
        sink.abort()
        error = UpstreamError(str(timeout), code=ErrorCode.UPSTREAM_TIMEOUT)
        raise AlreadyAnswered("upstream_timeout", error) from None
    except UpstreamBroken as broken:
        sink.abort()
        error = UpstreamError(str(broken), code=ErrorCode.UPSTREAM_PROTOCOL_ERROR)
        raise AlreadyAnswered("upstream_broken_mid_body", error) from None
    finally:
        exchange.sent(sent)
    sink.end()  # (the exchange's end stops its clock)
    if last:
        exchange.count_tokens(previous, last, None)


def sse_error_payload(error: PylonError) -> bytes:
    """The terminal `event: error` data: the same OpenAI-style `error` member as a problem
    body's (`pylon.core.errors.openai_error`), so a client reads both the same way."""
    return orjson.dumps({"error": openai_error(error, error.request_id)})
