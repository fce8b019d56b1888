"""The strip, both ways: spot checks of the request deny tables (scripts/golden_mutations.py
covers every entry), pylon-owned request headers, and the engine's response head."""

from __future__ import annotations

from mutations.anchors import (
    DropEntry,
    DropOperand,
    EmptyTable,
    Never,
    ReplaceStatements,
)
from mutations.spec import (
    CONTRACT_EP_T,
    FORWARDING,
    GOLDEN_H_T,
    GOLDEN_T,
    RESP_T,
    SAN_T,
    SANITIZE,
    Mutation,
    per_transport,
)

_NO_GOLDEN_CONTROL = per_transport(f"{GOLDEN_T}::test_no_golden_control_reaches_the_engine")
_PYLON_OWNED = {
    "core": (f"{GOLDEN_H_T}::test_pylon_owned_header_dropped_without_report[*]",),
    **per_transport(f"{CONTRACT_EP_T}::test_engine_sees_only_pylons_host_and_content_length"),
}
_RESPONSE = per_transport(
    f"{RESP_T}::test_engine_control_and_hop_by_hop_headers_never_reach_the_client"
)
_GOLDEN_RESPONSE = {"core": (f"{GOLDEN_H_T}::test_golden_response_header_removed[*]",), **_RESPONSE}

REQUEST_STRIP = [
    Mutation(
        "request strip",
        "x-dynamo-* header prefix",
        DropEntry(SANITIZE, "DENIED_REQUEST_HEADER_PREFIXES", 'b"x-dynamo-"'),
        _NO_GOLDEN_CONTROL,
    ),
    Mutation(
        "request strip",
        "body cache_salt",
        DropEntry(SANITIZE, "DENIED_BODY_FIELDS", '"cache_salt"'),
        _NO_GOLDEN_CONTROL,
    ),
    Mutation(
        "request strip",
        "client content-length forwarded beside pylon's",
        DropEntry(SANITIZE, "PYLON_OWNED_REQUEST_HEADERS", 'b"content-length"'),
        _PYLON_OWNED,
    ),
    Mutation(
        "request strip",
        "client host forwarded beside pylon's",
        DropEntry(SANITIZE, "PYLON_OWNED_REQUEST_HEADERS", 'b"host"'),
        _PYLON_OWNED,
    ),
]

_RESPONSE_HEADERS = "sanitize_response_head"

RESPONSE_STRIP = [
    Mutation(
        "response headers",
        "engine headers relayed unsanitized",
        ReplaceStatements(
            FORWARDING,
            "Proxy._response_head",
            "head = sanitize_response_head(status, attempt.headers, self._retry_header)",
            """
            head = sanitize_response_head(status, attempt.headers, self._retry_header)
            head.fields = list(attempt.headers)
            """,
        ),
        _RESPONSE,
    ),
    Mutation(
        "response headers",
        "engine x-stargate-* relayed",
        DropOperand(
            SANITIZE, _RESPONSE_HEADERS, "name.startswith(DENIED_RESPONSE_HEADER_PREFIXES)"
        ),
        _GOLDEN_RESPONSE,
    ),
    Mutation(
        "response headers",
        "engine hop-by-hop headers relayed",
        DropOperand(SANITIZE, _RESPONSE_HEADERS, "name in HOP_BY_HOP"),
        _GOLDEN_RESPONSE,
    ),
    Mutation(
        "response headers",
        "names listed in the engine's Connection relayed",
        Never(SANITIZE, _RESPONSE_HEADERS, "has_connection"),
        {"core": (f"{SAN_T}::test_response_headers",), **_RESPONSE},
    ),
    Mutation(
        "response headers",
        "engine's x-should-retry and x-request-id relayed (pylon-owned)",
        EmptyTable(SANITIZE, "PYLON_OWNED_RESPONSE_HEADERS"),
        _RESPONSE,
    ),
]
