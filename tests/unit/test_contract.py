"""The tunnel contract: one parse, typed result or ContractError."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pylon.core.contract import (
    MAX_REQUEST_ID_CHARS,
    U32_MAX,
    U64_MAX,
    HealthRequest,
    TunnelRequest,
    check_input_tokens,
    parse_request,
    parse_uint,
)
from pylon.core.errors import ContractError, ErrorCode

from .helpers import BASE_HEADERS, TRACEPARENT, tunnel

CHAT = b"/v1/chat/completions"


def error_of(headers, method=b"POST", target=CHAT) -> ContractError:
    with pytest.raises(ContractError) as info:
        parse_request(method, target, headers)
    return info.value


# --- x-request-id ------------------------------------------------------------------------------


def test_minimal_request_parses() -> None:
    request = tunnel()
    assert request.request_id == "req-1"
    assert request.model == "m"
    assert request.input_tokens is None
    assert request.priority is None
    assert request.routing_key is None
    assert request.expected_queue_ms is None
    assert request.trace is None
    assert request.method == "POST"
    assert request.target == "/v1/chat/completions"
    assert request.headers == BASE_HEADERS


@pytest.mark.parametrize("value", [b"  abc\t", b"\tabc", b"abc "])
def test_request_id_is_trimmed(value: bytes) -> None:
    request = parse_request(b"POST", CHAT, [(b"x-request-id", value), (b"x-model", b"m")])
    assert request.request_id == "abc"


@pytest.mark.parametrize(
    "headers",
    [
        [(b"x-model", b"m")],
        [(b"x-request-id", b""), (b"x-model", b"m")],
        [(b"x-request-id", b"  \t "), (b"x-model", b"m")],
    ],
)
def test_request_id_missing_or_blank(headers) -> None:
    error = error_of(headers)
    assert error.code is ErrorCode.MISSING_REQUEST_ID
    assert error.status == 400
    assert error.request_id is None


@pytest.mark.parametrize(
    "value",
    [b"a" * (MAX_REQUEST_ID_CHARS + 1), b"a b", b"caf\xc3\xa9", b"a\x00b", b"a\x7f", b"a\x01"],
)
def test_request_id_invalid(value: bytes) -> None:
    error = error_of([(b"x-request-id", value), (b"x-model", b"m")])
    assert error.code is ErrorCode.INVALID_REQUEST_ID
    assert error.status == 400
    assert error.request_id is None


def test_request_id_at_the_limit() -> None:
    value = b"~" * MAX_REQUEST_ID_CHARS
    request = parse_request(b"POST", CHAT, [(b"x-request-id", value), (b"x-model", b"m")])
    assert request.request_id == value.decode()


@pytest.mark.parametrize("name", [b"x-request-id", b"X-Request-ID", b" x-request-id"])
def test_duplicate_request_id_rejected(name: bytes) -> None:
    error = error_of([(b"x-request-id", b"a"), (name, b"a"), (b"x-model", b"m")])
    assert error.code is ErrorCode.INVALID_REQUEST_ID


def test_header_names_any_case() -> None:
    request = parse_request(
        b"POST", CHAT, [(b"X-REQUEST-ID", b"r"), (b"X-Model", b"M"), (b"X-Priority", b"7")]
    )
    assert (request.request_id, request.model, request.priority) == ("r", "M", 7)


# --- x-model -----------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [None, b"", b"   "])
def test_model_missing(value: bytes | None) -> None:
    headers = [(b"x-request-id", b"r")]
    if value is not None:
        headers.append((b"x-model", value))
    error = error_of(headers)
    assert error.code is ErrorCode.MISSING_MODEL
    assert error.status == 400
    assert error.request_id == "r"


@pytest.mark.parametrize("value", [b"a" * 257, b"m\x00", b"mod\xc3\xa9le", b"m\x1f"])
def test_model_invalid(value: bytes) -> None:
    error = error_of([(b"x-request-id", b"r"), (b"x-model", value)])
    assert error.code is ErrorCode.INVALID_MODEL
    assert error.request_id == "r"


def test_model_trimmed_and_may_hold_spaces() -> None:
    request = parse_request(b"POST", CHAT, [(b"x-request-id", b"r"), (b"x-model", b" my model ")])
    assert request.model == "my model"


def test_duplicate_model_rejected() -> None:
    error = error_of([*BASE_HEADERS, (b"X-MODEL", b"m")])
    assert error.code is ErrorCode.INVALID_MODEL
    assert error.request_id == "req-1"


# --- x-input-tokens (u64) ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"), [(b"0", 0), (b"17", 17), (b" 42 ", 42), (str(U64_MAX).encode(), U64_MAX)]
)
def test_input_tokens_valid(value: bytes, expected: int) -> None:
    assert tunnel((b"x-input-tokens", value)).input_tokens == expected


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b"-1",
        b"+1",
        b"1.0",
        b"1e3",
        b"0x10",
        b"1_000",
        b"1 2",
        str(U64_MAX + 1).encode(),
        "\u0663".encode(),
        "\uff11".encode(),
        b"abc",
    ],
)
def test_input_tokens_invalid(value: bytes) -> None:
    error = error_of([*BASE_HEADERS, (b"x-input-tokens", value)])
    assert error.code is ErrorCode.INVALID_INPUT_TOKENS
    assert error.status == 400
    assert error.request_id == "req-1"


def test_duplicate_input_tokens_rejected() -> None:
    error = error_of([*BASE_HEADERS, (b"x-input-tokens", b"1"), (b"x-input-tokens", b"1")])
    assert error.code is ErrorCode.INVALID_INPUT_TOKENS


# The template allowance, as docs/api-contract.md states it (independent of the constant).
DOCUMENTED_TEMPLATE_TOKENS = 1024


def claim_error(claimed: int, body_size: int) -> ContractError | None:
    request = tunnel((b"x-input-tokens", str(claimed).encode()))
    try:
        check_input_tokens(request, body_size)
    except ContractError as error:
        return error
    return None


@given(st.integers(0, U64_MAX), st.integers(0, 64 * 2**20))
def test_input_tokens_beyond_the_body_are_refused(claimed: int, body_size: int) -> None:
    """A prompt has at most one token per body byte plus the template allowance: a claim is
    believed up to that bound, exactly, and refused above it (never clamped)."""
    error = claim_error(claimed, body_size)
    if claimed <= body_size + DOCUMENTED_TEMPLATE_TOKENS:
        assert error is None
    else:
        assert error is not None
        assert error.code is ErrorCode.INVALID_INPUT_TOKENS and error.status == 400
        assert error.request_id == "req-1"
        assert "x-input-tokens" in error.detail and str(body_size) in error.detail


def test_the_issue_claim_on_a_small_body_is_refused() -> None:
    assert claim_error(U64_MAX, 80) is not None
    assert claim_error(80 + DOCUMENTED_TEMPLATE_TOKENS, 80) is None
    assert claim_error(80 + DOCUMENTED_TEMPLATE_TOKENS + 1, 80) is not None
    assert claim_error(DOCUMENTED_TEMPLATE_TOKENS + 1, 0) is not None  # a GET claims nothing more


def test_no_claim_is_nothing_to_check() -> None:
    check_input_tokens(tunnel(), 0)


# --- x-priority (u32) --------------------------------------------------------------------------


def test_priority_absent_is_none_not_zero() -> None:
    assert tunnel().priority is None
    assert tunnel((b"x-priority", b"0")).priority == 0


@pytest.mark.parametrize(
    ("value", "expected"),
    [(b"0", 0), (b"5", 5), (b"\t9 ", 9), (b"007", 7), (b"4294967295", U32_MAX)],
)
def test_priority_valid(value: bytes, expected: int) -> None:
    assert tunnel((b"x-priority", value)).priority == expected


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b"  ",
        b"-1",
        b"+1",
        b" 1 2",
        b"1 2",
        b"1.5",
        b"one",
        b"0x1",
        b"1_0",
        "\u0661".encode(),
        "\u0967".encode(),
        "\uff11".encode(),
        b"\xff",
        b"4294967296",
        b"99999999999999999999",
        b"1" * 40,
        str(-(2**31)).encode(),
    ],
)
def test_priority_invalid(value: bytes) -> None:
    error = error_of([*BASE_HEADERS, (b"x-priority", value)])
    assert error.code is ErrorCode.INVALID_PRIORITY
    assert error.status == 400
    assert error.request_id == "req-1"


def test_duplicate_priority_rejected_even_when_equal() -> None:
    error = error_of([*BASE_HEADERS, (b"x-priority", b"1"), (b"X-Priority", b"1")])
    assert error.code is ErrorCode.INVALID_PRIORITY


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=U32_MAX))
def test_priority_round_trips_every_u32(rank: int) -> None:
    assert tunnel((b"x-priority", str(rank).encode())).priority == rank


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=24))
def test_parse_uint_is_strict_ascii_decimal(raw: bytes) -> None:
    value = parse_uint(raw, U64_MAX)
    if value is None:
        assert not (raw and all(0x30 <= b <= 0x39 for b in raw) and int(raw) <= U64_MAX)
    else:
        assert all(0x30 <= b <= 0x39 for b in raw) and int(raw) == value


# --- optional headers --------------------------------------------------------------------------


def test_routing_key() -> None:
    assert tunnel((b"x-routing-key", b" key-1 ")).routing_key == "key-1"
    assert tunnel((b"x-routing-key", b"")).routing_key is None
    error = error_of([*BASE_HEADERS, (b"x-routing-key", b"k\x00")])
    assert error.code is ErrorCode.MALFORMED_REQUEST
    error = error_of([*BASE_HEADERS, (b"x-routing-key", b"a"), (b"x-routing-key", b"b")])
    assert error.code is ErrorCode.MALFORMED_REQUEST


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (b"250", 250),
        (b"0", 0),
        (b"", None),
        (b"-5", None),
        (b"abc", None),
        (b"1.5", None),
        (str(U64_MAX + 1).encode(), None),
    ],
)
def test_expected_queue_ms_invalid_is_none(value: bytes, expected: int | None) -> None:
    request = tunnel((b"x-stargate-expected-queue-ms", value))
    assert request.expected_queue_ms == expected


def test_expected_queue_ms_repeated_is_no_estimate() -> None:
    request = tunnel(
        (b"x-stargate-expected-queue-ms", b"1"), (b"x-stargate-expected-queue-ms", b"2")
    )
    assert request.expected_queue_ms is None


# --- trace context -----------------------------------------------------------------------------


def test_traceparent_valid_with_tracestate_joined() -> None:
    request = tunnel(
        (b"traceparent", TRACEPARENT),
        (b"tracestate", b"a=1,b=2"),
        (b"TraceState", b" c=3 "),
        (b"tracestate", b""),
    )
    assert request.trace is not None
    assert request.trace.traceparent == TRACEPARENT.decode()
    assert request.trace.tracestate == "a=1,b=2,c=3"


def test_traceparent_without_tracestate() -> None:
    request = tunnel((b"traceparent", TRACEPARENT))
    assert request.trace is not None and request.trace.tracestate is None


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b"garbage",
        b"ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # forbidden version
        b"00-00000000000000000000000000000000-b7ad6b7169203331-01",  # zero trace id
        b"00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # zero span id
        b"00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",  # upper case
        b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
        b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
    ],
)
def test_invalid_traceparent_starts_a_new_trace(value: bytes) -> None:
    request = tunnel((b"traceparent", value), (b"tracestate", b"a=1"))
    assert request.trace is None  # never a 400, and tracestate is ignored with it


def test_repeated_traceparent_is_ignored() -> None:
    assert tunnel((b"traceparent", TRACEPARENT), (b"traceparent", TRACEPARENT)).trace is None


@pytest.mark.parametrize("state", [b"a=\xff", b"a=\x01", "a=é".encode()])
def test_non_ascii_tracestate_is_not_propagated(state: bytes) -> None:
    request = tunnel(
        (b"traceparent", TRACEPARENT), (b"tracestate", b"ok=1"), (b"tracestate", state)
    )
    assert request.trace is not None
    assert request.trace.tracestate is None


# --- /health -----------------------------------------------------------------------------------


@pytest.mark.parametrize("method", [b"GET", b"HEAD"])
@pytest.mark.parametrize("target", [b"/health", b"/health?probe=1&x=y"])
def test_health_bypasses_the_contract(method: bytes, target: bytes) -> None:
    request = parse_request(method, target, [(b"x-priority", b"not a number")])
    assert isinstance(request, HealthRequest)
    assert request.target == target.decode()  # query kept
    assert request.method == method.decode()
    assert request.request_id is None


def test_health_keeps_a_usable_request_id() -> None:
    request = parse_request(b"GET", b"/health", [(b"x-request-id", b" stargate-health-1 ")])
    assert isinstance(request, HealthRequest)
    assert request.request_id == "stargate-health-1"
    unusable = parse_request(b"GET", b"/health", [(b"x-request-id", b"a b")])
    assert isinstance(unusable, HealthRequest) and unusable.request_id is None


@pytest.mark.parametrize(
    ("method", "target"),
    [(b"POST", b"/health"), (b"GET", b"/health/"), (b"GET", b"/healthz"), (b"GET", b"/v1/health")],
)
def test_only_get_head_exact_health_bypass(method: bytes, target: bytes) -> None:
    error = error_of([], method=method, target=target)
    assert error.code is ErrorCode.MISSING_REQUEST_ID


def test_health_with_non_ascii_query_is_a_contract_error() -> None:
    error = error_of([(b"x-request-id", b"h1")], method=b"GET", target=b"/health?q=\xff")
    assert error.code is ErrorCode.MALFORMED_REQUEST
    assert error.request_id == "h1"


# --- method and target -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        b"http://evil.example/v1/chat/completions",
        b"//evil.example/x",
        b"evil.example:443",
        b"*",
        b"",
        b"/a b",
        b"/caf\xc3\xa9",
        b"/a\x00",
    ],
)
def test_only_origin_form_targets(target: bytes) -> None:
    error = error_of(list(BASE_HEADERS), target=target)
    assert error.code is ErrorCode.MALFORMED_REQUEST
    assert error.status == 400
    assert error.request_id == "req-1"


@pytest.mark.parametrize("method", [b"CONNECT", b"TRACE", b"post", b"BREW", b"\xff"])
def test_unsupported_methods(method: bytes) -> None:
    error = error_of(list(BASE_HEADERS), method=method)
    assert error.code is ErrorCode.MALFORMED_REQUEST
    assert error.request_id == "req-1"


def test_target_kept_exactly_and_path_split() -> None:
    request = tunnel(target=b"/v1/completions?a=1&b=%20")
    assert request.target == "/v1/completions?a=1&b=%20"
    assert request.path == "/v1/completions"


def test_headers_kept_raw_in_order() -> None:
    extra = ((b"X-Foo", b"1"), (b"x-foo", b"2"), (b"Authorization", b"Bearer t"))
    assert tunnel(*extra).headers == (*BASE_HEADERS, *extra)


# --- fuzz: only the two results or ContractError -----------------------------------------------

_names = st.one_of(
    st.sampled_from(
        [
            b"x-request-id",
            b"X-Model",
            b"x-input-tokens",
            b"x-priority",
            b"x-routing-key",
            b"x-stargate-expected-queue-ms",
            b"traceparent",
            b"tracestate",
            b"host",
            b" x-priority ",
        ]
    ),
    st.binary(max_size=12),
)
_values = st.one_of(
    st.sampled_from([b"", b"1", b"4294967296", b"req", TRACEPARENT, b" \t", b"a=1"]),
    st.binary(max_size=40),
)


@settings(max_examples=600, deadline=None)
@given(
    method=st.one_of(st.sampled_from([b"GET", b"HEAD", b"POST", b"DELETE"]), st.binary(max_size=8)),
    target=st.one_of(
        st.sampled_from([b"/health", b"/v1/chat/completions"]),
        st.builds(
            lambda a, b: a + b, st.sampled_from([b"/health?", b"/", b""]), st.binary(max_size=20)
        ),
    ),
    headers=st.lists(st.tuples(_names, _values), max_size=10),
    base=st.booleans(),
)
def test_fuzz_parse_request_only_typed_results(method, target, headers, base) -> None:
    all_headers = [*BASE_HEADERS, *headers] if base else headers
    try:
        result = parse_request(method, target, all_headers)
    except ContractError as error:
        assert error.status == 400
        assert error.request_id is None or error.request_id.isascii()
        return
    assert isinstance(result, (TunnelRequest, HealthRequest))
    if isinstance(result, TunnelRequest):
        assert result.request_id and result.model
        assert result.priority is None or 0 <= result.priority <= U32_MAX
        if result.trace is not None and result.trace.tracestate is not None:
            result.trace.tracestate.encode("ascii")
