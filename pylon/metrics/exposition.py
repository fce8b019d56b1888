"""The scrape: the counted tables (`Counts`) turned into prometheus-client metric families, on a
`CollectorRegistry` of the process's own (never the global default, so several pylons in one
process keep their own), which the admin listener (`pylon.admin`) serves as Prometheus text or
OpenMetrics.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterator, Mapping, Sequence
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

from pylon.metrics.catalogue import DURATION_BUCKETS, SECONDS_BUCKETS, SPECS, TOKEN_BUCKETS
from pylon.metrics.counts import Counts, Histogram

if TYPE_CHECKING:
    from pylon.routing.build import RoutingSnapshot


def metrics_registry(read: Callable[[], Counts]) -> CollectorRegistry:
    """A registry of its own: pylon's families, read from `read()` at each scrape, and the
    process collector's (CPU, memory, file descriptors), named `pylon_process_*`."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_Collector(read))
    ProcessCollector(namespace="pylon", registry=registry)
    return registry


def build_info() -> dict[str, str]:
    """pylon_build_info's labels: pylon's version and the Python running it."""
    return {"version": _version(), "python": platform.python_version()}


def _version() -> str:
    try:
        return metadata.version("pylon")
    except metadata.PackageNotFoundError:
        return "unknown"


def families(counts: Counts, build: dict[str, str]) -> Iterator[Metric]:
    """Every family of `METRICS`, in that order, with the values of `counts`."""
    backend = counts.backend
    stats = counts.models
    info = InfoMetricFamily("pylon_build", SPECS["pylon_build_info"].help)
    info.add_metric([], build)
    yield info
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
    buckets = histogram_buckets(counts.priority_bounds, counts.priority)
    priority.add_metric([backend], buckets, counts.priority[-1])
    yield priority
    yield _counter("pylon_upstream_errors_total", counts.upstream_errors)
    yield _counter("pylon_retry_markings_total", counts.markings)
    yield _counter("pylon_stripped_controls_total", counts.stripped)
    yield _counter("pylon_transport_events_total", counts.transport_events)
    yield _counter("pylon_request_crashes_total", {(): counts.crashes})
    yield _counter("pylon_queue_admission_decisions_total", counts.queue_decisions)
    yield from queue_families(counts)
    yield _counter("pylon_model_discovery_polls_total", counts.discovery_polls)
    published = _gauge("pylon_models_published")
    published.add_metric([], counts.models_published)
    yield published
    ready = _gauge("pylon_ready")
    ready.add_metric([], counts.ready)
    yield ready
    expiry = _gauge("pylon_tls_certificate_expiry_timestamp_seconds")
    if counts.tls_not_after is not None:
        expiry.add_metric([], counts.tls_not_after)
    yield expiry
    reloads = {(result,): count for result, count in counts.tls_reloads.items()}
    yield _counter("pylon_tls_reloads_total", reloads)
    yield from routing_families(counts.routing)
    yield from gateway_families(counts)


def queue_families(counts: Counts) -> Iterator[Metric]:
    """The queue table's estimates and throughputs, for the models with a label of their own."""
    estimates = _gauge("pylon_queue_estimate_milliseconds")
    throughput = _gauge("pylon_queue_input_tokens_per_second")
    for snapshot in counts.queue:
        stats = counts.labelled.get(snapshot.model)
        if stats is None or stats is counts.other:
            continue  # only models with a label of their own: the series stay bounded
        if snapshot.input_tps is not None:
            throughput.add_metric([stats.label], snapshot.input_tps)
        if snapshot.idle_ms is not None:
            estimates.add_metric([stats.label, "idle"], snapshot.idle_ms)
        for level, estimate in snapshot.estimates_ms:
            estimates.add_metric([stats.label, str(level)], estimate)
    yield estimates
    yield throughput


def routing_families(snapshot: RoutingSnapshot | None) -> Iterator[Metric]:
    """The workers' bookings, health, passive ejections, decisions and KV-event faults, the kv
    selects' latencies, the core's own load view, the catalogue digest and the replica sync's
    events per peer (empty families with --routing off)."""
    active = _gauge("pylon_router_active_bookings")
    healthy = _gauge("pylon_router_worker_healthy")
    ejected = _gauge("pylon_router_worker_ejected")
    ejections: dict[tuple[str, str], int] = {}
    decisions: dict[tuple[str, str], int] = {}
    faults: dict[tuple[str, str], int] = {}
    select = _histogram("pylon_router_select_seconds")
    core_active = _gauge("pylon_router_core_active_requests")
    catalogue_info = InfoMetricFamily(
        "pylon_router_catalogue", SPECS["pylon_router_catalogue_info"].help
    )
    sync_events: dict[tuple[str, str], int] = {}
    catalogue: dict[tuple[str], int] = {}
    if snapshot is not None:
        for label, count in snapshot.core_active.items():
            core_active.add_metric([label], count)
        if snapshot.catalogue_digest is not None:
            catalogue_info.add_metric([], {"digest": snapshot.catalogue_digest})
        sync_events = snapshot.replica_sync_events
        if snapshot.catalogue_reloads is not None:
            changed, refused = snapshot.catalogue_reloads
            catalogue = {("changed",): changed, ("refused",): refused}
        for worker in snapshot.workers:
            active.add_metric([worker.label], worker.active)
            healthy.add_metric([worker.label], 1 if worker.in_rotation else 0)
            ejected.add_metric([worker.label], 1 if worker.ejected else 0)
            for reason, count in worker.ejections.items():
                ejections[(worker.label, reason)] = count
            for policy, count in worker.decisions.items():
                decisions[(worker.label, policy)] = count
            for kind, count in worker.kv_faults.items():
                faults[(worker.label, kind)] = count
        if snapshot.select_seconds is not None:
            latencies = list(snapshot.select_seconds)
            buckets = histogram_buckets(snapshot.select_bounds, latencies)
            select.add_metric([snapshot.policy], buckets, latencies[-1])
    yield _counter("pylon_router_catalogue_reloads_total", catalogue)
    yield active
    yield healthy
    yield ejected
    yield _counter("pylon_router_worker_ejections_total", ejections)
    yield _counter("pylon_router_decisions_total", decisions)
    yield _counter("pylon_router_kv_event_faults_total", faults)
    yield select
    connected = _gauge("pylon_router_authority_connected")
    events: dict[tuple[str], int] = {}
    if snapshot is not None and snapshot.authority is not None:
        up, counters = snapshot.authority
        connected.add_metric([], 1 if up else 0)
        events = {(event,): count for event, count in counters.items()}
    yield core_active
    yield catalogue_info
    yield _counter("pylon_router_replica_sync_events_total", sync_events)
    yield connected
    yield _counter("pylon_router_authority_events_total", events)


def gateway_families(counts: Counts) -> Iterator[Metric]:
    """Each registered gateway's stream state, acks, reconnects and advertised statuses (empty
    families without --gateway)."""
    connected = _gauge("pylon_gateway_registration_connected")
    status = _gauge("pylon_gateway_model_status")
    tunnels = _gauge("pylon_gateway_tunnel_connections")
    acks: dict[tuple[str], int] = {}
    reconnects: dict[tuple[str, str], int] = {}
    refusals: dict[tuple[str, str], int] = {}
    for gateway, report in (counts.gateways or {}).items():
        connected.add_metric([gateway], 1 if report.connected else 0)
        tunnels.add_metric([gateway], report.tunnels)
        for reason, count in report.tunnel_refusals.items():
            refusals[(gateway, reason)] = count
        acks[(gateway,)] = report.acks_total
        for reason, count in report.reconnects_total.items():
            reconnects[(gateway, reason)] = count
        for model, value in report.model_status.items():
            status.add_metric([gateway, model], 1 if value.value == "active" else 0)
    yield connected
    yield _counter("pylon_gateway_acks_total", acks)
    yield _counter("pylon_gateway_reconnects_total", reconnects)
    yield status
    yield tunnels
    yield _counter("pylon_gateway_tunnel_refusals_total", refusals)


def histogram_buckets(bounds: Sequence[float], histogram: Histogram) -> list[tuple[str, float]]:
    """The cumulative (le, count) pairs of an exposition, +Inf last."""
    out: list[tuple[str, float]] = []
    running = 0.0
    for bound, count in zip(bounds, histogram, strict=False):
        running += count
        out.append((repr(float(bound)), running))
    out.append(("+Inf", running + histogram[len(bounds)]))
    return out


def _counter(name: str, values: Mapping[Any, int] | None = None) -> CounterMetricFamily:
    spec = SPECS[name]
    family = CounterMetricFamily(name, spec.help, labels=spec.labels)
    for labels, count in (values or {}).items():
        family.add_metric(list(labels), count)
    return family


def _gauge(name: str) -> GaugeMetricFamily:
    spec = SPECS[name]
    return GaugeMetricFamily(name, spec.help, labels=spec.labels)


def _histogram(name: str) -> HistogramMetricFamily:
    spec = SPECS[name]
    return HistogramMetricFamily(name, spec.help, labels=spec.labels)


class _Collector:
    """prometheus-client's view of a `MetricsObserver`: its counts, read at each scrape."""

    def __init__(self, read: Callable[[], Counts]) -> None:
        self._read = read
        self._build = build_info()

    def collect(self) -> Iterator[Metric]:
        return families(self._read(), self._build)
