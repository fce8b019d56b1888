"""Header strip properties (style P7): no denied name survives; benign ones survive unchanged."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pylon.core.sanitize import (
    DENIED_REQUEST_HEADER_PREFIXES,
    DENIED_REQUEST_HEADERS,
    DENIED_RESPONSE_HEADER_PREFIXES,
    HOP_BY_HOP,
    PYLON_OWNED_REQUEST_HEADERS,
    header_denied_reason,
    sanitize_request_headers,
    sanitize_response_headers,
)

OWS = b" \t"
DENIED_EXACT = sorted(DENIED_REQUEST_HEADERS)
DENIED_PREFIXES = [prefix for prefix, _ in DENIED_REQUEST_HEADER_PREFIXES]
BENIGN_NAMES = [
    b"authorization",
    b"content-type",
    b"accept",
    b"user-agent",
    b"x-model",
    b"x-priority",
    b"x-input-tokens",
    b"x-routing-key",
    b"x-correlation-id",
    b"accept-encoding",
    b"x-dynamo",
    b"x-stargate",
    b"dynamo-x",
    b"x-override",
    b"x-smg",
    b"x-epp",
]


def normalise(name: bytes) -> bytes:
    return name.strip(OWS).lower()


def is_benign(name: bytes) -> bool:
    n = normalise(name)
    return (
        header_denied_reason(n) is None
        and n not in PYLON_OWNED_REQUEST_HEADERS
        and n not in HOP_BY_HOP
    )


@st.composite
def random_case(draw, name: bytes) -> bytes:
    flips = draw(st.lists(st.booleans(), min_size=len(name), max_size=len(name)))
    return b"".join(
        bytes([c]).upper() if f else bytes([c]) for c, f in zip(name, flips, strict=True)
    )


@st.composite
def spoofed_name(draw) -> bytes:
    kind = draw(st.sampled_from(["exact", "prefix", "hop"]))
    if kind == "exact":
        base = draw(st.sampled_from(DENIED_EXACT))
    elif kind == "prefix":
        suffix = draw(st.text("abcdefghijklmnopqrstuvwxyz0123456789-_", max_size=16))
        base = draw(st.sampled_from(DENIED_PREFIXES)) + suffix.encode()
    else:
        base = draw(st.sampled_from(sorted(HOP_BY_HOP)))
    name = draw(random_case(base))
    lead = draw(st.sampled_from([b"", b" ", b"\t", b" \t"]))
    trail = draw(st.sampled_from([b"", b" ", b"\t"]))
    return lead + name + trail


_token = st.text("abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12).map(str.encode)
_value = st.binary(max_size=24).filter(lambda v: b"\r" not in v and b"\n" not in v)


@st.composite
def header_mix(draw):
    """(headers, listed-in-Connection names) with spoofs, benign headers and Connection tokens."""
    benign_name = st.one_of(
        st.sampled_from(BENIGN_NAMES).flatmap(random_case), _token.map(lambda t: b"x-app-" + t)
    )
    spoof = st.tuples(spoofed_name(), _value)
    benign = st.tuples(benign_name, _value)
    headers = draw(st.lists(st.one_of(spoof, spoof, benign), max_size=30))
    # Spoofs repeated, to exercise duplicates.
    if headers and draw(st.booleans()):
        headers += draw(st.lists(st.sampled_from(headers), max_size=5))
    listed = draw(st.lists(_token.map(lambda t: b"x-hop-" + t), max_size=3))
    if listed:
        tokens = b", ".join(draw(random_case(t)) for t in listed)
        headers.insert(draw(st.integers(0, len(headers))), (b"Connection", tokens))
        for token in listed:
            headers.insert(draw(st.integers(0, len(headers))), (token, b"v"))
    return headers, {t.lower() for t in listed}


@settings(max_examples=300, deadline=None)
@given(header_mix())
def test_no_denied_header_survives_and_benign_ones_do(mix) -> None:
    headers, listed = mix
    result = sanitize_request_headers(headers)
    for name, _ in result.headers:
        n = normalise(name)
        assert header_denied_reason(n) is None, n
        assert n not in HOP_BY_HOP and n not in listed
        assert n not in PYLON_OWNED_REQUEST_HEADERS
    expected = [(n, v) for n, v in headers if is_benign(n) and normalise(n) not in listed]
    assert list(result.headers) == expected  # in order, names and values untouched


@settings(max_examples=200, deadline=None)
@given(header_mix())
def test_sanitize_is_idempotent(mix) -> None:
    once = sanitize_request_headers(mix[0]).headers
    assert sanitize_request_headers(once).headers == once


@pytest.mark.parametrize("name", DENIED_EXACT)
def test_every_denied_exact_name_is_stripped(name: bytes) -> None:
    variants = [name, name.upper(), b" " + name.title() + b"\t"]
    result = sanitize_request_headers([(v, b"1") for v in variants] + [(b"accept", b"*/*")])
    assert result.headers == ((b"accept", b"*/*"),)
    assert result.stripped == (name.decode(),) * 3


@pytest.mark.parametrize("prefix", DENIED_PREFIXES)
def test_every_denied_prefix_is_stripped(prefix: bytes) -> None:
    names = [prefix, prefix + b"anything", (prefix + b"x-y-z").upper()]
    result = sanitize_request_headers([(n, b"1") for n in names])
    assert result.headers == ()
    assert len(result.stripped) == 3


def test_pylon_owned_headers_dropped_silently() -> None:
    headers = [
        (b"Host", b"evil"),
        (b"Content-Length", b"5"),
        (b"X-Request-Id", b"r"),
        (b"traceparent", b"x"),
        (b"tracestate", b"y"),
        (b"accept", b"a"),
    ]
    result = sanitize_request_headers(headers)
    assert result.headers == ((b"accept", b"a"),)
    assert result.stripped == ()


def test_connection_listed_names_are_hop_by_hop() -> None:
    headers = [
        (b"Connection", b"keep-alive, X-Secret ,,"),
        (b"x-secret", b"1"),
        (b"X-SECRET", b"2"),
        (b"x-other", b"3"),
        (b"Keep-Alive", b"timeout=5"),
    ]
    result = sanitize_request_headers(headers)
    assert result.headers == ((b"x-other", b"3"),)
    assert result.stripped == ()  # connection management, not client controls


def test_denied_names_listed_in_connection_are_still_reported() -> None:
    headers = [
        (b"Connection", b"x-dynamo-worker-instance-id, x-app"),
        (b"x-dynamo-worker-instance-id", b"7"),
        (b"x-app", b"1"),
        (b"transfer_encoding", b"chunked"),  # an underscore twin is a client's doing: reported
    ]
    result = sanitize_request_headers(headers)
    assert result.headers == ()
    assert result.stripped == ("x-dynamo-worker-instance-id", "transfer_encoding")


def test_contract_headers_other_than_owned_are_forwarded() -> None:
    headers = [
        (b"x-model", b"m"),
        (b"x-input-tokens", b"3"),
        (b"x-priority", b"1"),
        (b"x-routing-key", b"k"),
    ]
    assert sanitize_request_headers(headers).headers == tuple(headers)


def test_expected_queue_ms_never_reaches_the_engine() -> None:
    result = sanitize_request_headers([(b"X-Stargate-Expected-Queue-Ms", b"5")])
    assert result.headers == ()


def test_response_headers() -> None:
    headers = [
        (b"Content-Type", b"text/event-stream"),
        (b"Content-Length", b"10"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Connection", b"x-internal"),
        (b"X-Internal", b"1"),
        (b"X-Stargate-Retryable", b"true"),
        (b"x-stargate-retry-after-ms", b"1"),
        (b"X-Stargate-Upstream-Retryable", b"true"),
        (b"x-engine-thing", b"kept"),
    ]
    kept = sanitize_response_headers(headers, frozenset({b"x-engine-thing"}))
    assert kept == [(b"content-type", b"text/event-stream")]  # names as h2 and h3 frame them
    kept = sanitize_response_headers(headers)
    assert kept == [(b"content-type", b"text/event-stream"), (b"x-engine-thing", b"kept")]
    assert all(not n.lower().startswith(DENIED_RESPONSE_HEADER_PREFIXES) for n, _ in kept)


@given(
    name=st.sampled_from(
        [n.decode() for n in DENIED_REQUEST_HEADERS]
        + [
            "x-dynamo-request-priority",
            "x-stargate-retryable",
            "x-priority",
            "x-request-id",
            "x-model",
            "host",
            "transfer-encoding",
        ]
    ),
    upper=st.booleans(),
)
def test_underscore_twins_are_stripped(name: str, upper: bool) -> None:
    twin = name.replace("-", "_")
    twin = twin.upper() if upper else twin
    out = sanitize_request_headers([(twin.encode(), b"1"), (b"x_benign_name", b"2")])
    assert out.headers == ((b"x_benign_name", b"2"),)
