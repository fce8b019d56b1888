"""Where a setting's value comes from, highest rank first: its flag, its `PYLON_<NAME>` variable,
OpenTelemetry's standard variable (the two tracing settings only), the `--config FILE` (TOML),
its default."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from pydantic_settings import BaseSettings, InitSettingsSource, PydanticBaseSettingsSource

from pylon.settings.tracing import standard_otel_values

ENV_PREFIX = "PYLON_"

# Set only by `config_file_values`, for the duration of one construction.
_FILE_VALUES: ContextVar[Mapping[str, Any] | None] = ContextVar("file_values", default=None)
# Set only by `given_values_only`: the values passed in are the only source.
_GIVEN_ONLY: ContextVar[bool] = ContextVar("given_only", default=False)


@contextmanager
def given_values_only() -> Iterator[None]:
    """While a `Settings` is built: no environment and no config file, only the values passed
    in (a supervised process rebuilds the supervisor's settings from its handover, and must
    not read its own environment: the supervisor validated them once, `pylon.supervisor`)."""
    token = _GIVEN_ONLY.set(True)
    try:
        yield
    finally:
        _GIVEN_ONLY.reset(token)


@contextmanager
def config_file_values(values: Mapping[str, Any] | None) -> Iterator[None]:
    """While a `Settings` is built: the config file's values (None: no file), ranked lowest."""
    token = _FILE_VALUES.set(values)
    try:
        yield
    finally:
        _FILE_VALUES.reset(token)


def ranked_sources(
    settings_cls: type[BaseSettings],
    init_settings: PydanticBaseSettingsSource,
    env_settings: PydanticBaseSettingsSource,
) -> tuple[PydanticBaseSettingsSource, ...]:
    """The sources in precedence order (flags are `init_settings`); no dotenv or secrets dir."""
    if _GIVEN_ONLY.get():
        return (init_settings,)
    sources: list[PydanticBaseSettingsSource] = [
        init_settings,
        env_settings,
        InitSettingsSource(settings_cls, init_kwargs=standard_otel_values(os.environ)),
    ]
    file_values = _FILE_VALUES.get()
    if file_values is not None:
        sources.append(InitSettingsSource(settings_cls, init_kwargs=dict(file_values)))
    return tuple(sources)
