"""Timeouts: the stall clock of a request body, the HTTP/1.1 head timer (slowloris), and the
idle timers of every kind of connection."""

from __future__ import annotations

from mutations.anchors import Always, InsertBefore, Never, ReplaceExpr, ReplaceStatements
from mutations.spec import (
    CONNECTION,
    FAULTS_T,
    H1_T,
    H2L_T,
    H2TLS_T,
    H3ISO_T,
    HTTP1,
    HTTP2,
    HTTP3,
    INTAKE,
    STREAMS,
    Mutation,
    per_transport,
    table_limits,
)

_STALLED_BODY = {
    "http1": f"{H1_T}::test_stalled_body_is_408_after_the_header_timeout",
    "h2": f"{H2L_T}::test_stalled_request_body_is_408_on_that_stream_only",
    "h3": f"{H3ISO_T}::test_stalled_request_body_is_408_on_that_stream_only",
}
_SLOWLORIS = f"{H1_T}::test_slowloris_head_is_closed_after_the_header_timeout"
_ARM_HEAD_TIMER = "self._timer.arm(self._limits.stall_timeout)"

STALL_CLOCK = [
    Mutation(
        "stall clock",
        "intake tick never rejects",
        Always(INTAKE, "RequestIntake.tick", "now - self.progress < self._limits.stall_timeout"),
        {t: (test,) for t, test in _STALLED_BODY.items()},
    ),
    Mutation(
        "stall clock",
        "stall watcher never armed (StreamTable.head)",
        ReplaceStatements(
            STREAMS, "StreamTable.head", "self._stall_watch.arm(self._limits.stall_timeout)", ""
        ),
        {t: (test,) for t, test in _STALLED_BODY.items()},
    ),
    *(
        Mutation(
            "stall clock",
            f"{t} stream table without the stall clock",
            table_limits(t, stall_timeout="1e9"),
            {t: (test,)},
        )
        for t, test in _STALLED_BODY.items()
    ),
]

HEAD_TIMER = [
    Mutation(
        "HTTP/1.1 head timer",
        "a started head never times out",
        Never(
            HTTP1,
            "Http1Connection._timed_out",
            "stream is not None and stream.intake.state is AWAITING_HEAD",
        ),
        {"http1": (_SLOWLORIS,)},
    ),
    Mutation(
        "HTTP/1.1 head timer",
        "every read restarts the head clock",
        InsertBefore(HTTP1, "Http1Connection.data_received", "self._feed(data)", _ARM_HEAD_TIMER),
        {"http1": (_SLOWLORIS,)},
    ),
    Mutation(
        "HTTP/1.1 head timer",
        "not armed when the connection is handed over",
        ReplaceStatements(HTTP1, "Http1Connection.connection_made", _ARM_HEAD_TIMER, ""),
        {
            "http1": (
                f"{H2TLS_T}::test_silent_tls_client_is_closed_after_the_header_timeout[http/1.1]",
            )
        },
    ),
]

IDLE_TIMERS = [
    Mutation(
        "idle timers",
        "HTTP/1.1 idle keep-alive never closed",
        ReplaceStatements(
            HTTP1,
            "Http1Connection._timed_out",
            'self._observer.transport_event("client_timeout", "http1", timer="idle")\nself.abort()',
            'self._observer.transport_event("client_timeout", "http1", timer="idle")',
        ),
        {"http1": (f"{H1_T}::test_idle_keep_alive_connection_is_closed",)},
    ),
    Mutation(
        "idle timers",
        "HTTP/2 idle connection never closed",
        ReplaceStatements(
            HTTP2,
            "Http2Connection._idle",
            'self._observer.transport_event("client_timeout", "h2", timer="idle")',
            "return",
        ),
        {"h2": (f"{H2L_T}::test_idle_connection_gets_goaway",)},
    ),
    Mutation(
        "idle timers",
        "HTTP/2 connection silent after its preface never closed",
        ReplaceStatements(HTTP2, "Http2Connection.connection_made", _ARM_HEAD_TIMER, ""),
        {
            "h2": (
                f"{H2L_T}::test_connection_silent_after_its_preface_is_closed_after_the_header_timeout",
                f"{H2TLS_T}::test_silent_tls_client_is_closed_after_the_header_timeout[h2]",
            )
        },
    ),
    Mutation(
        "idle timers",
        "TCP connection that never speaks never closed (ProtocolSwitch)",
        ReplaceStatements(
            HTTP2,
            "ProtocolSwitch.connection_made",
            "self._timer = loop.call_later(self._header_timeout, self._transport.abort)",
            "self._timer = None",
        ),
        {
            "http1": (f"{H1_T}::test_silent_client_is_closed_after_the_header_timeout",),
            "h2": (f"{H2L_T}::test_silent_connection_is_closed_after_the_header_timeout",),
        },
    ),
    Mutation(
        "idle timers",
        "QUIC idle timeout ignored",
        ReplaceExpr(HTTP3, "Http3Server.__init__", "options.idle_timeout", "3600.0"),
        {"h3": (f"{H3ISO_T}::test_idle_connection_is_closed",)},
    ),
]


# What pylon waits for from an engine: every request's response head.
_HEAD_504 = f"{FAULTS_T}::test_an_engine_that_never_sends_its_head_is_a_504_on_the_head_timeout"
ENGINE_TIMERS = [
    Mutation(
        "engine response head deadline",
        "the head clock expires and fails nothing",
        Never(
            CONNECTION,
            "UpstreamConnection._head_overdue",
            "attempt is not None and attempt.status == 0",
        ),
        per_transport(_HEAD_504),
    ),
    Mutation(
        "engine response head deadline",
        "the head clock is never armed",
        Never(CONNECTION, "UpstreamConnection.begin", "self._head_clock is not None"),
        per_transport(_HEAD_504),
    ),
]
