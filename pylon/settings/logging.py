"""Logging: how pylon's log lines are rendered, and from which level."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from pylon.settings.topics import LOGGING, group


class LoggingSettings(BaseModel):
    """The `Logging` topic; both settings take any letter case."""

    log_format: Literal["json", "console"] = Field(
        "json", description="log rendering", json_schema_extra=group(LOGGING)
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info",
        description="log level (the start and stop lines are written at any level)",
        json_schema_extra=group(LOGGING),
    )

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value
