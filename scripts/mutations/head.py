"""The head checks: wire safety, the HTTP/2 and HTTP/3 pseudo-header rules, HTTP/1.1's own
rules, Content-Length, and the tunnel contract (target, method, repeated headers, request id,
content coding)."""

from __future__ import annotations

from mutations.anchors import Never, ReplaceExpr, ReplaceStatements, ReturnAtOnce
from mutations.spec import (
    ADMISSION,
    CONTRACT,
    CONTRACT_T,
    H1_T,
    H2L_T,
    H3ISO_T,
    HEAD,
    HEADS_T,
    HTTP,
    SAME,
    Mutation,
    per_transport,
)

_HTTP1_WIRE = f"{HEADS_T}::test_http1_head_checks_host_and_wire_safety"
_CONTROL_CHARACTER = f"{SAME}::test_control_character_in_a_field_value_is_400"
_H2_MALFORMED = f"{H2L_T}::test_malformed_header_block_is_a_400_on_that_stream_only"
_H3_MALFORMED = f"{H3ISO_T}::test_malformed_request_costs_only_its_stream"
_PSEUDO_BY_HEAD = f"{HEADS_T}::test_each_pseudo_header_is_checked_by_the_head_itself"

WIRE_SAFETY = [
    Mutation(
        "wire safety",
        "wire_unsafe never objects",
        ReturnAtOnce(HTTP, "wire_unsafe", "None"),
        {
            # llhttp refuses these bytes itself: on HTTP/1.1 only a unit test sees the check.
            "core": (_HTTP1_WIRE,),
            **per_transport(_CONTROL_CHARACTER, ["h2", "h3"]),
        },
    ),
    Mutation(
        "wire safety",
        "skipped for HTTP/1.1 heads (http1_head)",
        ReplaceStatements(
            HEAD,
            "http1_head",
            "return _finish(method, target, list(fields), names)",
            "return RequestHead(method, target, list(fields), declared_length(fields))",
        ),
        {"core": (_HTTP1_WIRE,)},
    ),
    Mutation(
        "wire safety",
        "skipped for HTTP/2 and HTTP/3 heads (pseudo_head)",
        ReplaceStatements(
            HEAD,
            "pseudo_head",
            "return _finish(method, path, headers, [name for name, _ in headers])",
            "return RequestHead(method, path, headers, declared_length(headers))",
        ),
        per_transport(_CONTROL_CHARACTER, ["h2", "h3"]),
    ),
    Mutation(
        "wire safety",
        "field-name token check off",
        Never(
            HTTP,
            "wire_unsafe",
            'b"" in names or b"".join(names).translate(None, _TCHARS)',
        ),
        {"core": (f"{HEADS_T}::test_wire_unsafe_agrees_with_a_field_by_field_check",)},
    ),
    Mutation(
        "wire safety",
        "field-value control check off",
        Never(
            HTTP,
            "wire_unsafe",
            'b"".join([value for _, value in headers]).translate(None, _SAFE_VALUE_BYTES)',
        ),
        {"core": (_HTTP1_WIRE,), **per_transport(_CONTROL_CHARACTER, ["h2", "h3"])},
    ),
]

# (label, function, condition, HTTP/2 test id, HTTP/3 test id); no HTTP/3 test: a rule only a
# unit test can see, as a later layer (the contract) refuses the same requests anyway.
_PSEUDO_HEADER_RULES = [
    ("edge whitespace in values", "pseudo_head", "_EDGE_WHITESPACE.search(value)",
     "value_leading_space", "value_with_leading_space"),
    (":method not a token", "pseudo_head", "not TOKEN.fullmatch(method)", "*:method*", None),
    (":scheme not a URI scheme", "pseudo_head", "not _SCHEME.fullmatch(scheme)",
     "scheme_not_a_scheme", "scheme_not_a_scheme"),
    (":path not origin-form", "pseudo_head", "not _PATH.fullmatch(path)", "*:path*", None),
    ("pseudo-header after a regular field", "_add_pseudo", "after_regular",
     "pseudo_after_regular", "pseudo_after_regular"),
    ("unknown pseudo-header (:protocol)", "_add_pseudo", "name not in _REQUEST_PSEUDO",
     "unknown_pseudo", "unknown_pseudo"),
    ("repeated pseudo-header", "_add_pseudo", "name in pseudo", "repeated_path", "repeated_path"),
    ("field name not a lowercase token", "_check_regular", "not _LOWER_TOKEN.fullmatch(name)",
     "uppercase_name", "uppercase_name"),
    ("connection-specific field", "_check_regular", "name in _CONNECTION_SPECIFIC",
     "connection", "connection_header"),
    ("te other than trailers", "_check_regular", 'name == b"te" and value != b"trailers"',
     "te_gzip", "te_not_trailers"),
    (":authority empty or with userinfo", "_with_host",
     'not authority or authority.find(b"@") >= 0', "authority_userinfo", "authority_userinfo"),
    ("host differing from :authority", "_with_host", "any(host != authority for host in hosts)",
     "host_differs", "host_differs"),
    (":authority or host required", "_with_host", "not hosts and scheme in _AUTHORITY_SCHEMES",
     "missing_authority", "missing_authority"),
    ("repeated host without :authority", "_with_host", "len(hosts) > 1",
     "two_hosts_no_authority", "two_hosts_no_authority"),
]  # fmt: skip

PSEUDO_HEADER_RULES = [
    Mutation(
        "pseudo-header rules",
        label,
        Never(HEAD, function, condition),
        {"h2": (f"{_H2_MALFORMED}[{h2}]",), "h3": (f"{_H3_MALFORMED}[{h3}]",)}
        if h3
        else {"core": (f"{_PSEUDO_BY_HEAD}[{h2}]",)},
    )
    for label, function, condition, h2, h3 in _PSEUDO_HEADER_RULES
]

HTTP1_HEAD_RULES = [
    Mutation(
        "HTTP/1.1 head rules",
        "exactly one Host not enforced",
        Never(HEAD, "http1_head", "hosts > 1 or (hosts == 0 and not http10)"),
        {"http1": (f"{H1_T}::test_smuggling_shapes_are_400_and_close[two_hosts]",)},
    ),
    Mutation(
        "HTTP/1.1 head rules",
        "Transfer-Encoding on HTTP/1.0 accepted",
        Never(HEAD, "http1_head", 'http10 and b"transfer-encoding" in names'),
        {"http1": (f"{H1_T}::test_smuggling_shapes_are_400_and_close[te_on_http10]",)},
    ),
    Mutation(
        "content-length",
        "declared_length takes the last of differing values",
        ReplaceExpr(
            HEAD,
            "declared_length",
            "not value.isdigit() or (found is not None and value != found)",
            "not value.isdigit()",
        ),
        {"core": (f"{HEADS_T}::test_declared_length",)},
    ),
]

CONTRACT_RULES = [
    Mutation(
        "request target",
        "origin-form target not checked (contract)",
        Never(
            CONTRACT,
            "_check_target",
            'not target.startswith(b"/") or target.startswith(b"//")'
            " or not _VISIBLE_ASCII.fullmatch(target)",
        ),
        {"core": (f"{CONTRACT_T}::test_only_origin_form_targets[*]",)},
    ),
    Mutation(
        "request target",
        "ambiguous path accepted (dot or empty segments, encoded separators, fragment)",
        Never(
            CONTRACT,
            "_check_target",
            'target.find(b"#") >= 0 or _AMBIGUOUS_PATH.search(target.split(b"?", 1)[0])',
        ),
        per_transport(f"{SAME}::test_an_ambiguous_request_path_is_400"),
    ),
    Mutation(
        "request target",
        "/health query not checked for visible ASCII",
        Never(CONTRACT, "parse_request", "not _VISIBLE_ASCII.fullmatch(target)"),
        {"core": (f"{CONTRACT_T}::test_health_with_non_ascii_query_is_a_contract_error",)},
    ),
    Mutation(
        "method allow-list",
        "any method accepted",
        Never(CONTRACT, "_check_method", "method not in _ALLOWED_METHODS"),
        {"core": (f"{CONTRACT_T}::test_unsupported_methods[*]",)},
    ),
    Mutation(
        "duplicate contract headers",
        "repeated contract header: first copy wins",
        Never(CONTRACT, "_single", "len(found) > 1"),
        {"core": (f"{CONTRACT_T}::test_duplicate_priority_rejected_even_when_equal",)},
    ),
    Mutation(
        "x-request-id validation",
        "any bytes and length accepted",
        Never(
            CONTRACT,
            "_parse_request_id",
            "len(raw) > MAX_REQUEST_ID_CHARS or not _VISIBLE_ASCII.fullmatch(raw)",
        ),
        {"core": (f"{CONTRACT_T}::test_request_id_invalid[*]",)},
    ),
    Mutation(
        "content encoding",
        "a content-encoded body is admitted (the engine would read other bytes)",
        Never(ADMISSION, "ProxyAdmission.admit", "coding is not None"),
        per_transport(f"{SAME}::test_a_content_encoded_body_is_415"),
    ),
]
