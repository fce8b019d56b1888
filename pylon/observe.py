"""What happens to requests and connections, told to one `Observer`.

The transports and the proxy never call a logger: they report lifecycle events here. `LogObserver`
(structlog) writes the log lines; `pylon.metrics.MetricsObserver` counts them (traces can
subscribe the same way); `Observers` hands every event to each (`pylon.app.build_core` builds
it). Each request carries one `RequestRecord` with its timestamps (loop time, seconds) and its
token counts, so every observer sees the same readings. An event method that does nothing is
marked `@quiet`, and the fan-out never calls it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pylon.logs import get_lifecycle_logger, get_logger

if TYPE_CHECKING:
    from pylon.core.errors import PylonError
    from pylon.core.plan import ForwardPlan
    from pylon.core.queue import QueueDecision
    from pylon.core.retry import RetryMark


class RequestRecord:
    """One request as observed: who it is, where it went, and when each step happened."""

    __slots__ = (
        "dispatched_at",
        "done_at",
        "first_byte_at",
        "first_output_at",
        "head_at",
        "input_tokens",
        "input_tokens_source",
        "method",
        "model",
        "outcome",
        "output_tokens",
        "output_tokens_source",
        "path",
        "request_id",
        "status",
        "stream_id",
        "stripped",
        "transport",
        "worker",
    )

    def __init__(self, transport: str, stream_id: int, head_at: float) -> None:
        self.transport = transport  # "http1", "h2" or "h3"
        self.stream_id = stream_id
        self.head_at = head_at  # the request head was received
        self.dispatched_at: float | None = None  # the request was written to the engine
        self.first_byte_at: float | None = None  # the first response byte went to the client
        self.first_output_at: float | None = None  # the first output (event or body) arrived
        self.done_at: float | None = None
        self.request_id: str | None = None
        self.model: str | None = None
        self.method = ""
        self.path = ""
        self.status = 0
        self.outcome = ""
        self.worker: str | None = None
        self.stripped: tuple[str, ...] = ()
        # Token counts (see `pylon.core.usage`), and where each came from: "usage" (the engine's
        # report), "gateway" (x-input-tokens), "estimate" (streamed data events); "" = unknown.
        self.input_tokens: int | None = None
        self.input_tokens_source = ""
        self.output_tokens: int | None = None
        self.output_tokens_source = ""

    def duration_ms(self) -> float | None:
        if self.done_at is None:
            return None
        return round((self.done_at - self.head_at) * 1000, 3)


class Observer(Protocol):
    """Lifecycle events of requests and connections. Implementations must be cheap and never
    raise: they run on the hot path, inside the event loop."""

    def admitted(self, record: RequestRecord) -> None: ...

    def rejected(self, record: RequestRecord, error: PylonError) -> None:
        """Pylon answered with its own problem; the engine never saw the request."""
        ...

    def queue_admission(self, record: RequestRecord, decision: QueueDecision) -> None:
        """Queue admission decided on a request that carried `x-stargate-expected-queue-ms`
        (`decision.result`: accepted, rejected, unknown_estimate or disabled), before any
        engine saw it. A rejection is then also reported as `rejected`."""
        ...

    def dispatched(self, record: RequestRecord, plan: ForwardPlan) -> None: ...

    def first_output(self, record: RequestRecord) -> None: ...

    def upstream_status(self, record: RequestRecord, mark: RetryMark) -> None:
        """The engine answered with an error status; `mark` is what the gateway is told."""
        ...

    def upstream_failed(self, record: RequestRecord, error: PylonError, after_head: bool) -> None:
        """The engine could not be reached, timed out, or broke the exchange."""
        ...

    def done(self, record: RequestRecord) -> None:
        """The exchange is over (`record.outcome` says how)."""
        ...

    def crashed(self, record: RequestRecord | None, exc: BaseException | None) -> None:
        """A bug: pylon failed to handle a request. The stream is reset or closed."""
        ...

    def transport_event(self, kind: str, protocol: str, /, **fields: Any) -> None:
        """A connection-level event: flood guard, malformed frame, timeout, GOAWAY, ..."""
        ...

    def process_event(self, kind: str, /, **fields: Any) -> None:
        """A process-level event: listening, draining, TLS reload, token rotation, ..."""
        ...


OBSERVER_EVENTS = (
    "admitted",
    "rejected",
    "dispatched",
    "first_output",
    "upstream_status",
    "upstream_failed",
    "queue_admission",
    "done",
    "crashed",
    "transport_event",
    "process_event",
)

F = TypeVar("F", bound=Callable[..., None])


def quiet(method: F) -> F:
    """Marks an event method that does nothing, so `Observers` does not even call it."""
    method.quiet = True  # type: ignore[attr-defined]
    return method


def _ignore(*_args: Any, **_fields: Any) -> None:
    return None


# Log levels of the connection- and process-level events; anything unlisted logs at info.
_WARNING_EVENTS = frozenset(
    {
        "h2_flood",
        "h3_flood",
        "h2_send_failed",
        "h2_response_head_refused",
        "quic_client_rejected",
        "tls_reload_rejected",
        "tunnel_token_unusable",
        "insecure_listener",
        "upstream_path_v1",
        "setting_ignored",
        "unknown_env_var",
        "forced_stop",
        "tracing_error",
        "worker_ejected",
        "kv_routing_failed",
        "kv_router_error",
        "kv_events_gap",
        "kv_token_data_refused",
    }
)
_ERROR_EVENTS = frozenset({"engine_health_gate_failed"})
# The start and stop lines: written at info whatever --log-level says (see pylon.logs).
LIFECYCLE_EVENTS = frozenset(
    {
        "listening",
        "listening_quic",
        "listening_admin",
        "embedded_mock_started",
        "ready",
        "stopping",
        "draining",
        "drained",
    }
)
_DEBUG_EVENTS = frozenset(
    {
        "h2_stream_reset_by_client",
        "stream_reset_by_client",
        "engine_health_probe",
        "worker_health_probe",
    }
)


class LogObserver:
    """The structlog implementation: one JSON line per event, the request id on every line."""

    __slots__ = ("_lifecycle_log", "_log")

    def __init__(self) -> None:
        self._log = get_logger()
        self._lifecycle_log = get_lifecycle_logger()

    @quiet
    def admitted(self, record: RequestRecord) -> None:
        return None  # the `request_done` line says it all; no line per admission

    def rejected(self, record: RequestRecord, error: PylonError) -> None:
        self._log.warning(
            "request_rejected",
            request_id=record.request_id,
            model=record.model,
            transport=record.transport,
            status=error.status,
            code=error.code.value,
            detail=error.detail,
            duration_ms=record.duration_ms(),
        )

    def queue_admission(self, record: RequestRecord, decision: QueueDecision) -> None:
        if not self._log.is_enabled_for(logging.DEBUG):
            return  # one line per decision only when asked for; rejections log as rejected
        self._log.debug(
            "queue_admission",
            request_id=record.request_id,
            model=decision.model,
            result=decision.result.value,
            level=decision.level,
            expected_ms=decision.expected_ms,
            estimate_ms=decision.estimate_ms,
            threshold_ms=decision.threshold_ms,
        )

    @quiet
    def dispatched(self, record: RequestRecord, plan: ForwardPlan) -> None:
        return None

    @quiet
    def first_output(self, record: RequestRecord) -> None:
        return None

    def upstream_status(self, record: RequestRecord, mark: RetryMark) -> None:
        if mark.retryable or record.status >= 500:
            self._log.info(
                "upstream_error_status",
                request_id=record.request_id,
                status=record.status,
                retryable=mark.retryable,
                reason=mark.reason,
            )

    def upstream_failed(self, record: RequestRecord, error: PylonError, after_head: bool) -> None:
        self._log.warning(
            "stream_failed" if after_head else "upstream_failed",
            request_id=record.request_id,
            model=record.model,
            code=error.code.value,
            detail=error.detail,
            worker=record.worker,
        )

    def done(self, record: RequestRecord) -> None:
        if not self._log.is_enabled_for(logging.INFO):
            return  # the access log is off: do not even build the line
        self._log.info(
            "request_done",
            request_id=record.request_id,
            model=record.model,
            transport=record.transport,
            method=record.method,
            path=record.path,
            status=record.status,
            outcome=record.outcome,
            worker=record.worker,
            stripped=record.stripped or None,
            duration_ms=record.duration_ms(),
        )

    def crashed(self, record: RequestRecord | None, exc: BaseException | None) -> None:
        self._log.error(
            "request_crashed",
            request_id=record.request_id if record is not None else None,
            transport=record.transport if record is not None else None,
            exc_info=exc,
        )

    def transport_event(self, kind: str, protocol: str, /, **fields: Any) -> None:
        if kind in _DEBUG_EVENTS:
            self._log.debug(kind, protocol=protocol, **fields)
        elif kind in _WARNING_EVENTS:
            self._log.warning(kind, protocol=protocol, **fields)
        else:
            self._log.info(kind, protocol=protocol, **fields)

    def process_event(self, kind: str, /, **fields: Any) -> None:
        if kind == "model_discovery_poll":  # every few seconds: only a failure is news
            if fields.get("outcome") == "ok":
                self._log.debug(kind, **fields)
            else:
                self._log.warning(kind, **fields)
        elif kind in _WARNING_EVENTS:
            self._log.warning(kind, **fields)
        elif kind in _ERROR_EVENTS:
            self._log.error(kind, **fields)
        elif kind in _DEBUG_EVENTS:
            self._log.debug(kind, **fields)
        elif kind in LIFECYCLE_EVENTS:
            self._lifecycle_log.info(kind, **fields)
        else:
            self._log.info(kind, **fields)


_log_observer: type[Observer] = LogObserver


class Observers:
    """Several observers as one: every event goes to each, in the order given (the log lines
    first, then metrics, traces, ...). Each must be cheap and never raise, as for `Observer`.

    Built for the hot path: an event none of them handles (methods marked `quiet`) costs one
    call to nothing, and an event only one of them handles goes straight to it (the instance
    attribute shadows the fan-out method below).
    """

    def __init__(self, *observers: Observer) -> None:
        self.members = observers
        for event in OBSERVER_EVENTS:
            handlers = tuple(
                handler
                for observer in observers
                if not getattr(handler := getattr(observer, event), "quiet", False)
            )
            setattr(self, "_" + event, handlers)
            if len(handlers) <= 1:
                setattr(self, event, handlers[0] if handlers else _ignore)

    _admitted: tuple[Callable[[RequestRecord], None], ...]
    _rejected: tuple[Callable[[RequestRecord, PylonError], None], ...]
    _dispatched: tuple[Callable[[RequestRecord, ForwardPlan], None], ...]
    _first_output: tuple[Callable[[RequestRecord], None], ...]
    _upstream_status: tuple[Callable[[RequestRecord, RetryMark], None], ...]
    _upstream_failed: tuple[Callable[[RequestRecord, PylonError, bool], None], ...]
    _queue_admission: tuple[Callable[[RequestRecord, QueueDecision], None], ...]
    _done: tuple[Callable[[RequestRecord], None], ...]
    _crashed: tuple[Callable[[RequestRecord | None, BaseException | None], None], ...]
    _transport_event: tuple[Callable[..., None], ...]
    _process_event: tuple[Callable[..., None], ...]

    def admitted(self, record: RequestRecord) -> None:
        for handler in self._admitted:
            handler(record)

    def rejected(self, record: RequestRecord, error: PylonError) -> None:
        for handler in self._rejected:
            handler(record, error)

    def dispatched(self, record: RequestRecord, plan: ForwardPlan) -> None:
        for handler in self._dispatched:
            handler(record, plan)

    def first_output(self, record: RequestRecord) -> None:
        for handler in self._first_output:
            handler(record)

    def upstream_status(self, record: RequestRecord, mark: RetryMark) -> None:
        for handler in self._upstream_status:
            handler(record, mark)

    def upstream_failed(self, record: RequestRecord, error: PylonError, after_head: bool) -> None:
        for handler in self._upstream_failed:
            handler(record, error, after_head)

    def queue_admission(self, record: RequestRecord, decision: QueueDecision) -> None:
        for handler in self._queue_admission:
            handler(record, decision)

    def done(self, record: RequestRecord) -> None:
        for handler in self._done:
            handler(record)

    def crashed(self, record: RequestRecord | None, exc: BaseException | None) -> None:
        for handler in self._crashed:
            handler(record, exc)

    def transport_event(self, kind: str, protocol: str, /, **fields: Any) -> None:
        for handler in self._transport_event:
            handler(kind, protocol, **fields)

    def process_event(self, kind: str, /, **fields: Any) -> None:
        for handler in self._process_event:
            handler(kind, **fields)


_fan_out: type[Observer] = Observers
