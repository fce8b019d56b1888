"""Fairness to the event loop and to the log: no input source holds the loop for a burst, and
a repeated fault writes a bounded number of log lines (its counters stay exact)."""

from __future__ import annotations

from mutations.anchors import DropEntry, Never, ReplaceExpr
from mutations.spec import HTTP1, HTTP2, KV_ROUTING_T, KV_WATCH, LOG_RATE, OBSERVE, Mutation

_LOG_RATE_T = "tests/unit/test_log_rate.py"
_FAIR_T = "tests/transport/test_loop_fairness.py"
_KV_FLOOD = (
    f"{KV_ROUTING_T}::test_a_flood_of_kv_faults_writes_a_bounded_number_of_lines_and_counts_each"
)

LOOP_FAIRNESS = [
    Mutation(
        "loop fairness",
        "the KV-event watch never yields inside a burst",
        Never(KV_WATCH, "KvEventWatch._follow", "budget == 0"),
        {"core": (f"{KV_ROUTING_T}::test_a_burst_of_kv_events_does_not_hold_the_loop",)},
    ),
    Mutation(
        "loop fairness",
        "HTTP/1.1 parses a whole read of pipelined requests at once",
        Never(
            HTTP1,
            "Http1Connection._feed",
            "start < size and self._table.queued and not (self._closing or self._refused)",
        ),
        {
            "http1": (
                f"{_FAIR_T}::test_http1_pipelined_requests_in_one_write_are_parsed_one_turn_at_a_time",
            )
        },
    ),
    Mutation(
        "loop fairness",
        "HTTP/2 hands h2 a whole read at once",
        Never(HTTP2, "Http2Connection.data_received", "len(data) > FEED_BYTES"),
        {
            "h2": (
                f"{_FAIR_T}::test_http2_a_body_in_one_byte_data_frames_is_parsed_a_piece_per_turn",
                f"{_FAIR_T}::test_http2_a_ping_flood_in_one_write_trips_the_guard_within_a_piece",
            )
        },
    ),
]

_NATIVE = "pylon/native_logs.py"
_NATIVE_T = "tests/unit/test_native_logs.py"

LOG_RATE_LIMIT = [
    Mutation(
        "log rate limit",
        "native (Dynamo) log lines not limited per call site",
        Never(_NATIVE, "NativeStderr.line", "held is None"),
        {
            "core": (
                f"{_NATIVE_T}::test_a_burst_from_one_native_call_site_writes_a_bounded_number_of_lines",
                f"{_NATIVE_T}::test_cut_lines_and_text_lines_are_limited_too",
            )
        },
    ),
    Mutation(
        "log rate limit",
        "LogRate's burst never runs out",
        ReplaceExpr(LOG_RATE, "LogRate.admit", "slot[2] > 0", "True"),
        {
            "core": (
                f"{_LOG_RATE_T}::test_a_burst_goes_out_per_interval_then_lines_are_held_back",
                f"{_NATIVE_T}::test_a_burst_from_one_native_call_site_writes_a_bounded_number_of_lines",
            )
        },
    ),
    Mutation(
        "log rate limit",
        "LogRate never holds a line back",
        Never(LOG_RATE, "LogRate.admit", "now < slot[0]"),
        {
            "core": (
                f"{_LOG_RATE_T}::test_the_first_line_goes_out_then_one_per_interval_with_the_count_held_back",
                f"{_KV_FLOOD}[malformed]",
            )
        },
    ),
    Mutation(
        "log rate limit",
        "connection-level lines not limited",
        Never(OBSERVE, "LogObserver.transport_event", "self._held_back((event, protocol), fields)"),
        {"core": (f"{_LOG_RATE_T}::test_connection_events_are_rate_limited_per_protocol",)},
    ),
    Mutation(
        "log rate limit",
        "engine faults told per request not limited",
        Never(
            OBSERVE, "LogObserver.upstream_failed", "self._held_back((kind, record.worker), fields)"
        ),
        {
            "core": (
                f"{_LOG_RATE_T}::test_an_engines_faults_are_rate_limited_per_worker_and_the_access_line_is_not",
            )
        },
    ),
    Mutation(
        "log rate limit",
        "a repeated crash not limited",
        Never(
            OBSERVE,
            "LogObserver.crashed",
            'self._held_back(("request_crashed", transport, type(exc).__name__), fields)',
        ),
        {
            "core": (
                f"{_LOG_RATE_T}::test_a_bug_hit_by_every_request_is_one_traceback_per_interval_per_exception_type",
            )
        },
    ),
    Mutation(
        "log rate limit",
        "kv_events_malformed not limited",
        DropEntry(OBSERVE, "REPEATED_EVENTS", '"kv_events_malformed"'),
        {"core": (f"{_KV_FLOOD}[malformed]",)},
    ),
    Mutation(
        "log rate limit",
        "kv_events_gap not limited",
        DropEntry(OBSERVE, "REPEATED_EVENTS", '"kv_events_gap"'),
        {"core": (f"{_KV_FLOOD}[gap]",)},
    ),
]
