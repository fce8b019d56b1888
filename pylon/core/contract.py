"""The tunnel contract: raw request head in, one frozen `TunnelRequest` (or `HealthRequest`) out.

This is the only place a tunnel header is read. It is pure: no I/O, no clock, no settings. Header
names arrive as raw bytes in any letter case; values as raw bytes, already stripped of the
surrounding optional whitespace by the HTTP parser (we strip again, so other transports need not).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from urllib.parse import unquote

from pylon.core.errors import ContractError, ErrorCode, LimitError
from pylon.core.http import OWS, Header, Headers, field_names
from pylon.core.values import static_frozen

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
MAX_REQUEST_ID_CHARS = 256
MAX_MODEL_CHARS = 256
HEALTH_PATH = b"/health"
# Tokens a prompt may have beyond one per body byte (`check_input_tokens`): what an engine's chat
# template adds around the messages (role markers, special tokens, a default system prompt).
TEMPLATE_TOKENS = 1024

# Visible ASCII only: ids end up in logs, metrics labels and engine request ids.
_VISIBLE_ASCII = re.compile(rb"[\x21-\x7e]+")
# Model names may contain spaces (some catalogues do) but never controls or non-ASCII bytes.
_PRINTABLE_ASCII = re.compile(rb"[\x20-\x7e]+")
# Read on every request: globals, as on Python 3.11 `ErrorCode.X` goes through
# EnumType.__getattr__ (ten times a global's cost).
_INVALID_REQUEST_ID, _INVALID_MODEL = ErrorCode.INVALID_REQUEST_ID, ErrorCode.INVALID_MODEL
_TRACEPARENT = re.compile(rb"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_ALLOWED_METHODS = frozenset({b"GET", b"HEAD", b"POST", b"PUT", b"PATCH", b"DELETE", b"OPTIONS"})

# The tunnel headers the contract reads; a repeated one is ambiguous and rejected.
REQUEST_ID = b"x-request-id"
MODEL = b"x-model"
INPUT_TOKENS = b"x-input-tokens"
PRIORITY = b"x-priority"
ROUTING_KEY = b"x-routing-key"
EXPECTED_QUEUE_MS = b"x-stargate-expected-queue-ms"
TRACEPARENT = b"traceparent"
TRACESTATE = b"tracestate"
_CONTRACT_HEADERS = frozenset(
    {REQUEST_ID, MODEL, INPUT_TOKENS, PRIORITY, ROUTING_KEY, EXPECTED_QUEUE_MS, TRACEPARENT}
)


@static_frozen  # one per traced request: no run-time freeze (see `pylon.core.values`)
class TraceContext:
    traceparent: str
    tracestate: str | None


# One per request: frozen for mypy, no run-time freeze (see `pylon.core.values`). `parse_request`
# builds it positionally, in this field order (tests/unit/test_field_order.py pins it).
@static_frozen
class TunnelRequest:
    """A validated inference request as the gateway described it. Parsed once, never re-read."""

    method: str
    target: str  # origin-form path and query, exactly as received
    path: str  # the route as the engine will see it: the path, percent-decoded (see `route_of`)
    request_id: str
    model: str
    input_tokens: int | None
    priority: int | None  # u32 rank, lower = more urgent; None = unconfigured (not 0)
    routing_key: str | None
    expected_queue_ms: int | None
    trace: TraceContext | None
    headers: tuple[Header, ...]  # the raw header pairs, order, case and duplicates kept
    names: tuple[bytes, ...]  # the names of `headers`, lower-cased and stripped, in order


@static_frozen  # no run-time freeze (see `pylon.core.values`)
class HealthRequest:
    """`GET /health`: bypasses the contract and goes to the engine's health path."""

    method: str
    target: str
    headers: tuple[Header, ...]
    names: tuple[bytes, ...]  # the names of `headers`, lower-cased and stripped, in order
    request_id: str | None  # for logs only, when the caller sent a usable one


HEADER_OVERHEAD = 4  # bytes counted per field, as on an HTTP/1.1 wire (": " and CRLF)


def check_header_block(fields: Headers, max_headers: int, max_header_bytes: int) -> None:
    """The header limits every transport applies to a decoded header block, the same way.

    Counts regular fields (as HTTP/1.1 has no pseudo-headers) and the bytes of all fields,
    each with `HEADER_OVERHEAD`. Raises `LimitError` (431 or a stream reset, per transport).
    """
    count = sum(1 for name, _ in fields if name[:1] != b":")
    if count > max_headers:
        raise LimitError(f"more than {max_headers} header fields", code=ErrorCode.HEADERS_TOO_LARGE)
    size = sum(len(name) + len(value) for name, value in fields) + HEADER_OVERHEAD * len(fields)
    if size > max_header_bytes:
        raise LimitError(
            f"request head exceeds {max_header_bytes} bytes", code=ErrorCode.HEADERS_TOO_LARGE
        )


def is_health_target(method: bytes, target: bytes) -> bool:
    return method in (b"GET", b"HEAD") and target.split(b"?", 1)[0] == HEALTH_PATH


def parse_request(
    method: bytes, target: bytes, headers: Headers, names: Sequence[bytes] | None = None
) -> TunnelRequest | HealthRequest:
    """Turn a raw request head into the one typed value the rest of pylon uses.

    `names`: the field names already lower-cased, one per header (`RequestHead.names`); None
    when the caller has not computed them. Raises `ContractError` carrying the request id
    whenever one could be read.
    """
    lowered = tuple(field_names(headers) if names is None else names)
    values = _collect_contract_headers(headers, lowered)
    if is_health_target(method, target):
        if not _VISIBLE_ASCII.fullmatch(target):
            # The query is kept for the engine, so it must be as clean as any other target.
            raise ContractError(
                "request target must be an origin-form path",
                code=ErrorCode.MALFORMED_REQUEST,
                request_id=_optional_request_id(values),
            )
        return HealthRequest(
            method=method.decode("ascii"),
            target=target.decode("ascii"),
            headers=tuple(headers),
            names=lowered,
            request_id=_optional_request_id(values),
        )
    request_id = _parse_request_id(values)
    try:
        return _parse_tunnel(method, target, headers, lowered, values, request_id)
    except ContractError as error:
        error.request_id = request_id
        raise


def _parse_tunnel(
    method: bytes,
    target: bytes,
    headers: Headers,
    names: tuple[bytes, ...],
    values: dict[bytes, list[bytes]],
    request_id: str,
) -> TunnelRequest:
    _check_method(method)
    text, path = _checked_route(target)
    model = _parse_model(values)
    input_tokens, priority, routing_key, expected_queue_ms, trace = _parse_optional(
        headers, names, values
    )
    # Positional, in field order (test_field_order.py pins it): keywords build a dict on 3.11.
    return TunnelRequest(
        method.decode("ascii"),
        text,  # target
        path,  # path (the route)
        request_id,  # request_id
        model,  # model
        input_tokens,
        priority,
        routing_key,
        expected_queue_ms,
        trace,
        tuple(headers),
        names,
    )


_REQUIRED_HEADERS = frozenset({REQUEST_ID, MODEL})
_NO_OPTIONAL_HEADERS: tuple[None, None, None, None, None] = (None, None, None, None, None)


def _parse_optional(
    headers: Headers, names: Sequence[bytes], values: dict[bytes, list[bytes]]
) -> tuple[int | None, int | None, str | None, int | None, TraceContext | None]:
    """input tokens, priority, routing key, expected queue time and trace context, in the order
    their errors are reported; each None when its header is absent."""
    if values.keys() <= _REQUIRED_HEADERS:
        return _NO_OPTIONAL_HEADERS  # the common head: none of them was sent
    return (
        _parse_uint(values, INPUT_TOKENS, U64_MAX, ErrorCode.INVALID_INPUT_TOKENS),
        _parse_uint(values, PRIORITY, U32_MAX, ErrorCode.INVALID_PRIORITY),
        _parse_routing_key(values),
        _parse_expected_queue_ms(values),
        _parse_trace(headers, names, values),
    )


def _collect_contract_headers(headers: Headers, names: Sequence[bytes]) -> dict[bytes, list[bytes]]:
    values: dict[bytes, list[bytes]] = {}
    for index, name in enumerate(names):
        if name in _CONTRACT_HEADERS:
            values.setdefault(name, []).append(headers[index][1].strip(OWS))
    return values


def _single(values: dict[bytes, list[bytes]], name: bytes, code: ErrorCode) -> bytes | None:
    found = values.get(name)
    if found is None:
        return None
    if len(found) > 1:
        raise ContractError(f"{name.decode()} header must appear at most once", code=code)
    return found[0]


def request_id_of(headers: Headers) -> str | None:
    """The request's valid `x-request-id`, if it has one: for answering a head that failed
    before the contract ran (malformed framing), so the problem and the log still name it."""
    return _optional_request_id(_collect_contract_headers(headers, field_names(headers)))


def _optional_request_id(values: dict[bytes, list[bytes]]) -> str | None:
    try:
        return _parse_request_id(values)
    except ContractError:
        return None


def _parse_request_id(values: dict[bytes, list[bytes]]) -> str:
    found = values.get(REQUEST_ID)
    # One value (the common case) needs no helper; `_single` says what is wrong with the rest.
    raw = found[0] if found is not None and len(found) == 1 else None
    if raw is None:
        raw = _single(values, REQUEST_ID, _INVALID_REQUEST_ID)
    if raw is None or not raw:
        raise ContractError(
            "missing required x-request-id header", code=ErrorCode.MISSING_REQUEST_ID
        )
    if len(raw) > MAX_REQUEST_ID_CHARS or not _VISIBLE_ASCII.fullmatch(raw):
        raise ContractError(
            f"x-request-id must be 1-{MAX_REQUEST_ID_CHARS} visible ASCII characters",
            code=ErrorCode.INVALID_REQUEST_ID,
        )
    return raw.decode("ascii")


# `x-model` values that passed, with their text: a node serves a handful of models and every
# request names one. Bounded: past the limit, new names are checked every time (still correct).
_CHECKED_MODELS: dict[bytes, str] = {}
_CHECKED_MODELS_LIMIT = 256


def _parse_model(values: dict[bytes, list[bytes]]) -> str:
    found = values.get(MODEL)
    if found is not None and len(found) == 1:
        known = _CHECKED_MODELS.get(found[0])
        if known is not None:
            return known
    raw = _single(values, MODEL, _INVALID_MODEL)
    if raw is None or not raw:
        raise ContractError("missing required x-model header", code=ErrorCode.MISSING_MODEL)
    if len(raw) > MAX_MODEL_CHARS or not _PRINTABLE_ASCII.fullmatch(raw):
        raise ContractError(
            f"x-model must be 1-{MAX_MODEL_CHARS} printable ASCII characters",
            code=ErrorCode.INVALID_MODEL,
        )
    model = raw.decode("ascii")
    if len(_CHECKED_MODELS) < _CHECKED_MODELS_LIMIT:
        _CHECKED_MODELS[raw] = model
    return model


def parse_uint(raw: bytes, maximum: int) -> int | None:
    """Strict unsigned decimal: ASCII digits only (no sign, no '_', no Unicode digits)."""
    if not raw or len(raw) > 20 or not raw.isdigit():
        return None
    value = int(raw)
    return value if value <= maximum else None


def _parse_uint(
    values: dict[bytes, list[bytes]], name: bytes, maximum: int, code: ErrorCode
) -> int | None:
    raw = _single(values, name, code)
    if raw is None:
        return None
    value = parse_uint(raw, maximum)
    if value is None:
        raise ContractError(
            f"invalid {name.decode()} header: expected an unsigned integer <= {maximum}", code=code
        )
    return value


def check_input_tokens(request: TunnelRequest, body_size: int) -> None:
    """Refuse an `x-input-tokens` the request cannot hold: every tokenizer pylon serves spends
    at least one byte of text per prompt token (JSON only adds bytes), so a prompt has at most
    `body_size + TEMPLATE_TOKENS` tokens. The claim feeds the shared queue table and throughput
    estimate (`pylon.core.queue`): believed past that, one small request would stand for any
    amount of work. Refused, not clamped: a count pylon changed would mean something else."""
    claimed = request.input_tokens
    if claimed is not None and claimed > body_size + TEMPLATE_TOKENS:
        raise ContractError(
            f"invalid x-input-tokens header: {claimed} is more than a {body_size}-byte body can "
            f"hold (at most {body_size + TEMPLATE_TOKENS}: one token per byte plus "
            f"{TEMPLATE_TOKENS} for the chat template)",
            code=ErrorCode.INVALID_INPUT_TOKENS,
            request_id=request.request_id,
        )


def _parse_routing_key(values: dict[bytes, list[bytes]]) -> str | None:
    raw = _single(values, ROUTING_KEY, ErrorCode.MALFORMED_REQUEST)
    if not raw:
        return None
    if not _PRINTABLE_ASCII.fullmatch(raw):
        raise ContractError(
            "x-routing-key must be printable ASCII", code=ErrorCode.MALFORMED_REQUEST
        )
    return raw.decode("ascii")


def _parse_expected_queue_ms(values: dict[bytes, list[bytes]]) -> int | None:
    # An estimate, not an instruction: anything unusable means "no estimate".
    found = values.get(EXPECTED_QUEUE_MS)
    if not found or len(found) > 1:
        return None
    return parse_uint(found[0], U64_MAX)


def _parse_trace(
    headers: Headers, names: Sequence[bytes], values: dict[bytes, list[bytes]]
) -> TraceContext | None:
    # W3C trace context: an invalid traceparent means "start a new trace", never a 400, and a
    # tracestate without a valid traceparent must be ignored.
    found = values.get(TRACEPARENT)
    if not found or len(found) > 1:
        return None
    match = _TRACEPARENT.fullmatch(found[0])
    if match is None or match.group(1) == b"ff":
        return None
    if match.group(2) == b"0" * 32 or match.group(3) == b"0" * 16:
        return None
    states = [
        value.strip(OWS)
        for name, (_, value) in zip(names, headers, strict=True)
        if name == TRACESTATE and value.strip(OWS)
    ]
    # Repeated tracestate headers are one list, joined with commas (W3C 3.3.1.1). tracestate is
    # printable ASCII; anything else is not propagated at all (pylon re-sends it as a header).
    if not all(_PRINTABLE_ASCII.fullmatch(state) for state in states):
        states = []
    tracestate = b",".join(states).decode("ascii") if states else None
    return TraceContext(traceparent=found[0].decode("ascii"), tracestate=tracestate)


def route_of(target: str) -> str:
    """The path of an (already checked) origin-form target, percent-decoded as engines decode it
    before routing: pylon's view of the route is then the engine's, however it is spelled."""
    path = target.split("?", 1)[0]
    return unquote(path) if "%" in path else path


# What the engines' routers would read differently from the bytes (RFC 3986 5.2.4, 6.2.2):
# a fragment, dot segments, empty segments, a backslash, and encodings that decode to a path
# separator or a control character. Refused rather than normalised: pylon forwards the client's
# bytes unchanged, so the only safe target is one every engine reads the same way.
_AMBIGUOUS_PATH = re.compile(
    rb"//|\\|(?:^|/)\.{1,2}(?:/|$)|%(?:2[fF]|5[cC]|[01][0-9a-fA-F]|7[fF]|2[eE])|%(?![0-9a-fA-F]{2})"
)


# Targets already checked, with their text and route: a gateway sends a handful of distinct
# targets, so the scans below run once per target, not once per request. Only targets that
# passed are kept, and only short ones, up to a bound (then the checks simply run every time).
_ROUTES: dict[bytes, tuple[str, str]] = {}
_ROUTES_KEPT = 512
_ROUTE_KEPT_BYTES = 256


def _checked_route(target: bytes) -> tuple[str, str]:
    """A target that passes `_check_target`, as (text, route); raises `ContractError`."""
    known = _ROUTES.get(target)
    if known is not None:
        return known
    _check_target(target)
    text = target.decode("ascii")
    route = (text, route_of(text))
    if len(_ROUTES) < _ROUTES_KEPT and len(target) <= _ROUTE_KEPT_BYTES:
        _ROUTES[target] = route
    return route


def _check_method(method: bytes) -> None:
    if method not in _ALLOWED_METHODS:
        raise ContractError(
            f"method {method.decode('ascii', 'replace')} is not supported",
            code=ErrorCode.MALFORMED_REQUEST,
        )


def _check_target(target: bytes) -> None:
    # Only origin-form: an absolute-form or authority target would let a client pick the host.
    if (
        not target.startswith(b"/")
        or target.startswith(b"//")
        or not _VISIBLE_ASCII.fullmatch(target)
    ):
        raise ContractError(
            "request target must be an origin-form path", code=ErrorCode.MALFORMED_REQUEST
        )
    # A fragment is never part of a request target (RFC 9112 3.2); engines drop it.
    if target.find(b"#") >= 0 or _AMBIGUOUS_PATH.search(target.split(b"?", 1)[0]):
        raise ContractError(
            "request path must not contain a fragment, dot or empty segments, a backslash, or "
            "percent-encoded separators, dots or controls",
            code=ErrorCode.MALFORMED_REQUEST,
        )
