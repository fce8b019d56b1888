"""Pylon's settings: one model, built once at start-up, passed down. No env reads elsewhere.

Precedence: command-line flag > environment (`PYLON_<NAME>`) > `--config FILE` (TOML) > default.

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

from pydantic import AnyHttpUrl, Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from pylon.adapters import ADAPTERS, AdapterOptions
from pylon.adapters.base import I32_MAX
from pylon.core.retry import RetryPolicy

MiB = 1024 * 1024
KiB = 1024
Backend = Literal["dynamo", "vllm", "sglang", "passthrough"]
ENV_PREFIX = "PYLON_"

# The topics of `pylon serve --help` and of docs/operations.md, in the order they are shown.
LISTENERS = "Listeners"
ENGINE = "Engine"
LIMITS = "Limits"
TIMEOUTS = "Timeouts"
TLS_AUTH = "TLS and auth"
HTTP2 = "HTTP/2"
QUIC = "HTTP/3 / QUIC"
FLOODS = "Flood guards"
LOGGING = "Logging"
GROUPS = (LISTENERS, ENGINE, LIMITS, TIMEOUTS, TLS_AUTH, HTTP2, QUIC, FLOODS, LOGGING)


def group(topic: str, metavar: str | None = None) -> dict[str, Any]:
    """A field's topic (and, when the type does not say it, what its value is: BYTES, ...)."""
    extra: dict[str, Any] = {"group": topic}
    if metavar is not None:
        extra["metavar"] = metavar
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
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
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
    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(
            retryable_status_codes=frozenset(self.retryable_status_codes),
            require_upstream_retry_header=self.require_upstream_retry_header,
            upstream_retry_header=self.upstream_retry_header.encode("ascii"),
            propagate_retry_after=self.propagate_retry_after,
            local_connect_failures_retryable=self.local_connect_failures_retryable,
        )

    def redacted(self) -> dict[str, Any]:
        """Effective settings for display. No secret is a setting (the tunnel token lives in its
        file, URL credentials are refused); kept as the one place display goes through."""
        return self.model_dump(mode="json")


_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+")

# Set only by `load_settings`, for the duration of one construction.
_FILE_VALUES: Mapping[str, Any] | None = None


def load_settings(overrides: dict[str, Any], config_file: Path | None = None) -> Settings:
    """Build the one Settings object: flags (overrides) > env > config file > defaults.

    Raises `SettingsError`, one line naming the setting and where its value came from.
    """
    global _FILE_VALUES
    file_values = read_config_file(config_file) if config_file is not None else None
    _FILE_VALUES = file_values
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise SettingsError(
            describe_error(exc, overrides, os.environ, file_values, config_file)
        ) from None
    finally:
        _FILE_VALUES = None


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
    if file_values is not None and name in file_values:
        return f"config file {config_file}"
    return "default"
