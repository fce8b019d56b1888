"""Property tests for the one head normaliser (pure functions over bytes): whatever a peer sends,
the answer is a well-formed `RequestHead` or a typed rejection, never a crash, and nothing that
could break the HTTP/1.1 request line or a header line toward the engine gets through."""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pylon.core.contract import parse_request
from pylon.core.errors import ContractError, ErrorCode, PylonError
from pylon.core.head import declared_length, http1_head, pseudo_head
from pylon.core.http import wire_unsafe

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_UNSAFE_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
PSEUDO = [b":method", b":scheme", b":path", b":authority", b":protocol", b":status", b":x"]
REGULAR = [
    b"x-request-id",
    b"x-model",
    b"host",
    b"content-length",
    b"te",
    b"connection",
    b"cookie",
    b"X-Upper",
    b"x bad",
    b"x-priority",
    b"transfer-encoding",
]
VALUES = [
    b"GET",
    b"POST",
    b"GET /x",
    b"/v1/chat/completions",
    b"/a b HTTP/1.1",
    b"*",
    b"http",
    b"https",
    b"localhost",
    b"trailers",
    b"5",
    b"-1",
    b"",
    b" lead",
    b"a\r\nb",
    b"a\x01b",
    b"\x00",
    b"mock-model",
    b"r-1",
    b"/\x7f",
]

names = st.one_of(st.sampled_from(PSEUDO + REGULAR), st.binary(max_size=12))
values = st.one_of(st.sampled_from(VALUES), st.binary(max_size=24))
fields = st.lists(st.tuples(names, values), max_size=12)
# A well-formed HTTP/2 request head that the contract accepts, then random regular fields: random
# fields alone are (nearly) never a valid head, so the properties would only see refusals.
VALID_HEAD = [
    (b":method", b"POST"),
    (b":scheme", b"https"),
    (b":path", b"/v1/chat/completions"),
    (b":authority", b"gw"),
    (b"x-request-id", b"r-1"),
    (b"x-model", b"mock-model"),
]
regular = st.one_of(st.sampled_from(REGULAR), st.binary(max_size=12))
heads = st.one_of(
    fields,
    st.lists(st.tuples(regular, values), max_size=6).map(lambda extra: [*VALID_HEAD, *extra]),
)


def _assert_wire_safe(method: bytes, target: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    assert _TOKEN.fullmatch(method)
    assert target.startswith(b"/") and not re.search(rb"[\x00-\x20\x7f]", target)
    for name, value in headers:
        assert _TOKEN.fullmatch(name), name
        assert not _UNSAFE_VALUE.search(value), value


@settings(max_examples=500, deadline=None)
@given(heads)
def test_pseudo_head_is_well_formed_or_a_typed_error(head: list[tuple[bytes, bytes]]) -> None:
    try:
        result = pseudo_head(head)
    except ContractError as error:
        assert error.code is ErrorCode.MALFORMED_REQUEST
        return
    _assert_wire_safe(result.method, result.target, result.headers)
    for name, _ in result.headers:
        assert name == name.lower()
        assert name not in (b"connection", b"transfer-encoding", b"keep-alive", b"upgrade")
    assert sum(1 for name, _ in result.headers if name == b"cookie") <= 1
    assert any(name == b"host" for name, _ in result.headers)


@settings(max_examples=400, deadline=None)
@given(heads)
def test_accepted_heads_reach_the_contract_or_a_typed_error(
    head: list[tuple[bytes, bytes]],
) -> None:
    try:
        mapped = pseudo_head(head)
        request = parse_request(mapped.method, mapped.target, mapped.headers)
    except PylonError:
        return
    # Whatever is accepted is safe on an HTTP/1.1 request line.
    assert " " not in request.target and "\r" not in request.target
    assert request.method.isalpha()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.binary(max_size=10), st.binary(max_size=20)), max_size=8))
@example([(b"a\nb", b"v")])  # two tokens around an LF: one name that is none (once missed)
@example([(b"x-a", b"v"), (b"", b"w")])
@example([(b"x-a", b"v\x7f"), (b"x-b", b"\tw\x80")])
def test_wire_unsafe_agrees_with_a_field_by_field_check(
    headers: list[tuple[bytes, bytes]],
) -> None:
    by_field = all(
        _TOKEN.fullmatch(name) and not _UNSAFE_VALUE.search(value) for name, value in headers
    )
    assert (wire_unsafe(headers) is None) == by_field


def _h2(*extra: tuple[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    return [
        (b":method", b"POST"),
        (b":scheme", b"https"),
        (b":path", b"/v1/x?y=1"),
        (b":authority", b"gw"),
        (b"x-request-id", b"r"),
        *extra,
    ]


def test_authority_becomes_host() -> None:
    result = pseudo_head(_h2())
    assert (result.method, result.target) == (b"POST", b"/v1/x?y=1")
    assert (b"host", b"gw") in result.headers


def test_cookie_crumbs_are_joined_in_order() -> None:
    result = pseudo_head(_h2((b"cookie", b"a=1"), (b"x-b", b"2"), (b"cookie", b"c=3")))
    assert [v for n, v in result.headers if n == b"cookie"] == [b"a=1; c=3"]
    assert [n for n, _ in result.headers].index(b"cookie") < [n for n, _ in result.headers].index(
        b"x-b"
    )


@pytest.mark.parametrize(
    "extra",
    [
        (b"x-a", b"a\x01b"),
        (b"x-a", b"a\x7f"),
        (b"x-a", b"a\nb"),
        (b"x-a", b" a"),
        (b":protocol", b"websocket"),
    ],
)
def test_control_characters_and_extended_connect_are_malformed(
    extra: tuple[bytes, bytes],
) -> None:
    with pytest.raises(ContractError):
        pseudo_head(_h2(extra))


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (b":method", b"GET /x"),
        (b":method", b"GE\x00T"),
        (b":method", b""),
        (b":path", b"/a b"),
        (b":path", b"/a\r\nhost: evil"),
        (b":path", b"http://evil.example/x"),
        (b":path", b"*"),
        (b":path", b""),
        (b":scheme", b"ht tp"),
        (b":scheme", b"1http"),
    ],
)
def test_each_pseudo_header_is_checked_by_the_head_itself(name: bytes, value: bytes) -> None:
    """Each rule holds in `pseudo_head` on its own, not only because the contract would refuse
    the request later: a `RequestHead` is what every later layer takes as well-formed."""
    fields = [(n, value if n == name else v) for n, v in _h2()]
    with pytest.raises(ContractError) as refused:
        pseudo_head(fields)
    assert refused.value.code is ErrorCode.MALFORMED_REQUEST


def test_scheme_with_authority_needs_authority_or_host() -> None:
    fields = [f for f in _h2() if f[0] != b":authority"]
    with pytest.raises(ContractError):
        pseudo_head(fields)
    assert pseudo_head([*fields, (b"host", b"gw")]).headers[-1] == (b"host", b"gw")


def test_http1_head_checks_host_and_wire_safety() -> None:
    ok = http1_head(b"POST", b"/v1/x", [(b"Host", b"a"), (b"X-A", b"b\tc")], http10=False)
    assert ok.headers == [(b"Host", b"a"), (b"X-A", b"b\tc")]
    for bad in (
        [],
        [(b"Host", b"a"), (b"host", b"b")],
        [(b"Host", b"a"), (b"x-a", b"a\x01b")],
    ):
        with pytest.raises(ContractError):
            http1_head(b"POST", b"/v1/x", bad, http10=False)
    with pytest.raises(ContractError):
        http1_head(b"POST", b"/", [(b"Transfer-Encoding", b"chunked")], http10=True)
    assert http1_head(b"GET", b"/", [], http10=True).headers == []


def test_declared_length() -> None:
    assert declared_length([(b"Content-Length", b"12")]) == 12
    assert declared_length([(b"content-length", b"3"), (b"content-length", b"3")]) == 3
    assert declared_length([]) is None
    for bad in (b"-1", b"1.0", b"", b"0x1"):
        with pytest.raises(ContractError):
            declared_length([(b"content-length", bad)])
    with pytest.raises(ContractError):
        declared_length([(b"content-length", b"3"), (b"content-length", b"4")])
