"""The tracing seam: one span per engine exchange, and the trace context the engine continues.

The proxy holds an `ExchangeTracer`, or None when tracing is off (then nothing is built and a
request pays one `is None` check). Once a request is booked on a worker, the proxy starts the
exchange's span; the span's `trace` is what the `ForwardPlan` carries to the engine in place of
the client's (`ForwardPlan.routed`), so the engine's spans nest under pylon's. The span
subscribes to the exchange's moments and ends with its terminal one (every exit path).

`pylon.otel` implements it with the OpenTelemetry SDK (the `otel` extra); this module imports
nothing from OpenTelemetry, so a pylon without tracing never loads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from pylon.core.errors import ErrorCode
from pylon.core.hooks import ExchangeHooks

if TYPE_CHECKING:
    from pylon.core.contract import TraceContext, TunnelRequest
    from pylon.core.plan import ForwardPlan
    from pylon.core.record import RequestRecord

SPAN_NAME = "pylon.forward"

# How an exchange ends when the engine failed it (`RequestRecord.outcome`): unreachable, busy,
# timed out, a broken or malformed response (before the head: pylon's problem answer; after it:
# the relays' outcomes, see `pylon.proxy.relay`). A client that resets or leaves, a client that
# stops reading, and a shutdown are not engine failures.
UPSTREAM_FAILURES = frozenset(
    {
        ErrorCode.UPSTREAM_UNAVAILABLE.value,
        ErrorCode.UPSTREAM_BUSY.value,
        ErrorCode.UPSTREAM_TIMEOUT.value,
        ErrorCode.UPSTREAM_PROTOCOL_ERROR.value,
        "upstream_broken_mid_body",
    }
)


def exchange_error(record: RequestRecord) -> str | None:
    """Why the exchange failed (a span's `error.type`), or None when it did not.

    An engine failure is named by its outcome; an engine answer of 4xx or 5xx by its status (a
    client span's error, as OpenTelemetry's HTTP conventions define it).
    """
    if record.outcome in UPSTREAM_FAILURES:
        return record.outcome
    if record.first_byte_at is not None and record.status >= 400:
        return str(record.status)
    return None


class ExchangeSpan(ExchangeHooks, Protocol):
    """One exchange's span, from its booking to its end: it subscribes to the exchange's
    moments and ends with its terminal one (once; never raises)."""

    @property
    def trace(self) -> TraceContext | None:
        """The context the engine continues (pylon's span as its parent, the client's
        tracestate carried); None to forward the client's own trace context unchanged."""
        ...


class ExchangeTracer(Protocol):
    def start(
        self, request: TunnelRequest, plan: ForwardPlan, record: RequestRecord
    ) -> ExchangeSpan:
        """A booked request is about to go to `record.worker`. Cheap, never raises."""
        ...

    def close(self) -> None:
        """Flush what was not exported yet and stop (blocking: run it off the event loop)."""
        ...
