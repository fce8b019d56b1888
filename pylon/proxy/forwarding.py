"""The transport-neutral way out: plan, queue gate, book a worker, attempt, relay.

Every transport hands an admitted request and its body to `Proxy.handle` with the request's
`Exchange`; everything after that (strip, adapt, queue gate, route, forward, relay, timeouts,
retry marking) happens here, once, for all of them, and the exchange tells every subscriber
each moment. The parts are injected: the planner (contract -> plan), the queue gate (plan ->
entry in the live request table, or a 429), the router (plan -> booking), the upstream pool,
the relay limits, and the tracer (None when tracing is off).
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from pylon.core.contract import TraceContext, TunnelRequest, check_input_tokens
from pylon.core.errors import ErrorCode, PylonError, UpstreamError
from pylon.core.http import Header
from pylon.core.intake import AdmittedRequest
from pylon.core.plan import ForwardPlan, Planner
from pylon.core.queue import QueueDecision, QueueGate
from pylon.core.retry import RetryPolicy, classify_upstream_response, local_connect_failure
from pylon.core.sanitize import ResponseHead, sanitize_response_head
from pylon.observe import Observer
from pylon.proxy.exchange import Exchange
from pylon.proxy.relay import (
    AlreadyAnswered,
    ClientStalled,
    RelayLimits,
    relay_raw,
    relay_sse,
)
from pylon.proxy.sink import echo_request_id, send_problem
from pylon.routing import Booking, NoWorker, Router
from pylon.tracing import ExchangeTracer
from pylon.upstream import (
    Attempt,
    UpstreamBroken,
    UpstreamBusy,
    UpstreamConnectError,
    UpstreamPool,
    UpstreamTimeout,
)


class AttemptPool(Protocol):
    """What the proxy uses of the upstream pool (`pylon.upstream.UpstreamPool`): the loop its
    attempts run on, and attempts written (on an idle connection, or on one it opens or waits
    for) and finished. A seam, so the proxy can be driven without sockets."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    def send_idle(self, plan: ForwardPlan) -> Attempt | None: ...

    async def send(self, plan: ForwardPlan, *, fresh: bool = False) -> Attempt: ...

    def finish(self, attempt: Attempt) -> None: ...


class Proxy:
    def __init__(
        self,
        *,
        planner: Planner,
        router: Router,
        pool: AttemptPool,
        observer: Observer,
        relay: RelayLimits,
        retry: RetryPolicy,
        queue: QueueGate,
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

    async def handle(self, exchange: Exchange, request: AdmittedRequest, body: bytes) -> None:
        """Carry an admitted request to the engine and the answer back."""
        try:
            if isinstance(request, TunnelRequest):
                if request.input_tokens is not None:  # a claim the queue table would believe
                    check_input_tokens(request, len(body))
                plan = self._planner.plan(request, body)
                entry = self._queue.admit(request, len(plan.body), plan.stream_requested)
                exchange.planned(plan, len(body), request.input_tokens, entry)
                if entry.decision is not None:
                    self._queue_gate(exchange, entry.decision, request)  # raises a refusal
            else:
                plan = self._planner.plan_health(request)
                exchange.planned(plan, len(body), None)
            booking = await self._router.book(plan)
            exchange.booked(booking)
            # The span (when tracing) carries its own trace context to the engine.
            trace = None if self._tracer is None else self._trace(exchange, request, plan)
            await self._forward(exchange, plan, booking, trace)
        except PylonError as error:  # answered before any engine saw the request
            exchange.reject(exchange.sink, error)
        except NoWorker as exc:
            exchange.reject(exchange.sink, UpstreamError(str(exc), code=ErrorCode.NO_WORKER))
        except asyncio.CancelledError as cancel:
            # The transport says why (client reset, connection lost, shutdown, send timeout).
            exchange.ended_by(str(cancel.args[0]) if cancel.args else "cancelled")
            raise
        finally:
            exchange.complete()  # a no-op after a rejection

    def _queue_gate(
        self, exchange: Exchange, decision: QueueDecision, request: TunnelRequest
    ) -> None:
        """Tell the gate's decision on a request that carried the gateway's expectation; a
        rejection raises its 429 (the queue entry never joined the table)."""
        exchange.queue_decided(decision)
        if decision.rejected:
            raise self._queue.refusal(decision, request.request_id)

    def _trace(
        self, exchange: Exchange, request: AdmittedRequest, plan: ForwardPlan
    ) -> TraceContext | None:
        """Start the exchange's span; the trace context the engine continues (None: the
        client's own, for a health request)."""
        if self._tracer is None or not isinstance(request, TunnelRequest):
            return None
        span = self._tracer.start(request, plan, exchange)
        exchange.subscribe(span)
        return span.trace

    async def _forward(
        self,
        exchange: Exchange,
        unrouted: ForwardPlan,
        booking: Booking,
        trace: TraceContext | None,
    ) -> None:
        """Attempt the plan on the booked worker, wait for the response head, relay the response.

        A request written into a kept-alive connection that the engine had just closed (no
        response byte at all) gets a second attempt on a new connection: the engine never read
        the first. A request whose worker could not be reached at all (refused, reset before
        the request was written) moves, once, to another worker the router books: no engine
        saw it. (One coroutine, not one per step: this runs for every request.)
        """
        attempt: Attempt | None = None
        plan = exchange.plan = unrouted.routed(
            booking.upstream, booking.headers, trace, booking.body
        )
        try:
            # Every request's head is due within --response-head-timeout (the upstream
            # connection's own clock); a stream's also within the first-output timeout.
            if plan.stream_requested:
                timeout = self._relay.first_output_timeout
                exchange.clock().arm_for(timeout, "no response head in time")
            fresh = moved = False
            while True:
                attempt = None if fresh else self._pool.send_idle(plan)
                if attempt is None:
                    try:
                        attempt = await self._pool.send(plan, fresh=fresh)
                    except UpstreamConnectError as refused:  # (one name per handler: see relay_sse)
                        other = None
                        if not moved and not isinstance(refused, UpstreamBusy):
                            other = self._router.elsewhere(unrouted, booking)
                        if other is None:
                            self._answer_connect_failure(exchange, refused)
                            return
                        self._moved(exchange, booking, other, refused)
                        booking, moved, fresh = other, True, False
                        plan = exchange.plan = unrouted.routed(
                            other.upstream, other.headers, trace, other.body
                        )
                        continue
                if exchange.dispatched_at is None:
                    exchange.dispatched(attempt)  # after a move: the first one written
                else:
                    exchange.retried(attempt)  # one written already: never a second dispatch
                try:
                    await attempt.head
                    break
                except UpstreamBroken:
                    if fresh or not attempt.stale_connection:
                        raise
                    self._pool.finish(attempt)
                    attempt = None
                    fresh = True
            head = self._response_head(exchange, attempt)
            if head.event_stream and head.status == 200:
                await self._relay_events(exchange, head.fields)
            else:
                # The head of a whole response: prefill (and generation) is over. It measures the
                # input throughput only where it ends a prefill: a successful non-stream request.
                exchange.first_output(head.status == 200 and not plan.stream_requested)
                await relay_raw(exchange, head, self._relay)
        except AlreadyAnswered as cut:
            cut.error.request_id = plan.request_id
            exchange.failed(cut.error, cut.outcome, after_head=True)
        except ClientStalled:
            exchange.ended_by("client_send_timeout")  # the stream was reset; the engine stops
        except (UpstreamBroken, UpstreamTimeout) as exc:
            # Nothing was sent to the client yet (the relays handle failures after the head).
            code = (
                ErrorCode.UPSTREAM_TIMEOUT
                if isinstance(exc, UpstreamTimeout)
                else ErrorCode.UPSTREAM_PROTOCOL_ERROR
            )
            error = UpstreamError(str(exc), code=code, request_id=plan.request_id)
            exchange.sent(send_problem(exchange.sink, error))
            exchange.failed(error, code.value, after_head=False)
        finally:
            if attempt is not None:
                self._pool.finish(attempt)

    def _moved(
        self, exchange: Exchange, booking: Booking, other: Booking, exc: UpstreamConnectError
    ) -> None:
        """The booked worker could not be reached: the exchange moves to `other`'s worker (the
        first booking is released as not served, one attempt counted)."""
        error = UpstreamError(
            str(exc), code=ErrorCode.UPSTREAM_UNAVAILABLE, request_id=exchange.request_id
        )
        exchange.rebooked(booking, other, error)
        self._observer.process_event(
            "upstream_moved",
            request_id=exchange.request_id,
            worker=booking.worker,
            to=other.worker,
            detail=str(exc),
        )

    def _answer_connect_failure(self, exchange: Exchange, exc: UpstreamConnectError) -> None:
        busy = isinstance(exc, UpstreamBusy)
        code = ErrorCode.UPSTREAM_BUSY if busy else ErrorCode.UPSTREAM_UNAVAILABLE
        error = UpstreamError(str(exc), code=code, request_id=exchange.request_id)
        # Busy: the engine never saw the request, so another node may take it. A refused
        # connection is retryable only where the operator says so.
        mark = None if busy else local_connect_failure(self._retry)
        exchange.sent(send_problem(exchange.sink, error, mark))
        exchange.failed(error, code.value, after_head=False)

    def _response_head(self, exchange: Exchange, attempt: Attempt) -> ResponseHead:
        """The engine's response head as the client gets it: stripped, the request's id echoed,
        and the retry marking of an error status."""
        status = attempt.status
        head = sanitize_response_head(status, attempt.headers, self._retry_header)
        head.fields.extend(echo_request_id(exchange.request_id))
        mark = classify_upstream_response(status, attempt.headers, self._retry, time.time())
        if mark is not None:
            head.fields.extend(mark.headers())
        exchange.response_head(status, mark)
        return head

    async def _relay_events(self, exchange: Exchange, headers: list[Header]) -> None:
        exchange.sink.start(200, headers, None)
        failure = await relay_sse(exchange, self._relay)
        if failure is not None:
            exchange.failed(failure, failure.code.value, after_head=True)


_: type[AttemptPool] = UpstreamPool
