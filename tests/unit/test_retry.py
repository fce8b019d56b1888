"""Retry marking: pylon classifies, the gateway retries."""

from __future__ import annotations

from datetime import UTC, datetime
from email.utils import format_datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pylon.core.retry import (
    RETRY_AFTER_MS,
    RETRY_REASON,
    RETRYABLE,
    SHOULD_RETRY,
    RetryMark,
    RetryPolicy,
    classify_upstream_response,
    local_connect_failure,
    parse_retry_after_ms,
)

NOW = 1_700_000_000.0
DEFAULT = RetryPolicy()
NO_HEADER_NEEDED = RetryPolicy(require_upstream_retry_header=False)
ENGINE = b"x-stargate-upstream-retryable"


def classify(status, headers=(), policy=DEFAULT):
    return classify_upstream_response(status, list(headers), policy, NOW)


@pytest.mark.parametrize("status", [200, 201, 204, 206, 301, 304, 399])
def test_success_is_not_marked(status: int) -> None:
    assert classify(status, [(ENGINE, b"true")]) is None


@pytest.mark.parametrize(
    ("status", "headers", "policy", "expected"),
    [
        (429, [(ENGINE, b"true")], DEFAULT, RetryMark(True, "upstream_admission_rejected")),
        (
            503,
            [(b"X-Stargate-Upstream-Retryable", b" TRUE ")],
            DEFAULT,
            RetryMark(True, "upstream_admission_rejected"),
        ),
        (503, [(ENGINE, b"false")], DEFAULT, RetryMark(False, "missing_upstream_retry_header")),
        (503, [(ENGINE, b"yes")], DEFAULT, RetryMark(False, "missing_upstream_retry_header")),
        (503, [(ENGINE, b"1")], DEFAULT, RetryMark(False, "missing_upstream_retry_header")),
        (429, [], DEFAULT, RetryMark(False, "missing_upstream_retry_header")),
        (429, [], NO_HEADER_NEEDED, RetryMark(True, "upstream_admission_rejected")),
        (
            503,
            [(ENGINE, b"false")],
            NO_HEADER_NEEDED,
            RetryMark(True, "upstream_admission_rejected"),
        ),
        (500, [(ENGINE, b"true")], DEFAULT, RetryMark(False, "upstream_nonretryable_status")),
        (
            502,
            [(ENGINE, b"true")],
            NO_HEADER_NEEDED,
            RetryMark(False, "upstream_nonretryable_status"),
        ),
        (400, [], DEFAULT, RetryMark(False, "upstream_nonretryable_status")),
        (
            429,
            [(ENGINE, b"true")],
            RetryPolicy(retryable_status_codes=frozenset()),
            RetryMark(False, "upstream_nonretryable_status"),
        ),
        (
            500,
            [(b"x-engine-ok", b"true")],
            RetryPolicy(
                retryable_status_codes=frozenset({500}), upstream_retry_header=b"x-engine-ok"
            ),
            RetryMark(True, "upstream_admission_rejected"),
        ),
    ],
)
def test_classification_table(status, headers, policy, expected) -> None:
    assert classify(status, headers, policy) == expected


def test_first_engine_header_decides() -> None:
    mark = classify(503, [(ENGINE, b"false"), (ENGINE, b"true")])
    assert mark == RetryMark(False, "missing_upstream_retry_header")


def test_retry_after_seconds_and_date() -> None:
    mark = classify(429, [(ENGINE, b"true"), (b"Retry-After", b" 3 ")])
    assert mark == RetryMark(True, "upstream_admission_rejected", 3000)
    date = format_datetime(datetime.fromtimestamp(NOW + 7, UTC), usegmt=True).encode()
    mark = classify(503, [(ENGINE, b"true"), (b"retry-after", date)])
    assert mark is not None and mark.retry_after_ms == 7000


def test_retry_after_not_propagated_when_disabled_or_not_retryable() -> None:
    policy = RetryPolicy(propagate_retry_after=False)
    assert classify(429, [(ENGINE, b"true"), (b"Retry-After", b"3")], policy).retry_after_ms is None
    assert classify(429, [(b"Retry-After", b"3")]).retry_after_ms is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (b"0", 0),
        (b"120", 120_000),
        (b"4294967295", 4294967295 * 1000),
        (b"-1", None),
        (b"1.5", None),
        (b"", None),
        (b"soon", None),
        (b"\xff\xfe", None),
        (b"Wed, 21 Oct 2015 07:28:00 GMT", 0),  # in the past: no wait
        (b"Wed, 21 Oct 2015 07:28:00 -0000", None),  # no usable zone
        (b"Tue, 14 Nov 2023 22:13:30 GMT", 10_000),
        (b"Tue, 14 Nov 2023 22:13:20 +0000", 0),
    ],
)
def test_parse_retry_after_ms(value: bytes, expected: int | None) -> None:
    assert parse_retry_after_ms(value, NOW) == expected


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40) | st.text(max_size=40).map(str.encode))
def test_parse_retry_after_never_raises(value: bytes) -> None:
    result = parse_retry_after_ms(value, NOW)
    assert result is None or result >= 0


@pytest.mark.parametrize("retryable", [True, False])
def test_local_connect_failure(retryable: bool) -> None:
    mark = local_connect_failure(RetryPolicy(local_connect_failures_retryable=retryable))
    assert mark == RetryMark(retryable, "local_connect_failure")
    answer = b"true" if retryable else b"false"
    assert mark.headers() == [
        (RETRYABLE, answer),
        (RETRY_REASON, b"local_connect_failure"),
        (SHOULD_RETRY, answer),  # the OpenAI SDKs' switch says the same
    ]


def test_mark_headers_with_retry_after() -> None:
    assert RetryMark(True, "upstream_admission_rejected", 1500).headers() == [
        (RETRYABLE, b"true"),
        (RETRY_REASON, b"upstream_admission_rejected"),
        (SHOULD_RETRY, b"true"),
        (RETRY_AFTER_MS, b"1500"),
    ]
