"""`pylon serve`, `pylon config` and `pylon --version`. Every setting gets a flag generated from
the Settings model, so a new setting can never lack one; `serve --help` shows them by topic (the
field's `group`), each with its type or choices, default and environment variable. Flags beat
`PYLON_*` env vars, which beat `--config FILE`.

Every refusal is one line on stderr and exit status 2, never a traceback: a bad value (naming the
setting and where it came from), a combination that would do less than asked, a TLS or token file
that cannot be used (`pylon.preflight`), a listener that cannot bind.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import sys
import typing
from importlib import metadata
from pathlib import Path
from typing import Annotated, Any

import orjson
import typer
from pydantic.fields import FieldInfo
from typer.core import TyperCommand

from pylon.settings import (
    ENV_PREFIX,
    GROUPS,
    Settings,
    SettingsError,
    load_settings,
    unknown_env_vars,
)

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Pylon tunnel daemon.")
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
# Python types -> what `--help` calls their values.
_METAVARS: dict[object, str] = {
    int: "INTEGER",
    float: "SECONDS",
    str: "TEXT",
    Path: "FILE",
}


def _is_bool(field_name: str) -> bool:
    return Settings.model_fields[field_name].annotation is bool


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _extra(field: FieldInfo) -> dict[str, Any]:
    extra = field.json_schema_extra
    return extra if isinstance(extra, dict) else {}


def is_repeatable(name: str) -> bool:
    """A list setting whose flag is given once per value (`--model a --model b`)."""
    return bool(_extra(Settings.model_fields[name]).get("repeatable"))


def separator_name(name: str) -> str:
    """How a repeatable setting's environment variable separates its values, in words."""
    separator = _extra(Settings.model_fields[name]).get("separator", ",")
    return "comma" if separator == "," else f"'{separator}'"


def field_group(name: str) -> str:
    """The topic a setting is listed under (in `--help` and docs/operations.md)."""
    return str(_extra(Settings.model_fields[name])["group"])


def choices(field: FieldInfo) -> tuple[str, ...]:
    """The values a Literal setting accepts; empty for any other setting."""
    for candidate in (field.annotation, *typing.get_args(field.annotation)):
        if typing.get_origin(candidate) is typing.Literal:
            return tuple(str(value) for value in typing.get_args(candidate))
    return ()


def metavar(name: str) -> str:
    """What a setting's value is: CHOICE, or a type name (INTEGER, SECONDS, BYTES, FILE, ...)."""
    field = Settings.model_fields[name]
    if choices(field):
        return "CHOICE"
    explicit = _extra(field).get("metavar")
    if explicit is not None:
        return str(explicit)
    if "Url" in str(field.annotation):
        return "URL"
    for python_type, shown in _METAVARS.items():
        if field.annotation is python_type or python_type in typing.get_args(field.annotation):
            return shown
    return "TEXT"


def help_parts(name: str) -> tuple[str, list[str]]:
    """A setting's help: what it does, then its notes (choices, default, env var), each one
    a `[...]` that `--help` never breaks across lines."""
    field = Settings.model_fields[name]
    notes = []
    allowed = choices(field)
    if allowed:
        notes.append(f"[choices: {', '.join(allowed)}]")
    if is_repeatable(name):
        notes.append(f"[repeatable; env var: {separator_name(name)}-separated]")
    notes.append(f"[default: {default_text(field.default)}]")
    notes.append(f"[env var: {ENV_PREFIX}{name.upper()}]")
    return str(field.description), notes


def help_text(name: str) -> str:
    """A setting's help line: what it does, its choices, its default and its env var."""
    description, notes = help_parts(name)
    return " ".join([description, *notes])


class PlainHelp(TyperCommand):
    """`--help` as plain text, by topic: each flag on a line of its own, its help wrapped
    below it, so that no flag or env var name is ever cut, at any width (a table of three
    columns cuts them at 80). Typer's rich panels stay for the other commands.
    `settings_help`: a flag named as a setting takes the setting's help (pylon's commands; a
    command with flags of its own, such as `mock-dynamo`, says False)."""

    settings_help = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rich_markup_mode = None  # typer's plain formatter, with our `format_options`

    # `ctx` and `formatter` are the click classes typer vendors (not a public import).
    def format_options(self, ctx: Any, formatter: Any) -> None:
        topics: dict[str, list[tuple[str, str, list[str]]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            name = param.name or ""
            if self.settings_help and name in Settings.model_fields:
                description, notes = help_parts(name)
            else:
                description, notes = record[1], []
            topic = getattr(param, "rich_help_panel", None) or "Options"
            topics.setdefault(topic, []).append((record[0], description, notes))
        width = max(formatter.width or 78, 40)
        for topic, rows in topics.items():
            formatter.write(f"\n{topic}:\n")
            for flags, description, notes in rows:
                formatter.write(f"  {flags}\n")
                for line in _fill([*description.split(), *notes], width - 6):
                    formatter.write(f"      {line}\n")


def _fill(words: list[str], width: int) -> list[str]:
    """Greedy line filling that never breaks a word or a `[...]` note."""
    lines: list[str] = []
    line = ""
    for word in words:
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    if line:
        lines.append(line)
    return lines


def default_text(value: object) -> str:
    """A default as the operator would type it."""
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "(empty)"
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _parameters() -> list[inspect.Parameter]:
    params = []
    # By topic, in GROUPS order (typer shows panels in the order their first flag comes).
    for name in sorted(Settings.model_fields, key=lambda name: GROUPS.index(field_group(name))):
        shared: dict[str, Any] = {
            "help": help_text(name),
            "show_default": False,
            "rich_help_panel": field_group(name),
        }
        if _is_bool(name):
            flag = _flag(name)
            option = typer.Option(f"{flag}/--no-{flag[2:]}", **shared)
            annotation: Any = Annotated[bool | None, option]
        elif is_repeatable(name):
            option = typer.Option(_flag(name), metavar=metavar(name), **shared)
            annotation = Annotated[list[str] | None, option]
        else:
            option = typer.Option(_flag(name), metavar=metavar(name), **shared)
            annotation = Annotated[str | None, option]
        params.append(
            inspect.Parameter(
                name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation
            )
        )
    config = typer.Option(
        "--config",
        help="TOML file with settings (lowest precedence but defaults)",
        metavar="FILE",
        rich_help_panel="Settings file",
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
    # A repeatable flag not given arrives as an empty list: not given.
    overrides = {key: value for key, value in kwargs.items() if value is not None and value != []}
    try:
        return load_settings(overrides, config)
    except SettingsError as exc:
        _die(str(exc))
    raise AssertionError("unreachable")


def _die(reason: str) -> None:
    typer.echo(f"pylon: {reason}", err=True)
    raise typer.Exit(2)


def _with_settings_signature(func: Any) -> Any:
    func.__signature__ = inspect.Signature(_parameters())
    return func


def _start_logging(settings: Settings) -> Any:
    """Structured logs to stderr, and the warnings about the environment pydantic ignores."""
    from pylon.logs import configure_logging
    from pylon.observe import LogObserver

    configure_logging(settings.log_format, settings.log_level)
    observer = LogObserver()
    for variable, meant in unknown_env_vars(os.environ):
        observer.process_event(
            "unknown_env_var",
            variable=variable,
            did_you_mean=meant,
            detail="matches no setting, so it has no effect",
        )
    return observer


def _version(value: bool) -> None:
    if value:
        try:
            version = metadata.version("pylon")
        except metadata.PackageNotFoundError:
            version = "unknown"
        typer.echo(f"pylon {version}")
        raise typer.Exit(0)


@app.callback()
def main_options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Pylon tunnel daemon."""


@app.command(cls=PlainHelp)
@_with_settings_signature
def serve(**kwargs: Any) -> None:
    """Run pylon in front of an engine (or an embedded mock_dynamo when --upstream is unset)."""
    from pylon.signals import EarlySignals

    early = EarlySignals()  # first: no signal may end pylon silently while it starts
    early.install()
    settings = _build(kwargs)
    from pylon.preflight import check_files, check_routing, check_tracing, load_tokenizer
    from pylon.startup import StartupError

    try:
        check_files(settings)  # first, so a refusal is the only line (start() checks again)
        check_tracing(settings)
        check_routing(settings)
        tokenizer = load_tokenizer(settings)  # loaded once: start() takes this one
    except StartupError as exc:
        _die(str(exc))
    if settings.processes > 1:
        from pylon.preflight import tokenizer_warnings

        # Loaded to refuse one that cannot be used, and to say once what it will not do; each
        # process loads its own.
        warnings = tokenizer_warnings(tokenizer)
        del tokenizer
        _supervise(settings, early, warnings)
        return
    native = _native_stderr(settings)
    observer = _start_logging(settings)
    import uvloop

    # Imported before the loop starts: from then until `pylon.run.serve` installs the loop's
    # signal handlers, a signal reaches both those and `early`; the window stays short.
    import pylon.run  # noqa: F401

    try:
        status = uvloop.run(_serving(settings, observer, tokenizer, native, early))
    except StartupError as exc:
        _die(str(exc))
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename is not None else ""
        _die(f"cannot start: {exc.strerror or exc}{where}")
    finally:
        if native is not None:
            native.stop()
    if status:
        raise typer.Exit(status)


def _supervise(settings: Settings, early: Any, warnings: list[Any]) -> None:
    """`--processes N` (N > 1): the supervisor (`pylon.supervisor`), refusals as one line."""
    from pylon.startup import StartupError
    from pylon.supervisor.supervisor import supervise

    observer = _start_logging(settings)
    try:
        status = supervise(settings, observer, early, warnings)
    except StartupError as exc:
        _die(str(exc))
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename is not None else ""
        _die(f"cannot start: {exc.strerror or exc}{where}")
    if status:
        raise typer.Exit(status)


def _native_stderr(settings: Settings) -> Any:
    """With `--routing kv` (Dynamo's native core): the native core's stderr lines become
    pylon's `dynamo_native_log` lines (`pylon.native_logs`), in `--log-format`."""
    if settings.routing != "kv":
        return None
    from pylon.native_logs import NativeStderr

    native = NativeStderr()
    native.start()
    return native


async def _serving(
    settings: Settings, observer: Any, tokenizer: Any, native: Any, early: Any
) -> int:
    from pylon.run import serve as run_server  # imported already (`serve`)

    if native is not None:
        native.attach(asyncio.get_running_loop())
    return await run_server(settings, observer=observer, tokenizer=tokenizer, early=early)


@app.command(cls=PlainHelp)
@_with_settings_signature
def config(**kwargs: Any) -> None:
    """Print the effective settings as JSON."""
    settings = _build(kwargs)
    _start_logging(settings)
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
