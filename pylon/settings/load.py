"""Building the one `Settings` (`load_settings`) and saying in one line why it cannot be built."""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pylon.settings.model import Settings
from pylon.settings.sources import ENV_PREFIX, config_file_values
from pylon.settings.tracing import OTLP_PROTOCOL, OTLP_PROTOCOL_ENV, STANDARD_OTEL_ENV


class SettingsError(ValueError):
    """The settings cannot be built; the message is one line for the operator."""


def load_settings(overrides: dict[str, Any], config_file: Path | None = None) -> Settings:
    """Build the one Settings object: flags (overrides) > env > config file > defaults.

    Raises `SettingsError`, one line naming the setting and where its value came from.
    """
    file_values = read_config_file(config_file) if config_file is not None else None
    try:
        with config_file_values(file_values):
            settings = Settings(**overrides)
    except ValidationError as exc:
        raise SettingsError(
            describe_error(exc, overrides, os.environ, file_values, config_file)
        ) from None
    if settings.otel_endpoint is not None:
        check_otlp_protocol(os.environ)
    return settings


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
    """Where the value of setting `name` came from: the highest-ranked source that has one."""
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
