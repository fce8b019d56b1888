"""Dynamo's native core in pylon's log: one shape for every line on stderr.

With `--routing kv`, Dynamo's native selection core (`dynamo._core`, ai-dynamo-runtime) logs
through its own Rust subscriber straight to file descriptor 2, in its own JSON shape
(`{"time", "level": "WARN", "file", "line", "target", "message"}`, no `event`); its only knobs
are environment variables (`DYN_LOG`: the levels, `DYN_LOGGING_JSONL`: JSON or text,
`DYN_LOG_USE_LOCAL_TZ`, `DYN_LOGGING_CONFIG_PATH`), none of which changes where it writes or
what its keys are called. So `pylon serve --routing kv` hands it a pipe (`NativeStderr`): file
descriptor 2 becomes the pipe's write end, pylon's own lines (and Python's tracebacks) go on to
the original stderr, and a reader thread turns each line that arrives on the pipe into one of
pylon's (`native_line`): event `dynamo_native_log`, pylon's level names, the native `target`,
`message`, `time` (as `native_time`) and any other field it had. A line that is not JSON (the
text format, a C library's output) is kept whole as `text`.

The reader thread hands each line to the event loop (`attach`), which writes every log line;
without a running loop (before the start, after the stop) it logs the line itself. A native
call site that repeats (a warning per KV event, per request) is written at a bounded rate, as
pylon's own repeated faults are: per (level, target, file, line) `NATIVE_BURST` lines per
`REPEAT_INTERVAL_S`, then the next line carries `suppressed`. The thread holds them back, so a
burst costs the event loop nothing either (a callback per line would queue without bound).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import orjson

from pylon.core.log_rate import LogRate
from pylon.logs import get_logger
from pylon.observe import REPEAT_INTERVAL_S

EVENT = "dynamo_native_log"
MAX_LINE_BYTES = 64 * 1024  # a longer native line is cut there (`truncated: true`)
# The native levels (tracing's) in pylon's words.
LEVELS = {"ERROR": "error", "WARN": "warning", "INFO": "info", "DEBUG": "debug", "TRACE": "debug"}
# Keys pylon's renderer writes itself: a native field of that name is kept as native_<name>.
_OWN_KEYS = frozenset({"event", "level", "timestamp"})
# Lines of one native call site per interval before any is held back: a call site that names
# different things (the catalog's "Adding worker" for each worker of a fleet) is not cut short.
NATIVE_BURST = 16


def native_line(line: bytes) -> tuple[str, dict[str, Any]]:
    """One line the native core wrote, as (pylon level, fields of a `dynamo_native_log` line).

    Never raises: a line that is not a JSON object is kept as `text`, at warning."""
    text = line.rstrip(b"\r\n")
    try:
        parsed = orjson.loads(text)
    except orjson.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        return "warning", {"text": text.decode("utf-8", "replace")}
    level = LEVELS.get(str(parsed.pop("level", "")).upper(), "warning")
    fields: dict[str, Any] = {"native_time": parsed.pop("time", None)}
    for key, value in parsed.items():
        fields[f"native_{key}" if key in _OWN_KEYS or key == "native_time" else key] = value
    return level, fields


def native_key(level: str, fields: dict[str, Any]) -> Hashable:
    """The call site a native line came from (its fault kind and source, for the rate limit):
    the same for every line of one `tracing` macro, whatever its message says. Text lines and
    cut lines have no call site: each kind shares one."""
    if "text" in fields:
        return (level, "truncated" if fields.get("truncated") else "text")
    return (level, fields.get("target"), fields.get("file"), fields.get("line"))


def _log(level: str, fields: dict[str, Any]) -> None:
    getattr(get_logger(), level)(EVENT, **fields)


class NativeStderr:
    """File descriptor 2 as a pipe whose lines become `dynamo_native_log` lines (`start`),
    until `stop` puts the original stderr back."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._original: int | None = None
        self._reader: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._clock = clock
        self._rate = LogRate(REPEAT_INTERVAL_S, burst=NATIVE_BURST)  # the reader thread's only

    def start(self) -> None:
        """Before pylon configures its logging: `sys.stderr` is then the original stderr."""
        self._original = os.dup(2)
        read_end, write_end = os.pipe()
        os.dup2(write_end, 2)
        os.close(write_end)
        sys.stderr = open(  # noqa: SIM115 (open until the process ends)
            self._original, "w", buffering=1, errors="backslashreplace", closefd=False
        )
        self._reader = threading.Thread(
            target=self._read, args=(read_end,), name="pylon-native-stderr", daemon=True
        )
        self._reader.start()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Lines are logged on `loop` from now on (the thread that writes every log line)."""
        self._loop = loop

    def stop(self, timeout: float = 1.0) -> None:
        """The original stderr back on file descriptor 2; the lines still in the pipe are
        logged (for at most `timeout` seconds)."""
        if self._original is None:
            return
        self._loop = None
        os.dup2(self._original, 2)  # the pipe's last write end closes: the reader sees its end
        if self._reader is not None:
            self._reader.join(timeout)

    def _read(self, read_end: int) -> None:
        with open(read_end, "rb") as pipe:
            while line := pipe.readline(MAX_LINE_BYTES):
                truncated = not line.endswith(b"\n")
                if truncated:
                    while (rest := pipe.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
                        pass  # the rest of an over-long line is dropped
                self.line(line, truncated)

    def line(self, line: bytes, truncated: bool = False) -> None:
        """One line from the pipe (cut at `MAX_LINE_BYTES` when `truncated`): logged, unless
        its call site is over its rate."""
        level, fields = native_line(line)
        if truncated:
            level, fields = "warning", {"text": line.decode("utf-8", "replace"), "truncated": True}
        held = self._rate.admit(native_key(level, fields), self._clock())
        if held is None:
            return
        if held:
            fields["suppressed"] = held
        self._emit(level, fields)

    def _emit(self, level: str, fields: dict[str, Any]) -> None:
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(_log, level, fields)
                return
            except RuntimeError:  # the loop closed meanwhile
                pass
        _log(level, fields)
