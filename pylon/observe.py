"""What happens to requests and connections, told to one `Observer`.

The transports and the proxy never call a logger: they report lifecycle events here. `LogObserver`
(structlog) writes the log lines; `pylon.metrics.MetricsObserver` counts them (traces can
subscribe the same way); `Observers` hands every event to each (`pylon.app.build_core` builds
it). Each request carries one `RequestRecord` with its timestamps (loop time, seconds) and its
token counts, so every observer sees the same readings. An event method that does nothing (one
marked `@quiet`, or a no-op inherited from `QuietMoments`: `is_quiet`) is never called by the
fan-out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from mypy_extensions import mypyc_attr

from pylon.core.hooks import ExchangeHooks
from pylon.core.log_rate import LogRate
from pylon.core.record import RequestRecord
from pylon.logs import access_lines, get_lifecycle_logger, get_logger

if TYPE_CHECKING:
    from pylon.core.errors import PylonError
    from pylon.core.queue import QueueDecision
    from pylon.core.retry import RetryMark


class Observer(ExchangeHooks, Protocol):
    """The process's view of requests and connections: the moments of every exchange (the
    `ExchangeHooks`, heard after the exchange's own subscribers; `output` only reaches the
    subscribers that count output, so an observer never hears it), what the intake decided,
    and connection- and process-level events. Implementations must be cheap and never raise: they
    run on the hot path, inside the event loop."""

    def admitted(self, record: RequestRecord) -> None:
        """The intake admitted the request's head."""
        ...

    def queue_gate(self, record: RequestRecord, decision: QueueDecision) -> None:
        """The queue gate decided on a request that carried `x-stargate-expected-queue-ms`
        (`decision.result`: accepted, rejected, unknown_estimate or disabled), before any
        engine saw it. A rejection then ends the exchange with `rejected`."""
        ...

    def upstream_status(self, record: RequestRecord, mark: RetryMark) -> None:
        """The engine answered with an error status; `mark` is what the gateway is told."""
        ...

    def upstream_failed(self, record: RequestRecord, error: PylonError, after_head: bool) -> None:
        """The engine could not be reached, timed out, or broke the exchange."""
        ...

    def crashed(self, record: RequestRecord | None, exc: BaseException | None) -> None:
        """A bug: pylon failed to handle a request. The stream is reset or closed."""
        ...

    # `event` and `protocol` are positional-only, named as keys a line has anyway (no field may
    # reuse them): in the optional compiled build a positional-only name still collides with a
    # field of the same name (a field `kind`, for one, once raised TypeError there).
    def transport_event(self, event: str, protocol: str, /, **fields: Any) -> None:
        """A connection-level event: flood guard, malformed frame, timeout, GOAWAY, ..."""
        ...

    def process_event(self, event: str, /, **fields: Any) -> None:
        """A process-level event: listening, draining, TLS reload, token rotation, ..."""
        ...


# Every event an observer hears, the exchange's moments first (in their order).
OBSERVER_EVENTS = (
    "admitted",
    "queue_gate",
    "dispatched",
    "response_head",
    "first_output",
    "output",
    "upstream_status",
    "upstream_failed",
    "complete",
    "rejected",
    "crashed",
    "transport_event",
    "process_event",
)

F = TypeVar("F", bound=Callable[..., None])


def quiet(method: F) -> F:
    """Marks an event method that does nothing, so `Observers` does not even call it. (The
    moments an observer inherits from `QuietMoments` are quiet without the mark.)"""
    method.quiet = True  # type: ignore[attr-defined]
    return method


def is_quiet(observer: object, event: str) -> bool:
    """Whether `observer` does nothing on `event`: the method is marked `quiet`, or it is the
    no-op `QuietMoments` gives it. (Identity, not a mark, for the latter: in the optional
    compiled build a compiled method takes no attribute.)"""
    method = getattr(type(observer), event, None)
    own = getattr(observer, "__dict__", ())  # an instance's own handler overrides its class's
    if method is not None and method is _QUIET_MOMENTS.get(event) and event not in own:
        return True
    return bool(getattr(getattr(observer, event), "quiet", False))


def _ignore(*_args: Any, **_fields: Any) -> None:
    return None


# What an event of one argument (the record) that nobody hears is bound to: a C function that
# returns None, so such an event costs a few instructions, not a Python frame. (The exchange
# emits five of them per request. An empty dict's `get` hashes the record by identity and finds
# nothing; `id` would return an int, which the compiled exchange refuses from a hook typed None.)
_NOTHING: dict[object, None] = {}
_ignore_record: Callable[[RequestRecord], None] = _NOTHING.get
_RECORD_EVENTS = frozenset({"admitted", "dispatched", "response_head", "first_output", "complete"})


# Log levels of the connection- and process-level events; anything unlisted logs at info.
_WARNING_EVENTS = frozenset(
    {
        "h2_flood",
        "h3_flood",
        "raw_quic_flood",
        "h2_send_failed",
        "h2_response_head_refused",
        "quic_client_rejected",
        "tls_reload_rejected",
        "tunnel_token_unusable",
        "gateway_token_unreadable",
        "gateway_stream_lost",
        "gateway_watch_lost",
        "gateway_insecure",
        "tunnel_lost",
        "tunnel_refused",
        "tunnel_dial_failed",
        "tunnel_ca_reload_rejected",
        "insecure_listener",
        "upstream_path_v1",
        "setting_ignored",
        "unknown_env_var",
        "forced_stop",
        "tracing_error",
        "worker_ejected",
        "worker_outlier_ejected",
        "worker_outlier_held",
        "upstream_moved",
        "engine_waiting",
        "kv_routing_failed",
        "kv_router_error",
        "kv_events_gap",
        "kv_events_malformed",
        "kv_token_data_refused",
        "replica_sync_started",  # names an unauthenticated port open on every interface
        "replica_sync_dropped",
        "signal_ignored",
        "tls_self_signed",
        "booking_authority_lost",
        "booking_authority_refused",
        "booking_authority_stalled",
        "booking_catalogue_differs",
        "booking_client_refused",
        "process_exited",
        "processes_killed",
        "supervisor_gone",
        "canary_failed",  # pylon.gateway.canary: a model's canary failed (INACTIVE, /ready 503)
    }
)
_ERROR_EVENTS = frozenset(
    {"engine_health_gate_failed", "reload_failed", "supervisor_halted", "process_start_failed"}
)
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
        "reloaded",
        "status_report",
        "supervisor_started",
        "process_started",
        "process_stopped",
        "stopped",
    }
)
_DEBUG_EVENTS = frozenset(
    {
        "h2_stream_reset_by_client",
        "stream_reset_by_client",
        "engine_health_probe",
        "worker_health_probe",
        "canary_passed",
        "canary_still_failing",
    }
)


# Lines that repeat with their input (a message, a poll, a request, a client's connection): per
# (event, source) the first is written at once, then at most one per `REPEAT_INTERVAL_S`, with
# `suppressed` (how many were held back since the last one) when any were. Every connection-level
# event is one (a client decides how often it happens); so are the engine's faults as told per
# request (`upstream_failed`, `stream_failed`, `upstream_error_status`: the request's own
# `request_done` / `request_rejected` line is never held back), a bug hit again and again
# (`request_crashed`, per exception type) and these process events. The
# start and stop lines and the state changes (a worker ejected, a model published) are not.
REPEAT_INTERVAL_S = 10.0
REPEATED_EVENTS = frozenset(
    {
        "kv_events_malformed",
        "kv_events_gap",
        "kv_view_reset",
        "kv_routing_failed",
        "kv_router_error",
        "kv_token_data_refused",
        "model_discovery_poll",
        "tracing_error",
        "upstream_moved",  # one per request while a dead worker is still in rotation
    }
)
# The fields that name a process event's source (all from the configuration: workers, their
# endpoints, published models, the router's operations), never from a client.
_SOURCE_FIELDS = ("worker", "endpoint", "model", "op")


@mypyc_attr(allow_interpreted_subclasses=True)
class QuietMoments:
    """The moments of an exchange an observer does not hear, each a no-op the fan-out never
    calls (`is_quiet`): an observer subclasses it and overrides what it hears."""

    __slots__ = ()

    def admitted(self, record: RequestRecord) -> None:
        return None

    def dispatched(self, record: RequestRecord) -> None:
        return None

    def response_head(self, record: RequestRecord) -> None:
        return None

    def first_output(self, record: RequestRecord) -> None:
        return None

    def output(self, record: RequestRecord, count: int) -> None:
        return None


_QUIET_MOMENTS: dict[str, object] = {
    event: getattr(QuietMoments, event) for event in OBSERVER_EVENTS if hasattr(QuietMoments, event)
}


@mypyc_attr(allow_interpreted_subclasses=True)  # tests record what it hears
class LogObserver(QuietMoments):
    """The structlog implementation: one JSON line per event, the request id on every line
    (the moments before the end have none: the `request_done` line says it all). Repeated
    faults are written at a bounded rate (`REPEATED_EVENTS`); `clock` is injectable for tests."""

    __slots__ = ("_access", "_clock", "_lifecycle_log", "_log", "_repeats")

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        repeat_interval_s: float = REPEAT_INTERVAL_S,
    ) -> None:
        self._log = get_logger()
        self._lifecycle_log = get_lifecycle_logger()
        # The access lines' direct writer (JSON logs): the same line as `_log` would write, at
        # a fraction of its cost (see `pylon.logs.AccessLines`).
        self._access = access_lines()
        self._clock = clock
        self._repeats = LogRate(repeat_interval_s)

    def _held_back(self, key: tuple[Any, ...], fields: dict[str, Any]) -> bool:
        """Whether this line of a repeated fault is held back; if not, `fields` gets
        `suppressed` when lines of the same key were held back before it."""
        held = self._repeats.admit(key, self._clock())
        if held is None:
            return True
        if held:
            fields["suppressed"] = held
        return False

    def _access_line(self, event: str, level: str, fields: dict[str, Any]) -> None:
        """An access line (`request_done`, `request_rejected`): straight as JSON where the
        logs are JSON, else through structlog like any other line."""
        if self._access is not None:
            self._access.write(event, level, fields)
        else:
            getattr(self._log, level)(event, **fields)

    def rejected(self, record: RequestRecord, error: PylonError) -> None:
        if not self._log.is_enabled_for(logging.WARNING):
            return
        fields = {
            "request_id": record.request_id,
            "model": record.model,
            "transport": record.transport,
            "method": record.method,
            "path": record.path,
            "status": error.status,
            "code": error.code.value,
            "detail": error.detail,
            "duration_ms": record.duration_ms(),
            "bytes_received": record.bytes_received,
            "bytes_sent": record.bytes_sent,
        }
        self._access_line("request_rejected", "warning", fields)

    def queue_gate(self, record: RequestRecord, decision: QueueDecision) -> None:
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

    def upstream_status(self, record: RequestRecord, mark: RetryMark) -> None:
        if mark.retryable or record.status >= 500:
            fields: dict[str, Any] = {}
            if self._held_back(("upstream_error_status", record.worker), fields):
                return
            self._log.info(
                "upstream_error_status",
                request_id=record.request_id,
                status=record.status,
                retryable=mark.retryable,
                reason=mark.reason,
                **fields,
            )

    def upstream_failed(self, record: RequestRecord, error: PylonError, after_head: bool) -> None:
        kind = "stream_failed" if after_head else "upstream_failed"
        fields: dict[str, Any] = {}
        if self._held_back((kind, record.worker), fields):
            return
        self._log.warning(
            kind,
            request_id=record.request_id,
            model=record.model,
            code=error.code.value,
            detail=error.detail,
            worker=record.worker,
            **fields,
        )

    def complete(self, record: RequestRecord) -> None:
        if not self._log.is_enabled_for(logging.INFO):
            return  # the access log is off: do not even build the line
        fields = {
            "request_id": record.request_id,
            "model": record.model,
            "transport": record.transport,
            "method": record.method,
            "path": record.path,
            "status": record.status,
            "outcome": record.outcome,
            "worker": record.worker,
            "stripped": record.stripped or None,
            "duration_ms": record.duration_ms(),
            "bytes_received": record.bytes_received,
            "bytes_sent": record.bytes_sent,
        }
        self._access_line("request_done", "info", fields)

    def crashed(self, record: RequestRecord | None, exc: BaseException | None) -> None:
        transport = record.transport if record is not None else None
        fields: dict[str, Any] = {}
        # One bug hit by every request is one traceback per interval, not one per request.
        if self._held_back(("request_crashed", transport, type(exc).__name__), fields):
            return
        self._log.error(
            "request_crashed",
            request_id=record.request_id if record is not None else None,
            transport=transport,
            exc_info=exc,
            **fields,
        )

    def transport_event(self, event: str, protocol: str, /, **fields: Any) -> None:
        if event in _DEBUG_EVENTS:
            self._log.debug(event, protocol=protocol, **fields)
        elif self._held_back((event, protocol), fields):
            return
        elif event in _WARNING_EVENTS:
            self._log.warning(event, protocol=protocol, **fields)
        else:
            self._log.info(event, protocol=protocol, **fields)

    def process_event(self, event: str, /, **fields: Any) -> None:
        if event in REPEATED_EVENTS and not (event == "model_discovery_poll" and _ok(fields)):
            source = tuple(fields.get(name) for name in _SOURCE_FIELDS)
            if self._held_back((event, *source), fields):
                return
        if event == "model_discovery_poll":  # every few seconds: only a failure is news
            if _ok(fields):
                self._log.debug(event, **fields)
            else:
                self._log.warning(event, **fields)
        elif event == "readiness_changed":  # losing readiness is news, regaining it less so
            if fields.get("ready"):
                self._log.info(event, **fields)
            else:
                self._log.warning(event, **fields)
        elif event in _WARNING_EVENTS:
            self._log.warning(event, **fields)
        elif event in _ERROR_EVENTS:
            self._log.error(event, **fields)
        elif event in _DEBUG_EVENTS:
            self._log.debug(event, **fields)
        elif event in LIFECYCLE_EVENTS:
            self._lifecycle_log.info(event, **fields)
        else:
            self._log.info(event, **fields)


def _ok(fields: dict[str, Any]) -> bool:
    return fields.get("outcome") == "ok"


_log_observer: type[Observer] = LogObserver


# A plain Python class in the compiled build too (its methods compiled): the instance attributes
# that shadow its fan-out methods need one.
@mypyc_attr(native_class=False)
class Observers:
    """Several observers as one: every event goes to each, in the order given (the log lines
    first, then metrics, traces, ...). Each must be cheap and never raise, as for `Observer`.

    Built for the hot path: an event none of them handles (quiet methods, `is_quiet`) costs one
    call to nothing (a C one for the record events), and an event only one of them handles goes
    straight to it (the instance attribute shadows the fan-out method below).
    """

    def __init__(self, *observers: Observer) -> None:
        self.members = observers
        for event in OBSERVER_EVENTS:
            handlers = tuple(
                getattr(observer, event) for observer in observers if not is_quiet(observer, event)
            )
            setattr(self, "_" + event, handlers)
            if handlers:
                if len(handlers) == 1:
                    setattr(self, event, handlers[0])
            else:
                setattr(self, event, _ignore_record if event in _RECORD_EVENTS else _ignore)

    _admitted: tuple[Callable[[RequestRecord], None], ...]
    _queue_gate: tuple[Callable[[RequestRecord, QueueDecision], None], ...]
    _dispatched: tuple[Callable[[RequestRecord], None], ...]
    _response_head: tuple[Callable[[RequestRecord], None], ...]
    _first_output: tuple[Callable[[RequestRecord], None], ...]
    _output: tuple[Callable[[RequestRecord, int], None], ...]
    _upstream_status: tuple[Callable[[RequestRecord, RetryMark], None], ...]
    _upstream_failed: tuple[Callable[[RequestRecord, PylonError, bool], None], ...]
    _complete: tuple[Callable[[RequestRecord], None], ...]
    _rejected: tuple[Callable[[RequestRecord, PylonError], None], ...]
    _crashed: tuple[Callable[[RequestRecord | None, BaseException | None], None], ...]
    _transport_event: tuple[Callable[..., None], ...]
    _process_event: tuple[Callable[..., None], ...]

    def admitted(self, record: RequestRecord) -> None:
        for handler in self._admitted:
            handler(record)

    def queue_gate(self, record: RequestRecord, decision: QueueDecision) -> None:
        for handler in self._queue_gate:
            handler(record, decision)

    def dispatched(self, record: RequestRecord) -> None:
        for handler in self._dispatched:
            handler(record)

    def response_head(self, record: RequestRecord) -> None:
        for handler in self._response_head:
            handler(record)

    def first_output(self, record: RequestRecord) -> None:
        for handler in self._first_output:
            handler(record)

    def output(self, record: RequestRecord, count: int) -> None:
        for handler in self._output:
            handler(record, count)

    def upstream_status(self, record: RequestRecord, mark: RetryMark) -> None:
        for handler in self._upstream_status:
            handler(record, mark)

    def upstream_failed(self, record: RequestRecord, error: PylonError, after_head: bool) -> None:
        for handler in self._upstream_failed:
            handler(record, error, after_head)

    def complete(self, record: RequestRecord) -> None:
        for handler in self._complete:
            handler(record)

    def rejected(self, record: RequestRecord, error: PylonError) -> None:
        for handler in self._rejected:
            handler(record, error)

    def crashed(self, record: RequestRecord | None, exc: BaseException | None) -> None:
        for handler in self._crashed:
            handler(record, exc)

    def transport_event(self, event: str, protocol: str, /, **fields: Any) -> None:
        for handler in self._transport_event:
            handler(event, protocol, **fields)

    def process_event(self, event: str, /, **fields: Any) -> None:
        for handler in self._process_event:
            handler(event, **fields)


_fan_out: type[Observer] = Observers
