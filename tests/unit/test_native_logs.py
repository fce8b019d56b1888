"""pylon.native_logs.native_line: every line Dynamo's native core writes becomes the fields of
one `dynamo_native_log` line, whatever the bytes."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st

from pylon.native_logs import NATIVE_BURST, NativeStderr, native_key, native_line
from pylon.observe import REPEAT_INTERVAL_S

# A line as ai-dynamo-runtime 1.6.1 writes it with DYN_LOGGING_JSONL=1 (seen with --routing kv).
SEEN = (
    b'{"time":"2026-12-02T03:10:14.921819Z","level":"WARN","file":"/opt/dynamo/lib/kv-router/'
    b'src/sequences/multi_worker.rs","line":733,"target":"dynamo_kv_router::sequences::'
    b'multi_worker","message":"Adding worker WorkerWithDpRank { worker_id: 1, dp_rank: 0 }"}\n'
)


def test_a_native_json_line_keeps_its_fields_in_pylons_words() -> None:
    level, fields = native_line(SEEN)
    assert level == "warning"
    assert fields == {
        "native_time": "2026-12-02T03:10:14.921819Z",
        "file": "/opt/dynamo/lib/kv-router/src/sequences/multi_worker.rs",
        "line": 733,
        "target": "dynamo_kv_router::sequences::multi_worker",
        "message": "Adding worker WorkerWithDpRank { worker_id: 1, dp_rank: 0 }",
    }


def test_levels_and_clashing_keys() -> None:
    expected = {"ERROR": "error", "WARN": "warning", "INFO": "info", "DEBUG": "debug"}
    for native, pylon in {**expected, "TRACE": "debug", "odd": "warning"}.items():
        assert native_line(orjson.dumps({"level": native}))[0] == pylon
    _, fields = native_line(b'{"event":"x","timestamp":1,"level":"INFO","native_time":2}')
    assert fields == {
        "native_time": None,
        "native_event": "x",
        "native_timestamp": 1,
        "native_native_time": 2,
    }
    # The text format, or anything else on the pipe: kept whole.
    assert native_line(b"\x1b[33mWARN\x1b[0m text line\n") == (
        "warning",
        {"text": "\x1b[33mWARN\x1b[0m text line"},
    )
    assert native_line(b"[1, 2]") == ("warning", {"text": "[1, 2]"})


@given(st.binary(max_size=300))
def test_any_bytes_give_a_line_without_pylons_own_keys(line: bytes) -> None:
    level, fields = native_line(line)
    assert level in {"error", "warning", "info", "debug"}
    assert not {"event", "level", "timestamp"} & set(fields)


# --- The rate of one native call site ---------------------------------------------------------


class _Recorded(NativeStderr):
    """The lines `line` lets through, recorded instead of written; the clock is the test's."""

    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(clock=lambda: self.now)
        self.written: list[tuple[str, dict[str, Any]]] = []

    def _emit(self, level: str, fields: dict[str, Any]) -> None:
        self.written.append((level, fields))


def _native(message: str, line: int = 90, level: str = "WARN") -> bytes:
    fields = {"level": level, "file": "lib/kv.rs", "line": line, "target": "dynamo_kv_router"}
    return orjson.dumps({**fields, "message": message}) + b"\n"


def test_a_burst_from_one_native_call_site_writes_a_bounded_number_of_lines() -> None:
    native = _Recorded()
    for n in range(5_000):  # a warning per event: the messages differ, the call site does not
        native.line(_native(f"event {n} refers to an unknown worker"))
    assert len(native.written) == NATIVE_BURST == 16
    assert all("suppressed" not in fields for _, fields in native.written)
    # Another call site, another level, a text line: each has its own budget.
    native.line(_native("other", line=91))
    native.line(_native("same site, error", level="ERROR"))
    native.line(b"plain text from a C library\n")
    assert len(native.written) == NATIVE_BURST + 3
    native.now = REPEAT_INTERVAL_S
    native.line(_native("event 5000 refers to an unknown worker"))
    level, fields = native.written[-1]
    assert level == "warning" and fields["suppressed"] == 5_000 - NATIVE_BURST
    assert fields["message"] == "event 5000 refers to an unknown worker"


def test_cut_lines_and_text_lines_are_limited_too() -> None:
    native = _Recorded()
    for _ in range(1_000):
        native.line(b"x" * 100, truncated=True)
        native.line(b"not json\n")
    assert len(native.written) == 2 * NATIVE_BURST
    assert native_key("warning", {"text": "a", "truncated": True}) != native_key(
        "warning", {"text": "a"}
    )
