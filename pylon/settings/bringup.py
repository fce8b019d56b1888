"""Engine bring-up and models: the health gate pylon waits on before it takes requests, and
which models it serves (a static set, or discovered from the engine)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Self

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import NoDecode

from pylon.settings.topics import BRINGUP, ORIGIN_FORM, group

_PRINTABLE = re.compile(r"[\x20-\x7e]+")  # what `x-model` may carry


class BringupSettings(BaseModel):
    """The `Engine bring-up and models` topic."""

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
    upstream_health_check_interval: float = Field(
        2.0,
        gt=0,
        description="seconds between health checks of the engine after start-up: 2 failed in "
        "a row make /ready 503 engine_unhealthy, one passed makes it ready again",
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
            if not path.startswith("/") or not ORIGIN_FORM.fullmatch(path):
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
    def _bringup_takes_effect(self) -> Self:
        """A discovery or health-probe setting that could not take effect refuses the start."""
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
                "upstream_health_check_interval",
                "upstream_health_timeout",
            ):
                if name in chosen:
                    flag = "--" + name.replace("_", "-")
                    raise ValueError(
                        f"{flag} has no effect with --no-upstream-health-gate (no health probes)"
                    )
        return self
