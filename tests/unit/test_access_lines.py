"""The access log's direct writer (`pylon.logs.AccessLines`) writes exactly the line structlog's
processor chain would: same keys in the same order, same values, same timestamp format."""

from __future__ import annotations

import datetime
import io
import sys
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st

import pylon.logs
from pylon.core.errors import ClientError, ErrorCode
from pylon.core.record import RequestRecord
from pylon.logs import configure_logging, flush_logs
from pylon.observe import LogObserver


class _Stderr:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.buffer = io.BytesIO()
        self._monkeypatch = monkeypatch

    def configure(self, log_format: str, level: str, process: int | str | None = None) -> None:
        self._monkeypatch.setattr(sys, "stderr", self)
        configure_logging(log_format, level, process=process)

    def lines(self) -> list[dict[str, Any]]:
        flush_logs()
        return [orjson.loads(line) for line in self.buffer.getvalue().splitlines()]


@pytest.fixture
def stderr(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Stderr]:
    """A byte stderr for `configure_logging` (pytest's own capture is set up again after the
    fixtures ran, so each test installs it with `fake.install()`)."""
    saved = structlog.get_config(), pylon.logs._CORKED, pylon.logs._ACCESS
    fake = _Stderr(monkeypatch)
    yield fake
    flush_logs()
    structlog.configure(**saved[0])  # as the tests before this one left it
    pylon.logs._CORKED, pylon.logs._ACCESS = saved[1], saved[2]


def _record(**fields: Any) -> RequestRecord:
    record = RequestRecord("h2", 3, 100.0)
    record.request_id = "req-1"
    record.model = "mock-model"
    record.method = "POST"
    record.path = "/v1/chat/completions"
    record.status = 200
    record.outcome = "ok"
    record.worker = "http://127.0.0.1:1"
    record.stripped = ("x-priority", "body.priority")
    record.done_at = 100.012345
    record.bytes_received = 90
    record.bytes_sent = 1021
    for name, value in fields.items():
        setattr(record, name, value)
    return record


def _both(observer: LogObserver, emit: Any, stderr: _Stderr) -> tuple[dict[str, Any], ...]:
    """The line written directly, then the same one through structlog."""
    assert observer._access is not None  # JSON to a byte stream: the direct writer is on
    emit(observer)
    observer._access = None
    emit(observer)
    direct, chained = stderr.lines()[-2:]
    return direct, chained


def _same(direct: dict[str, Any], chained: dict[str, Any]) -> None:
    assert list(direct) == list(chained)  # the same keys, in the same order
    stamps = direct.pop("timestamp"), chained.pop("timestamp")
    assert direct == chained
    for stamp in stamps:  # structlog's form: ISO 8601, UTC, `Z`
        assert stamp.endswith("Z")
        parsed = datetime.datetime.fromisoformat(stamp[:-1] + "+00:00")
        assert parsed.tzinfo is not None


@pytest.mark.parametrize("process", [None, 2, "router"])
def test_request_done_is_the_chains_line(stderr: _Stderr, process: int | str | None) -> None:
    stderr.configure("json", "info", process=process)
    record = _record(model='m"\\\u00e9\n', request_id="r\u2028x")  # escaping as the chain's
    direct, chained = _both(LogObserver(), lambda o: o.complete(record), stderr)
    assert direct["event"] == "request_done" and direct["level"] == "info"
    assert direct["bytes_sent"] == 1021 and direct["bytes_received"] == 90
    assert direct["duration_ms"] == 12.345
    assert direct["stripped"] == ["x-priority", "body.priority"]
    assert direct.get("process") == process
    _same(direct, chained)


def test_request_rejected_is_the_chains_line(stderr: _Stderr) -> None:
    stderr.configure("json", "info")
    record = _record(status=0, stripped=(), worker=None)
    error = ClientError("no x-model", code=ErrorCode.MISSING_MODEL)
    direct, chained = _both(LogObserver(), lambda o: o.rejected(record, error), stderr)
    assert direct["event"] == "request_rejected" and direct["level"] == "warning"
    assert direct["status"] == 400 and direct["code"] == "missing_model"
    _same(direct, chained)


def test_levels_still_filter_the_direct_lines(stderr: _Stderr) -> None:
    stderr.configure("json", "warning")
    observer = LogObserver()
    observer.complete(_record())  # info: off
    observer.rejected(_record(), ClientError("x", code=ErrorCode.MISSING_MODEL))
    stderr.configure("json", "error")
    LogObserver().rejected(_record(), ClientError("x", code=ErrorCode.MISSING_MODEL))
    assert [line["event"] for line in stderr.lines()] == ["request_rejected"]


def test_console_logs_have_no_direct_writer(stderr: _Stderr) -> None:
    stderr.configure("console", "info")
    assert LogObserver()._access is None


@given(
    st.datetimes(
        min_value=datetime.datetime(1970, 1, 2),
        max_value=datetime.datetime(9998, 12, 31),
        timezones=st.just(datetime.UTC),
    )
)
def test_the_timestamp_is_written_as_structlogs_iso_utc(moment: datetime.datetime) -> None:
    # structlog's TimeStamper(fmt="iso", utc=True): isoformat() with "+00:00" written "Z"
    # (and no fraction when the microseconds are 0).
    expected = moment.isoformat().replace("+00:00", "Z")
    assert orjson.dumps(moment, option=pylon.logs._ACCESS_OPTIONS) == orjson.dumps(expected) + b"\n"


def test_a_long_burst_of_lines_is_bounded_and_loses_nothing(stderr: _Stderr) -> None:
    stderr.configure("json", "info")
    observer = LogObserver()
    for n in range(2000):  # outside a loop each line is written at once; the buffer stays small
        observer.complete(_record(request_id=f"r{n}"))
        assert len(pylon.logs._CORKED._buffer) < pylon.logs._CorkedLines.FLUSH_AT  # type: ignore[union-attr]
    assert [line["request_id"] for line in stderr.lines()] == [f"r{n}" for n in range(2000)]
