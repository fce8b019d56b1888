"""`pylon serve` and `pylon config`. Every setting gets a flag generated from the Settings model,
so a new setting can never lack one. Flags beat `PYLON_*` env vars, which beat `--config FILE`.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Annotated, Any

import orjson
import typer
from pydantic import ValidationError

from pylon.settings import Settings, load_settings

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Pylon tunnel daemon.")
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _is_bool(field_name: str) -> bool:
    return Settings.model_fields[field_name].annotation is bool


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parameters() -> list[inspect.Parameter]:
    params = []
    for name, field in Settings.model_fields.items():
        default = field.default
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        help_text = f"{field.description} [env PYLON_{name.upper()}; default {shown}]"
        if _is_bool(name):
            flag = _flag(name)
            option = typer.Option(f"{flag}/--no-{flag[2:]}", help=help_text, show_default=False)
            annotation: Any = Annotated[bool | None, option]
        else:
            option = typer.Option(_flag(name), help=help_text, show_default=False)
            annotation = Annotated[str | None, option]
        params.append(
            inspect.Parameter(
                name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation
            )
        )
    config = typer.Option(
        "--config", help="TOML file with settings (lowest precedence but defaults)"
    )
    params.append(
        inspect.Parameter(
            "config",
            inspect.Parameter.KEYWORD_ONLY,
            default=None,
            annotation=Annotated[Path | None, config],
        )
    )
    return params


def _build(kwargs: dict[str, Any]) -> Settings:
    config = kwargs.pop("config", None)
    overrides = {key: value for key, value in kwargs.items() if value is not None}
    try:
        return load_settings(overrides, config)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "settings"
        _die(f"invalid setting {where}: {first['msg']}")
    except ValueError as exc:
        _die(str(exc))
    raise AssertionError("unreachable")


def _die(reason: str) -> None:
    typer.echo(f"pylon: {reason}", err=True)
    raise typer.Exit(2)


def _with_settings_signature(func: Any) -> Any:
    func.__signature__ = inspect.Signature(_parameters())
    return func


@app.command()
@_with_settings_signature
def serve(**kwargs: Any) -> None:
    """Run pylon in front of an engine (or an embedded mock_dynamo when --upstream is unset)."""
    settings = _build(kwargs)
    from pylon.logs import configure_logging

    configure_logging(settings.log_format, settings.log_level)
    import uvloop

    from pylon.app import serve as run_server

    try:
        uvloop.run(run_server(settings))
    except OSError as exc:
        _die(f"cannot start: {exc}")


@app.command()
@_with_settings_signature
def config(**kwargs: Any) -> None:
    """Print the effective settings as JSON (secrets redacted)."""
    settings = _build(kwargs)
    typer.echo(orjson.dumps(settings.redacted(), option=orjson.OPT_INDENT_2).decode())


def normalise_bool_flags(argv: list[str]) -> list[str]:
    """Accept `--flag=true|false|1|0` beside typer's bare `--flag` / `--no-flag`."""
    out = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        field = name[2:].replace("-", "_") if name.startswith("--") else ""
        if eq and field in Settings.model_fields and _is_bool(field):
            lowered = value.strip().lower()
            if lowered in _TRUE:
                out.append(name)
            elif lowered in _FALSE:
                out.append("--no-" + name[2:])
            else:
                typer.echo(
                    f"pylon: invalid value for {name}: {value!r} (expected true/false)", err=True
                )
                raise SystemExit(2)
        else:
            out.append(arg)
    return out


def main() -> None:
    sys.argv[1:] = normalise_bool_flags(sys.argv[1:])
    app()
