"""The assembly layer: Settings in, each component's frozen options and the shared parts out.

Nothing below this layer reads Settings: every component takes its own options, and the
functions here are the one place they are built from it (`ingress_limits`, `pool_options`,
`relay_limits`, `retry_policy`, `quic_options`, `routing_options`, `bring_up_options`,
`tracing_options`, `gateway_options`).
`build_core` then assembles the transport-neutral parts every listener shares (lifecycle,
observers, metrics, admission, pool, router, tracer, queue gate, proxy) into a `Core`;
`pylon.run.start` hands it to the listeners (`pylon.listeners`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pylon.adapters import build_adapter
from pylon.adapters.base import PriorityAdapter
from pylon.auth import TokenAuth
from pylon.bringup import BringUpOptions
from pylon.core.intake import IngressLimits
from pylon.core.plan import Planner
from pylon.core.queue import QueueGate, QueueTable
from pylon.core.retry import RetryPolicy
from pylon.core.upstream import Upstream
from pylon.lifecycle import Lifecycle
from pylon.metrics import MetricsObserver
from pylon.observe import LogObserver, Observer, Observers
from pylon.proxy import Proxy, ProxyAdmission, RelayLimits
from pylon.routing import Router, SingleUpstream
from pylon.routing.build import KvOptions, RoutingOptions
from pylon.routing.catalogue import CatalogueRules, DiscoveryOptions, WorkersFileOptions
from pylon.routing.health import HealthCheckOptions
from pylon.routing.outlier import OutlierOptions
from pylon.server.budget import BodyBudget
from pylon.server.streams import Ingress
from pylon.settings import Settings
from pylon.tracing import ExchangeTracer
from pylon.upstream.pool import PoolOptions, UpstreamPool

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from pylon.gateway.canary import CanaryOptions
    from pylon.gateway.options import GatewayOptions
    from pylon.otel import TracingOptions
    from pylon.server.http3 import QuicOptions
    from pylon.tokenize import Tokenizer


# --- Settings -> each component's options ---------------------------------------------------


def ingress_limits(settings: Settings) -> IngressLimits:
    return IngressLimits(
        max_header_bytes=settings.max_header_bytes,
        max_headers=settings.max_headers,
        max_body_bytes=settings.max_body_bytes,
        max_connection_body_bytes=settings.max_connection_body_bytes,
        stall_timeout=settings.header_timeout,
        idle_timeout=settings.client_idle_timeout,
        max_streams=settings.h2_max_concurrent_streams,
        max_quic_streams=settings.quic_max_concurrent_streams,
        h2_stream_window=settings.h2_stream_window,
        max_stream_resets=settings.max_stream_resets,
        max_control_frames=settings.max_control_frames,
        flood_window=settings.flood_window,
    )


def pool_options(settings: Settings) -> PoolOptions:
    return PoolOptions(
        connect_timeout=settings.upstream_connect_timeout,
        idle_timeout=settings.upstream_idle_timeout,
        max_idle=settings.upstream_max_idle,
        max_connections=settings.upstream_max_connections,
        queue_timeout=settings.upstream_queue_timeout,
        head_timeout=settings.response_head_timeout,
    )


def relay_limits(settings: Settings) -> RelayLimits:
    return RelayLimits(
        first_output_timeout=settings.first_output_timeout,
        output_gap_timeout=settings.output_gap_timeout,
        max_sse_event_bytes=settings.max_sse_event_bytes,
        client_send_timeout=settings.client_send_timeout,
    )


def quic_options(settings: Settings, reset_key: bytes | None = None) -> QuicOptions:
    """`reset_key`: the node's stateless reset key, the same for every process the supervisor
    starts on one UDP port (`--processes N`), so any of them can reset a connection that the
    kernel's hash moved away from its own process. None (one process): a random key."""
    from pylon.server.http3 import QuicOptions  # aioquic: imported only with a QUIC listener

    return QuicOptions(
        idle_timeout=settings.quic_idle_timeout,
        max_data=settings.quic_max_data,
        max_stream_data=settings.quic_max_stream_data,
        retry=settings.quic_retry,
        reset_key=reset_key,
    )


def routing_options(settings: Settings) -> RoutingOptions:
    """`--routing` other than off: the workers, their health checks, the `kv` router."""
    mode = settings.routing
    assert mode != "off", "--routing off has no routing parts"
    return RoutingOptions(
        mode,
        workers=settings.worker,
        frontend=Upstream.from_url(str(settings.upstream)) if settings.upstream else None,
        health=HealthCheckOptions(
            path=settings.worker_health_path,
            interval=settings.worker_health_interval,
            timeout=settings.worker_health_timeout,
            eject_after=settings.worker_eject_after,
            readmit_after=settings.worker_readmit_after,
        ),
        kv=kv_options(settings) if mode == "kv" else None,
        outlier=OutlierOptions(
            consecutive=settings.worker_outlier_failures,
            base_ejection=settings.worker_outlier_ejection,
            max_ejection=settings.worker_outlier_max_ejection,
            max_ejected_share=settings.worker_outlier_max_percent / 100,
        ),
        workers_file=workers_file_options(settings),
        discovery=discovery_options(settings),
    )


def discovery_options(settings: Settings) -> DiscoveryOptions | None:
    """`--discover-instances`: the frontend, the path that lists its instances, how often."""
    if not settings.discover_instances:
        return None
    assert settings.upstream is not None, "Settings require --upstream for discovery"
    return DiscoveryOptions(
        frontend=Upstream.from_url(str(settings.upstream)),
        path=settings.worker_health_path,
        interval=settings.workers_file_interval,
        timeout=settings.worker_health_timeout,
    )


def workers_file_options(settings: Settings) -> WorkersFileOptions | None:
    """`--workers-file`: where the catalogue is read, how often, and the rules it must keep."""
    if settings.workers_file is None:
        return None
    return WorkersFileOptions(
        path=settings.workers_file,
        interval=settings.workers_file_interval,
        rules=CatalogueRules(
            mode=settings.routing,
            instance_ids=settings.backend == "dynamo" and settings.upstream is not None,
        ),
    )


def retry_policy(settings: Settings) -> RetryPolicy:
    """How pylon marks what it answers for the gateway. With `--routing` other than off, an
    engine connect failure is always retryable: it reaches the client only when no other worker
    could take the request, and no engine saw it (`--local-connect-failures-retryable` is for
    the one `--upstream`)."""
    policy = settings.retry_policy
    if settings.routing != "off" and not policy.local_connect_failures_retryable:
        policy = replace(policy, local_connect_failures_retryable=True)
    return policy


def kv_options(settings: Settings) -> KvOptions:
    return KvOptions(
        overlap_weight=settings.kv_overlap_weight,
        token_data=settings.kv_token_data,
        # A proof probe is a one-token stream: it answers within a first output's time.
        probe_timeout=settings.first_output_timeout,
        replica_sync_port=settings.replica_sync_port,
        replica_peers=settings.replica_peer,
        booking_expiry=settings.kv_booking_expiry,
    )


def bring_up_options(settings: Settings) -> BringUpOptions:
    return BringUpOptions(
        health_gate=settings.upstream_health_gate,
        health_paths=settings.upstream_health_path,
        health_wait=settings.upstream_health_wait,
        health_interval=settings.upstream_health_interval,
        health_timeout=settings.upstream_health_timeout,
        health_check_interval=settings.upstream_health_check_interval,
        models=settings.model,
        discovery_interval=settings.model_discovery_interval,
        discovery_timeout=settings.model_discovery_timeout,
    )


def gateway_options(settings: Settings) -> GatewayOptions | None:
    """The gateway side's parts: None without `--gateway` and without an explicit
    `--canary-interval` (which alone runs the canaries, heard only by `/ready`)."""
    from pylon.gateway.discovery import ControlPlaneTls
    from pylon.gateway.options import GatewayOptions
    from pylon.gateway.registration import RegistrationOptions
    from pylon.gateway.tunnel import TunnelOptions

    canary = canary_options(settings)
    if not settings.gateway:
        return GatewayOptions(registration=None, canary=canary, tunnel=None) if canary else None
    assert settings.inference_server_id is not None  # Settings refuses --gateway without it
    reverse = settings.connectivity == "reverse"
    tls = ControlPlaneTls(settings.gateway_ca) if settings.gateway_tls else None
    registration = RegistrationOptions(
        seeds=settings.gateway,
        tls=tls,
        inference_server_id=settings.inference_server_id,
        cluster_id=settings.cluster_id,
        token_file=settings.gateway_token_file,
        inference_server_url=settings.inference_server_url or "",
        reverse_tunnel=reverse,
        interval=settings.registration_interval,
        connect_timeout=settings.gateway_connect_timeout,
    )
    tunnel = None
    if reverse:
        tunnel = TunnelOptions(
            inference_server_id=settings.inference_server_id,
            token_file=settings.gateway_token_file,
            protocol=settings.tunnel_protocol,
            connections=settings.tunnel_connections,
            connect_timeout=settings.gateway_connect_timeout,
            keepalive=settings.tunnel_keepalive,
            idle_timeout=settings.tunnel_idle_timeout,
            ca=settings.gateway_ca,
            insecure=settings.gateway_insecure,
            max_data=settings.quic_max_data,
            max_stream_data=settings.quic_max_stream_data,
        )
    return GatewayOptions(registration=registration, canary=canary, tunnel=tunnel)


def canary_options(settings: Settings) -> CanaryOptions | None:
    """The active canaries' options: with `--gateway` (unless `--canary-interval 0`), or
    without it when `--canary-interval` is given explicitly; None otherwise."""
    from pylon.gateway.canary import CanaryOptions

    wanted = bool(settings.gateway) or "canary_interval" in settings.model_fields_set
    if not wanted or settings.canary_interval == 0:
        return None
    return CanaryOptions(
        interval=settings.canary_interval,
        timeout=settings.canary_timeout,
        max_tokens=settings.canary_max_tokens,
        recovery_interval=settings.canary_recovery_interval,
    )


def tracing_options(settings: Settings) -> TracingOptions:
    from pylon.otel import TracingOptions  # the `otel` extra: imported only with tracing on

    return TracingOptions(
        service_name=settings.otel_service_name,
        traces_url=settings.otel_traces_url,
        backend=settings.backend,
    )


# --- options -> the shared parts ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Core:
    """The transport-neutral parts every listener shares."""

    lifecycle: Lifecycle
    observer: Observer
    admission: ProxyAdmission
    proxy: Proxy
    pool: UpstreamPool
    limits: IngressLimits
    ingress: Ingress  # what every client connection shares
    queue: QueueGate  # the live request tables and queue estimates (`queue.table`)
    tracer: ExchangeTracer | None = None  # None: tracing is off
    metrics: MetricsObserver | None = None  # None when there is no admin listener to serve them
    tokenizer: Tokenizer | None = None  # --tokenizer, loaded once (pylon.tokenize)


def build_core(
    settings: Settings,
    upstream: str,
    *,
    observer: Observer | None = None,
    lifecycle: Lifecycle | None = None,
    router: Router | None = None,
    span_exporter: SpanExporter | None = None,
    tokenizer: Tokenizer | None = None,
) -> Core:
    """Assemble the proxy and its parts. Must run inside the event loop (the pool binds it).

    `router`: who picks the engine worker; default, every request to `upstream`.
    `observer`: who hears the events (default, the log lines); with an admin listener, the
    metrics hear them too (`Observers`).
    `span_exporter`: where spans go instead of the OTLP collector (tests); tracing is on when
    it is given or `settings.otel_endpoint` is set, and nothing of it is built otherwise.
    `tokenizer`: the `--tokenizer` model dir as `preflight.load_tokenizer` loaded it.
    """
    metrics = _metrics(settings)
    observer = observer or LogObserver()
    if metrics is not None:
        observer = Observers(observer, metrics)
    lifecycle = lifecycle or Lifecycle()
    path = settings.tunnel_token_file
    auth = TokenAuth(path) if path is not None else None
    pool = UpstreamPool(pool_options(settings))
    adapter = build_adapter(
        settings.backend, settings.adapter_options, derive=settings.derive_priority
    )
    planner = Planner(adapter, consumed=auth.consumed if auth is not None else frozenset())
    queue = _queue_gate(settings, adapter, lifecycle, metrics)
    tracer = _tracer(settings, pool.loop, observer, span_exporter)
    proxy = Proxy(
        planner=planner,
        router=router or SingleUpstream(Upstream.from_url(upstream)),
        pool=pool,
        observer=observer,
        relay=relay_limits(settings),
        retry=retry_policy(settings),
        tracer=tracer,
        queue=queue,
    )
    admission = ProxyAdmission(lifecycle, auth)
    limits = ingress_limits(settings)
    budget = BodyBudget(settings.max_total_body_bytes)
    ingress = Ingress(proxy, admission, limits, lifecycle, budget)
    return Core(
        lifecycle,
        observer,
        admission,
        proxy,
        pool,
        limits,
        ingress,
        queue,
        tracer,
        metrics,
        tokenizer,
    )


def _metrics(settings: Settings) -> MetricsObserver | None:
    """The metrics observer, when an admin listener will serve them (`--admin-listen`)."""
    if not settings.admin_listen:
        return None
    return MetricsObserver(
        settings.backend,
        priority_ceiling=settings.priority_ceiling,
        local_connect_retryable=retry_policy(settings).local_connect_failures_retryable,
    )


def _queue_gate(
    settings: Settings,
    adapter: PriorityAdapter,
    lifecycle: Lifecycle,
    metrics: MetricsObserver | None,
) -> QueueGate:
    queue = QueueGate(QueueTable(settings.initial_input_tps), settings.queue_policy, adapter)
    # A re-published model is a new generation: its throughput is measured afresh.
    lifecycle.models.on_retire(queue.table.retire)
    if metrics is not None:
        metrics.queue_snapshot = queue.table.snapshot
    return queue


def _tracer(
    settings: Settings,
    loop: asyncio.AbstractEventLoop,
    observer: Observer,
    exporter: SpanExporter | None,
) -> ExchangeTracer | None:
    """Tracing, when `--otel-endpoint` is set or a test hands in its exporter; else None, and
    nothing of OpenTelemetry is imported."""
    if settings.otel_endpoint is None and exporter is None:
        return None
    from pylon.otel import OtelTracer

    return OtelTracer.build(tracing_options(settings), loop, observer, exporter)
