"""The queue gate, pure: the live request table, the throughput estimate, the decision rule."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pylon.adapters import AdapterOptions, build_adapter
from pylon.core.contract import TunnelRequest
from pylon.core.errors import ErrorCode, QueueMismatchError, problem_body
from pylon.core.queue import (
    BYTES_PER_TOKEN,
    GONE,
    MIN_SAMPLE_BUSY_S,
    MIN_SAMPLES,
    PENDING,
    WINDOW,
    QueueEntry,
    QueueGate,
    QueuePolicy,
    QueueTable,
    Result,
    median_tps,
    queue_ms,
)
from pylon.core.record import RequestRecord
from pylon.core.sanitize import sanitize_request_headers
from pylon.settings import SettingsError, load_settings

from .helpers import tunnel

FAST = settings(max_examples=200, deadline=None)


# The exchange's moments, as an exchange tells them to its queue entry (the record carries the
# loop-clock readings; see pylon.core.record).
def dispatch(entry: QueueEntry, now: float) -> None:
    record = RequestRecord("http1", 1, 0.0)
    record.dispatched_at = now
    entry.dispatched(record)


def head(entry: QueueEntry) -> None:
    entry.response_head(RequestRecord("http1", 1, 0.0))


def release(entry: QueueEntry, now: float) -> None:
    record = RequestRecord("http1", 1, 0.0)
    record.done_at = now
    entry.complete(record)


def output(entry: QueueEntry, now: float, ends_prefill: bool) -> None:
    record = RequestRecord("http1", 1, 0.0)
    record.first_output_at = now
    record.ends_prefill = ends_prefill
    entry.first_output(record)


CEILING = 3600


def request(
    *,
    tokens: int | None = 100,
    expected: int | None = None,
    priority: int | None = None,
    model: str = "m",
    target: bytes = b"/v1/chat/completions",
) -> TunnelRequest:
    headers: list[tuple[bytes, bytes]] = []
    if tokens is not None:
        headers.append((b"x-input-tokens", str(tokens).encode()))
    if expected is not None:
        headers.append((b"x-stargate-expected-queue-ms", str(expected).encode()))
    if priority is not None:
        headers.append((b"x-priority", str(priority).encode()))
    built = tunnel(*headers, target=target)  # x-model: m
    return built if model == "m" else replace(built, model=model)


def admission(
    initial_tps: float | None = 1000.0,
    backend: str = "vllm",
    policy: QueuePolicy | None = None,
    max_models: int = 1024,
) -> QueueGate:
    adapter = build_adapter(backend, AdapterOptions(CEILING), derive=True)
    return QueueGate(QueueTable(initial_tps, max_models), policy or QueuePolicy(), adapter)


def admit(queue: QueueGate, stream: bool = True, body_size: int = 0, **kw: Any) -> QueueEntry:
    return queue.admit(request(**kw), body_size, stream)


# --- the rule ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expected", "threshold"),
    [(0, 25), (1, 26), (100, 125), (101, 127), (1000, 1250), (10, 35)],
)
def test_threshold_is_the_larger_tolerance(expected: int, threshold: int) -> None:
    assert QueuePolicy().threshold_ms(expected) == threshold


def test_equal_is_accepted_one_more_is_refused() -> None:
    queue = admission(initial_tps=1000.0)  # 1 token = 1 ms
    admit(queue, tokens=125)  # 125 ms ahead of everyone at the same level
    decision = admit(queue, tokens=1, expected=100).decision
    assert decision is not None and decision.result is Result.ACCEPTED
    queue = admission(initial_tps=1000.0)
    admit(queue, tokens=126)
    decision = admit(queue, tokens=1, expected=100).decision
    assert decision is not None and decision.result is Result.REJECTED
    assert (decision.expected_ms, decision.estimate_ms, decision.threshold_ms) == (100, 126, 125)


@pytest.mark.parametrize(
    ("policy", "match"),
    [
        ({"factor": 0.99}, "factor"),
        ({"factor": math.inf}, "factor"),
        ({"factor": math.nan}, "factor"),
        ({"min_delta_ms": -1}, "min_delta_ms"),
    ],
)
def test_policy_refuses_what_cannot_work(policy: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        QueuePolicy(**policy)


@pytest.mark.parametrize("tps", [0.0, -1.0, math.inf, math.nan])
def test_table_refuses_a_bad_initial_throughput(tps: float) -> None:
    with pytest.raises(ValueError, match="initial_tps"):
        QueueTable(tps)


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("queue_admission_factor", "0.5"),
        ("queue_admission_factor", "inf"),
        ("queue_admission_min_delta_ms", "-1"),
        ("queue_admission_retry_after_ms", "-5"),
        ("initial_input_tps", "0"),
        ("initial_input_tps", "-3"),
        ("initial_input_tps", "nan"),
    ],
)
def test_settings_refuse_bad_values(flag: str, value: str) -> None:
    with pytest.raises(SettingsError, match=flag):
        load_settings({flag: value})


def test_settings_build_the_policy() -> None:
    built = load_settings(
        {
            "queue_admission": "false",
            "queue_admission_min_delta_ms": "0",
            "queue_admission_factor": "1",
            "queue_admission_retry_after_ms": "50",
            "initial_input_tps": "2500",
        }
    )
    assert built.queue_policy == QueuePolicy(False, 0, 1.0, 50)
    assert built.initial_input_tps == 2500.0
    assert load_settings({}).queue_policy == QueuePolicy(True, 25, 1.25, None)


# --- decisions ---------------------------------------------------------------------------------


def test_no_header_means_no_decision_but_a_place_in_the_table() -> None:
    queue = admission()
    entry = admit(queue, tokens=7)
    assert entry.decision is None and entry.phase == PENDING
    (snap,) = queue.table.snapshot()
    assert (snap.pending, snap.pending_tokens) == (1, 7)


def test_unknown_throughput_admits() -> None:
    queue = admission(initial_tps=None)
    for _ in range(3):
        admit(queue, tokens=10**9)
    decision = admit(queue, tokens=1, expected=0).decision
    assert decision is not None
    assert decision.result is Result.UNKNOWN_ESTIMATE and decision.estimate_ms is None
    assert queue.table.estimate_ms("m", 0) is None


def test_disabled_admits_but_still_estimates() -> None:
    queue = admission(policy=QueuePolicy(enabled=False))
    admit(queue, tokens=10**6)
    entry = admit(queue, tokens=1, expected=0)
    assert entry.decision is not None and entry.decision.result is Result.DISABLED
    assert entry.decision.estimate_ms == 1_000_000
    assert entry.phase == PENDING  # in the table like any admitted request


def test_a_refused_request_never_enters_the_table() -> None:
    queue = admission()
    first = admit(queue, tokens=1000)
    refused = admit(queue, tokens=5, expected=0)
    assert refused.decision is not None and refused.decision.rejected
    assert refused.phase == GONE
    release(refused, 1.0)  # harmless
    (snap,) = queue.table.snapshot()
    assert (snap.pending, snap.pending_tokens) == (1, 1000)
    release(first, 1.0)
    (snap,) = queue.table.snapshot()
    assert (snap.pending, snap.prefill, snap.decode) == (0, 0, 0)


def test_refusal_problem_carries_the_figures_and_the_retry_hint() -> None:
    queue = admission(policy=QueuePolicy(retry_after_ms=40))
    admit(queue, tokens=1000)
    decision = admit(queue, tokens=5, expected=100).decision
    assert decision is not None
    error = queue.refusal(decision, "req-7")
    assert isinstance(error, QueueMismatchError)
    assert error.code is ErrorCode.QUEUE_ESTIMATE_MISMATCH and error.status == 429
    assert error.code.retryable and error.retry_after_ms == 40
    body = json.loads(problem_body(error, "req-7"))
    assert body["code"] == "queue_estimate_mismatch" and body["status"] == 429
    assert (body["expected_queue_ms"], body["actual_queue_ms"], body["threshold_ms"]) == (
        100,
        1000,
        125,
    )
    assert body["error"]["type"] == "rate_limit_error"


# --- phases and priorities ---------------------------------------------------------------------


def test_phases_move_and_leave() -> None:
    queue = admission()
    entry = admit(queue, tokens=40)
    table = queue.table

    def counts() -> tuple[int, int, int, int, int]:
        (snap,) = table.snapshot()
        return snap.pending, snap.pending_tokens, snap.prefill, snap.prefill_tokens, snap.decode

    assert counts() == (1, 40, 0, 0, 0)
    dispatch(entry, 0.0)
    assert counts() == (1, 40, 0, 0, 0)  # dispatch alone is not a response head
    head(entry)
    assert counts() == (0, 0, 1, 40, 0)
    output(entry, 0.5, True)
    assert counts() == (0, 0, 0, 0, 1)
    release(entry, 1.0)
    assert counts() == (0, 0, 0, 0, 0)
    release(entry, 2.0)  # idempotent
    output(entry, 2.0, True)  # too late: nothing moves
    assert counts() == (0, 0, 0, 0, 0)


def test_non_stream_head_moves_straight_to_decode_and_every_phase_can_leave() -> None:
    queue = admission()
    whole = admit(queue, stream=False, tokens=5)
    output(whole, 1.0, False)  # the head of a whole response
    in_prefill = admit(queue, tokens=6)
    head(in_prefill)
    pending = admit(queue, tokens=7)
    (snap,) = queue.table.snapshot()
    assert (snap.pending, snap.prefill, snap.decode) == (1, 1, 1)
    for entry in (whole, in_prefill, pending):
        release(entry, 2.0)
    (snap,) = queue.table.snapshot()
    assert (snap.pending, snap.pending_tokens, snap.prefill, snap.prefill_tokens, snap.decode) == (
        0,
        0,
        0,
        0,
        0,
    )


def test_prefill_is_ahead_of_everyone_pending_only_of_its_level_and_below() -> None:
    queue = admission(initial_tps=1000.0, backend="vllm")  # level = min(rank, C), absent = C
    urgent = admit(queue, tokens=100, priority=1)
    admit(queue, tokens=1000, priority=50)
    admit(queue, tokens=10_000)  # no x-priority: the least urgent for the engine
    table = queue.table
    assert table.estimate_ms("m", 0) == 0
    assert table.estimate_ms("m", 1) == 100
    assert table.estimate_ms("m", 50) == 1100
    assert table.estimate_ms("m", CEILING) == 11_100
    head(urgent)  # in prefill now: ahead of everyone, even level 0
    assert table.estimate_ms("m", 0) == 100
    (snap,) = table.snapshot()
    assert snap.estimates_ms == ((50, 1100), (CEILING, 11_100))
    assert snap.idle_ms == 100
    # A gateway expectation for an urgent request is checked against the urgent queue only.
    decision = admit(queue, tokens=1, expected=80, priority=0).decision
    assert decision is not None and decision.result is Result.ACCEPTED
    assert decision.estimate_ms == 100 and decision.level == 0


@pytest.mark.parametrize(
    ("backend", "low_first"),
    [("dynamo", False), ("vllm", False), ("sglang", False), ("sglang", True)],
)
def test_levels_follow_each_engine_direction(backend: str, low_first: bool) -> None:
    adapter = build_adapter(backend, AdapterOptions(CEILING, low_first), derive=True)
    queue = QueueGate(QueueTable(1000.0), QueuePolicy(), adapter)
    admit(queue, tokens=300, priority=5)  # more urgent than rank 9 on every engine
    decision = admit(queue, tokens=1, expected=0, priority=9).decision
    assert decision is not None and decision.estimate_ms == 300
    decision = admit(queue, tokens=1, expected=0, priority=2).decision
    assert decision is not None and decision.estimate_ms == 0


@pytest.mark.parametrize("backend", ["passthrough", "dynamo-disabled"])
def test_without_engine_priority_everything_pending_is_ahead(backend: str) -> None:
    name, _, disabled = backend.partition("-")
    adapter = build_adapter(name, AdapterOptions(CEILING), derive=not disabled)
    queue = QueueGate(QueueTable(1000.0), QueuePolicy(), adapter)
    admit(queue, tokens=300)  # unconfigured, and rank 9 below: same level for the engine
    admit(queue, tokens=200, priority=9)
    decision = admit(queue, tokens=1, expected=0, priority=0).decision
    assert decision is not None and decision.estimate_ms == 500 and decision.level == 0


def test_input_tokens_fall_back_to_the_body_size() -> None:
    queue = admission()
    admit(queue, tokens=None, body_size=4 * BYTES_PER_TOKEN + 1)
    (snap,) = queue.table.snapshot()
    assert snap.pending_tokens == 5


def test_models_are_separate_and_bounded() -> None:
    queue = admission(max_models=2)
    admit(queue, model="a", tokens=100)
    admit(queue, model="b", tokens=200)
    assert queue.table.estimate_ms("a", CEILING) == 100
    assert queue.table.estimate_ms("b", CEILING) == 200
    # A third model is not tracked: unknown, so admitted; nothing is kept for it.
    admit(queue, model="c", tokens=10**9)
    decision = admit(queue, model="c", tokens=1, expected=0).decision
    assert decision is not None and decision.result is Result.UNKNOWN_ESTIMATE
    assert decision.model == "c"
    assert sorted(queue.table.models()) == ["a", "b"]
    queue.table.retire("a")
    assert queue.table.models() == ["b"]
    assert queue.table.estimate_ms("a", 0) == 0  # unknown model, initial throughput: empty


def test_queue_ms_rounds_up_and_caps() -> None:
    assert queue_ms(0, 1e-300) == 0
    assert queue_ms(1, 3.0) == 334
    assert queue_ms(2**64, 1e-300) == 2**63 - 1


# --- input throughput --------------------------------------------------------------------------


def run_one(queue: QueueGate, tokens: int, start: float, end: float) -> None:
    entry = admit(queue, tokens=tokens)
    dispatch(entry, start)
    head(entry)
    output(entry, end, True)
    release(entry, end)


def test_initial_throughput_holds_until_enough_samples() -> None:
    queue = admission(initial_tps=1000.0)
    for i in range(MIN_SAMPLES - 1):
        run_one(queue, 500, float(i), i + 0.1)  # 5000 tokens/s
        assert queue.table.input_tps("m") == 1000.0
    run_one(queue, 500, 10.0, 10.1)
    assert queue.table.input_tps("m") == pytest.approx(5000.0)


def test_throughput_is_unknown_until_measured() -> None:
    queue = admission(initial_tps=None)
    assert queue.table.input_tps("m") is None
    for i in range(MIN_SAMPLES):
        run_one(queue, 200, float(i), i + 0.2)
    assert queue.table.input_tps("m") == pytest.approx(1000.0)


def test_concurrent_prefills_share_their_time() -> None:
    """Four prefills over the same 0.1 s: 4 x 100 tokens in 0.1 s is 4000 tokens/s, not 1000."""
    queue = admission(initial_tps=None)
    for round_ in range(MIN_SAMPLES):
        start = round_ * 1.0
        entries = [admit(queue, tokens=100) for _ in range(4)]
        for entry in entries:
            dispatch(entry, start)
        for i, entry in enumerate(entries):
            output(entry, start + 0.1 + i * 0.0001, True)
            release(entry, start + 0.2)
    tps = queue.table.input_tps("m")
    assert tps is not None and tps == pytest.approx(4000.0, rel=0.01)


def test_continuous_load_is_cut_into_samples() -> None:
    """Prefills overlapping without a pause: no busy period ends, samples still close."""
    queue = admission(initial_tps=None)
    previous = admit(queue, tokens=250)
    dispatch(previous, 0.0)
    for i in range(1, 40):
        following = admit(queue, tokens=250)
        dispatch(following, i * 0.25 - 0.01)  # starts before the previous one ends
        output(previous, i * 0.25, True)
        release(previous, i * 0.25)
        previous = following
    assert queue.table.input_tps("m") == pytest.approx(1000.0, rel=0.01)


def test_the_window_forgets_old_samples() -> None:
    queue = admission(initial_tps=None)
    for i in range(WINDOW):
        run_one(queue, 100, float(i), i + 0.1)  # 1000 tokens/s
    for i in range(WINDOW):
        run_one(queue, 300, 100.0 + i, 100.0 + i + 0.1)  # 3000 tokens/s
    assert queue.table.input_tps("m") == pytest.approx(3000.0)


def test_failed_and_unsampled_requests_do_not_measure() -> None:
    queue = admission(initial_tps=None)
    for i in range(MIN_SAMPLES + 2):
        failed = admit(queue, tokens=100)
        dispatch(failed, float(i))
        release(failed, i + 5.0)  # timed out, alone: its busy time is dropped
        whole = admit(queue, stream=False, tokens=100)  # not an event stream: not sampled
        dispatch(whole, float(i))
        output(whole, i + 0.001, True)
        release(whole, i + 0.001)
    assert queue.table.input_tps("m") is None
    for i in range(MIN_SAMPLES):
        run_one(queue, 100, 50.0 + i, 50.0 + i + 0.1)
    assert queue.table.input_tps("m") == pytest.approx(1000.0)


def test_embeddings_measure_at_their_head() -> None:
    queue = admission(initial_tps=None)
    for i in range(MIN_SAMPLES):
        entry = queue.admit(request(tokens=50, target=b"/v1/embeddings"), 0, False)
        dispatch(entry, float(i))
        output(entry, i + 0.05, True)
        release(entry, i + 0.05)
    assert queue.table.input_tps("m") == pytest.approx(1000.0)


# --- one outlier sample ------------------------------------------------------------------------

# (tokens, busy seconds) of one sample that says anything: a claim from 1 token to 2**64 - 1,
# a prefill from just over 10 ms (MIN_SAMPLE_BUSY_S, below which no sample is taken; the clock's
# float sums must not round it under) to a minute.
outlier_sample = st.tuples(st.integers(1, 2**64 - 1), st.floats(MIN_SAMPLE_BUSY_S * 1.01, 60.0))
honest_rates = st.lists(st.floats(500.0, 2000.0), min_size=MIN_SAMPLES, max_size=3 * WINDOW)


@FAST
@given(honest_rates, outlier_sample, st.integers(0, 3 * WINDOW))
def test_one_outlier_sample_stays_within_the_others(
    rates: list[float], outlier: tuple[int, float], at: int
) -> None:
    """However far one sample is from the rest (one request's claim, one prefill the engine
    held), the estimate stays between the other samples' rates, at every step."""
    queue = admission(initial_tps=None)
    clock = 0.0
    at = min(at, len(rates))
    samples: list[tuple[int, float]] = [(round(rate * 0.1), 0.1) for rate in rates]
    samples.insert(at, outlier)
    for index, (tokens, busy) in enumerate(samples):
        run_one(queue, tokens, clock, clock + busy)
        clock += busy + 1.0
        tps = queue.table.input_tps("m")
        if index + 1 < MIN_SAMPLES:
            assert tps is None
            continue
        assert tps is not None
        honest = [round(r * 0.1) / 0.1 for r in rates]
        assert min(honest) * (1 - 1e-9) <= tps <= max(honest) * (1 + 1e-9)


@given(
    st.lists(st.tuples(st.floats(1.0, 1e6), st.floats(0.01, 1.0)), min_size=3, max_size=WINDOW),
    st.lists(outlier_sample, max_size=WINDOW),
)
def test_median_throughput_holds_against_fewer_than_half(
    samples: list[tuple[float, float]], outliers: list[tuple[int, float]]
) -> None:
    """Any number of outlier samples below half of all (each as long or short, as high or low
    as it likes) leaves the estimate between the other samples' rates."""
    outliers = outliers[: len(samples) - 1]  # fewer outliers than others: under half of all
    rates = [tokens / busy for tokens, busy in samples]
    mixed = [*samples, *((float(t), b) for t, b in outliers)]
    assert len(outliers) * 2 < len(mixed)
    tps = median_tps([t for t, _ in mixed], [b for _, b in mixed])
    assert min(rates) * (1 - 1e-9) <= tps <= max(rates) * (1 + 1e-9)


@FAST
@given(honest_rates, st.integers(1, 10), st.floats(0.5, 60.0))
def test_low_claims_over_held_prefills_cannot_zero_the_estimate(
    rates: list[float], claimed: int, held: float
) -> None:
    """Issue 17, rule 1, from below: requests claiming a token or ten over prefills the engine
    held for seconds, fewer than half of the window's samples, one after the other: the
    estimate stays between the honest rates (a ratio of sums fell to a few tokens a second)."""
    queue = admission(initial_tps=None)
    clock = 0.0
    for rate in rates:
        run_one(queue, round(rate * 0.1), clock, clock + 0.1)
        clock += 1.1
    honest = [round(r * 0.1) / 0.1 for r in rates[-WINDOW:]]
    for _ in range((WINDOW - 1) // 2):
        run_one(queue, claimed, clock, clock + held)
        clock += held + 1.0
        tps = queue.table.input_tps("m")
        assert tps is not None
        assert min(honest) * (1 - 1e-9) <= tps <= max(honest) * (1 + 1e-9)


def test_the_issue_outlier_cannot_zero_the_next_estimates() -> None:
    """A request claiming 2**64 - 1 tokens (had it been believed) ends its prefill in 10 ms: the
    next requests' estimates still follow the honest 1000 tokens/s."""
    queue = admission(initial_tps=None)
    for i in range(MIN_SAMPLES):
        run_one(queue, 100, float(i), i + 0.1)
    run_one(queue, 2**64 - 1, 10.0, 10.01)
    assert queue.table.input_tps("m") == pytest.approx(1000.0)
    waiting = admit(queue, tokens=500)
    estimate = queue.table.estimate_ms("m", waiting.level)
    assert estimate is not None and 500 <= estimate <= 501  # (float busy times round up)


def test_one_held_prefill_cannot_blow_up_the_next_estimates() -> None:
    """One request of 1 token the engine held for a minute: the estimates do not become hours."""
    queue = admission(initial_tps=None)
    for i in range(MIN_SAMPLES):
        run_one(queue, 100, float(i), i + 0.1)
    run_one(queue, 1, 10.0, 70.0)
    assert queue.table.input_tps("m") == pytest.approx(1000.0)


# --- properties --------------------------------------------------------------------------------

# One operation: (kind, index, tokens, rank); indexes pick among the live entries.
operations = st.lists(
    st.tuples(
        st.sampled_from(["admit", "dispatch", "head", "first", "release"]),
        st.integers(0, 50),
        st.integers(0, 10**6),
        st.none() | st.integers(0, 5000),
        st.booleans(),
    ),
    max_size=80,
)


@FAST
@given(operations, st.sampled_from(["dynamo", "vllm", "sglang", "passthrough"]))
def test_entries_always_leave_and_counts_stay_sane(ops: list[Any], backend: str) -> None:
    queue = admission(initial_tps=1234.5, backend=backend)
    entries = [admit(queue)]
    now = 0.0
    for kind, index, tokens, rank, flag in ops:
        now += 0.003
        if kind == "admit" or not entries:
            entries.append(admit(queue, stream=flag, tokens=tokens, priority=rank))
            continue
        entry = entries[index % len(entries)]
        if kind == "dispatch":
            dispatch(entry, now)
        elif kind == "head":
            head(entry)
        elif kind == "first":
            output(entry, now, flag)
        else:
            release(entry, now)
        (snap,) = queue.table.snapshot()
        assert min(snap.pending, snap.pending_tokens, snap.prefill, snap.prefill_tokens) >= 0
        assert snap.decode >= 0
        assert all(ms >= 0 for _, ms in snap.estimates_ms)
        tps = queue.table.input_tps("m")
        assert tps is not None and tps > 0 and math.isfinite(tps)
    for entry in entries:
        release(entry, now + 1)
    (snap,) = queue.table.snapshot()
    assert (snap.pending, snap.pending_tokens, snap.prefill, snap.prefill_tokens, snap.decode) == (
        0,
        0,
        0,
        0,
        0,
    )
    assert queue.table.estimate_ms("m", 0) == 0


live_requests = st.lists(
    st.tuples(st.integers(0, 10**9), st.none() | st.integers(0, 10_000), st.booleans()),
    max_size=30,
)


@FAST
@given(live_requests, st.integers(0, CEILING), st.integers(0, CEILING))
def test_estimates_are_monotonic_in_level(
    live: list[tuple[int, int | None, bool]], low: int, high: int
) -> None:
    low, high = sorted((low, high))
    queue = admission(initial_tps=777.0)
    for tokens, rank, started in live:
        entry = admit(queue, tokens=tokens, priority=rank)
        if started:
            head(entry)
    low_ms = queue.table.estimate_ms("m", low)
    high_ms = queue.table.estimate_ms("m", high)
    assert low_ms is not None and high_ms is not None
    assert 0 <= low_ms <= high_ms


@FAST
@given(live_requests, st.integers(0, 10**9), st.none() | st.integers(0, 10_000), st.booleans())
def test_more_work_ahead_never_lowers_an_estimate(
    live: list[tuple[int, int | None, bool]],
    tokens: int,
    rank: int | None,
    started: bool,
) -> None:
    queue = admission(initial_tps=321.0)
    for live_tokens, live_rank, live_started in live:
        entry = admit(queue, tokens=live_tokens, priority=live_rank)
        if live_started:
            head(entry)
    levels = [0, 1, 100, CEILING]
    before = [queue.table.estimate_ms("m", level) for level in levels]
    extra = admit(queue, tokens=tokens, priority=rank)
    if started:
        head(extra)
    after = [queue.table.estimate_ms("m", level) for level in levels]
    assert all(
        a is not None and b is not None and a >= b for a, b in zip(after, before, strict=True)
    )
    # ... and a refusal follows the same order: what is refused at a level is refused above it.
    release(extra, 1.0)
    assert [queue.table.estimate_ms("m", level) for level in levels] == before


@FAST
@given(st.integers(0, 2**64 - 1), st.integers(0, 10**6), st.floats(1, 100))
def test_threshold_never_below_expected_plus_delta(
    expected: int, delta: int, factor: float
) -> None:
    threshold = QueuePolicy(min_delta_ms=delta, factor=factor).threshold_ms(expected)
    assert threshold >= expected + delta
    assert threshold >= expected * factor - 1e-6 * expected


def test_expected_queue_header_never_reaches_the_engine() -> None:
    """The strip removes it (x-stargate-*), whatever the queue decided."""
    built = request(expected=100)
    sanitized = sanitize_request_headers(built.headers, frozenset())
    assert all(name.lower() != b"x-stargate-expected-queue-ms" for name, _ in sanitized.headers)
