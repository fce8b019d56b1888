"""Limits: how large a request (head, body) and an engine event may be, and how many body bytes
pylon buffers at once."""

from __future__ import annotations

from typing import Self

from pydantic import BaseModel, Field, model_validator

from pylon.settings.topics import LIMITS, KiB, MiB, group


class LimitSettings(BaseModel):
    """The `Limits` topic (all in bytes but `max_headers`, a count)."""

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
    max_sse_event_bytes: int = Field(
        1 * MiB,
        ge=64,
        description="largest unterminated event",
        json_schema_extra=group(LIMITS, "BYTES"),
    )

    @model_validator(mode="after")
    def _body_budgets(self) -> Self:
        """Each body budget holds at least the one below it: otherwise a single request of the
        allowed size could never be buffered."""
        if self.max_connection_body_bytes < self.max_body_bytes:
            raise ValueError("--max-connection-body-bytes must be at least --max-body-bytes")
        if self.max_total_body_bytes < self.max_connection_body_bytes:
            raise ValueError("--max-total-body-bytes must be at least --max-connection-body-bytes")
        return self
