"""pylon.native_logs.native_line: every line Dynamo's native core writes becomes the fields of
one `dynamo_native_log` line, whatever the bytes."""

from __future__ import annotations

import orjson
from hypothesis import given
from hypothesis import strategies as st

from pylon.native_logs import native_line

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
