"""The metrics `Observer`: `MetricsObserver` counts the same events as the log lines into the
plain tables of `pylon.metrics.counts`, and hands them to `pylon.metrics.exposition` at scrape.

The hot path (`dispatched`, `complete`, `rejected`, `flush`) is measured per request
(docs/benchmarks.md): it only bumps plain integers, and batches the counting (`flush`).
"""

from __future__ import annotations

import contextlib
import datetime
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from pylon.core.errors import ErrorCode
from pylon.core.sanitize import stripped_control_label
from pylon.metrics.catalogue import (
    AFTER_HEAD,
    BEFORE_HEAD,
    DURATION_BUCKETS,
    MODEL_LABEL_LIMIT,
    NO_MODEL,
    OTHER_MODEL,
    RETRYABLE,
    SECONDS_BUCKETS,
    STATUS_CLASS,
    TLS_RELOAD_RESULTS,
    TOKEN_BUCKETS,
    UNPUBLISHED_MODEL,
    priority_buckets,
)
from pylon.metrics.counts import Counts, Histogram, ModelStats, new_histogram
from pylon.metrics.exposition import metrics_registry
from pylon.observe import Observer, QuietMoments

if TYPE_CHECKING:
    from pylon.core.errors import PylonError
    from pylon.core.queue import QueueDecision, QueueSnapshot
    from pylon.core.record import RequestRecord
    from pylon.core.retry import RetryMark
    from pylon.gateway.registration import GatewayReport
    from pylon.routing.build import RoutingSnapshot

_STRIPPED_CACHE_LIMIT = 1024  # stripped names whose label is remembered
BATCH = 64  # requests counted together (see `MetricsObserver.flush`)


class MetricsObserver(QuietMoments):
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
        self._other = ModelStats(OTHER_MODEL)
        self._none = ModelStats(NO_MODEL)
        self._unpublished = ModelStats(UNPUBLISHED_MODEL)
        # model (None for none) -> its stats; the reserved labels map to their own stats, so a
        # client model spelled like one is counted there rather than given a duplicate series.
        self._models: dict[str | None, ModelStats] = {
            None: self._none,
            NO_MODEL: self._none,
            OTHER_MODEL: self._other,
            UNPUBLISHED_MODEL: self._unpublished,
        }
        # The models published now (`model_published` / `model_retired`): a refused request is
        # labelled by its model only when it is one of them.
        self._published: set[str] = set()
        self._client_models: list[ModelStats] = []
        self._priority_bounds = priority_buckets(priority_ceiling)
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
        self._ready = 0  # what /ready answers now (1: 200); pylon starts not ready
        # Set once the queue table exists (`pylon.assemble.build_core`): read at scrape time only.
        self.queue_snapshot: Callable[[], Iterable[QueueSnapshot]] | None = None
        # Set by `pylon.run.start` with --routing other than off: read at scrape time only.
        self.routing_snapshot: Callable[[], RoutingSnapshot] | None = None
        # Set by `pylon.run.start` with --gateway (`Registration.report`): read at scrape time.
        self.gateway_report: Callable[[], Mapping[str, GatewayReport]] | None = None
        self._tls_not_after: float | None = None
        self._tls_reloads = dict.fromkeys(TLS_RELOAD_RESULTS, 0)
        # Last: registering reads the counts once (prometheus-client's auto_describe).
        self.registry = metrics_registry(self.counts)

    # --- labels ---
    def _stats(self, model: str | None) -> ModelStats:
        stats = self._models.get(model)
        if stats is not None:
            return stats
        if len(self._client_models) >= self._model_limit:
            return self._other  # not remembered: the table stays bounded
        stats = self._models[model] = ModelStats(model or NO_MODEL)
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
        key = (reason, RETRYABLE[retryable])
        self._markings[key] = self._markings.get(key, 0) + 1

    # --- the Observer events ---
    def rejected(self, record: RequestRecord, error: PylonError) -> None:
        model = record.model
        # Refused at admission (`error.model`): the client's x-model, a label of its own only
        # when pylon publishes it. A request admitted first had a published model already.
        if error.model is not None and model not in self._published:
            stats = self._unpublished
        else:
            stats = self._stats(model)
        stats.count(error.status, record.transport)
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

    def upstream_status(self, record: RequestRecord, mark: RetryMark) -> None:
        self._mark(mark.reason, mark.retryable)

    def upstream_failed(self, record: RequestRecord, error: PylonError, after_head: bool) -> None:
        code = error.code
        key = (code.value, AFTER_HEAD if after_head else BEFORE_HEAD)
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
            key = (STATUS_CLASS.get(record.status // 100, "other"), transport)
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

    def transport_event(self, event: str, protocol: str, /, **fields: Any) -> None:
        key = (protocol, event)
        self._transport_events[key] = self._transport_events.get(key, 0) + 1

    def process_event(self, event: str, /, **fields: Any) -> None:
        if event in ("tls_identity_loaded", "tls_reloaded"):
            if event == "tls_reloaded":
                self._tls_reloads["ok"] += 1
            not_after = fields.get("not_after")
            if isinstance(not_after, str):
                with contextlib.suppress(ValueError):
                    self._tls_not_after = datetime.datetime.fromisoformat(not_after).timestamp()
        elif event == "tls_reload_rejected":
            self._tls_reloads["rejected"] += 1
        elif event == "model_discovery_poll":
            key = (str(fields.get("outcome")), str(fields.get("reason") or ""))
            self._discovery_polls[key] = self._discovery_polls.get(key, 0) + 1
        elif event == "model_published":
            self._models_published += 1
            self._published.add(str(fields.get("model")))
        elif event == "model_retired":
            self._models_published -= 1
            self._published.discard(str(fields.get("model")))
        elif event == "readiness_changed":
            self._ready = 1 if fields.get("ready") else 0

    # --- the scrape ---
    def counts(self) -> Counts:
        """Everything counted so far (the batch flushed first), with the queue table and the
        routers read now: what one scrape exposes."""
        self.flush()
        return Counts(
            backend=self.backend,
            models=[self._none, self._other, self._unpublished, *self._client_models],
            labelled=self._models,
            other=self._other,
            priority_bounds=self._priority_bounds,
            priority=self._priority,
            upstream_errors=self._upstream_errors,
            markings=self._markings,
            stripped=self._stripped,
            transport_events=self._transport_events,
            crashes=self._crashes,
            queue_decisions=self._queue_decisions,
            discovery_polls=self._discovery_polls,
            models_published=self._models_published,
            ready=self._ready,
            tls_not_after=self._tls_not_after,
            tls_reloads=self._tls_reloads,
            queue=self.queue_snapshot() if self.queue_snapshot is not None else (),
            routing=self.routing_snapshot() if self.routing_snapshot is not None else None,
            gateways=self.gateway_report() if self.gateway_report is not None else None,
        )


def _tokens(histograms: dict[str, Histogram], source: str) -> Histogram:
    histogram = histograms.get(source)
    if histogram is None:
        histogram = histograms[source] = new_histogram(TOKEN_BUCKETS)
    return histogram


_: type[Observer] = MetricsObserver
