"""The transport-neutral forwarding core: plan, book a worker, send, relay, release.

Every transport hands an admitted request and its body to `Proxy.handle` with a `ResponseSink`;
everything after that (strip, adapt, route, forward, relay, timeouts, retry marking, observation)
happens here, once, for all of them. The parts are injected: the planner (contract -> plan), the
router (plan -> booking), the upstream pool, the observer, the relay limits.
"""

from __future__ import annotations

import asyncio
import time

from pylon.core.contract import HealthRequest, TunnelRequest
from pylon.core.errors import ErrorCode, PylonError, UpstreamError
from pylon.core.plan import ForwardPlan, Planner
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
    ) -> None:
        self._planner = planner
        self._router = router
        self._pool = pool
        self._observer = observer
        self._relay = relay
        self._retry = retry
        self._retry_header = frozenset({retry.upstream_retry_header})
        self._loop = pool.loop

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
        try:
            booking = await self._router.book(plan)
        except NoWorker as exc:
            self.reject(sink, UpstreamError(str(exc), code=ErrorCode.NO_WORKER), record)
            return
        record.worker = booking.target.label
        try:
            await self._forward(plan.routed(booking.target, booking.headers), booking, sink, record)
        finally:
            booking.release(record.outcome)
            record.done_at = self._loop.time()
            self._observer.done(record)

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
        self, plan: ForwardPlan, booking: Booking, sink: ResponseSink, record: RequestRecord
    ) -> None:
        watchdog = Watchdog(self._loop)
        exchange: Exchange | None = None
        record.outcome = "ok"
        try:
            if plan.stream_requested:
                watchdog.arm_for(self._relay.first_output_timeout, "no response head in time")
            exchange = await self._open_exchange(plan, sink, watchdog, record)
            if exchange is None:
                return
            await self._relay_response(plan, exchange, booking, sink, watchdog, record)
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

    async def _open_exchange(
        self, plan: ForwardPlan, sink: ResponseSink, watchdog: Watchdog, record: RequestRecord
    ) -> Exchange | None:
        """Send the plan and wait for the response head; None when a problem was answered.

        A request written into a kept-alive connection that the engine had just closed (no
        response byte at all) is sent once more on a new connection: the engine never read it.
        """
        fresh = False
        while True:
            try:
                exchange = await self._pool.send(plan, fresh=fresh)
            except UpstreamConnectError as exc:
                self._answer_connect_failure(sink, plan, exc, record)
                return None
            record.dispatched_at = self._loop.time()
            if not fresh:
                self._observer.dispatched(record, plan)
            watchdog.attach(exchange)
            try:
                await exchange.head
            except UpstreamBroken:
                if fresh or not exchange.stale_connection:
                    self._pool.finish(exchange)
                    raise
                self._pool.finish(exchange)
                fresh = True
                continue
            except BaseException:
                self._pool.finish(exchange)
                raise
            return exchange

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

    async def _relay_response(
        self,
        plan: ForwardPlan,
        exchange: Exchange,
        booking: Booking,
        sink: ResponseSink,
        watchdog: Watchdog,
        record: RequestRecord,
    ) -> None:
        status = exchange.status
        record.status = status
        headers = sanitize_response_headers(exchange.headers, self._retry_header)
        headers += echo_request_id(plan.request_id)
        mark = classify_upstream_response(status, exchange.headers, self._retry, time.time())
        if mark is not None:
            headers += mark.headers()
            self._observer.upstream_status(record, mark)
        record.first_byte_at = self._loop.time()
        if status == 200 and is_event_stream(exchange.headers):
            sink.start(200, headers, None)
            failure = await relay_sse(
                exchange,
                sink,
                watchdog,
                self._relay,
                plan.request_id,
                lambda: self._first_output(booking, record),
                record,
            )
            if failure is not None:
                record.outcome = failure.code.value
                self._observer.upstream_failed(record, failure, after_head=True)
        else:
            self._first_output(booking, record)
            await relay_raw(exchange, sink, headers, watchdog, self._relay, record)

    def _first_output(self, booking: Booking, record: RequestRecord) -> None:
        record.first_output_at = self._loop.time()
        booking.first_output()
        self._observer.first_output(record)
