"""Structured logs: JSON by default, one line per event, the request id bound on every line.

Never log a prompt, a completion or token ids: only names, sizes, codes and timings.

`--log-level` filters every line except the lifecycle ones (`get_lifecycle_logger`): the start
and stop lines are written at info whatever the level, so a quiet pylon still says where it
listens and when it stops.
"""

from __future__ import annotations

import asyncio
import atexit
import datetime
import logging
import sys
from typing import Any, ClassVar

import orjson
import structlog
from mypy_extensions import mypyc_attr

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


class _CorkedLines:
    """Log lines written to stderr once per event-loop iteration, not once per line.

    An access line per request is on the hot path; a write syscall per line costs more than
    rendering it. Lines logged in one loop iteration go out in one write right after it (and at
    once outside a loop, at exit, or past `FLUSH_AT` bytes), so nothing waits longer than a
    loop turn. They gather in one buffer: keeping each rendered line alive until the flush
    costs more than rendering it (orjson's output is a fresh 1 KiB allocation each time,
    reused only when it is freed at once; measured ~5 us a line against ~0.3).
    """

    __slots__ = ("_buffer", "_scheduled", "_stream")

    FLUSH_AT: ClassVar[int] = 64 * 1024

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._buffer = bytearray()
        self._scheduled = False
        atexit.register(self.flush)

    def write(self, line: bytes) -> None:
        self._buffer += line
        self._written()

    def _written(self) -> None:
        if len(self._buffer) >= self.FLUSH_AT:
            self.flush()
        elif not self._scheduled:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush()
                return
            self._scheduled = True
            loop.call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        if not self._buffer:
            return
        data = bytes(self._buffer)
        self._buffer.clear()
        try:
            self._stream.write(data)
            self._stream.flush()
        except (OSError, ValueError):
            pass  # stderr gone (closed pipe at exit): nothing left to tell


# A plain Python class in the compiled build too: its level names are one method under many
# names, set on the class below (a compiled class body takes no alias).
@mypyc_attr(native_class=False)
class _CorkedLogger:
    """A structlog logger for rendered JSON lines (bytes), through `_CorkedLines`."""

    __slots__ = ("_lines",)

    def __init__(self, lines: _CorkedLines) -> None:
        self._lines = lines

    def msg(self, message: bytes) -> None:
        lines = self._lines
        lines._buffer += message
        lines.write(b"\n")


# The names structlog calls a logger's method by (its level names and their aliases).
for _name in [
    "log",
    "debug",
    "info",
    "warn",
    "warning",
    "err",
    "error",
    "critical",
    "exception",
    "fatal",
    "failure",
]:
    setattr(_CorkedLogger, _name, _CorkedLogger.msg)
del _name


_CORKED: _CorkedLines | None = None


class AccessLines:
    """The access log's lines written straight as JSON bytes, without structlog's processor
    chain: the same keys, values and order as the chain writes (a test holds the two equal),
    at about a third of its instructions. One line per request is on the hot path; through the
    chain (a bound logger, three processors and a renderer, a dict copy in each) a request's
    line cost ~62k instructions (~6 us), this way ~22k (docs/benchmarks.md, issue 20).

    The timestamp is the chain's (ISO 8601, UTC, microseconds, `Z`: `datetime.isoformat`'s,
    which orjson writes the same way, in C).
    """

    __slots__ = ("_lines", "_process")

    def __init__(self, lines: _CorkedLines, process: int | str | None) -> None:
        self._lines = lines
        self._process = process

    def write(self, event: str, level: str, fields: dict[str, Any]) -> None:
        fields["event"] = event
        if self._process is not None:
            fields["process"] = self._process
        fields["level"] = level
        fields["timestamp"] = _now(_UTC)
        lines = self._lines
        lines._buffer += orjson.dumps(fields, option=_ACCESS_OPTIONS)
        lines._written()


_now = datetime.datetime.now
_UTC = datetime.UTC
_ACCESS_OPTIONS = orjson.OPT_APPEND_NEWLINE | orjson.OPT_UTC_Z
_ACCESS: AccessLines | None = None


def access_lines() -> AccessLines | None:
    """The access log's direct writer as configured now; None when the log is not JSON to a
    byte stream (the access lines then go through structlog like any other)."""
    return _ACCESS


def _orjson_text(obj: Any, default: Any = None) -> str:
    return orjson.dumps(obj, default=default).decode()


def flush_logs() -> None:
    """Write out lines not yet written (before exiting)."""
    if _CORKED is not None:
        _CORKED.flush()


def configure_logging(log_format: str, log_level: str, process: int | str | None = None) -> None:
    """`process`: a supervised process's index (`pylon serve --processes N`), or "router" (the
    node's booking authority), on every line."""
    processors: list[Any] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if process is not None:
        processors.insert(0, _ProcessField(process))
    global _CORKED, _ACCESS
    _ACCESS = None
    factory: Any
    stream = getattr(sys.stderr, "buffer", None)
    if log_format == "json" and stream is not None:
        processors += [
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=orjson.dumps),  # bytes, not str
        ]
        if _CORKED is None or _CORKED._stream is not stream:
            flush_logs()
            _CORKED = _CorkedLines(stream)
        corked = _CORKED
        factory = lambda *_: _CorkedLogger(corked)  # noqa: E731
        _ACCESS = AccessLines(corked, process)
    elif log_format == "json":  # a stderr without bytes underneath (embedded, replaced)
        processors += [
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=_orjson_text),
        ]
        factory = structlog.PrintLoggerFactory(file=sys.stderr)
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=False))
        factory = structlog.PrintLoggerFactory(file=sys.stderr)
    structlog.configure(
        processors=processors,
        # A filtering logger makes a disabled level cost one method call and nothing more.
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[log_level]),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )


class _ProcessField:
    """Adds `process` to every line (a supervised process's index, or "router")."""

    __slots__ = ("_process",)

    def __init__(self, process: int | str) -> None:
        self._process = process

    def __call__(self, _logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
        event.setdefault("process", self._process)
        return event


def get_logger(**bound: Any) -> Any:
    return structlog.get_logger("pylon").bind(**bound)


def get_lifecycle_logger() -> Any:
    """A logger that writes at every `--log-level`: for the start and stop lines only."""
    unfiltered = structlog.make_filtering_bound_logger(logging.DEBUG)
    return structlog.wrap_logger(None, wrapper_class=unfiltered, logger_factory_args=("pylon",))
