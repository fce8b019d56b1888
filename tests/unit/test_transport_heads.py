"""Property tests for the HTTP/2 and HTTP/3 request-head mappers (pure functions over bytes):
whatever a peer sends, the answer is a well-formed head or a typed rejection, never a crash, and
nothing that could break the HTTP/1.1 request line toward the engine gets through."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from pylon.core.contract import parse_request
from pylon.core.errors import PylonError
from pylon.server.http2 import Malformed, split_request_headers
from pylon.server.http3 import _to_origin_form

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
PSEUDO = [b":method", b":scheme", b":path", b":authority", b":protocol", b":status", b":x"]
REGULAR = [
    b"x-request-id",
    b"x-model",
    b"host",
    b"content-length",
    b"te",
    b"connection",
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
    b"\x00",
    b"mock-model",
    b"r-1",
    b"/\x7f",
]

names = st.one_of(st.sampled_from(PSEUDO + REGULAR), st.binary(max_size=12))
values = st.one_of(st.sampled_from(VALUES), st.binary(max_size=24))
fields = st.lists(st.tuples(names, values), max_size=12)


@settings(max_examples=400, deadline=None)
@given(fields)
def test_h2_head_is_well_formed_or_malformed(head: list[tuple[bytes, bytes]]) -> None:
    try:
        result = split_request_headers(head)
    except Malformed:
        return
    assert _TOKEN.fullmatch(result.method)
    assert result.path == b"*" or (
        result.path.startswith(b"/") and not re.search(rb"[\x00-\x20\x7f]", result.path)
    )
    for name, value in result.headers:
        assert name == name.lower() and _TOKEN.fullmatch(name)
        assert not re.search(rb"[\r\n\x00]", value)
        assert name not in (b"connection", b"transfer-encoding")


@settings(max_examples=400, deadline=None)
@given(fields)
def test_h2_and_h3_heads_reach_the_contract_or_a_typed_error(
    head: list[tuple[bytes, bytes]],
) -> None:
    for mapper in ("h2", "h3"):
        try:
            if mapper == "h2":
                mapped = split_request_headers(head)
                method, target, headers = mapped.method, mapped.path, mapped.headers
            else:
                method, target, headers = _to_origin_form(head)
            request = parse_request(method, target, headers)
        except (Malformed, PylonError):
            continue
        # Whatever is accepted is safe on an HTTP/1.1 request line.
        assert " " not in request.target and "\r" not in request.target
        assert request.method.isalpha()


def test_h2_valid_head_maps_authority_to_host() -> None:
    result = split_request_headers(
        [
            (b":method", b"POST"),
            (b":scheme", b"https"),
            (b":path", b"/v1/x?y=1"),
            (b":authority", b"gw"),
            (b"x-request-id", b"r"),
        ]
    )
    assert (result.method, result.path) == (b"POST", b"/v1/x?y=1")
    assert (b"host", b"gw") in result.headers
