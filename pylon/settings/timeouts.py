"""Timeouts: how long pylon waits on clients, on the engine and on the drain."""

from __future__ import annotations

from pydantic import BaseModel, Field

from pylon.settings.topics import TIMEOUTS, group


class TimeoutSettings(BaseModel):
    """The `Timeouts` topic (all in seconds)."""

    first_output_timeout: float = Field(
        30.0, gt=0, description="seconds until first output", json_schema_extra=group(TIMEOUTS)
    )
    output_gap_timeout: float = Field(
        30.0, gt=0, description="seconds allowed between events", json_schema_extra=group(TIMEOUTS)
    )
    response_head_timeout: float = Field(
        600.0,
        gt=0,
        description="seconds from writing a request to the engine until its response head "
        "(a whole response's head comes after generation); a 504 upstream_timeout after it. "
        "A stream also has --first-output-timeout",
        json_schema_extra=group(TIMEOUTS),
    )
    client_send_timeout: float = Field(
        30.0,
        gt=0,
        description="seconds a client may keep the response waiting (not reading) before its "
        "stream is reset and the engine request cancelled",
        json_schema_extra=group(TIMEOUTS),
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
    upstream_queue_timeout: float = Field(
        5.0,
        gt=0,
        description="seconds a request waits for a free engine connection before a "
        "retryable 503 (upstream_busy)",
        json_schema_extra=group(TIMEOUTS),
    )
    shutdown_grace: float = Field(
        30.0,
        ge=0,
        description="seconds requests in flight get to finish after SIGTERM or SIGINT "
        "(a second signal ends them at once)",
        json_schema_extra=group(TIMEOUTS),
    )
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
