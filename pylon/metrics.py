"""Prometheus metrics: a `MetricsObserver` fed by the same events as the log lines.

The hot path only bumps plain integers (a dict entry, a histogram bucket found by `bisect`): no
locks, no label lookups through prometheus-client, no allocation beyond a small tuple per
request. Everything runs on the event loop, and so does the scrape, so nothing is torn. At scrape
time a collector turns the numbers into metric families on the process's own `CollectorRegistry`
(never the global default, so several pylons in one process keep their own), which the admin
listener (`pylon.admin`) serves as Prometheus text or OpenMetrics.

Label values are bounded everywhere: `model` comes from a client header, so only the first
`MODEL_LABEL_LIMIT` distinct models get their own label and later ones are counted as `_other`
(requests without a model, like `/health` or one refused before its contract was read, as
`_none`); stripped controls are labelled with the deny-list rule they matched
(`pylon.core.sanitize.stripped_control_label`); every other label is a name pylon's code defines.

`METRICS` lists every family with its type, labels and meaning: docs/operations.md renders it
(scripts/gen_operations_doc.py), and tests pin it against their own list.
"""

from __future__ import annotations

import contextlib
import datetime
import platform
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import CollectorRegistry

from pylon.core.errors import ErrorCode
from pylon.core.sanitize import stripped_control_label
from pylon.observe import Observer, quiet

if TYPE_CHECKING:
    from pylon.core.errors import PylonError
    from pylon.core.queue import QueueDecision, QueueSnapshot
    from pylon.core.record import RequestRecord
    from pylon.core.retry import RetryMark
    from pylon.routing.build import RoutingSnapshot

MODEL_LABEL_LIMIT = 100  # distinct client model names with a label of their own
OTHER_MODEL = "_other"  # every model past the limit
NO_MODEL = "_none"  # requests without a model (health checks, refused before the contract)
_STRIPPED_CACHE_LIMIT = 1024  # stripped names whose label is remembered
BATCH = 64  # requests counted together (see `MetricsObserver.flush`)

SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DURATION_BUCKETS = (*SECONDS_BUCKETS, 120.0, 300.0, 600.0)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)
_PRIORITY_FRACTIONS = (0, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4, 1)

_STATUS_CLASS = {0: "none", 1: "1xx", 2: "2xx", 3: "3xx", 4: "4xx", 5: "5xx"}
_BEFORE_HEAD, _AFTER_HEAD = "before_head", "after_head"
_BOOL = {True: "true", False: "false"}
_TLS_RELOAD_RESULTS = ("ok", "rejected")


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str  # as exposed in the Prometheus text format (counters end in _total)
    kind: str  # counter, gauge, histogram or info
    labels: tuple[str, ...]
    help: str


_REQUEST = ("model", "status_class", "transport", "backend")
METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "pylon_build_info",
        "info",
        ("version", "python"),
        "pylon's version and the Python running it (value 1)",
    ),
    MetricSpec(
        "pylon_requests_total",
        "counter",
        _REQUEST,
        "requests answered, by the status class of the answer (`none`: the client left before "
        "any answer); pylon's own refusals included",
    ),
    MetricSpec(
        "pylon_requests_in_flight",
        "gauge",
        ("model", "transport", "backend"),
        "requests sent to the engine and not finished yet",
    ),
    MetricSpec(
        "pylon_request_time_to_response_head_seconds",
        "histogram",
        ("model",),
        "from the request head to the response head, for requests the engine answered",
    ),
    MetricSpec(
        "pylon_request_time_to_first_output_seconds",
        "histogram",
        ("model",),
        "from the request head to the first output: the first output event of a stream, the "
        "response head otherwise",
    ),
    MetricSpec(
        "pylon_request_duration_seconds",
        "histogram",
        ("model",),
        "from the request head to the end of the exchange, for requests sent to the engine",
    ),
    MetricSpec(
        "pylon_request_input_tokens",
        "histogram",
        ("model", "source"),
        "input tokens per request: `usage` (the engine's report) or `gateway` (x-input-tokens)",
    ),
    MetricSpec(
        "pylon_request_output_tokens",
        "histogram",
        ("model", "source"),
        "output tokens per request: `usage` (the engine's report) or `estimate` (streamed data "
        "events, when the engine reports no usage)",
    ),
    MetricSpec(
        "pylon_engine_priority",
        "histogram",
        ("backend",),
        "engine priority values pylon derived for requests sent to the engine (buckets: "
        "fractions of --priority-ceiling)",
    ),
    MetricSpec(
        "pylon_upstream_errors_total",
        "counter",
        ("reason", "stage"),
        "engine exchanges that failed: unreachable, busy, timed out or broken (reason: the error "
        "code), before or after the response head (stage)",
    ),
    MetricSpec(
        "pylon_retry_markings_total",
        "counter",
        ("reason", "retryable"),
        "retry markings (x-stargate-retryable, x-stargate-retry-reason) on answers: pylon's own "
        "problems (reason: the error code) and the engine's error statuses",
    ),
    MetricSpec(
        "pylon_stripped_controls_total",
        "counter",
        ("control", "location"),
        "client steering controls removed before the engine (a security signal): the deny-list "
        "rule that matched (a header, a header family such as `x-dynamo-*`, an underscore twin, "
        "or a body field path) and where it was (header or body)",
    ),
    MetricSpec(
        "pylon_transport_events_total",
        "counter",
        ("protocol", "event"),
        "connection-level events: flood guards, malformed frames, client timeouts, cancelled "
        "streams, ...",
    ),
    MetricSpec(
        "pylon_request_crashes_total",
        "counter",
        (),
        "requests pylon failed to handle (a bug; the stream was reset or closed)",
    ),
    MetricSpec(
        "pylon_queue_admission_decisions_total",
        "counter",
        ("result",),
        "queue-admission decisions on requests that carried x-stargate-expected-queue-ms: "
        "`accepted`, `rejected` (429 queue_estimate_mismatch), `unknown_estimate` (admitted: no "
        "throughput measured yet) or `disabled` (admitted: --no-queue-admission)",
    ),
    MetricSpec(
        "pylon_queue_estimate_milliseconds",
        "gauge",
        ("model", "level"),
        "pylon's local queue estimate for a new request of a model at an engine priority level "
        "(lower levels run first; `idle` = nothing pending ahead, prefill work only); absent "
        "while the model's input throughput is unknown",
    ),
    MetricSpec(
        "pylon_queue_input_tokens_per_second",
        "gauge",
        ("model",),
        "a model's measured prefill throughput (or --initial-input-tps before 5 samples), "
        "which the queue estimates divide by",
    ),
    MetricSpec(
        "pylon_model_discovery_polls_total",
        "counter",
        ("outcome", "reason"),
        "polls of the engine's /v1/models: `ok`, or `failed` with the reason (connect, timeout, "
        "closed, protocol, too_large, status, invalid, error); a failed poll keeps the last set",
    ),
    MetricSpec(
        "pylon_models_published",
        "gauge",
        (),
        "models published now (static --model set or the last good discovery poll)",
    ),
    MetricSpec(
        "pylon_tls_certificate_expiry_timestamp_seconds",
        "gauge",
        (),
        "notAfter of the TLS certificate in use, in seconds since the epoch (TLS listeners only)",
    ),
    MetricSpec(
        "pylon_tls_reloads_total",
        "counter",
        ("result",),
        "reloads of --tls-cert / --tls-key: `ok` (the new pair is in use) or `rejected` (kept "
        "the old one)",
    ),
    MetricSpec(
        "pylon_router_active_bookings",
        "gauge",
        ("worker",),
        "requests booked on the engine worker and not finished (with --routing other than off)",
    ),
    MetricSpec(
        "pylon_router_worker_healthy",
        "gauge",
        ("worker",),
        "1 while the worker is admitted by its health checks, 0 while it is ejected (or not "
        "admitted yet)",
    ),
    MetricSpec(
        "pylon_router_decisions_total",
        "counter",
        ("worker", "policy"),
        "requests booked on the worker, by the policy that chose it (with --routing kv, "
        "`least-loaded` counts the requests with no prompt to route by)",
    ),
    MetricSpec(
        "pylon_router_kv_event_faults_total",
        "counter",
        ("worker", "kind"),
        "faults seen on the worker's KV-event streams (--routing kv): `gap` (messages lost) and "
        "`regressed` (the sequence went back: the engine restarted) each reset the worker's "
        "cache view in the selection core; `malformed` messages are skipped",
    ),
    MetricSpec(
        "pylon_router_select_seconds",
        "histogram",
        ("policy",),
        "time the event loop waited for Dynamo's native select-and-reserve (--routing kv)",
    ),
)
_SPECS = {spec.name: spec for spec in METRICS}


# A histogram is a plain list, observed inline on the hot path (no call):
#   histogram[bisect_left(bounds, value)] += 1; histogram[-1] += value
# One count per bucket bound, then the +Inf count, then the sum; cumulated at scrape time.
Histogram = list[float]


def new_histogram(bounds: Sequence[float]) -> Histogram:
    return [0] * (len(bounds) + 1) + [0.0]


def histogram_buckets(bounds: Sequence[float], histogram: Histogram) -> list[tuple[str, float]]:
    """The cumulative (le, count) pairs of an exposition, +Inf last."""
    out: list[tuple[str, float]] = []
    running = 0.0
    for bound, count in zip(bounds, histogram, strict=False):
        running += count
        out.append((repr(float(bound)), running))
    out.append(("+Inf", running + histogram[len(bounds)]))
    return out


class _ModelStats:
    """Everything counted for one model label."""

    __slots__ = (
        "duration",
        "first_output",
        "head",
        "in_flight",
        "input_tokens",
        "label",
        "output_tokens",
        "requests",
    )

    def __init__(self, label: str) -> None:
        self.label = label
        self.requests: dict[tuple[str, str], int] = {}  # (status class, transport) -> count
        self.in_flight: dict[str, int] = {}  # transport -> requests at the engine
        self.head = new_histogram(SECONDS_BUCKETS)
        self.first_output = new_histogram(SECONDS_BUCKETS)
        self.duration = new_histogram(DURATION_BUCKETS)
        self.input_tokens: dict[str, Histogram] = {}  # source -> histogram (TOKEN_BUCKETS)
        self.output_tokens: dict[str, Histogram] = {}

    def count(self, status: int, transport: str) -> None:
        key = (_STATUS_CLASS.get(status // 100, "other"), transport)
        self.requests[key] = self.requests.get(key, 0) + 1


def _tokens(histograms: dict[str, Histogram], source: str) -> Histogram:
    histogram = histograms.get(source)
    if histogram is None:
        histogram = histograms[source] = new_histogram(TOKEN_BUCKETS)
    return histogram


def _version() -> str:
    try:
        return metadata.version("pylon")
    except metadata.PackageNotFoundError:
        return "unknown"


class MetricsObserver:
    """The metrics `Observer`: counts every event, exposes them on `registry`.

    `backend`: the engine dialect (`--backend`), a label of the request metrics.
    `priority_ceiling`: --priority-ceiling, which the priority buckets divide.
    `local_connect_retryable`: --local-connect-failures-retryable, how an unreachable engine is
    marked (the marking is counted as written).
    """

    def __init__(
        self,
        backend: str,
        *,
        priority_ceiling: int = 3600,
        local_connect_retryable: bool = False,
        model_limit: int = MODEL_LABEL_LIMIT,
    ) -> None:
        self.backend = backend
        self._connect_retryable = local_connect_retryable
        self._model_limit = model_limit
        self._other = _ModelStats(OTHER_MODEL)
        self._none = _ModelStats(NO_MODEL)
        # model (None for none) -> its stats; the reserved labels map to their own stats, so a
        # client model spelled like one is counted there rather than given a duplicate series.
        self._models: dict[str | None, _ModelStats] = {
            None: self._none,
            NO_MODEL: self._none,
            OTHER_MODEL: self._other,
        }
        self._client_models: list[_ModelStats] = []
        self._priority_bounds = tuple(
            sorted({round(priority_ceiling * fraction) for fraction in _PRIORITY_FRACTIONS})
        )
        self._priority = new_histogram(self._priority_bounds)
        # Batched until `flush`: requests sent to the engine (and their engine priority), and
        # requests finished.
        self._started: list[RequestRecord] = []
        self._priorities: list[int] = []
        self._finished: list[RequestRecord] = []
        self._upstream_errors: dict[tuple[str, str], int] = {}
        self._markings: dict[tuple[str, str], int] = {}
        self._stripped: dict[tuple[str, str], int] = {}
        self._stripped_labels: dict[str, tuple[str, str]] = {}
        self._transport_events: dict[tuple[str, str], int] = {}
        self._crashes = 0
        self._queue_decisions: dict[tuple[str], int] = {}
        self._discovery_polls: dict[tuple[str, str], int] = {}
        self._models_published = 0
        # Set once the queue table exists (`pylon.assemble.build_core`): read at scrape time only.
        self.queue_snapshot: Callable[[], Iterable[QueueSnapshot]] | None = None
        # Set by `pylon.run.start` with --routing other than off: read at scrape time only.
        self.routing_snapshot: Callable[[], RoutingSnapshot] | None = None
        self._tls_not_after: float | None = None
        self._tls_reloads = dict.fromkeys(_TLS_RELOAD_RESULTS, 0)
        self._build = {"version": _version(), "python": platform.python_version()}
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_Collector(self))
        ProcessCollector(namespace="pylon", registry=self.registry)

    # --- labels ---
    def _stats(self, model: str | None) -> _ModelStats:
        stats = self._models.get(model)
        if stats is not None:
            return stats
        if len(self._client_models) >= self._model_limit:
            return self._other  # not remembered: the table stays bounded
        stats = self._models[model] = _ModelStats(model or NO_MODEL)
        self._client_models.append(stats)
        return stats

    def _count_stripped(self, stripped: tuple[str, ...]) -> None:
        labels = self._stripped_labels
        counts = self._stripped
        for name in stripped:
            key = labels.get(name)
            if key is None:
                key = stripped_control_label(name)
                if len(labels) < _STRIPPED_CACHE_LIMIT:
                    labels[name] = key
            counts[key] = counts.get(key, 0) + 1

    def _mark(self, reason: str, retryable: bool) -> None:
        key = (reason, _BOOL[retryable])
        self._markings[key] = self._markings.get(key, 0) + 1

    # --- the Observer events ---
    @quiet
    def admitted(self, record: RequestRecord) -> None:
        return None

    def rejected(self, record: RequestRecord, error: PylonError) -> None:
        self._stats(record.model).count(error.status, record.transport)
        self._mark(error.code.value, error.code.retryable)
        if record.stripped:
            self._count_stripped(record.stripped)

    def dispatched(self, record: RequestRecord) -> None:
        started = self._started
        started.append(record)
        value = record.engine_priority
        if value is not None:
            self._priorities.append(value)
        if len(started) >= BATCH:
            self.flush()

    @quiet
    def response_head(self, record: RequestRecord) -> None:
        return None

    @quiet
    def first_output(self, record: RequestRecord) -> None:
        return None

    @quiet
    def output(self, record: RequestRecord, count: int) -> None:
        return None

    def upstream_status(self, record: RequestRecord, mark: RetryMark) -> None:
        self._mark(mark.reason, mark.retryable)

    def upstream_failed(self, record: RequestRecord, error: PylonError, after_head: bool) -> None:
        code = error.code
        key = (code.value, _AFTER_HEAD if after_head else _BEFORE_HEAD)
        self._upstream_errors[key] = self._upstream_errors.get(key, 0) + 1
        if after_head:
            return  # the head went out: no marking could be written
        if code is ErrorCode.UPSTREAM_UNAVAILABLE:  # see Proxy._answer_connect_failure
            self._mark("local_connect_failure", self._connect_retryable)
        else:
            self._mark(code.value, code.retryable)

    def queue_gate(self, record: RequestRecord, decision: QueueDecision) -> None:
        key = (decision.result.value,)
        self._queue_decisions[key] = self._queue_decisions.get(key, 0) + 1

    def complete(self, record: RequestRecord) -> None:
        finished = self._finished
        finished.append(record)
        if len(finished) >= BATCH:
            self.flush()

    def flush(self) -> None:
        """Count the requests batched since the last flush.

        The hot path only appends the records (two list appends per request); counting them a
        batch at a time keeps this code and its tables warm in the CPU caches, which costs a
        fraction of counting each request in the middle of its own. Every scrape flushes
        first, so what is exposed is always exact.
        """
        started, finished, priorities = self._started, self._finished, self._priorities
        if not (started or finished or priorities):
            return
        self._started, self._finished, self._priorities = [], [], []
        models, by_model = self._models, self._stats
        for record in started:
            in_flight = (models.get(record.model) or by_model(record.model)).in_flight
            in_flight[record.transport] = in_flight.get(record.transport, 0) + 1
        bounds, histogram = self._priority_bounds, self._priority
        for value in priorities:
            histogram[bisect_left(bounds, value)] += 1
            histogram[-1] += value
        for record in finished:
            stats = models.get(record.model) or by_model(record.model)
            transport = record.transport
            key = (_STATUS_CLASS.get(record.status // 100, "other"), transport)
            requests = stats.requests
            requests[key] = requests.get(key, 0) + 1
            head_at = record.head_at
            if record.dispatched_at is not None:
                stats.in_flight[transport] -= 1
                if record.done_at is not None:
                    seconds = record.done_at - head_at
                    histogram = stats.duration
                    histogram[bisect_left(DURATION_BUCKETS, seconds)] += 1
                    histogram[-1] += seconds
            if record.first_byte_at is not None:
                seconds = record.first_byte_at - head_at
                histogram = stats.head
                histogram[bisect_left(SECONDS_BUCKETS, seconds)] += 1
                histogram[-1] += seconds
            if record.first_output_at is not None:
                seconds = record.first_output_at - head_at
                histogram = stats.first_output
                histogram[bisect_left(SECONDS_BUCKETS, seconds)] += 1
                histogram[-1] += seconds
            tokens = record.input_tokens
            if tokens is not None:
                source = record.input_tokens_source
                histogram = stats.input_tokens.get(source) or _tokens(stats.input_tokens, source)
                histogram[bisect_left(TOKEN_BUCKETS, tokens)] += 1
                histogram[-1] += tokens
            tokens = record.output_tokens
            if tokens is not None:
                source = record.output_tokens_source
                histogram = stats.output_tokens.get(source) or _tokens(stats.output_tokens, source)
                histogram[bisect_left(TOKEN_BUCKETS, tokens)] += 1
                histogram[-1] += tokens
            if record.stripped:
                self._count_stripped(record.stripped)

    def crashed(self, record: RequestRecord | None, exc: BaseException | None) -> None:
        self._crashes += 1

    def transport_event(self, kind: str, protocol: str, /, **fields: Any) -> None:
        key = (protocol, kind)
        self._transport_events[key] = self._transport_events.get(key, 0) + 1

    def process_event(self, kind: str, /, **fields: Any) -> None:
        if kind in ("tls_identity_loaded", "tls_reloaded"):
            if kind == "tls_reloaded":
                self._tls_reloads["ok"] += 1
            not_after = fields.get("not_after")
            if isinstance(not_after, str):
                with contextlib.suppress(ValueError):
                    self._tls_not_after = datetime.datetime.fromisoformat(not_after).timestamp()
        elif kind == "tls_reload_rejected":
            self._tls_reloads["rejected"] += 1
        elif kind == "model_discovery_poll":
            key = (str(fields.get("outcome")), str(fields.get("reason") or ""))
            self._discovery_polls[key] = self._discovery_polls.get(key, 0) + 1
        elif kind == "model_published":
            self._models_published += 1
        elif kind == "model_retired":
            self._models_published -= 1

    # --- the scrape ---
    def families(self) -> Iterator[Metric]:
        """Every family of `METRICS`, in that order, with the current values."""
        self.flush()
        backend = self.backend
        stats = [self._none, self._other, *self._client_models]
        build = InfoMetricFamily("pylon_build", _SPECS["pylon_build_info"].help)
        build.add_metric([], self._build)
        yield build
        requests = _counter("pylon_requests_total")
        in_flight = _gauge("pylon_requests_in_flight")
        for model in stats:
            for (status_class, transport), count in model.requests.items():
                requests.add_metric([model.label, status_class, transport, backend], count)
            for transport, count in model.in_flight.items():
                in_flight.add_metric([model.label, transport, backend], count)
        yield requests
        yield in_flight
        for name, attribute, bounds in (
            ("pylon_request_time_to_response_head_seconds", "head", SECONDS_BUCKETS),
            ("pylon_request_time_to_first_output_seconds", "first_output", SECONDS_BUCKETS),
            ("pylon_request_duration_seconds", "duration", DURATION_BUCKETS),
        ):
            family = _histogram(name)
            for model in stats:
                histogram: Histogram = getattr(model, attribute)
                if any(histogram[:-1]):
                    buckets = histogram_buckets(bounds, histogram)
                    family.add_metric([model.label], buckets, histogram[-1])
            yield family
        for name, attribute in (
            ("pylon_request_input_tokens", "input_tokens"),
            ("pylon_request_output_tokens", "output_tokens"),
        ):
            family = _histogram(name)
            for model in stats:
                by_source: dict[str, Histogram] = getattr(model, attribute)
                for source, histogram in by_source.items():
                    buckets = histogram_buckets(TOKEN_BUCKETS, histogram)
                    family.add_metric([model.label, source], buckets, histogram[-1])
            yield family
        priority = _histogram("pylon_engine_priority")
        buckets = histogram_buckets(self._priority_bounds, self._priority)
        priority.add_metric([backend], buckets, self._priority[-1])
        yield priority
        yield _counter("pylon_upstream_errors_total", self._upstream_errors)
        yield _counter("pylon_retry_markings_total", self._markings)
        yield _counter("pylon_stripped_controls_total", self._stripped)
        yield _counter("pylon_transport_events_total", self._transport_events)
        yield _counter("pylon_request_crashes_total", {(): self._crashes})
        yield _counter("pylon_queue_admission_decisions_total", self._queue_decisions)
        yield from self._queue_families()
        yield _counter("pylon_model_discovery_polls_total", self._discovery_polls)
        published = _gauge("pylon_models_published")
        published.add_metric([], self._models_published)
        yield published
        expiry = _gauge("pylon_tls_certificate_expiry_timestamp_seconds")
        if self._tls_not_after is not None:
            expiry.add_metric([], self._tls_not_after)
        yield expiry
        reloads = {(result,): count for result, count in self._tls_reloads.items()}
        yield _counter("pylon_tls_reloads_total", reloads)
        yield from self._routing_families()

    def _routing_families(self) -> Iterator[Metric]:
        active = _gauge("pylon_router_active_bookings")
        healthy = _gauge("pylon_router_worker_healthy")
        decisions: dict[tuple[str, str], int] = {}
        faults: dict[tuple[str, str], int] = {}
        select = _histogram("pylon_router_select_seconds")
        snapshot = self.routing_snapshot() if self.routing_snapshot is not None else None
        if snapshot is not None:
            for worker in snapshot.workers:
                active.add_metric([worker.label], worker.active)
                healthy.add_metric([worker.label], 1 if worker.admitted else 0)
                for policy, count in worker.decisions.items():
                    decisions[(worker.label, policy)] = count
                for kind, count in worker.kv_faults.items():
                    faults[(worker.label, kind)] = count
            if snapshot.select_seconds is not None:
                latencies = list(snapshot.select_seconds)
                buckets = histogram_buckets(snapshot.select_bounds, latencies)
                select.add_metric([snapshot.policy], buckets, latencies[-1])
        yield active
        yield healthy
        yield _counter("pylon_router_decisions_total", decisions)
        yield _counter("pylon_router_kv_event_faults_total", faults)
        yield select

    def _queue_families(self) -> Iterator[Metric]:
        estimates = _gauge("pylon_queue_estimate_milliseconds")
        throughput = _gauge("pylon_queue_input_tokens_per_second")
        snapshots = self.queue_snapshot() if self.queue_snapshot is not None else ()
        for snapshot in snapshots:
            stats = self._models.get(snapshot.model)
            if stats is None or stats is self._other:
                continue  # only models with a label of their own: the series stay bounded
            if snapshot.input_tps is not None:
                throughput.add_metric([stats.label], snapshot.input_tps)
            if snapshot.idle_ms is not None:
                estimates.add_metric([stats.label, "idle"], snapshot.idle_ms)
            for level, estimate in snapshot.estimates_ms:
                estimates.add_metric([stats.label, str(level)], estimate)
        yield estimates
        yield throughput


def _counter(name: str, values: dict[Any, int] | None = None) -> CounterMetricFamily:
    spec = _SPECS[name]
    family = CounterMetricFamily(name, spec.help, labels=spec.labels)
    for labels, count in (values or {}).items():
        family.add_metric(list(labels), count)
    return family


def _gauge(name: str) -> GaugeMetricFamily:
    spec = _SPECS[name]
    return GaugeMetricFamily(name, spec.help, labels=spec.labels)


def _histogram(name: str) -> HistogramMetricFamily:
    spec = _SPECS[name]
    return HistogramMetricFamily(name, spec.help, labels=spec.labels)


class _Collector:
    """prometheus-client's view of a `MetricsObserver`."""

    def __init__(self, metrics: MetricsObserver) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return self._metrics.families()


_: type[Observer] = MetricsObserver
