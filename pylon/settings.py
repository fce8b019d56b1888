"""Pylon's settings: one model, built once at start-up, passed down. No env reads elsewhere.

Precedence: command-line flag > environment (`PYLON_<NAME>`, then for the two tracing settings
OpenTelemetry's standard `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_SERVICE_NAME`) > `--config FILE`
(TOML) > default.

Every field names its topic (`group`): `pylon serve --help` shows the flags by topic and
docs/operations.md tables them the same way. `load_settings` turns every failure into one
`SettingsError` line that names the setting and where its value came from.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AnyHttpUrl,
    Field,
    PlainSerializer,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from pylon.adapters import ADAPTERS, AdapterOptions
from pylon.adapters.base import I32_MAX
from pylon.core.queue import QueuePolicy
from pylon.core.retry import RetryPolicy
from pylon.routing.spec import WorkerSpec, WorkerSpecError, parse_worker_spec, worker_from_table

MiB = 1024 * 1024
KiB = 1024
Backend = Literal["dynamo", "vllm", "sglang", "passthrough"]
Routing = Literal["off", "round-robin", "least-loaded", "kv"]
# A worker as a setting: parsed from its SPEC (or a [[worker]] table), shown as its SPEC.
Worker = Annotated[WorkerSpec, PlainSerializer(lambda spec: spec.text(), return_type=str)]
WORKER_ENV_SEPARATOR = ";"  # a SPEC holds commas, so PYLON_WORKER separates specs with `;`
ENV_PREFIX = "PYLON_"

# The topics of `pylon serve --help` and of docs/operations.md, in the order they are shown.
LISTENERS = "Listeners"
ENGINE = "Engine"
ROUTING = "Routing"
QUEUE = "Queue admission"
BRINGUP = "Engine bring-up and models"
LIMITS = "Limits"
TIMEOUTS = "Timeouts"
TLS_AUTH = "TLS and auth"
HTTP2 = "HTTP/2"
QUIC = "HTTP/3 / QUIC"
FLOODS = "Flood guards"
LOGGING = "Logging"
TRACING = "Tracing"
GROUPS = (
    LISTENERS,
    ENGINE,
    ROUTING,
    BRINGUP,
    QUEUE,
    LIMITS,
    TIMEOUTS,
    TLS_AUTH,
    HTTP2,
    QUIC,
    FLOODS,
    LOGGING,
    TRACING,
)
# The OpenTelemetry standard variables pylon reads, each for one setting. They rank below the
# setting's own PYLON_* variable and above the config file (see `settings_customise_sources`).
STANDARD_OTEL_ENV = {
    "OTEL_EXPORTER_OTLP_ENDPOINT": "otel_endpoint",
    "OTEL_SERVICE_NAME": "otel_service_name",
}
# pylon's exporter speaks OTLP over HTTP with protobuf bodies, nothing else.
OTLP_PROTOCOL_ENV = ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
OTLP_PROTOCOL = "http/protobuf"
OTLP_TRACES_PATH = "v1/traces"


def group(
    topic: str,
    metavar: str | None = None,
    *,
    repeatable: bool = False,
    separator: str = ",",
) -> dict[str, Any]:
    """A field's topic (and, when the type does not say it, what its value is: BYTES, ...).

    `repeatable`: a list whose flag is given once per value (`--model a --model b`); its
    environment variable and a plain string take the values `separator`-separated (a comma,
    unless the values hold commas themselves).
    """
    extra: dict[str, Any] = {"group": topic}
    if metavar is not None:
        extra["metavar"] = metavar
    if repeatable:
        extra["repeatable"] = True
        if separator != ",":
            extra["separator"] = separator
    return extra


class SettingsError(ValueError):
    """The settings cannot be built; the message is one line for the operator."""


def split_host_port(value: str) -> tuple[str, int]:
    """`HOST:PORT` or `[IPv6]:PORT` -> (host, port)."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError(f"port out of range in {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"not an IPv6 address in brackets: {value!r}") from None
    return host, port


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="PYLON_", extra="forbid", frozen=True, validate_default=True
    )

    listen: str = Field(
        "127.0.0.1:8080",
        description="TCP listen address (HTTP/1.1 and HTTP/2)",
        json_schema_extra=group(LISTENERS, "HOST:PORT"),
    )
    upstream: AnyHttpUrl | None = Field(
        None,
        description="engine base URL (http://, no credentials); unset = an embedded mock_dynamo",
        json_schema_extra=group(ENGINE),
    )
    backend: Backend = Field(
        "dynamo",
        description="engine dialect for priority derivation",
        json_schema_extra=group(ENGINE),
    )
    priority_ceiling: int = Field(
        3600, ge=1, le=I32_MAX, description="rank ceiling C", json_schema_extra=group(ENGINE)
    )
    derive_priority: bool = Field(
        True, description="kill switch for priority derivation", json_schema_extra=group(ENGINE)
    )
    sglang_low_priority_first: bool = Field(
        False,
        description="SGLang runs --schedule-low-priority-values-first",
        json_schema_extra=group(ENGINE),
    )
    # --- routing ---
    routing: Routing = Field(
        "off",
        description="how a request picks its engine worker: off (every request to --upstream), "
        "round-robin, least-loaded (fewest requests in flight) or kv (the worker that holds "
        "the prompt's KV cache and is not overloaded; needs --tokenizer and the dynamo extra)",
        json_schema_extra=group(ROUTING),
    )
    worker: Annotated[tuple[Worker, ...], NoDecode] = Field(
        (),
        description="an engine worker to route to (repeatable; needs --routing other than off): "
        "comma-separated key=value, url=http://HOST:PORT (its own URL) or instance-id=U64 (a "
        "Dynamo instance behind the --upstream frontend), plus kv-events=tcp://HOST:PORT (one "
        "per dp rank), block-size=16, dp-size=1; also [[worker]] tables in --config",
        json_schema_extra=group(ROUTING, "SPEC", repeatable=True, separator=WORKER_ENV_SEPARATOR),
    )
    worker_health_path: str = Field(
        "/health",
        description="path each worker's active health check GETs (2xx = healthy)",
        json_schema_extra=group(ROUTING, "PATH"),
    )
    worker_health_interval: float = Field(
        1.0,
        gt=0,
        description="seconds between health checks of each worker",
        json_schema_extra=group(ROUTING),
    )
    worker_health_timeout: float = Field(
        1.0,
        gt=0,
        description="seconds one worker health check may take (longer = a failure)",
        json_schema_extra=group(ROUTING),
    )
    worker_eject_after: int = Field(
        3,
        ge=1,
        le=1000,
        description="consecutive failed health checks that take a worker out of routing",
        json_schema_extra=group(ROUTING, "CHECKS"),
    )
    worker_readmit_after: int = Field(
        2,
        ge=1,
        le=1000,
        description="consecutive passed health checks that bring an ejected worker back (a "
        "worker is admitted at start after its first passed check)",
        json_schema_extra=group(ROUTING, "CHECKS"),
    )
    kv_overlap_weight: float | None = Field(
        None,
        ge=0,
        le=1000,
        allow_inf_nan=False,
        description="--routing kv: how much a worker's cached prefix counts against its load in "
        "Dynamo's selection cost (weight x blocks to prefill + active blocks); unset = Dynamo's "
        "default (1). docs/benchmarks.md 'Routing quality' measures 1 against 8",
        json_schema_extra=group(ROUTING, "WEIGHT"),
    )
    kv_token_data: bool = Field(
        False,
        description="--routing kv, --backend dynamo: send the frontend pylon's token ids "
        "(nvext.token_data) for models whose rendering pylon proved identical to its own (a "
        "mismatch at start refuses it); docs/routing.md",
        json_schema_extra=group(ROUTING),
    )
    # --- engine bring-up and models ---
    upstream_health_gate: bool = Field(
        True,
        description="take tunnel requests only once the engine answered a health path with 2xx "
        "(requests before get 503 not_ready); --no-upstream-health-gate takes them at once",
        json_schema_extra=group(BRINGUP),
    )
    upstream_health_path: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description="engine health path probed first (repeatable), before /health and "
        "/v1/health/ready",
        json_schema_extra=group(BRINGUP, "PATH", repeatable=True),
    )
    upstream_health_wait: float = Field(
        60.0,
        ge=0,
        description="seconds the engine has at start to answer a health path with 2xx; then "
        "pylon exits with status 1 (0 = one round of probes)",
        json_schema_extra=group(BRINGUP),
    )
    upstream_health_interval: float = Field(
        0.5,
        gt=0,
        description="seconds between rounds of health probes at start",
        json_schema_extra=group(BRINGUP),
    )
    upstream_health_timeout: float = Field(
        5.0,
        gt=0,
        description="seconds one health probe may take",
        json_schema_extra=group(BRINGUP),
    )
    model: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description="a model this pylon serves (repeatable): a static set, never polled; unset "
        "= discover the models from the engine's /v1/models",
        json_schema_extra=group(BRINGUP, "NAME", repeatable=True),
    )
    model_discovery_interval: float = Field(
        5.0,
        gt=0,
        description="seconds between polls of the engine's /v1/models (without --model)",
        json_schema_extra=group(BRINGUP),
    )
    model_discovery_timeout: float = Field(
        5.0,
        gt=0,
        description="seconds one /v1/models poll may take (without --model)",
        json_schema_extra=group(BRINGUP),
    )
    max_body_bytes: int = Field(
        64 * MiB,
        ge=0,
        description="request body limit (413)",
        json_schema_extra=group(LIMITS, "BYTES"),
    )
    max_connection_body_bytes: int = Field(
        256 * MiB,
        ge=0,
        description="request-body bytes one client connection may have buffered at once "
        "(503 body_budget_exceeded above it)",
        json_schema_extra=group(LIMITS, "BYTES"),
    )
    max_total_body_bytes: int = Field(
        1024 * MiB,
        ge=0,
        description="request-body bytes pylon buffers at once across all connections "
        "(503 body_budget_exceeded above it)",
        json_schema_extra=group(LIMITS, "BYTES"),
    )
    max_header_bytes: int = Field(
        60 * KiB,
        ge=256,
        description="request header section limit",
        json_schema_extra=group(LIMITS, "BYTES"),
    )
    max_headers: int = Field(
        100, ge=4, description="request header count limit (431)", json_schema_extra=group(LIMITS)
    )
    first_output_timeout: float = Field(
        30.0, gt=0, description="seconds until first output", json_schema_extra=group(TIMEOUTS)
    )
    output_gap_timeout: float = Field(
        30.0, gt=0, description="seconds allowed between events", json_schema_extra=group(TIMEOUTS)
    )
    client_send_timeout: float = Field(
        30.0,
        gt=0,
        description="seconds a client may keep the response waiting (not reading) before its "
        "stream is reset and the engine request cancelled",
        json_schema_extra=group(TIMEOUTS),
    )
    max_sse_event_bytes: int = Field(
        1 * MiB,
        ge=64,
        description="largest unterminated event",
        json_schema_extra=group(LIMITS, "BYTES"),
    )
    upstream_connect_timeout: float = Field(
        5.0, gt=0, description="seconds to connect", json_schema_extra=group(TIMEOUTS)
    )
    upstream_idle_timeout: float = Field(
        4.0,
        gt=0,
        description="idle pooled connections are closed after this many seconds",
        json_schema_extra=group(TIMEOUTS),
    )
    upstream_max_idle: int = Field(
        256,
        ge=0,
        description="idle connections kept per engine target",
        json_schema_extra=group(ENGINE),
    )
    upstream_max_connections: int = Field(
        1024,
        ge=1,
        description="open connections per engine target; requests above it wait their turn",
        json_schema_extra=group(ENGINE),
    )
    upstream_queue_timeout: float = Field(
        5.0,
        gt=0,
        description="seconds a request waits for a free engine connection before a "
        "retryable 503 (upstream_busy)",
        json_schema_extra=group(TIMEOUTS),
    )
    retryable_status_codes: Annotated[tuple[int, ...], NoDecode] = Field(
        (429, 503),
        description="upstream statuses the gateway may retry",
        json_schema_extra=group(ENGINE, "CODES"),
    )
    require_upstream_retry_header: bool = Field(
        True,
        description="a retryable status needs the engine's retry header set to true",
        json_schema_extra=group(ENGINE),
    )
    upstream_retry_header: str = Field(
        "x-stargate-upstream-retryable",
        description="engine header that authorises a retry",
        json_schema_extra=group(ENGINE, "NAME"),
    )
    propagate_retry_after: bool = Field(
        True,
        description="Retry-After -> x-stargate-retry-after-ms",
        json_schema_extra=group(ENGINE),
    )
    local_connect_failures_retryable: bool = Field(
        False,
        description="mark engine connect failures retryable",
        json_schema_extra=group(ENGINE),
    )
    tokenizer: Path | None = Field(
        None,
        description="local Hugging Face model dir (tokenizer.json, tokenizer_config.json with "
        "its chat template) that KV-aware routing tokenizes prompts with, exactly as the "
        "--backend engine does; loaded and checked at start (needs the dynamo extra: pip "
        "install 'pylon[dynamo]')",
        json_schema_extra=group(ENGINE, "DIR"),
    )
    # --- queue admission ---
    queue_admission: bool = Field(
        True,
        description="kill switch for queue admission: answer 429 queue_estimate_mismatch "
        "(retryable) before the engine sees a request whose local queue estimate is above "
        "what the gateway expected (x-stargate-expected-queue-ms)",
        json_schema_extra=group(QUEUE),
    )
    queue_admission_min_delta_ms: int = Field(
        25,
        ge=0,
        description="additive tolerance: a request is refused only when the local estimate "
        "exceeds max(expected + this, ceil(expected * --queue-admission-factor))",
        json_schema_extra=group(QUEUE, "MS"),
    )
    queue_admission_factor: float = Field(
        1.25,
        ge=1,
        allow_inf_nan=False,
        description="multiplicative tolerance over the gateway's expected queue time (>= 1)",
        json_schema_extra=group(QUEUE, "FACTOR"),
    )
    queue_admission_retry_after_ms: int | None = Field(
        None,
        ge=0,
        description="x-stargate-retry-after-ms sent with a queue_estimate_mismatch 429; "
        "unset = none (retry elsewhere at once)",
        json_schema_extra=group(QUEUE, "MS"),
    )
    initial_input_tps: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="input tokens per second assumed for every model until pylon has measured "
        "its own (5 prefill samples); unset = unknown until then, and unknown admits",
        json_schema_extra=group(QUEUE, "TOKENS/S"),
    )
    shutdown_grace: float = Field(
        30.0,
        ge=0,
        description="seconds requests in flight get to finish after SIGTERM or SIGINT "
        "(a second signal ends them at once)",
        json_schema_extra=group(TIMEOUTS),
    )
    log_format: Literal["json", "console"] = Field(
        "json", description="log rendering", json_schema_extra=group(LOGGING)
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info",
        description="log level (the start and stop lines are written at any level)",
        json_schema_extra=group(LOGGING),
    )
    # --- HTTP/2 --- (and the client-connection timeouts HTTP/1.1 shares)
    header_timeout: float = Field(
        30.0,
        gt=0,
        description="seconds a client has to send a complete request head",
        json_schema_extra=group(TIMEOUTS),
    )
    client_idle_timeout: float = Field(
        300.0,
        gt=0,
        description="seconds an HTTP/1.1 or HTTP/2 connection may sit idle",
        json_schema_extra=group(TIMEOUTS),
    )
    h2_max_concurrent_streams: int = Field(
        128,
        ge=1,
        le=4096,
        description="concurrent request streams per HTTP/2 connection",
        json_schema_extra=group(HTTP2),
    )
    h2_stream_window: int = Field(
        1 * MiB,
        ge=65535,
        le=2**31 - 1,
        description="HTTP/2 per-stream receive window (bytes)",
        json_schema_extra=group(HTTP2, "BYTES"),
    )
    # --- flood guards (HTTP/2 and HTTP/3) ---
    flood_window: float = Field(
        10.0, gt=0, description="seconds per flood-guard window", json_schema_extra=group(FLOODS)
    )
    max_stream_resets: int = Field(
        1000,
        ge=0,
        description="client stream resets per window per connection (0 = no limit)",
        json_schema_extra=group(FLOODS),
    )
    max_control_frames: int = Field(
        200,
        ge=0,
        description="client PING/SETTINGS frames per window per h2 connection (0 = off)",
        json_schema_extra=group(FLOODS),
    )
    # --- tunnel auth ---
    tunnel_token_file: Path | None = Field(
        None,
        description="file holding the bearer token every non-health request must carry "
        "(re-read when it changes)",
        json_schema_extra=group(TLS_AUTH),
    )
    # --- TLS identity ---
    tls_cert: Path | None = Field(
        None,
        description="server certificate chain (PEM), with --tls-key; unset = plaintext TCP "
        "and a self-signed QUIC identity",
        json_schema_extra=group(TLS_AUTH),
    )
    tls_key: Path | None = Field(
        None,
        description="server private key (PEM), with --tls-cert",
        json_schema_extra=group(TLS_AUTH),
    )
    tls_client_ca: Path | None = Field(
        None,
        description="CA bundle (PEM): only clients with a certificate from it may connect "
        "(needs --tls-cert)",
        json_schema_extra=group(TLS_AUTH),
    )
    tls_reload_interval: float = Field(
        2.0,
        gt=0,
        description="seconds between checks of the cert/key files for a new pair "
        "(needs --tls-cert)",
        json_schema_extra=group(TLS_AUTH),
    )
    # --- HTTP/3 / QUIC ---
    quic_listen: str | None = Field(
        None,
        description="UDP listen address for HTTP/3; unset = no QUIC listener",
        json_schema_extra=group(LISTENERS, "HOST:PORT"),
    )
    admin_listen: str = Field(
        "127.0.0.1:9089",
        description="plain-HTTP admin listener: /metrics, /live, /ready (no tunnel auth); "
        "empty = no admin listener and no metrics",
        json_schema_extra=group(LISTENERS, "HOST:PORT"),
    )
    quic_idle_timeout: float = Field(
        60.0,
        gt=0,
        description="seconds without packets before a QUIC connection is closed",
        json_schema_extra=group(QUIC),
    )
    quic_max_data: int = Field(
        16 * MiB,
        ge=64 * KiB,
        description="QUIC connection receive window (bytes)",
        json_schema_extra=group(QUIC, "BYTES"),
    )
    quic_max_stream_data: int = Field(
        4 * MiB,
        ge=16 * KiB,
        description="QUIC per-stream receive window (bytes)",
        json_schema_extra=group(QUIC, "BYTES"),
    )
    quic_max_concurrent_streams: int = Field(
        128,
        ge=1,
        le=4096,
        description="concurrent request streams per QUIC connection",
        json_schema_extra=group(QUIC),
    )
    quic_retry: bool = Field(
        True,
        description="validate client addresses with a QUIC Retry before any handshake",
        json_schema_extra=group(QUIC),
    )
    # --- tracing (OpenTelemetry) ---
    otel_endpoint: AnyHttpUrl | None = Field(
        None,
        description="OTLP/HTTP collector base URL: one span per engine exchange goes to "
        "URL/v1/traces (also read from OTEL_EXPORTER_OTLP_ENDPOINT); unset = no tracing at all "
        "(needs the otel extra: pip install 'pylon[otel]')",
        json_schema_extra=group(TRACING),
    )
    otel_service_name: str = Field(
        "pylon",
        min_length=1,
        description="service.name of pylon's spans (also read from OTEL_SERVICE_NAME)",
        json_schema_extra=group(TRACING, "NAME"),
    )

    @field_validator("listen")
    @classmethod
    def _valid_listen(cls, value: str) -> str:
        split_host_port(value)
        return value

    @field_validator("admin_listen")
    @classmethod
    def _valid_admin_listen(cls, value: str) -> str:
        value = value.strip()
        if value:
            split_host_port(value)
        return value

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("retryable_status_codes", mode="before")
    @classmethod
    def _status_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            parts = [part.strip() for part in value.split(",") if part.strip()]
            bad = [part for part in parts if not part.isdigit()]
            if bad:
                raise ValueError(f"not an HTTP status: {bad[0]!r}")
            return tuple(int(part) for part in parts)
        if isinstance(value, int):
            return (value,)
        return value

    @field_validator("retryable_status_codes")
    @classmethod
    def _valid_statuses(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        for status in value:
            if not 100 <= status <= 599:
                raise ValueError(f"not an HTTP status: {status}")
        return value

    @field_validator("upstream_retry_header")
    @classmethod
    def _lower_header(cls, value: str) -> str:
        value = value.strip().lower()
        if not _TOKEN.fullmatch(value):
            raise ValueError(f"not an HTTP header name: {value!r}")
        return value

    @field_validator("upstream")
    @classmethod
    def _plain_http(cls, value: AnyHttpUrl | None) -> AnyHttpUrl | None:
        if value is None:
            return value
        if value.scheme != "http":
            raise ValueError("only http:// engines are supported (pylon is node-local)")
        if value.username or value.password:
            raise ValueError(
                "the upstream URL may not carry credentials: pylon never sends credentials to "
                "the engine (keep the engine on loopback, or on a network only pylon reaches)"
            )
        if value.query or value.fragment:
            raise ValueError("the upstream URL may not carry a query or fragment")
        return value

    @field_validator("otel_endpoint", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        # An empty variable means "not configured", as the OpenTelemetry SDKs read it.
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("otel_endpoint")
    @classmethod
    def _collector_url(cls, value: AnyHttpUrl | None) -> AnyHttpUrl | None:
        if value is not None and (value.query or value.fragment):
            raise ValueError("the OTLP endpoint may not carry a query or fragment")
        return value

    @field_validator("quic_listen")
    @classmethod
    def _valid_quic_listen(cls, value: str | None) -> str | None:
        if value is not None:
            split_host_port(value)
        return value

    @field_validator("worker", mode="before")
    @classmethod
    def _workers(cls, value: Any) -> Any:
        """SPEC strings (flags; the environment's `;`-separated), [[worker]] tables (config
        file) or specs -> a tuple of `WorkerSpec`; the first bad one is the error."""
        if isinstance(value, str):
            value = [part for part in value.split(WORKER_ENV_SEPARATOR) if part.strip()]
        if isinstance(value, (WorkerSpec, Mapping)):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"expected worker specs, got {value!r}")
        specs = []
        for item in value:
            try:
                if isinstance(item, str):
                    specs.append(parse_worker_spec(item))
                elif isinstance(item, Mapping):
                    specs.append(worker_from_table(item))
                elif isinstance(item, WorkerSpec):
                    specs.append(item)
                else:
                    raise WorkerSpecError(f"not a worker spec: {item!r}")
            except WorkerSpecError as exc:
                raise ValueError(str(exc)) from None
        return tuple(specs)

    @field_validator("worker_health_path")
    @classmethod
    def _valid_worker_health_path(cls, value: str) -> str:
        if not value.startswith("/") or not _ORIGIN_FORM.fullmatch(value):
            raise ValueError(
                f"not a request path: {value!r} (a path such as /health, visible ASCII)"
            )
        return value

    @field_validator("upstream_health_path", "model", mode="before")
    @classmethod
    def _repeatable(cls, value: Any) -> Any:
        """A comma-separated string (environment) or one value -> a list of stripped values."""
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        if isinstance(value, (list, tuple)):
            return [part.strip() if isinstance(part, str) else part for part in value]
        return value

    @field_validator("upstream_health_path")
    @classmethod
    def _valid_health_paths(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for path in value:
            if not path.startswith("/") or not _ORIGIN_FORM.fullmatch(path):
                raise ValueError(
                    f"not a request path: {path!r} (a path such as /healthz, visible ASCII)"
                )
        return tuple(dict.fromkeys(value))  # duplicates collapse, order kept

    @field_validator("model")
    @classmethod
    def _valid_models(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            if not name:
                raise ValueError("a model name may not be blank")
            if len(name) > 256 or not _PRINTABLE.fullmatch(name):
                raise ValueError(
                    f"not a model name x-model can carry: {name!r} (1-256 printable ASCII)"
                )
        return tuple(dict.fromkeys(value))

    @model_validator(mode="after")
    def _bringup_takes_effect(self) -> Settings:
        chosen = self.model_fields_set
        if self.model:
            for name in ("model_discovery_interval", "model_discovery_timeout"):
                if name in chosen:
                    flag = "--" + name.replace("_", "-")
                    raise ValueError(
                        f"{flag} needs discovery, and --model sets a static model set that is "
                        "never polled: give one or the other"
                    )
        if not self.upstream_health_gate:
            for name in (
                "upstream_health_path",
                "upstream_health_wait",
                "upstream_health_interval",
                "upstream_health_timeout",
            ):
                if name in chosen:
                    flag = "--" + name.replace("_", "-")
                    raise ValueError(
                        f"{flag} has no effect with --no-upstream-health-gate (no health probes)"
                    )
        return self

    @model_validator(mode="after")
    def _routing_takes_effect(self) -> Settings:
        """Workers and routing modes that could not do what they say refuse the start."""
        mode, workers = self.routing, self.worker
        if mode == "off":
            if workers:
                raise ValueError(
                    "--worker needs --routing round-robin, least-loaded or kv: with --routing "
                    "off every request goes to --upstream and the workers would be ignored"
                )
            if self.tokenizer is not None:
                raise ValueError("--tokenizer is only used by --routing kv")
            if self.kv_token_data:
                raise ValueError("--kv-token-data needs --routing kv (its tokenization)")
            return self
        if not workers:
            raise ValueError(f"--routing {mode} needs at least one --worker")
        ids: set[int] = set()
        urls: set[str] = set()
        for spec in workers:
            if spec.url is not None:
                if spec.url in urls:
                    raise ValueError(f"--worker url={spec.url} is given twice")
                urls.add(spec.url)
            if spec.worker_id in ids:
                raise ValueError(
                    f"--worker {spec.label}: worker id {spec.worker_id} is given twice"
                )
            ids.add(spec.worker_id)
        pinned = [spec for spec in workers if spec.instance_id is not None]
        if pinned:
            if self.backend != "dynamo":
                raise ValueError(
                    f"--worker {pinned[0].label} needs --backend dynamo (a Dynamo frontend "
                    f"pins the instance by header), not {self.backend}"
                )
            if self.upstream is None:
                raise ValueError(
                    f"--worker {pinned[0].label} needs --upstream: the Dynamo frontend in "
                    "front of the instance"
                )
        elif self.upstream is not None:
            raise ValueError(
                f"--upstream is not used with --routing {mode} and only url= workers (requests "
                "go to the workers' own URLs): drop it, or route to instance-id= workers"
            )
        if mode == "kv":
            for spec in workers:
                if not spec.kv_events:
                    raise ValueError(
                        f"--routing kv: --worker {spec.label} has no kv-events= endpoint (the "
                        "KV router follows each worker's cache through its KV events)"
                    )
            if self.tokenizer is None:
                raise ValueError(
                    "--routing kv needs --tokenizer DIR: prompts are tokenized as the engine "
                    "does, to find the worker that holds their KV blocks"
                )
            if self.kv_token_data and self.backend != "dynamo":
                raise ValueError(
                    f"--kv-token-data needs --backend dynamo: only a Dynamo frontend reads "
                    f"nvext.token_data, not {self.backend}"
                )
        else:
            if self.tokenizer is not None:
                raise ValueError("--tokenizer is only used by --routing kv")
            if self.kv_token_data:
                raise ValueError("--kv-token-data needs --routing kv (its tokenization)")
        return self

    @model_validator(mode="after")
    def _body_budgets(self) -> Settings:
        # Otherwise a single request of the allowed size could never be buffered.
        if self.max_connection_body_bytes < self.max_body_bytes:
            raise ValueError("--max-connection-body-bytes must be at least --max-body-bytes")
        if self.max_total_body_bytes < self.max_connection_body_bytes:
            raise ValueError("--max-total-body-bytes must be at least --max-connection-body-bytes")
        return self

    @model_validator(mode="after")
    def _tls_takes_effect(self) -> Settings:
        """A TLS setting that could not take effect refuses the start: never less than asked."""
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key must be given together (or neither)")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError(
                "--tls-client-ca needs --tls-cert and --tls-key: without them the TCP listener "
                "is plaintext and accepts any client"
            )
        if "tls_reload_interval" in self.model_fields_set and self.tls_cert is None:
            raise ValueError(
                "--tls-reload-interval needs --tls-cert and --tls-key: without them there are "
                "no files to reload"
            )
        return self

    @model_validator(mode="after")
    def _known_backend(self) -> Settings:
        if self.backend not in ADAPTERS:
            raise ValueError(f"unknown backend {self.backend!r}")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [
            init_settings,
            env_settings,
            InitSettingsSource(settings_cls, init_kwargs=standard_otel_values(os.environ)),
        ]
        if _FILE_VALUES is not None:
            sources.append(InitSettingsSource(settings_cls, init_kwargs=dict(_FILE_VALUES)))
        return tuple(sources)

    # Derived views, so the rest of pylon never re-derives them.
    @property
    def listen_host_port(self) -> tuple[str, int]:
        return split_host_port(self.listen)

    @property
    def adapter_options(self) -> AdapterOptions:
        return AdapterOptions(self.priority_ceiling, self.sglang_low_priority_first)

    @property
    def queue_policy(self) -> QueuePolicy:
        return QueuePolicy(
            enabled=self.queue_admission,
            min_delta_ms=self.queue_admission_min_delta_ms,
            factor=self.queue_admission_factor,
            retry_after_ms=self.queue_admission_retry_after_ms,
        )

    @property
    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(
            retryable_status_codes=frozenset(self.retryable_status_codes),
            require_upstream_retry_header=self.require_upstream_retry_header,
            upstream_retry_header=self.upstream_retry_header.encode("ascii"),
            propagate_retry_after=self.propagate_retry_after,
            local_connect_failures_retryable=self.local_connect_failures_retryable,
        )

    @property
    def otel_traces_url(self) -> str | None:
        """Where the OTLP exporter posts spans: the endpoint with `/v1/traces` appended (as the
        OpenTelemetry specification says for OTEL_EXPORTER_OTLP_ENDPOINT), unless it is there."""
        if self.otel_endpoint is None:
            return None
        base = str(self.otel_endpoint).rstrip("/")
        return base if base.endswith("/" + OTLP_TRACES_PATH) else f"{base}/{OTLP_TRACES_PATH}"

    def redacted(self) -> dict[str, Any]:
        """Effective settings for display. No secret is a setting (the tunnel token lives in its
        file, URL credentials are refused); kept as the one place display goes through."""
        return self.model_dump(mode="json")


_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+")
_ORIGIN_FORM = re.compile(r"/[\x21\x22\x24-\x7e]*")  # a request target: visible ASCII, no #
_PRINTABLE = re.compile(r"[\x20-\x7e]+")  # what `x-model` may carry

# Set only by `load_settings`, for the duration of one construction.
_FILE_VALUES: Mapping[str, Any] | None = None


def standard_otel_values(environ: Mapping[str, str]) -> dict[str, str]:
    """The settings given by OpenTelemetry's standard variables (`STANDARD_OTEL_ENV`); an empty
    variable counts as unset."""
    return {
        name: environ[variable].strip()
        for variable, name in STANDARD_OTEL_ENV.items()
        if environ.get(variable, "").strip()
    }


def check_otlp_protocol(environ: Mapping[str, str]) -> None:
    """With tracing on, refuse an OTLP protocol pylon's exporter does not speak (it would
    export nothing)."""
    for variable in OTLP_PROTOCOL_ENV:
        value = environ.get(variable, "").strip()
        if value and value.lower() != OTLP_PROTOCOL:
            raise SettingsError(
                f"{variable}={value}: pylon exports traces over OTLP/HTTP ({OTLP_PROTOCOL}) "
                "only; unset it, or point --otel-endpoint at the collector's HTTP port (4318)"
            )


def load_settings(overrides: dict[str, Any], config_file: Path | None = None) -> Settings:
    """Build the one Settings object: flags (overrides) > env > config file > defaults.

    Raises `SettingsError`, one line naming the setting and where its value came from.
    """
    global _FILE_VALUES
    file_values = read_config_file(config_file) if config_file is not None else None
    _FILE_VALUES = file_values
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        raise SettingsError(
            describe_error(exc, overrides, os.environ, file_values, config_file)
        ) from None
    finally:
        _FILE_VALUES = None
    if settings.otel_endpoint is not None:
        check_otlp_protocol(os.environ)
    return settings


def read_config_file(path: Path) -> dict[str, Any]:
    """The TOML file's settings; every failure names the file."""
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise SettingsError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise SettingsError(f"config file {path} is a directory") from None
    except OSError as exc:
        raise SettingsError(f"config file {path} cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise SettingsError(f"config file {path} is not UTF-8 text") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config file {path} is not valid TOML: {exc}") from None
    for key in data:
        if key not in Settings.model_fields:
            hint = closest_setting(key)
            also = f" (did you mean {hint!r}?)" if hint else ""
            raise SettingsError(f"config file {path}: unknown setting {key!r}{also}")
    return data


def closest_setting(name: str) -> str | None:
    """The setting `name` was probably meant to be, if one is close enough."""
    close = difflib.get_close_matches(name.lower(), Settings.model_fields, n=1, cutoff=0.75)
    return close[0] if close else None


def unknown_env_vars(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """`PYLON_*` variables that match no setting (pydantic would ignore them silently), each
    with the variable it was probably meant to be."""
    unknown = []
    for key in sorted(environ):
        if not key.upper().startswith(ENV_PREFIX):
            continue
        name = key[len(ENV_PREFIX) :].lower()
        if name in Settings.model_fields:
            continue
        hint = closest_setting(name)
        unknown.append((key, ENV_PREFIX + hint.upper() if hint else None))
    return unknown


def describe_error(
    exc: ValidationError,
    overrides: Mapping[str, Any],
    environ: Mapping[str, str],
    file_values: Mapping[str, Any] | None,
    config_file: Path | None,
) -> str:
    """One line for the first validation error: the setting, where its value came from, and
    the reason in words (no pydantic type names, URLs or 'Value error' prefixes)."""
    first = exc.errors(include_url=False)[0]
    context = first.get("ctx") or {}
    cause = context.get("error")
    reason = str(cause) if isinstance(cause, ValueError) else str(first["msg"])
    loc = first["loc"]
    if not loc:
        return reason  # a rule across settings: its message names the flags
    name = str(loc[0])
    if first["type"] == "extra_forbidden":
        hint = closest_setting(name)
        also = f" (did you mean {hint!r}?)" if hint else ""
        return f"unknown setting {name!r}{also}"
    source = _source(name, overrides, environ, file_values, config_file)
    return f"invalid setting {name} ({source}): {reason}"


def _source(
    name: str,
    overrides: Mapping[str, Any],
    environ: Mapping[str, str],
    file_values: Mapping[str, Any] | None,
    config_file: Path | None,
) -> str:
    if name in overrides:
        return "--" + name.replace("_", "-")
    env_name = ENV_PREFIX + name.upper()
    if any(key.upper() == env_name for key in environ):
        return env_name
    for variable, field in STANDARD_OTEL_ENV.items():
        if field == name and environ.get(variable, "").strip():
            return variable
    if file_values is not None and name in file_values:
        return f"config file {config_file}"
    return "default"
