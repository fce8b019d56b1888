"""Header strip against the golden list (tests/golden.py), never against pylon's own tables.

Deleting any entry or rule from `pylon.core.sanitize` must fail a test here.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pylon.adapters import AdapterOptions, build_adapter
from pylon.core.http import Header
from pylon.core.plan import Planner
from pylon.core.sanitize import sanitize_request_headers, sanitize_response_headers
from tests.golden import (
    BENIGN_HEADERS,
    HOP_BY_HOP,
    PYLON_OWNED,
    REQUEST_HEADER_PREFIXES,
    REQUEST_HEADERS,
    RESPONSE_HEADER_PREFIXES,
    RESPONSE_HEADERS,
    TUNNEL_HEADERS,
    Golden,
    enforced,
    params,
)

from .helpers import TRACEPARENT, tunnel

OWS = b" \t"
SUFFIXES = ["", "golden", "a-b-c", "Policy-Class", "x_y", "0"]
KEEP: tuple[Header, ...] = ((b"accept", b"*/*"), (b"x-app-after", b"1"))


def spellings(name: bytes) -> list[bytes]:
    """Exact, upper, mixed case and surrounding whitespace: all one header to an engine."""
    mixed = bytes(c ^ 0x20 if i % 2 and 0x61 <= c <= 0x7A else c for i, c in enumerate(name))
    return [name, name.upper(), name.title(), mixed, b" " + name + b"\t", b"\t " + name.upper()]


def twin(name: bytes) -> bytes:
    return name.replace(b"-", b"_")


def normalise(name: bytes) -> bytes:
    return name.strip(OWS).lower()


def strip_all(names: Sequence[bytes]) -> tuple[tuple[Header, ...], tuple[str, ...]]:
    """Surround `names` (each sent twice: a duplicate) with benign headers and sanitize."""
    headers = [KEEP[0], *((n, b"golden") for n in names), *((n, b"dup") for n in names), KEEP[1]]
    result = sanitize_request_headers(headers)
    return result.headers, result.stripped


# --- exact names ---------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", params(REQUEST_HEADERS))
def test_golden_header_removed_and_reported(entry: Golden) -> None:
    name = entry.name.encode()
    variants = spellings(name)
    kept, stripped = strip_all(variants)
    assert kept == KEEP
    assert stripped == (entry.name,) * (2 * len(variants))


@pytest.mark.parametrize("entry", params(HOP_BY_HOP))
def test_golden_hop_by_hop_removed_without_report(entry: Golden) -> None:
    # Connection management, not a client control: `request_done.stripped` does not list it.
    kept, stripped = strip_all(spellings(entry.name.encode()))
    assert kept == KEEP
    assert stripped == ()


def _twin_candidates() -> list[Golden]:
    prefixed = [Golden(p.name + "golden-suffix", p.source, p.gap) for p in REQUEST_HEADER_PREFIXES]
    tunnel_headers = [Golden(n, "API 4.1: tunnel header twin") for n in TUNNEL_HEADERS]
    every = REQUEST_HEADERS + HOP_BY_HOP + PYLON_OWNED + tuple(tunnel_headers + prefixed)
    return [entry for entry in every if "-" in entry.name]


@pytest.mark.parametrize("entry", params(_twin_candidates()))
def test_underscore_twin_removed_and_reported(entry: Golden) -> None:
    # Some stacks read `_` as `-` (CGI, some servers): a twin is as dangerous as the original.
    name = twin(entry.name.encode())
    variants = [name, name.upper(), b" " + name + b" ", twin(entry.name.title().encode())]
    kept, stripped = strip_all(variants)
    assert kept == KEEP
    assert stripped == (name.decode(),) * (2 * len(variants))


# --- families -----------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.parametrize("entry", params(REQUEST_HEADER_PREFIXES))
def test_golden_prefix_removed_and_reported(entry: Golden, suffix: str) -> None:
    name = (entry.name + suffix).encode()
    kept, stripped = strip_all(spellings(name))
    assert kept == KEEP
    assert stripped == (name.lower().decode(),) * (2 * len(spellings(name)))


_suffix = st.text(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.!~", max_size=24
)


@settings(max_examples=200, deadline=None)
@given(
    prefix=st.sampled_from([p.name for p in enforced(REQUEST_HEADER_PREFIXES)]),
    suffix=_suffix,
    upper=st.booleans(),
)
def test_golden_prefix_with_any_suffix(prefix: str, suffix: str, upper: bool) -> None:
    name = (prefix + suffix).encode()
    name = name.upper() if upper else name
    result = sanitize_request_headers([(name, b"1"), (b"x-app-keep", b"2")])
    assert result.headers == ((b"x-app-keep", b"2"),)
    assert result.stripped == (name.lower().decode(),)


# --- hop-by-hop: names listed in Connection ------------------------------------------------------

_listed = st.text("abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12).map(
    lambda t: ("x-app-" + t).encode()
)


@settings(max_examples=100, deadline=None)
@given(names=st.lists(_listed, min_size=1, max_size=4, unique=True), upper=st.booleans())
def test_names_listed_in_connection_are_removed(names: list[bytes], upper: bool) -> None:
    # RFC 9110 7.6.1: a name listed in Connection is hop-by-hop for this message, whatever it is.
    listing = b" , ".join(n.upper() if upper else n for n in names) + b",,"
    headers = [(b"x-app-kept", b"1"), *((n, b"v") for n in names), (b"Connection", listing)]
    headers += [(b" " + n.title(), b"w") for n in names]
    result = sanitize_request_headers(headers)
    assert result.headers == ((b"x-app-kept", b"1"),)
    response = sanitize_response_headers(headers)
    assert response == [(b"x-app-kept", b"1")]


# --- pylon-owned: dropped silently, then written once by pylon ----------------------------------


@pytest.mark.parametrize("entry", params(PYLON_OWNED))
def test_pylon_owned_header_dropped_without_report(entry: Golden) -> None:
    kept, stripped = strip_all(spellings(entry.name.encode()))
    assert kept == KEEP
    assert stripped == ()


def test_planner_writes_each_owned_header_once_with_its_own_value() -> None:
    client: list[Header] = [
        (b"traceparent", TRACEPARENT),
        (b"tracestate", b"a=1"),
        (b"TraceState", b"b=2"),
    ]
    for name in ("host", "content-length", "expect"):
        client += [(spelling, b"golden") for spelling in spellings(name.encode())]
    client += [(twin(e.name.encode()), b"golden") for e in PYLON_OWNED if "-" in e.name]
    plan = Planner(build_adapter("dynamo", AdapterOptions(3600), derive=True)).plan(
        tunnel(*client), b'{"model":"m"}'
    )

    def values(name: bytes) -> list[bytes]:
        return [v for n, v in plan.headers if normalise(n) == name]

    # host and content-length are the transport's own (API 3); expect never goes upstream.
    assert values(b"host") == values(b"content-length") == values(b"expect") == []
    assert values(b"x-request-id") == [b"req-1"]
    assert values(b"traceparent") == [TRACEPARENT]
    assert values(b"tracestate") == [b"a=1,b=2"]
    assert not [n for n, _ in plan.headers if b"_" in n]
    assert all(b"golden" not in v for _, v in plan.headers)


# --- everything at once, with benign headers ----------------------------------------------------

_GOLDEN_NAMES = [e.name.encode() for e in enforced(REQUEST_HEADERS + HOP_BY_HOP)]
_OWNED_NAMES = [e.name.encode() for e in PYLON_OWNED]
_HOP_BY_HOP_NAMES = {e.name.encode() for e in HOP_BY_HOP}  # removed, never reported
_token = st.text("abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=10)
_value = st.binary(max_size=16).filter(lambda v: b"\r" not in v and b"\n" not in v)


@st.composite
def spelled(draw: st.DrawFn, name: bytes) -> bytes:
    flips = draw(st.lists(st.booleans(), min_size=len(name), max_size=len(name)))
    name = bytes(
        c ^ 0x20 if f and 0x61 <= c <= 0x7A else c for c, f in zip(name, flips, strict=True)
    )
    return draw(st.sampled_from([b"", b" ", b"\t"])) + name + draw(st.sampled_from([b"", b" "]))


@st.composite
def golden_name(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["exact", "prefix", "twin"]))
    if kind == "prefix":
        prefix = draw(st.sampled_from(enforced(REQUEST_HEADER_PREFIXES))).name
        base = (prefix + draw(_token)).encode()
    else:
        base = draw(st.sampled_from(_GOLDEN_NAMES))
        base = twin(base) if kind == "twin" else base
    return draw(spelled(base))


@st.composite
def benign_name(draw: st.DrawFn) -> bytes:
    if draw(st.booleans()):
        return draw(spelled(draw(st.sampled_from(BENIGN_HEADERS)).encode()))
    return b"x-app-" + draw(_token).encode()


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("golden"), golden_name(), _value),
            st.tuples(st.just("owned"), st.sampled_from(_OWNED_NAMES).flatmap(spelled), _value),
            st.tuples(st.just("benign"), benign_name(), _value),
        ),
        max_size=40,
    )
)
def test_golden_mixed_with_benign(mix: list[tuple[str, bytes, bytes]]) -> None:
    # A `connection` header lists tokens; make sure none of them names a benign header here.
    mix = [(k, n, b"golden" if normalise(n) == b"connection" else v) for k, n, v in mix]
    result = sanitize_request_headers([(n, v) for _, n, v in mix])
    assert list(result.headers) == [(n, v) for kind, n, v in mix if kind == "benign"]
    assert list(result.stripped) == [
        normalise(n).decode()
        for kind, n, _ in mix
        if kind == "golden" and normalise(n) not in _HOP_BY_HOP_NAMES
    ]


# --- response side (engine -> gateway) ----------------------------------------------------------


@pytest.mark.parametrize(
    "entry",
    params(
        RESPONSE_HEADERS
        + HOP_BY_HOP
        + tuple(
            Golden(p.name + s, p.source, p.gap) for p in RESPONSE_HEADER_PREFIXES for s in SUFFIXES
        )
    ),
)
def test_golden_response_header_removed(entry: Golden) -> None:
    variants = spellings(entry.name.encode())
    headers = [(b"content-type", b"text/event-stream"), *((v, b"true") for v in variants)]
    headers.append((b"x-engine-thing", b"kept"))
    assert sanitize_response_headers(headers) == [
        (b"content-type", b"text/event-stream"),
        (b"x-engine-thing", b"kept"),
    ]


def test_configured_engine_retry_header_removed_from_responses() -> None:
    headers = [(b"X-Engine-Retryable", b"true"), (b" x-engine-retryable", b"true"), KEEP[0]]
    assert sanitize_response_headers(headers, frozenset({b"x-engine-retryable"})) == [KEEP[0]]
