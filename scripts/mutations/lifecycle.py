"""Lifecycle: what is admitted before the engine is ready and while pylon drains, and how each
transport lets its connections finish (GOAWAY, `connection: close`)."""

from __future__ import annotations

from mutations.anchors import Always, Never, ReplaceExpr
from mutations.spec import (
    ADMISSION,
    BRINGUP,
    BRINGUP_T,
    H3ISO_T,
    HTTP1,
    HTTP2,
    HTTP3,
    LIFE_T,
    SEAMS_T,
    SHUT_T,
    Mutation,
    per_transport,
)

_H2_DRAIN = f"{LIFE_T}::test_h2_drain_sends_goaway_and_refuses_new_streams"
_H3_DRAIN = f"{H3ISO_T}::test_drain_sends_goaway_and_lets_in_flight_streams_finish"
_UNSPOKEN = f"{LIFE_T}::test_tcp_connection_that_has_not_spoken_is_closed_on_drain"

GATES = [
    Mutation(
        "drain",
        "tunnel requests admitted while draining",
        Never(ADMISSION, "ProxyAdmission.admit", "lifecycle.phase is not _READY"),
        {"http1": (f"{SEAMS_T}::test_a_request_arriving_during_the_drain_gets_a_retryable_503",)},
    ),
    Mutation(
        "model gate",
        "a request for a model pylon does not publish reaches the engine",
        Never(ADMISSION, "ProxyAdmission.admit", "request.model not in lifecycle.models.published"),
        per_transport(
            f"{BRINGUP_T}::test_an_unpublished_model_is_503_and_never_reaches_the_engine"
        ),
    ),
    Mutation(
        "health gate",
        "tunnel requests admitted before the engine passed its health gate",
        Never(BRINGUP, "bring_up", "options.health_gate"),
        {
            "core": (
                f"{BRINGUP_T}::test_requests_during_the_gate_get_503_not_ready_on_every_transport",
            )
        },
    ),
    Mutation(
        "drain",
        "/health admitted while draining",
        Never(ADMISSION, "ProxyAdmission.admit", "self._lifecycle.draining"),
        {"http1": (f"{LIFE_T}::test_health_arriving_during_the_drain_is_503",)},
    ),
]

DRAIN = [
    Mutation(
        "drain",
        "HTTP/2 GOAWAY not sent",
        Always(
            HTTP2, "Http2Connection.graceful_close", "self._closed or self._goaway_sent is not None"
        ),
        {"h2": (f"{SHUT_T}::test_http2_goaway_lets_open_streams_finish", _H2_DRAIN)},
    ),
    Mutation(
        "drain",
        "HTTP/2 streams above the GOAWAY id not refused",
        Never(
            HTTP2,
            "Http2Connection._on_request",
            "self._goaway_sent is not None and sid > self._goaway_sent",
        ),
        {"h2": (_H2_DRAIN,)},
    ),
    Mutation(
        "drain",
        "HTTP/3 GOAWAY not sent",
        Always(HTTP3, "Http3Protocol.drain", "self._goaway_sent or self._http is None"),
        {"h3": (_H3_DRAIN,)},
    ),
    Mutation(
        "drain",
        "HTTP/3 streams after GOAWAY not refused",
        Never(HTTP3, "Http3Protocol._on_head", "self._goaway_sent"),
        {"h3": (_H3_DRAIN,)},
    ),
    Mutation(
        "drain",
        "HTTP/1.1 request completed during the drain not answered connection: close",
        ReplaceExpr(
            HTTP1,
            "Http1Connection.response_sink",
            "keep_alive and self._lifecycle.phase is not DRAINING",
            "keep_alive",
        ),
        {
            "http1": (
                f"{LIFE_T}::test_h1_request_completed_during_the_drain_is_answered_with_connection_close",
            )
        },
    ),
    Mutation(
        "drain",
        "HTTP/1.1 connection kept open after its in-flight response",
        Never(HTTP1, "Http1Connection.stream_done", "self._lifecycle.phase is DRAINING"),
        {
            "http1": (
                f"{LIFE_T}::test_h1_drain_closes_after_the_response_in_flight_and_runs_no_more",
            )
        },
    ),
    Mutation(
        "drain",
        "HTTP/1.1 idle keep-alive not closed",
        Never(
            HTTP1, "Http1Connection.graceful_close", "not self._table.busy and self._stream is None"
        ),
        {"http1": (f"{LIFE_T}::test_h1_idle_keep_alive_is_closed_at_once_on_drain",)},
    ),
    Mutation(
        "drain",
        "TCP connection that has not spoken yet kept open (ProtocolSwitch)",
        Never(
            HTTP2,
            "ProtocolSwitch.graceful_close",
            "self._transport is not None and self._transport.get_protocol() is self",
        ),
        {"http1": (_UNSPOKEN,), "h2": (_UNSPOKEN,)},
    ),
]
