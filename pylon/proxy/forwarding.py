"""The transport-neutral forwarding core: plan, book a worker, send, relay, release.

Every transport hands an admitted request and its body to `Proxy.handle` with a `ResponseSink`;
everything after that (strip, adapt, queue admission, route, forward, relay, timeouts, retry
marking, observation) happens here, once, for all of them. The parts are injected: the planner
(contract -> plan), the queue admission (plan -> entry in the live request table, or a 429), the
router (plan -> booking), the upstream pool, the observer, the relay limits, and the tracer
(None when tracing is off).
"""

from __future__ import annotations

import asyncio
import time

from pylon.core.contract import HealthRequest, TunnelRequest
from pylon.core.errors import ErrorCode, PylonError, UpstreamError
from pylon.core.http import Header
from pylon.core.plan import ForwardPlan, Planner
from pylon.core.queue import QueueAdmission, QueueEntry
from pylon.core.retry import RetryPolicy, classify_upstream_response, local_connect_failure
from pylon.core.sanitize import sanitize_response_headers
from pylon.core.usage import FROM_GATEWAY
from pylon.observe import Observer, RequestRecord
from pylon.proxy.relay import (
    AlreadyAnswered,
    ClientStalled,
    RelayLimits,
    Watchdog,
    is_event_stream,
    relay_raw,
    relay_sse,
)
from pylon.proxy.sink import ResponseSink, echo_request_id, send_problem
from pylon.routing import Booking, NoWorker, Router
from pylon.tracing import ExchangeSpan, ExchangeTracer
from pylon.upstream.pool import (
    Exchange,
    UpstreamBroken,
    UpstreamBusy,
    UpstreamConnectError,
    UpstreamPool,
    UpstreamTimeout,
)


class Proxy:
    def __init__(
        self,
        *,
        planner: Planner,
        router: Router,
        pool: UpstreamPool,
        observer: Observer,
        relay: RelayLimits,
        retry: RetryPolicy,
        queue: QueueAdmission,
        tracer: ExchangeTracer | None = None,
    ) -> None:
        self._planner = planner
        self._queue = queue
        self._router = router
        self._pool = pool
        self._observer = observer
        self._relay = relay
        self._retry = retry
        self._retry_header = frozenset({retry.upstream_retry_header})
        self._loop = pool.loop
        self._tracer = tracer

    @property
    def observer(self) -> Observer:
        return self._observer

    async def handle(
        self,
        request: TunnelRequest | HealthRequest,
        body: bytes,
        sink: ResponseSink,
        record: RequestRecord,
    ) -> None:
        """Carry an admitted request to the engine and the answer back."""
        try:
            if isinstance(request, TunnelRequest):
                plan = self._planner.plan(request, body)
                if request.input_tokens is not None:
                    record.input_tokens = request.input_tokens
                    record.input_tokens_source = FROM_GATEWAY
            else:
                plan = self._planner.plan_health(request)
        except PylonError as error:
            error.request_id = request.request_id
            self.reject(sink, error, record)
            return
        record.stripped = plan.stripped
        entry: QueueEntry | None = None
        if isinstance(request, TunnelRequest):
            entry = self._queue.admit(request, len(plan.body), plan.stream_requested)
            decision = entry.decision
            if decision is not None:
                self._observer.queue_admission(record, decision)
                if decision.rejected:
                    self.reject(sink, self._queue.refusal(decision, request.request_id), record)
                    return
        try:
            try:
                booking = self._router.book(plan)
            except NoWorker as exc:
                self.reject(sink, UpstreamError(str(exc), code=ErrorCode.NO_WORKER), record)
                return
            record.worker = booking.worker
            span: ExchangeSpan | None = None
            try:
                trace = None
                if self._tracer is not None and isinstance(request, TunnelRequest):
                    # The plan carries the span's trace context to the engine, not the client's.
                    span = self._tracer.start(request, plan, record)
                    trace = span.trace
                routed = plan.routed(booking.target, booking.headers, trace, booking.body)
                await self._forward(routed, booking, entry, sink, record)
            finally:
                booking.release(record.outcome)  # whatever happened, the booking is freed
                record.done_at = self._loop.time()
                if entry is not None:
                    entry.release(record.done_at)  # before `done`: observers see it gone
                    entry = None
                if span is not None:
                    span.end(record)
                self._observer.done(record)
        finally:
            if entry is not None:
                entry.release(self._loop.time())  # refused or cancelled before the exchange

    def reject(self, sink: ResponseSink, error: PylonError, record: RequestRecord) -> None:
        """Answer with pylon's own problem response; the engine never sees the request."""
        if error.request_id is None:
            error.request_id = record.request_id
        elif record.request_id is None:
            record.request_id = error.request_id
        send_problem(sink, error)
        record.status = error.status
        record.outcome = error.code.value
        record.done_at = self._loop.time()
        self._observer.rejected(record, error)

    async def _forward(
        self,
        plan: ForwardPlan,
        booking: Booking,
        entry: QueueEntry | None,
        sink: ResponseSink,
        record: RequestRecord,
    ) -> None:
        """Send the plan, wait for the response head, relay the response.

        A request written into a kept-alive connection that the engine had just closed (no
        response byte at all) is sent once more on a new connection: the engine never read it.
        (One coroutine, not one per step: this runs for every request.)
        """
        watchdog = Watchdog(self._loop)
        exchange: Exchange | None = None
        record.outcome = "ok"
        try:
            if plan.stream_requested:
                watchdog.arm_for(self._relay.first_output_timeout, "no response head in time")
            fresh = False
            while True:
                exchange = None if fresh else self._pool.send_idle(plan)
                if exchange is None:
                    try:
                        exchange = await self._pool.send(plan, fresh=fresh)
                    except UpstreamConnectError as exc:
                        self._answer_connect_failure(sink, plan, exc, record)
                        return
                record.dispatched_at = now = self._loop.time()
                if not fresh:
                    if entry is not None:
                        entry.dispatched(now)
                    self._observer.dispatched(record, plan)
                watchdog.attach(exchange)
                try:
                    await exchange.head
                    break
                except UpstreamBroken:
                    if fresh or not exchange.stale_connection:
                        raise
                    self._pool.finish(exchange)
                    exchange = None
                    fresh = True
            headers = self._response_headers(plan, exchange, record)
            if exchange.status == 200 and is_event_stream(exchange.headers, exchange.names):
                await self._relay_events(
                    plan, exchange, headers, booking, entry, sink, watchdog, record
                )
            else:
                # The head of a whole response: prefill (and generation) is over. It measures the
                # input throughput only where it ends a prefill: a successful non-stream request.
                sample = exchange.status == 200 and not plan.stream_requested
                self._first_output(booking, entry, record, sample)
                await relay_raw(exchange, sink, headers, watchdog, self._relay, record)
        except AlreadyAnswered as cut:
            record.outcome = cut.outcome
            cut.error.request_id = plan.request_id
            self._observer.upstream_failed(record, cut.error, after_head=True)
        except ClientStalled:
            record.outcome = "client_send_timeout"  # the stream was reset; the engine stops
        except (UpstreamBroken, UpstreamTimeout) as exc:
            # Nothing was sent to the client yet (the relays handle failures after the head).
            code = (
                ErrorCode.UPSTREAM_TIMEOUT
                if isinstance(exc, UpstreamTimeout)
                else ErrorCode.UPSTREAM_PROTOCOL_ERROR
            )
            error = UpstreamError(str(exc), code=code, request_id=plan.request_id)
            send_problem(sink, error)
            record.status, record.outcome = code.status, code.value
            self._observer.upstream_failed(record, error, after_head=False)
        except asyncio.CancelledError as cancel:
            # The transport says why (client reset, connection lost, shutdown, send timeout).
            record.outcome = str(cancel.args[0]) if cancel.args else "cancelled"
            raise
        finally:
            watchdog.cancel()
            if exchange is not None:
                self._pool.finish(exchange)

    def _answer_connect_failure(
        self,
        sink: ResponseSink,
        plan: ForwardPlan,
        exc: UpstreamConnectError,
        record: RequestRecord,
    ) -> None:
        busy = isinstance(exc, UpstreamBusy)
        code = ErrorCode.UPSTREAM_BUSY if busy else ErrorCode.UPSTREAM_UNAVAILABLE
        error = UpstreamError(str(exc), code=code, request_id=plan.request_id)
        # Busy: the engine never saw the request, so another node may take it. A refused
        # connection is retryable only where the operator says so.
        send_problem(sink, error, None if busy else local_connect_failure(self._retry))
        record.status, record.outcome = error.status, code.value
        self._observer.upstream_failed(record, error, after_head=False)

    def _response_headers(
        self, plan: ForwardPlan, exchange: Exchange, record: RequestRecord
    ) -> list[Header]:
        """The engine's response head as the client gets it: stripped, the request's id echoed,
        and the retry marking of an error status."""
        status = exchange.status
        record.status = status
        headers = sanitize_response_headers(exchange.headers, self._retry_header, exchange.names)
        headers += echo_request_id(plan.request_id)
        mark = classify_upstream_response(status, exchange.headers, self._retry, time.time())
        if mark is not None:
            headers += mark.headers()
            self._observer.upstream_status(record, mark)
        record.first_byte_at = self._loop.time()
        return headers

    async def _relay_events(
        self,
        plan: ForwardPlan,
        exchange: Exchange,
        headers: list[Header],
        booking: Booking,
        entry: QueueEntry | None,
        sink: ResponseSink,
        watchdog: Watchdog,
        record: RequestRecord,
    ) -> None:
        if entry is not None:
            entry.head()
        sink.start(200, headers, None)
        failure = await relay_sse(
            exchange,
            sink,
            watchdog,
            self._relay,
            plan.request_id,
            lambda: self._first_output(booking, entry, record, True),
            record,
            booking.output_tokens if booking.counts_output else None,
        )
        if failure is not None:
            record.outcome = failure.code.value
            self._observer.upstream_failed(record, failure, after_head=True)

    def _first_output(
        self, booking: Booking, entry: QueueEntry | None, record: RequestRecord, sample: bool
    ) -> None:
        record.first_output_at = now = self._loop.time()
        if entry is not None:
            entry.first_output(now, sample)
        booking.first_output()
        self._observer.first_output(record)
