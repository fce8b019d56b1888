"""Engine response -> client: the SSE relay (event by event, with output timeouts) and the raw one.

Each relay writes one block per wake-up (everything the engine sent since the last one), waits on
the client's back-pressure, and turns engine failures into what the client can still be told: a
problem response before the head, a terminal SSE error event after it, or a cut connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import orjson

from pylon.core.errors import ErrorCode, PylonError, UpstreamError, openai_error
from pylon.core.http import Header
from pylon.core.sse import SseEventTooLarge, SseSplitter, error_event, is_output_event, iter_events
from pylon.proxy.sink import ResponseSink
from pylon.timers import Deadline
from pylon.upstream.pool import Exchange, UpstreamBroken, UpstreamTimeout


@dataclass(frozen=True, slots=True)
class RelayLimits:
    first_output_timeout: float  # seconds from dispatch to the first output event
    output_gap_timeout: float  # seconds allowed between events once output started
    max_sse_event_bytes: int  # largest event that may arrive without ending
    client_send_timeout: float = 30.0  # seconds a client may leave the response unread


class Watchdog(Deadline):
    """The relay's timer: when it expires, the engine exchange fails with the armed reason.

    Re-arming per event only stores a float (see `Deadline`), so the gap timeout is nearly free.
    """

    __slots__ = ("_exchange", "_reason")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self._exchange: Exchange | None = None
        self._reason = ""

    def attach(self, exchange: Exchange) -> None:
        self._exchange = exchange

    def expired(self) -> None:
        if self._exchange is not None:
            self._exchange.fail(UpstreamTimeout(self._reason))

    def arm_for(self, seconds: float, reason: str) -> None:
        self._reason = reason
        self.arm(seconds)


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
    `upstream_broken_mid_body`)."""

    def __init__(self, outcome: str) -> None:
        super().__init__(outcome)
        self.outcome = outcome


async def relay_sse(
    exchange: Exchange,
    sink: ResponseSink,
    watchdog: Watchdog,
    limits: RelayLimits,
    request_id: str | None,
    on_first_output: Callable[[], None],
    on_output: Callable[[int], None] | None = None,
) -> PylonError | None:
    """Relay an event stream whose head was sent; returns the failure told to the client.

    `on_output`: told, for each block relayed from the first output on, how many output
    events it held (`output_event_count`; None: nobody counts, and nothing is counted)."""
    splitter = SseSplitter(limits.max_sse_event_bytes)
    watchdog.arm_for(limits.first_output_timeout, "no output before the first-output timeout")
    seen_output = False
    failure: PylonError | None = None
    try:
        while (chunk := await exchange.next_chunk()) is not None:
            block = splitter.feed_block(chunk)
            if not block:
                continue
            sink.write(block)
            if seen_output or any(map(is_output_event, iter_events(block))):
                if not seen_output:
                    seen_output = True
                    on_first_output()
                if on_output is not None:
                    on_output(output_event_count(block))
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
    except UpstreamTimeout as exc:
        failure = UpstreamError(str(exc), code=ErrorCode.UPSTREAM_TIMEOUT)
    except UpstreamBroken as exc:
        failure = UpstreamError(str(exc), code=ErrorCode.UPSTREAM_PROTOCOL_ERROR)
    except SseEventTooLarge as exc:
        failure = UpstreamError(str(exc), code=ErrorCode.UPSTREAM_PROTOCOL_ERROR)
        exchange.fail(UpstreamBroken(str(exc)))  # the connection cannot be reused
    if failure is not None:
        failure.request_id = request_id
        sink.write(error_event(sse_error_payload(failure)))
    sink.end()
    return failure


async def relay_raw(
    exchange: Exchange,
    sink: ResponseSink,
    headers: list[Header],
    watchdog: Watchdog,
    limits: RelayLimits,
) -> None:
    """Relay any other response as it comes; a break after the head cuts the stream.

    The body must keep coming: the output-gap timeout runs between pieces, so an engine that
    stalls after its head cannot hold the request (and the client) forever.
    """
    sink.start(exchange.status, headers, content_length(exchange.headers))
    gap = limits.output_gap_timeout
    try:
        while True:
            if not exchange.ready:
                # Only a wait needs the clock: a small body that came with its head (the
                # common case) never arms a timer.
                watchdog.arm_for(gap, "the response body stopped arriving")
            chunk = await exchange.next_chunk()
            if chunk is None:
                break
            sink.write(chunk)
            if sink.paused:
                await drain_within(sink, watchdog, limits, "the response body stopped arriving")
    except UpstreamTimeout:
        # The head is out; a half body cannot be signalled in HTTP/1.1 except by closing.
        sink.abort()
        raise AlreadyAnswered("upstream_timeout") from None
    except UpstreamBroken:
        sink.abort()
        raise AlreadyAnswered("upstream_broken_mid_body") from None
    watchdog.cancel()
    sink.end()


def output_event_count(block: bytes) -> int:
    """Output events in a block of whole events, counted cheaply: its `data:` fields, less a
    `[DONE]`. Engines stream one token per event by default, so this is the output token
    count the routers' decode accounting needs (approximate where an engine batches tokens
    into one event, or an event has several `data:` lines)."""
    return block.count(b"data:") - block.count(b"data: [DONE]")


def sse_error_payload(error: PylonError) -> bytes:
    """The terminal `event: error` data: the same OpenAI-style `error` member as a problem
    body's (`pylon.core.errors.openai_error`), so a client reads both the same way."""
    return orjson.dumps({"error": openai_error(error, error.request_id)})


def is_event_stream(headers: Sequence[Header]) -> bool:
    for name, value in headers:
        if name.lower() == b"content-type":
            return value.lower().startswith(b"text/event-stream")
    return False


def content_length(headers: Sequence[Header]) -> int | None:
    for name, value in headers:
        if name.lower() == b"content-length":
            return int(value) if value.strip().isdigit() else None
    return None
