"""The transport-neutral forwarding core: carry out a `ForwardPlan` against the engine.

Every ingress (HTTP/1.1 today) reduces its request to (method, target, raw header pairs, body)
and provides a `ResponseSink`; everything else (contract, strip, adapt, forward, relay, limits,
timeouts, retry marking, logging) happens here, once, for all of them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from typing import Any, Protocol

import orjson

from pylon.adapters import build_adapter
from pylon.auth import TokenAuth, strip_authorization, unauthorized
from pylon.core.contract import HealthRequest, TunnelRequest, parse_request
from pylon.core.errors import ErrorCode, PylonError, UpstreamError, problem_body
from pylon.core.http import Header
from pylon.core.plan import ForwardPlan, Planner
from pylon.core.retry import RetryMark, classify_upstream_response, local_connect_failure
from pylon.core.sanitize import sanitize_response_headers
from pylon.core.sse import (
    SseEventTooLarge,
    SseSplitter,
    error_event,
    is_output_event,
    iter_events,
)
from pylon.logs import get_logger
from pylon.settings import Settings
from pylon.timers import Deadline
from pylon.upstream.pool import (
    Exchange,
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamPool,
    UpstreamTimeout,
)

_PROBLEM_HEADERS: tuple[Header, ...] = ((b"content-type", b"application/problem+json"),)
_SSE_ERROR_TYPES = {
    ErrorCode.UPSTREAM_TIMEOUT: "upstream_timeout",
    ErrorCode.UPSTREAM_PROTOCOL_ERROR: "upstream_error",
}


class ResponseSink(Protocol):
    """What an ingress transport offers the core for one response."""

    @property
    def paused(self) -> bool:
        """True while the client is not keeping up; the core then awaits `drain`."""
        ...

    def start(self, status: int, headers: Sequence[Header], content_length: int | None) -> None:
        """Send the response head; `content_length` None means a streamed body."""
        ...

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

    def end(self) -> None:
        """The body is complete."""
        ...

    def abort(self) -> None:
        """The body cannot be completed: reset the stream / close the connection."""
        ...


class Watchdog(Deadline):
    """The relay's timer: when it expires, the engine exchange fails with the armed reason.

    Re-arming per event only stores a float (see `Deadline`), so the gap timeout is nearly free.
    """

    __slots__ = ("_exchange", "_reason")

    def __init__(self, loop: asyncio.AbstractEventLoop, exchange: Exchange) -> None:
        super().__init__(loop)
        self._exchange = exchange
        self._reason = ""

    def expired(self) -> None:
        self._exchange.fail(UpstreamTimeout(self._reason))

    def arm_for(self, seconds: float, reason: str) -> None:
        self._reason = reason
        self.arm(seconds)


class Proxy:
    def __init__(self, settings: Settings, pool: UpstreamPool) -> None:
        self._settings = settings
        self._pool = pool
        self._planner = Planner(
            build_adapter(
                settings.backend, settings.adapter_options, derive=settings.derive_priority
            )
        )
        self._retry = settings.retry_policy
        self._retry_header = frozenset({self._retry.upstream_retry_header})
        self._loop = pool.loop
        self._log = get_logger()
        # Tunnel authentication lives here, not in a transport, so every ingress gets it.
        path = settings.tunnel_token_file
        self._auth = TokenAuth(path) if path is not None else None

    def admit(
        self, method: bytes, target: bytes, headers: Sequence[Header]
    ) -> TunnelRequest | HealthRequest:
        """Every transport's first step, at headers time, before any body byte is read.

        The tunnel contract, then tunnel authentication: so a bad or unauthenticated request is
        answered at once, and no transport can forget either. Raises `PylonError`.
        """
        request = parse_request(method, target, headers)
        if (
            self._auth is not None
            and isinstance(request, TunnelRequest)
            and not self._auth.allows(request.headers)
        ):
            error = unauthorized()
            error.request_id = request.request_id
            raise error
        return request

    async def handle(
        self, request: TunnelRequest | HealthRequest, body: bytes, sink: ResponseSink
    ) -> None:
        """Carry an admitted request (see `admit`) to the engine and the answer back."""
        started = time.monotonic()
        request_id = request.request_id
        try:
            if isinstance(request, TunnelRequest):
                plan = self._planner.plan(request, body)
            else:
                plan = self._planner.plan_health(request)
        except PylonError as error:
            self.reject(sink, error, request_id, started, getattr(request, "model", None))
            return
        if self._auth is not None:
            plan = dataclasses.replace(plan, headers=strip_authorization(plan.headers))
        await self._forward(plan, sink, started)

    def reject(
        self,
        sink: ResponseSink,
        error: PylonError,
        request_id: str | None,
        started: float,
        model: str | None = None,
    ) -> None:
        """Answer with pylon's own problem response; the engine never sees the request."""
        send_problem(sink, error, request_id)
        self._log.warning(
            "request_rejected",
            request_id=request_id,
            model=model,
            status=error.status,
            code=error.code.value,
            detail=error.detail,
            duration_ms=round((time.monotonic() - started) * 1000, 3),
        )

    async def _forward(self, plan: ForwardPlan, sink: ResponseSink, started: float) -> None:
        try:
            exchange = await self._pool.send(plan.method, plan.target, plan.headers, plan.body)
        except UpstreamConnectError as exc:
            error = UpstreamError(str(exc), code=ErrorCode.UPSTREAM_UNAVAILABLE)
            send_problem(sink, error, plan.request_id, local_connect_failure(self._retry))
            self._log.warning(
                "upstream_connect_failed",
                request_id=plan.request_id,
                model=plan.model,
                status=503,
                detail=str(exc),
            )
            return
        watchdog = Watchdog(self._loop, exchange)
        outcome = "ok"
        status = 0
        try:
            if plan.stream_requested:
                watchdog.arm_for(self._settings.first_output_timeout, "no response head in time")
            status = await self._relay(plan, exchange, sink, watchdog)
        except _AlreadyAnswered:
            outcome = "upstream_broken_mid_body"
        except (UpstreamBroken, UpstreamTimeout) as exc:
            # Nothing was sent to the client yet (the relay handles failures after the head).
            timeout = isinstance(exc, UpstreamTimeout)
            code = ErrorCode.UPSTREAM_TIMEOUT if timeout else ErrorCode.UPSTREAM_PROTOCOL_ERROR
            status = code.status
            outcome = code.value
            send_problem(sink, UpstreamError(str(exc), code=code), plan.request_id)
        except asyncio.CancelledError:
            outcome = "client_cancelled"
            raise
        finally:
            watchdog.cancel()
            self._pool.finish(exchange)
            self._log_done(plan, status, outcome, started)

    async def _relay(
        self, plan: ForwardPlan, exchange: Exchange, sink: ResponseSink, watchdog: Watchdog
    ) -> int:
        await exchange.wait_head()
        status = exchange.status
        mark = classify_upstream_response(status, exchange.headers, self._retry, time.time())
        headers = sanitize_response_headers(exchange.headers, self._retry_header)
        if mark is not None:
            headers += mark.headers()
            if mark.retryable or status >= 500:
                self._log.info(
                    "upstream_error_status",
                    request_id=plan.request_id,
                    status=status,
                    retryable=mark.retryable,
                    reason=mark.reason,
                )
        if status == 200 and _is_event_stream(exchange.headers):
            await self._relay_sse(plan, exchange, sink, watchdog, headers)
        else:
            watchdog.cancel()
            await self._relay_raw(exchange, sink, headers)
        return status

    async def _relay_sse(
        self,
        plan: ForwardPlan,
        exchange: Exchange,
        sink: ResponseSink,
        watchdog: Watchdog,
        headers: list[Header],
    ) -> None:
        settings = self._settings
        sink.start(200, headers, None)
        splitter = SseSplitter(settings.max_sse_event_bytes)
        watchdog.arm_for(settings.first_output_timeout, "no output before the first-output timeout")
        seen_output = False
        failure: PylonError | None = None
        try:
            while (chunk := await exchange.next_chunk()) is not None:
                block = splitter.feed_block(chunk)
                if not block:
                    continue
                sink.write(block)
                if seen_output or any(map(is_output_event, iter_events(block))):
                    seen_output = True
                    watchdog.arm_for(settings.output_gap_timeout, "gap between events too long")
                if sink.paused:
                    await sink.drain()
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
            sink.write(error_event(_sse_error_payload(failure, plan.request_id)))
            self._log.warning(
                "stream_failed",
                request_id=plan.request_id,
                model=plan.model,
                code=failure.code.value,
                detail=failure.detail,
                seen_output=seen_output,
            )
        sink.end()

    async def _relay_raw(
        self, exchange: Exchange, sink: ResponseSink, headers: list[Header]
    ) -> None:
        length = _content_length(exchange.headers)
        sink.start(exchange.status, headers, length)
        try:
            while (chunk := await exchange.next_chunk()) is not None:
                sink.write(chunk)
                if sink.paused:
                    await sink.drain()
        except (UpstreamBroken, UpstreamTimeout):
            # The head is out; a half body cannot be signalled in HTTP/1.1 except by closing.
            sink.abort()
            raise _AlreadyAnswered() from None
        sink.end()

    def log_crash(self, exc: BaseException | None) -> None:
        self._log.error("request_crashed", exc_info=exc)

    def _log_done(self, plan: ForwardPlan, status: int, outcome: str, started: float) -> None:
        self._log.info(
            "request_done",
            request_id=plan.request_id,
            model=plan.model,
            method=plan.method,
            path=plan.target.split("?", 1)[0],
            status=status,
            outcome=outcome,
            stripped=plan.stripped or None,
            duration_ms=round((time.monotonic() - started) * 1000, 3),
        )


class _AlreadyAnswered(UpstreamBroken):
    """The client already got a head; only the connection can tell it something went wrong."""


def send_problem(
    sink: ResponseSink, error: PylonError, request_id: str | None, mark: RetryMark | None = None
) -> None:
    body = problem_body(error, request_id)
    headers = list(_PROBLEM_HEADERS)
    headers += (mark or RetryMark(False, error.code.value)).headers()
    sink.start(error.status, headers, len(body))
    sink.write(body)
    sink.end()


def _sse_error_payload(error: PylonError, request_id: str | None) -> bytes:
    payload: dict[str, Any] = {
        "error": {
            "message": error.detail,
            "type": _SSE_ERROR_TYPES.get(error.code, error.code.value),
            "code": error.status,
            "request_id": request_id,
        }
    }
    return orjson.dumps(payload)


def _is_event_stream(headers: list[Header]) -> bool:
    for name, value in headers:
        if name.lower() == b"content-type":
            return value.lower().startswith(b"text/event-stream")
    return False


def _content_length(headers: list[Header]) -> int | None:
    for name, value in headers:
        if name.lower() == b"content-length":
            return int(value) if value.strip().isdigit() else None
    return None
