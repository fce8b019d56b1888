"""Tracing: where pylon exports its OpenTelemetry spans, and under which service name.

Both settings are also read from OpenTelemetry's standard variables (`STANDARD_OTEL_ENV`), which
rank below pylon's own `PYLON_*` variables and above the config file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import AnyHttpUrl, BaseModel, Field, field_validator

from pylon.settings.topics import TRACING, group

# The OpenTelemetry standard variables pylon reads, each for one setting. They rank below the
# setting's own PYLON_* variable and above the config file (see `pylon.settings.sources`).
STANDARD_OTEL_ENV = {
    "OTEL_EXPORTER_OTLP_ENDPOINT": "otel_endpoint",
    "OTEL_SERVICE_NAME": "otel_service_name",
}
# pylon's exporter speaks OTLP over HTTP with protobuf bodies, nothing else.
OTLP_PROTOCOL_ENV = ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
OTLP_PROTOCOL = "http/protobuf"
OTLP_TRACES_PATH = "v1/traces"


def standard_otel_values(environ: Mapping[str, str]) -> dict[str, str]:
    """The settings given by OpenTelemetry's standard variables (`STANDARD_OTEL_ENV`); an empty
    variable counts as unset."""
    return {
        name: environ[variable].strip()
        for variable, name in STANDARD_OTEL_ENV.items()
        if environ.get(variable, "").strip()
    }


class TracingSettings(BaseModel):
    """The `Tracing` topic."""

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

    # Derived view, so the rest of pylon never re-derives it.
    @property
    def otel_traces_url(self) -> str | None:
        """Where the OTLP exporter posts spans: the endpoint with `/v1/traces` appended (as the
        OpenTelemetry specification says for OTEL_EXPORTER_OTLP_ENDPOINT), unless it is there."""
        if self.otel_endpoint is None:
            return None
        base = str(self.otel_endpoint).rstrip("/")
        return base if base.endswith("/" + OTLP_TRACES_PATH) else f"{base}/{OTLP_TRACES_PATH}"
