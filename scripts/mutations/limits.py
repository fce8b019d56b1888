"""Limits and budgets: header sections, bodies, the bytes a connection and the process may hold,
and what an engine can make pylon hold (connections, an SSE event)."""

from __future__ import annotations

from mutations.anchors import Always, Never, ReplaceExpr, ReplaceStatements
from mutations.spec import (
    CONNECTION,
    ERRORS_T,
    FAULTS_T,
    FORWARDING,
    H2L_T,
    H3ISO_T,
    H3L_T,
    H3LAYER,
    HEAD,
    HTTP1,
    HTTP2,
    HTTP3,
    INTAKE,
    INTAKE_T,
    POOL,
    POOL_T,
    PROBE,
    RELAY,
    SAME,
    SSE,
    STREAMS,
    TRANSPORTS,
    Mutation,
    per_transport,
    table_limits,
)

_TRAILERS_UNSAFE = f"{INTAKE_T}::test_trailers_over_the_limits_or_with_pseudo_headers_are_rejected"

HEADER_LIMITS = [
    Mutation(
        "header limits",
        "HTTP/1.1 header bytes not counted (_head_over_limits)",
        Never(
            HTTP1,
            "Http1Connection._head_over_limits",
            "self._head_bytes > self._limits.max_header_bytes",
        ),
        {"http1": (f"{ERRORS_T}::test_header_limits_are_431",)},
    ),
    Mutation(
        "header limits",
        "HTTP/1.1 head bytes not counted as they arrive (one endless line buffered whole)",
        Never(HTTP1, "Http1Connection._count_fed", "self._head_fed > limit + _HEAD_SLACK"),
        {"http1": (f"{ERRORS_T}::test_one_endless_header_line_is_refused_as_it_arrives[*]",)},
    ),
    Mutation(
        "header limits",
        "HTTP/1.1 header count not checked (max_headers)",
        Never(
            HTTP1,
            "Http1Connection._head_over_limits",
            "len(self._headers) > self._limits.max_headers",
        ),
        {"http1": (f"{SAME}::test_too_many_header_fields_is_431[http1]",)},
    ),
    Mutation(
        "header limits",
        "HTTP/2 and HTTP/3 header block not checked (StreamTable.header_block)",
        ReplaceStatements(
            STREAMS,
            "StreamTable.header_block",
            "check_header_block(fields, limits.max_headers, limits.max_header_bytes)",
            "",
        ),
        {
            "h2": (
                f"{SAME}::test_too_many_header_fields_is_431[h2]",
                f"{H2L_T}::test_header_bytes_over_limit_is_431",
            ),
            "h3": (
                f"{SAME}::test_too_many_header_fields_is_431[h3]",
                f"{H3ISO_T}::test_header_bytes_over_the_limit_is_431",
            ),
        },
    ),
    Mutation(
        "header limits",
        "HTTP/3 header block over the limit read and decoded (h3layer)",
        Never(H3LAYER, "H3Layer._start_frame", "length > self._max_header_block"),
        {"h3": (f"{H3L_T}::test_oversized_header_block_is_refused_unread_with_bounded_memory",)},
    ),
    Mutation(
        "header limits",
        "HTTP/2 hard HPACK cap lifted",
        ReplaceExpr(
            HTTP2,
            "Http2Connection._start_h2",
            "max(64 * KiB, 2 * (limits.max_header_bytes + 32 * limits.max_headers))",
            "2**31 - 1",
        ),
        {"h2": (f"{H2L_T}::test_hpack_bomb_past_the_hard_cap_is_a_connection_error",)},
    ),
    Mutation(
        "header limits",
        "trailer section not held to the limits",
        ReplaceStatements(
            INTAKE,
            "RequestIntake.receive_trailers",
            "check_header_block(fields, limits.max_headers, limits.max_header_bytes)",
            "",
        ),
        {
            "core": (_TRAILERS_UNSAFE,),
            "h2": (f"{SAME}::test_trailers_over_the_header_limits_are_431[h2]",),
            "h3": (f"{SAME}::test_trailers_over_the_header_limits_are_431[h3]",),
        },
    ),
    Mutation(
        "header limits",
        "pseudo-header in trailers accepted (intake)",
        ReplaceStatements(
            HEAD, "trailers_unsafe", 'return "pseudo-header in trailers"', "return None"
        ),
        {
            "core": (_TRAILERS_UNSAFE,),
            "h2": (f"{SAME}::test_pseudo_header_in_trailers_is_400[h2]",),
        },
    ),
    Mutation(
        "header limits",
        "HTTP/2 trailers end the request unchecked",
        ReplaceStatements(
            HTTP2,
            "Http2Connection._on_end",
            "self._table.trailers(sid, stream.trailers)",
            "self._table.end(sid)",
        ),
        {
            "h2": (
                f"{SAME}::test_trailers_over_the_header_limits_are_431[h2]",
                f"{SAME}::test_pseudo_header_in_trailers_is_400[h2]",
            )
        },
    ),
    Mutation(
        "header limits",
        "HTTP/3 trailers end the request unchecked",
        ReplaceStatements(
            HTTP3,
            "Http3Protocol._h3_event",
            "self._table.trailers(event.stream_id, event.headers)",
            "self._table.end(event.stream_id)",
        ),
        {"h3": (f"{SAME}::test_trailers_over_the_header_limits_are_431[h3]",)},
    ),
    Mutation(
        "header limits",
        "pseudo-header in HTTP/3 trailers accepted (h3layer)",
        Never(H3LAYER, "H3Layer._trailers", 'name[:1] == b":"'),
        {"h3": (f"{H3L_T}::test_malformed_request_is_a_stream_error_and_others_keep_working[*]",)},
    ),
]

BODY_LIMITS = [
    Mutation(
        "body limit",
        "declared length not checked (receive_head)",
        Never(
            INTAKE,
            "RequestIntake.receive_head",
            "declared is not None and declared > self._limits.max_body_bytes",
        ),
        {
            "http1": (f"{ERRORS_T}::test_declared_body_over_limit_is_413_before_reading",),
            "h2": (f"{H2L_T}::test_declared_body_over_limit_is_413_at_headers",),
            "h3": (f"{H3ISO_T}::test_declared_body_over_the_limit_is_413_at_once",),
        },
    ),
    Mutation(
        "body limit",
        "streamed size not checked (receive_data)",
        Never(INTAKE, "RequestIntake.receive_data", "size > self._limits.max_body_bytes"),
        {
            "http1": (f"{ERRORS_T}::test_chunked_body_over_limit_is_413",),
            "h2": (f"{H2L_T}::test_streamed_body_over_limit_is_413",),
            "h3": (f"{H3ISO_T}::test_streamed_body_over_the_limit_is_413",),
        },
    ),
    *(
        Mutation(
            "body limit",
            f"{t} stream table without the body limit",
            table_limits(t, max_body_bytes="1 << 62"),
            {t: (f"{SAME}::test_body_over_the_limit_is_413_with_the_request_id[{t}]",)},
        )
        for t in TRANSPORTS
    ),
]

BODY_BUDGETS = [
    Mutation(
        "body budget",
        "a connection may hold any number of bodies at once",
        Never(
            STREAMS,
            "StreamTable._hold",
            "self._held + size > self._limits.max_connection_body_bytes",
        ),
        {"h2": (f"{SAME}::test_one_connection_cannot_hold_more_than_its_body_budget",)},
    ),
    Mutation(
        "body budget",
        "the process budget never refuses",
        Never(STREAMS, "StreamTable._hold", "not self._budget.take(size)"),
        per_transport(f"{SAME}::test_the_process_body_budget_bounds_every_transport"),
    ),
]

# What an engine can make pylon hold.
ENGINE_SIDE = [
    Mutation(
        "engine connection cap",
        "connections per engine not capped",
        Never(POOL, "UpstreamPool._open", "pool.open >= self._max_connections"),
        {"core": (f"{POOL_T}::test_requests_above_the_cap_wait_for_a_free_connection",)},
    ),
    Mutation(
        "SSE event size cap",
        "an engine's SSE event may grow without bound",
        Never(SSE, "SseSplitter._keep", "len(self._pending) > self.max_event_bytes"),
        {"core": (f"{ERRORS_T}::test_oversized_sse_event_ends_the_stream",)},
    ),
    Mutation(
        "engine response head cap",
        "head bytes counted only as llhttp delivers fields, not per read",
        Never(
            CONNECTION,
            "UpstreamConnection.data_received",
            "self._stray > MAX_RESPONSE_HEAD and not self._final",
        ),
        {
            **per_transport(f"{FAULTS_T}::test_one_huge_engine_header_line_is_a_502_before_*"),
            "core": (
                f"{FAULTS_T}::test_one_huge_engine_trailer_line_cuts_the_stream_*",
                f"{FAULTS_T}::test_every_shape_of_endless_engine_framing_*[*-interim_heads]",
                f"{FAULTS_T}::test_every_shape_of_endless_engine_framing_*[*-chunk_extension]",
            ),
        },
    ),
    Mutation(
        "engine response head cap",
        "no cap on the count of fields in an engine's response head",
        Never(CONNECTION, "UpstreamConnection.on_header", "len(fields) >= MAX_RESPONSE_FIELDS"),
        {**per_transport(f"{FAULTS_T}::test_an_engine_head_over_the_field_count_is_502")},
    ),
    Mutation(
        "engine response head cap",
        "the probe counts head bytes only as llhttp delivers fields, not per read",
        Never(PROBE, "_OneResponse.data_received", "self._stray > MAX_RESPONSE_HEAD"),
        {"core": (f"{FAULTS_T}::test_the_probe_counts_one_huge_header_line_as_it_arrives",)},
    ),
]

# A response the engine cut short must never reach a client as a complete one.
_CUT = f"{FAULTS_T}::test_a_truncated_engine_body_is_never_complete_for_any_client"
TRUNCATION = [
    Mutation(
        "truncation framing",
        "HTTP/1.1 with connection: close gets a close-delimited body (a cut reads as whole)",
        ReplaceExpr(HTTP1, "Http1Responder.start", "not self._http10", "self._keep_alive"),
        {"http1": (f"{_CUT}[chunked-http1-close]", f"{_CUT}[chunked-mid-chunk-http1-close]")},
    ),
    Mutation(
        "truncation framing",
        "a cut close-delimited HTTP/1.0 body ends in a FIN, not a reset",
        Always(HTTP1, "Http1Responder.abort", "self._chunked or self._length or self._is_head"),
        {"http1": (f"{FAULTS_T}::test_an_http10_client_sees_a_cut_body_as_a_reset_and_a_whole_*",)},
    ),
    Mutation(
        "truncation framing",
        "a body the engine broke ends cleanly instead of being cut (relay_raw)",
        ReplaceStatements(
            RELAY,
            "relay_raw",
            """
            sink.abort()
            error = UpstreamError(str(broken), code=ErrorCode.UPSTREAM_PROTOCOL_ERROR)
            """,
            """
            sink.end()
            error = UpstreamError(str(broken), code=ErrorCode.UPSTREAM_PROTOCOL_ERROR)
            """,
        ),
        per_transport(_CUT),
    ),
    Mutation(
        "truncation framing",
        "a cut response's record keeps outcome ok",
        ReplaceStatements(
            FORWARDING,
            "Proxy._forward",
            "exchange.failed(cut.error, cut.outcome, after_head=True)",
            "pass",
        ),
        {"core": (f"{_CUT}[*]",)},
    ),
]
