"""The tracing seam (`pylon.tracing`) on the OpenTelemetry SDK: OTLP/HTTP export.

Imported only when tracing is on (`--otel-endpoint` / `OTEL_EXPORTER_OTLP_ENDPOINT`); needs the
`otel` extra (`pip install 'pylon[otel]'`), which `pylon.preflight.check_tracing` asks for.

One span per engine exchange, named `pylon.forward`, kind CLIENT: it stands for pylon's request
to the engine, and its context is the one the engine continues, so the engine's SERVER span is
its child (the CLIENT -> SERVER pair trace back ends use to draw the pylon -> engine edge). Its
parent is the client's W3C `traceparent` when the request carried a valid one; otherwise it
starts a new trace. Its clock readings are the request's `RequestRecord`'s: it starts when the
request head arrived and ends when the exchange is over, with events when the request was
written to the engine and when the engine's response head came back.

The provider is pylon's own (not the OpenTelemetry global one) and is shut down, flushing the
batch, when pylon stops. The SDK's own log records (an export that failed, a full queue) are
turned into `tracing_error` process events on the event loop, so they reach pylon's JSON log
like every other line instead of stderr as plain text.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING

from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import (
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    set_span_in_context,
)
from opentelemetry.util.types import AttributeValue

from pylon.core.contract import TraceContext
from pylon.core.hooks import ExchangeHooks
from pylon.tracing import SPAN_NAME, ExchangeSpan, ExchangeTracer, exchange_error

if TYPE_CHECKING:
    from pylon.core.contract import TunnelRequest
    from pylon.core.errors import PylonError
    from pylon.core.plan import ForwardPlan
    from pylon.core.record import RequestRecord
    from pylon.observe import Observer

_NO_PARENT = Context()  # a root span: never the ambient (contextvars) context
_NS = 1_000_000_000


def _version() -> str:
    try:
        return metadata.version("pylon")
    except metadata.PackageNotFoundError:
        return "unknown"


def remote_parent(traceparent: str) -> Context:
    """The context of a (contract-validated) W3C traceparent: `vv-trace_id-parent_id-flags`."""
    parent = SpanContext(
        trace_id=int(traceparent[3:35], 16),
        span_id=int(traceparent[36:52], 16),
        is_remote=True,
        trace_flags=TraceFlags(int(traceparent[53:55], 16)),
    )
    return set_span_in_context(NonRecordingSpan(parent), _NO_PARENT)


class OtelSpan(ExchangeHooks):
    """One exchange's span and the trace context the engine gets; ends with the exchange."""

    __slots__ = ("_offset", "_span", "trace")

    def __init__(self, span: Span, trace: TraceContext | None, offset: int) -> None:
        self._span = span
        self.trace = trace
        self._offset = offset  # epoch ns minus loop-clock ns, read once at the start

    def _ns(self, loop_time: float) -> int:
        return self._offset + int(loop_time * _NS)

    def complete(self, record: RequestRecord) -> None:
        span = self._span
        if not span.is_recording():  # not sampled: nothing to fill in
            span.end()
            return
        attributes: dict[str, AttributeValue] = {"pylon.outcome": record.outcome or "unknown"}
        if record.attempts > 1 and record.worker is not None:
            # A retry (a stale connection, or a move to another worker): where it was served.
            attributes["pylon.worker"] = record.worker
            attributes["pylon.attempts"] = record.attempts
        if record.dispatched_at is not None:
            span.add_event("pylon.dispatched", timestamp=self._ns(record.dispatched_at))
        if record.first_byte_at is not None:  # the engine answered: its status
            attributes["http.response.status_code"] = record.status
            span.add_event("pylon.response_head", timestamp=self._ns(record.first_byte_at))
        error = exchange_error(record)
        if error is not None:
            attributes["error.type"] = error
            span.set_status(Status(StatusCode.ERROR, error))
        span.set_attributes(attributes)
        done = record.done_at
        span.end(end_time=self._ns(done) if done is not None else None)

    def rejected(self, record: RequestRecord, error: PylonError) -> None:
        self.complete(record)


_SDK_LOGGER = logging.getLogger("opentelemetry")


class SdkLogBridge(logging.Handler):
    """The SDK's warnings and errors (its threads log them) as `tracing_error` process events,
    handed to the event loop: the observer is only ever called there."""

    def __init__(self, loop: asyncio.AbstractEventLoop, observer: Observer) -> None:
        super().__init__(logging.WARNING)
        self._loop = loop
        self._observer = observer

    def emit(self, record: logging.LogRecord) -> None:
        event = functools.partial(
            self._observer.process_event,
            "tracing_error",
            logger=record.name,
            detail=record.getMessage(),
        )
        # A closed loop: pylon is gone, there is nobody to tell.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(event)

    def attach(self) -> None:
        _SDK_LOGGER.addHandler(self)
        _SDK_LOGGER.propagate = False  # not to the root logger (plain text on stderr)

    def detach(self) -> None:
        _SDK_LOGGER.removeHandler(self)
        if not _SDK_LOGGER.handlers:
            _SDK_LOGGER.propagate = True


@dataclass(frozen=True, slots=True)
class TracingOptions:
    """Where spans go and what they say about this pylon."""

    service_name: str
    """The `service.name` resource attribute (`--otel-service-name`)."""
    traces_url: str | None
    """The OTLP/HTTP URL spans are posted to (`--otel-endpoint` + `/v1/traces`); None with an
    injected exporter (tests), which has its own."""
    backend: str
    """The engine dialect every span names as `pylon.backend` (`--backend`)."""


class OtelTracer:
    """`ExchangeTracer` on an OpenTelemetry tracer provider of pylon's own."""

    __slots__ = ("_backend", "_bridge", "_clock", "_provider", "_tracer")

    def __init__(
        self,
        provider: TracerProvider,
        backend: str,
        clock: Callable[[], float],
        bridge: SdkLogBridge | None = None,
    ) -> None:
        self._provider = provider
        self._tracer = provider.get_tracer("pylon", _version())
        self._backend = backend
        self._clock = clock  # the clock of the RequestRecord readings (the event loop's)
        self._bridge = bridge

    @classmethod
    def build(
        cls,
        options: TracingOptions,
        loop: asyncio.AbstractEventLoop,
        observer: Observer,
        exporter: SpanExporter | None = None,
    ) -> OtelTracer:
        """Spans to the OTLP/HTTP collector at `options.traces_url`, batched; or, when
        `exporter` is given (tests), to it, each as it ends. The SDK's log records go to
        `observer`."""
        resource = Resource.create({SERVICE_NAME: options.service_name})
        provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(
                BatchSpanProcessor(OTLPSpanExporter(endpoint=options.traces_url))
            )
        else:
            provider.add_span_processor(SimpleSpanProcessor(exporter))
        bridge = SdkLogBridge(loop, observer)
        bridge.attach()
        return cls(provider, options.backend, loop.time, bridge)

    def start(self, request: TunnelRequest, plan: ForwardPlan, record: RequestRecord) -> OtelSpan:
        offset = time.time_ns() - int(self._clock() * _NS)
        incoming = request.trace
        attributes: dict[str, AttributeValue] = {
            "pylon.request_id": request.request_id,
            "pylon.model": request.model,
            "pylon.backend": self._backend,
            "pylon.transport": record.transport,
            "http.request.method": request.method,
            "url.path": record.path,
        }
        if record.worker is not None:
            attributes["pylon.worker"] = record.worker
        if request.priority is not None:
            attributes["pylon.priority"] = request.priority
        priority = plan.priority.value
        if priority is not None:
            attributes["pylon.engine_priority"] = priority
        span = self._tracer.start_span(
            SPAN_NAME,
            _NO_PARENT if incoming is None else remote_parent(incoming.traceparent),
            SpanKind.CLIENT,
            attributes,
            start_time=offset + int(record.head_at * _NS),
        )
        context = span.get_span_context()
        if context is None or not context.is_valid:  # the SDK is disabled (OTEL_SDK_DISABLED)
            return OtelSpan(span, None, offset)
        trace = TraceContext(
            traceparent=f"00-{context.trace_id:032x}-{context.span_id:016x}-"
            f"{context.trace_flags:02x}",
            tracestate=incoming.tracestate if incoming is not None else None,
        )
        return OtelSpan(span, trace, offset)

    def close(self) -> None:
        try:
            self._provider.shutdown()
        finally:
            if self._bridge is not None:
                self._bridge.detach()


_: type[ExchangeTracer] = OtelTracer
__: type[ExchangeSpan] = OtelSpan
