"""Repeated faults are logged at a bounded rate: `LogRate` (the clock passed in) and what
`LogObserver` writes with it (a fake clock, the lines recorded instead of written)."""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from pylon.core.errors import UpstreamError
from pylon.core.log_rate import OVERFLOW, LogRate
from pylon.core.record import RequestRecord
from pylon.core.retry import RetryMark
from pylon.observe import REPEAT_INTERVAL_S, LogObserver

# --- LogRate --------------------------------------------------------------------------------


def test_the_first_line_goes_out_then_one_per_interval_with_the_count_held_back() -> None:
    rate = LogRate(10.0)
    assert rate.admit("gap", 100.0) == 0
    assert [rate.admit("gap", 100.0 + t) for t in (0.0, 1.0, 9.99)] == [None, None, None]
    assert rate.admit("gap", 110.0) == 3  # due: it carries the three held back
    assert rate.admit("gap", 119.0) is None
    assert rate.admit("gap", 500.0) == 1
    assert rate.admit("gap", 500.5) is None


def test_a_burst_goes_out_per_interval_then_lines_are_held_back() -> None:
    rate = LogRate(10.0, burst=3)
    assert [rate.admit("site", t) for t in (0.0, 0.1, 0.2, 0.3, 5.0)] == [0, 0, 0, None, None]
    assert [rate.admit("site", t) for t in (10.0, 10.1, 10.2, 10.3)] == [2, 0, 0, None]
    assert rate.admit("site", 30.0) == 1


def test_each_key_has_its_own_budget() -> None:
    rate = LogRate(10.0)
    assert rate.admit(("kv_events_gap", "w0"), 0.0) == 0
    assert rate.admit(("kv_events_gap", "w1"), 0.0) == 0  # another source
    assert rate.admit(("kv_events_malformed", "w0"), 0.0) == 0  # another fault
    assert rate.admit(("kv_events_gap", "w0"), 1.0) is None


def test_past_max_keys_new_keys_share_one_slot_and_idle_keys_are_forgotten() -> None:
    rate = LogRate(10.0, max_keys=2)
    assert rate.admit("a", 0.0) == 0
    assert rate.admit("b", 0.0) == 0
    assert rate.admit("c", 1.0) == 0  # full: the overflow slot's first line
    assert rate.admit("d", 2.0) is None  # the same slot, held back
    assert rate.admit(OVERFLOW, 2.5) is None
    # Later "a" and "b" are due with nothing held back: forgotten, so "e" gets its own slot.
    assert rate.admit("e", 20.0) == 0
    assert rate.admit("e", 21.0) is None


@given(
    st.lists(
        st.tuples(st.sampled_from("abc"), st.floats(0, 5, allow_nan=False)),
        min_size=1,
        max_size=300,
    )
)
def test_lines_are_bounded_and_every_fault_is_told_or_still_held(
    steps: list[tuple[str, float]],
) -> None:
    rate = LogRate(10.0)
    now = 0.0
    written: dict[str, list[float]] = {}
    told: dict[str, int] = {}
    total: dict[str, int] = {}
    for key, step in steps:
        now += step
        total[key] = total.get(key, 0) + 1
        held = rate.admit(key, now)
        if held is not None:
            written.setdefault(key, []).append(now)
            told[key] = told.get(key, 0) + 1 + held
    for times in written.values():
        # At most one line per interval after the first. (`a + 10.0`, as LogRate computes the
        # next window: `b - a` can round below 10.0 for a line due exactly then.)
        assert all(b >= a + 10.0 for a, b in itertools.pairwise(times))
        assert len(times) <= 1 + (times[-1] - times[0]) / 10.0 + 1e-9  # the same rounding
    for key, count in total.items():
        # What was held back since the key's last line is told, exactly, by its next one.
        assert rate.admit(key, now + 10.0) == count - told[key]


# --- LogObserver ------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    """Stands in for the structlog logger: keeps (level, event, fields) of each line."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def is_enabled_for(self, _level: int) -> bool:
        return True

    def __getattr__(self, level: str) -> Any:
        return lambda event, **fields: self.lines.append((level, event, fields))

    def of(self, event: str) -> list[dict[str, Any]]:
        return [fields for _, seen, fields in self.lines if seen == event]


def observer() -> tuple[LogObserver, Recorder, Clock]:
    clock = Clock()
    log = LogObserver(clock=clock)
    recorder = Recorder()
    log._log = log._lifecycle_log = recorder
    log._access = None  # the access lines too, not straight to stderr
    return log, recorder, clock


# Each process event that repeats with its input, as this test's author listed them: a new
# one must be added here and to `REPEATED_EVENTS`, and removing one fails this test.
REPEATED = {
    "kv_events_malformed": {"worker": "w0", "endpoint": "tcp://a", "detail": "x"},
    "kv_events_gap": {"worker": "w0", "endpoint": "tcp://a", "kind": "gap"},
    "kv_view_reset": {"worker": "w0", "lifecycle": "schedulable"},
    "kv_routing_failed": {"op": "tokenize", "detail": "x"},
    "kv_router_error": {"detail": "x"},
    "kv_token_data_refused": {"model": "m", "detail": "x"},
    "model_discovery_poll": {"outcome": "failed", "reason": "connect"},
    "tracing_error": {"detail": "x"},
    "upstream_moved": {"worker": "w0", "to": "w1", "detail": "x"},
}


def test_every_repeated_process_event_is_rate_limited_per_source() -> None:
    log, lines, clock = observer()
    for kind, fields in REPEATED.items():
        for _ in range(1000):
            log.process_event(kind, **fields)
        assert len(lines.of(kind)) == 1, kind
    clock.now += REPEAT_INTERVAL_S
    for kind, fields in REPEATED.items():
        log.process_event(kind, **fields)
        assert lines.of(kind)[-1]["suppressed"] == 999, kind
    # Another worker's faults have their own budget.
    log.process_event("kv_events_gap", worker="w1", endpoint="tcp://b", kind="gap")
    assert lines.of("kv_events_gap")[-1] == {"worker": "w1", "endpoint": "tcp://b", "kind": "gap"}


def test_state_changes_and_the_start_and_stop_lines_are_never_held_back() -> None:
    log, lines, _ = observer()
    for kind in ("worker_ejected", "worker_readmitted", "model_published", "listening", "ready"):
        for _ in range(5):
            log.process_event(kind, worker="w0", model="m")
        assert len(lines.of(kind)) == 5, kind
    for _ in range(5):  # a successful poll (debug) is not a fault
        log.process_event("model_discovery_poll", outcome="ok")
    assert len(lines.of("model_discovery_poll")) == 5


def test_connection_events_are_rate_limited_per_protocol() -> None:
    log, lines, clock = observer()
    for protocol in ("http1", "h2", "h3"):
        for _ in range(100):
            log.transport_event("client_timeout", protocol, timer="header")
    assert [f["protocol"] for f in lines.of("client_timeout")] == ["http1", "h2", "h3"]
    for _ in range(100):
        log.transport_event("h2_flood", "h2", kind="ping", streams=0)
    assert len(lines.of("h2_flood")) == 1
    clock.now += REPEAT_INTERVAL_S
    log.transport_event("h2_flood", "h2", kind="ping", streams=0)
    assert lines.of("h2_flood")[-1]["suppressed"] == 99


def test_an_engines_faults_are_rate_limited_per_worker_and_the_access_line_is_not() -> None:
    log, lines, clock = observer()
    error = UpstreamError("connection refused")
    for n in range(50):
        record = RequestRecord("h2", 2 * n + 1, 0.0)
        record.request_id = f"r{n}"
        record.worker = "w0"
        record.status = 500
        log.upstream_failed(record, error, False)
        log.upstream_failed(record, error, True)
        log.upstream_status(record, RetryMark(False, "upstream_500"))
        log.rejected(record, error)
    assert [len(lines.of(k)) for k in ("upstream_failed", "stream_failed")] == [1, 1]
    assert len(lines.of("upstream_error_status")) == 1
    assert len(lines.of("request_rejected")) == 50  # one per request, never held back
    clock.now += REPEAT_INTERVAL_S
    log.upstream_failed(record, error, False)
    assert lines.of("upstream_failed")[-1]["suppressed"] == 49
    assert lines.of("upstream_failed")[-1]["request_id"] == "r49"


def test_a_bug_hit_by_every_request_is_one_traceback_per_interval_per_exception_type() -> None:
    log, lines, clock = observer()
    record = RequestRecord("http1", 0, 0.0)
    for _ in range(20):
        log.crashed(record, KeyError("x"))
        log.crashed(record, ValueError("y"))
    assert [type(f["exc_info"]).__name__ for f in lines.of("request_crashed")] == [
        "KeyError",
        "ValueError",
    ]
    clock.now += REPEAT_INTERVAL_S
    log.crashed(record, KeyError("x"))
    assert lines.of("request_crashed")[-1]["suppressed"] == 19
