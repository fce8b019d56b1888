"""Structured logs: JSON by default, one line per event, the request id bound on every line.

Never log a prompt, a completion or token ids: only names, sizes, codes and timings.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import orjson
import structlog

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def _orjson_dumps(obj: Any, default: Any = None) -> str:
    return orjson.dumps(obj, default=default).decode()


def configure_logging(log_format: str, log_level: str) -> None:
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if log_format == "json":
        processors += [
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=_orjson_dumps),
        ]
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=processors,
        # A filtering logger makes a disabled level cost one method call and nothing more.
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[log_level]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def get_logger(**bound: Any) -> Any:
    return structlog.get_logger("pylon").bind(**bound)
