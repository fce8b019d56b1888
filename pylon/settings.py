"""Pylon's settings: one model, built once at start-up, passed down. No env reads elsewhere.

Precedence: command-line flag > environment (`PYLON_<NAME>`) > `--config FILE` (TOML) > default.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AnyHttpUrl, Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from pylon.adapters import ADAPTERS, AdapterOptions
from pylon.adapters.base import I32_MAX
from pylon.core.retry import RetryPolicy

MiB = 1024 * 1024
KiB = 1024
Backend = Literal["dynamo", "vllm", "sglang", "passthrough"]


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
        ipaddress.IPv6Address(host)
    return host, port


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="PYLON_", extra="forbid", frozen=True, validate_default=True
    )

    listen: str = Field("127.0.0.1:8080", description="TCP listen address, HOST:PORT")
    upstream: AnyHttpUrl | None = Field(
        None, description="engine base URL; unset = start an embedded mock_dynamo"
    )
    backend: Backend = Field("dynamo", description="engine dialect for priority derivation")
    priority_ceiling: int = Field(3600, ge=1, le=I32_MAX, description="rank ceiling C")
    derive_priority: bool = Field(True, description="kill switch for priority derivation")
    sglang_low_priority_first: bool = Field(
        False, description="SGLang runs --schedule-low-priority-values-first"
    )
    max_body_bytes: int = Field(64 * MiB, ge=0, description="request body limit (413)")
    max_connection_body_bytes: int = Field(
        256 * MiB,
        ge=0,
        description="request-body bytes one client connection may have buffered at once "
        "(503 body_budget_exceeded above it)",
    )
    max_total_body_bytes: int = Field(
        1024 * MiB,
        ge=0,
        description="request-body bytes pylon buffers at once across all connections "
        "(503 body_budget_exceeded above it)",
    )
    max_header_bytes: int = Field(60 * KiB, ge=256, description="request header section limit")
    max_headers: int = Field(100, ge=4, description="request header count limit (431)")
    first_output_timeout: float = Field(30.0, gt=0, description="seconds until first output")
    output_gap_timeout: float = Field(30.0, gt=0, description="seconds allowed between events")
    client_send_timeout: float = Field(
        30.0,
        gt=0,
        description="seconds a client may keep the response waiting (not reading) before its "
        "stream is reset and the engine request cancelled",
    )
    max_sse_event_bytes: int = Field(1 * MiB, ge=64, description="largest unterminated event")
    upstream_connect_timeout: float = Field(5.0, gt=0, description="seconds to connect")
    upstream_idle_timeout: float = Field(
        4.0, gt=0, description="idle pooled connections are closed after this many seconds"
    )
    upstream_max_idle: int = Field(256, ge=0, description="idle connections kept per engine target")
    upstream_max_connections: int = Field(
        1024,
        ge=1,
        description="open connections per engine target; requests above it wait their turn",
    )
    upstream_queue_timeout: float = Field(
        5.0,
        gt=0,
        description="seconds a request waits for a free engine connection before a "
        "retryable 503 (upstream_busy)",
    )
    retryable_status_codes: Annotated[tuple[int, ...], NoDecode] = Field(
        (429, 503), description="upstream statuses the gateway may retry"
    )
    require_upstream_retry_header: bool = Field(
        True, description="a retryable status needs the engine's retry header set to true"
    )
    upstream_retry_header: str = Field(
        "x-stargate-upstream-retryable", description="engine header that authorises a retry"
    )
    propagate_retry_after: bool = Field(
        True, description="Retry-After -> x-stargate-retry-after-ms"
    )
    local_connect_failures_retryable: bool = Field(
        False, description="mark engine connect failures retryable"
    )
    shutdown_grace: float = Field(
        30.0, ge=0, description="seconds requests in flight get to finish after SIGTERM"
    )
    log_format: Literal["json", "console"] = Field("json", description="log rendering")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    # --- HTTP/2 --- (and the client-connection timeouts HTTP/1.1 shares)
    header_timeout: float = Field(
        30.0, gt=0, description="seconds a client has to send a complete request head"
    )
    client_idle_timeout: float = Field(
        300.0, gt=0, description="seconds an HTTP/1.1 or HTTP/2 connection may sit idle"
    )
    h2_max_concurrent_streams: int = Field(
        128, ge=1, le=4096, description="concurrent request streams per HTTP/2 connection"
    )
    h2_stream_window: int = Field(
        1 * MiB, ge=65535, le=2**31 - 1, description="HTTP/2 per-stream receive window (bytes)"
    )
    # --- flood guards (HTTP/2 and HTTP/3) ---
    flood_window: float = Field(10.0, gt=0, description="seconds per flood-guard window")
    max_stream_resets: int = Field(
        1000, ge=0, description="client stream resets per window per connection (0 = no limit)"
    )
    max_control_frames: int = Field(
        200, ge=0, description="client PING/SETTINGS frames per window per h2 connection (0 = off)"
    )
    # --- tunnel auth ---
    tunnel_token_file: Path | None = Field(
        None,
        description="file holding the bearer token every non-health request must carry "
        "(re-read when it changes)",
    )
    # --- TLS identity ---
    tls_cert: Path | None = Field(
        None, description="server certificate chain (PEM); unset with --tls-key = self-signed"
    )
    tls_key: Path | None = Field(None, description="server private key (PEM), with --tls-cert")
    tls_client_ca: Path | None = Field(
        None, description="CA bundle (PEM): only clients with a certificate from it may connect"
    )
    tls_reload_interval: float = Field(
        2.0, gt=0, description="seconds between checks of the cert/key files for a new pair"
    )
    # --- HTTP/3 / QUIC ---
    quic_listen: str | None = Field(
        None, description="UDP listen address for HTTP/3 (HOST:PORT); unset = no QUIC listener"
    )
    quic_idle_timeout: float = Field(
        60.0, gt=0, description="seconds without packets before a QUIC connection is closed"
    )
    quic_max_data: int = Field(
        16 * MiB, ge=64 * KiB, description="QUIC connection receive window (bytes)"
    )
    quic_max_stream_data: int = Field(
        4 * MiB, ge=16 * KiB, description="QUIC per-stream receive window (bytes)"
    )
    quic_max_concurrent_streams: int = Field(
        128, ge=1, le=4096, description="concurrent request streams per QUIC connection"
    )
    quic_retry: bool = Field(
        True, description="validate client addresses with a QUIC Retry before any handshake"
    )

    @field_validator("listen")
    @classmethod
    def _valid_listen(cls, value: str) -> str:
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
            return tuple(int(part) for part in value.split(",") if part.strip())
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
        return value.strip().lower()

    @field_validator("upstream")
    @classmethod
    def _plain_http(cls, value: AnyHttpUrl | None) -> AnyHttpUrl | None:
        if value is not None and value.scheme != "http":
            raise ValueError("only http:// engines are supported (pylon is node-local)")
        if value is not None and (value.query or value.fragment):
            raise ValueError("the upstream URL may not carry a query or fragment")
        return value

    @field_validator("quic_listen")
    @classmethod
    def _valid_quic_listen(cls, value: str | None) -> str | None:
        if value is not None:
            split_host_port(value)
        return value

    @model_validator(mode="after")
    def _body_budgets(self) -> Settings:
        # Otherwise a single request of the allowed size could never be buffered.
        if self.max_connection_body_bytes < self.max_body_bytes:
            raise ValueError("--max-connection-body-bytes must be at least --max-body-bytes")
        if self.max_total_body_bytes < self.max_connection_body_bytes:
            raise ValueError("--max-total-body-bytes must be at least --max-connection-body-bytes")
        return self

    @model_validator(mode="after")
    def _tls_pair(self) -> Settings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key must be given together (or neither)")
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
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if _CONFIG_FILE is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=_CONFIG_FILE))
        return tuple(sources)

    # Derived views, so the rest of pylon never re-derives them.
    @property
    def listen_host_port(self) -> tuple[str, int]:
        return split_host_port(self.listen)

    @property
    def adapter_options(self) -> AdapterOptions:
        return AdapterOptions(self.priority_ceiling, self.sglang_low_priority_first)

    @property
    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(
            retryable_status_codes=frozenset(self.retryable_status_codes),
            require_upstream_retry_header=self.require_upstream_retry_header,
            upstream_retry_header=self.upstream_retry_header.encode("ascii"),
            propagate_retry_after=self.propagate_retry_after,
            local_connect_failures_retryable=self.local_connect_failures_retryable,
        )

    def redacted(self) -> dict[str, Any]:
        """Effective settings for display: secrets (none today beyond URL credentials) hidden."""
        data = self.model_dump(mode="json")
        if self.upstream is not None and (self.upstream.username or self.upstream.password):
            data["upstream"] = "<redacted: URL with credentials>"
        return data


# Set only by `load_settings`, for the duration of one construction.
_CONFIG_FILE: Path | None = None


def load_settings(overrides: dict[str, Any], config_file: Path | None = None) -> Settings:
    """Build the one Settings object: flags (overrides) > env > config file > defaults."""
    global _CONFIG_FILE
    if config_file is not None and not config_file.is_file():
        raise ValueError(f"config file not found: {config_file}")
    _CONFIG_FILE = config_file
    try:
        return Settings(**overrides)
    finally:
        _CONFIG_FILE = None
