"""The assembly layer: Settings in, each component's frozen options out.

Nothing below this layer reads Settings: every component takes its own options, and the
functions here are the one place they are built from it (`ingress_limits`, `pool_options`,
`relay_limits`, `quic_options`, `routing_options`, `bring_up_options`, `tracing_options`).
`pylon.app` builds the parts from them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pylon.bringup import BringUpOptions
from pylon.core.intake import IngressLimits
from pylon.core.target import UpstreamTarget
from pylon.proxy import RelayLimits
from pylon.routing.build import KvOptions, RoutingOptions
from pylon.routing.health import HealthCheckOptions
from pylon.settings import Settings
from pylon.upstream.pool import PoolOptions

if TYPE_CHECKING:
    from pylon.otel import TracingOptions
    from pylon.server.http3 import QuicOptions


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
    )


def relay_limits(settings: Settings) -> RelayLimits:
    return RelayLimits(
        first_output_timeout=settings.first_output_timeout,
        output_gap_timeout=settings.output_gap_timeout,
        max_sse_event_bytes=settings.max_sse_event_bytes,
        client_send_timeout=settings.client_send_timeout,
    )


def quic_options(settings: Settings) -> QuicOptions:
    from pylon.server.http3 import QuicOptions  # aioquic: imported only with a QUIC listener

    return QuicOptions(
        idle_timeout=settings.quic_idle_timeout,
        max_data=settings.quic_max_data,
        max_stream_data=settings.quic_max_stream_data,
        retry=settings.quic_retry,
    )


def routing_options(settings: Settings) -> RoutingOptions:
    """`--routing` other than off: the workers, their health checks, the `kv` router."""
    mode = settings.routing
    assert mode != "off", "--routing off has no routing parts"
    return RoutingOptions(
        mode,
        workers=settings.worker,
        frontend=UpstreamTarget.from_url(str(settings.upstream)) if settings.upstream else None,
        health=HealthCheckOptions(
            path=settings.worker_health_path,
            interval=settings.worker_health_interval,
            timeout=settings.worker_health_timeout,
            eject_after=settings.worker_eject_after,
            readmit_after=settings.worker_readmit_after,
        ),
        kv=kv_options(settings) if mode == "kv" else None,
    )


def kv_options(settings: Settings) -> KvOptions:
    return KvOptions(
        overlap_weight=settings.kv_overlap_weight,
        token_data=settings.kv_token_data,
        # A proof probe is a one-token stream: it answers within a first output's time.
        probe_timeout=settings.first_output_timeout,
    )


def bring_up_options(settings: Settings) -> BringUpOptions:
    return BringUpOptions(
        health_gate=settings.upstream_health_gate,
        health_paths=settings.upstream_health_path,
        health_wait=settings.upstream_health_wait,
        health_interval=settings.upstream_health_interval,
        health_timeout=settings.upstream_health_timeout,
        models=settings.model,
        discovery_interval=settings.model_discovery_interval,
        discovery_timeout=settings.model_discovery_timeout,
    )


def tracing_options(settings: Settings) -> TracingOptions:
    from pylon.otel import TracingOptions  # the `otel` extra: imported only with tracing on

    return TracingOptions(
        service_name=settings.otel_service_name,
        traces_url=settings.otel_traces_url,
        backend=settings.backend,
    )
