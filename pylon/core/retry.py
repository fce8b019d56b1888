"""Retry marking, as the reference Pylon does it: pylon classifies, the gateway retries.

Pure: (status, engine response headers, policy, now) -> what to tell the gateway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

from pylon.core.contract import parse_uint
from pylon.core.http import Header

RETRYABLE = b"x-stargate-retryable"
RETRY_REASON = b"x-stargate-retry-reason"
RETRY_AFTER_MS = b"x-stargate-retry-after-ms"
# The OpenAI SDKs' own retry switch: set beside x-stargate-retryable, with the same answer.
SHOULD_RETRY = b"x-should-retry"
_OWS = b" \t"


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    retryable_status_codes: frozenset[int] = frozenset({429, 503})
    require_upstream_retry_header: bool = True
    upstream_retry_header: bytes = b"x-stargate-upstream-retryable"
    propagate_retry_after: bool = True
    local_connect_failures_retryable: bool = False


@dataclass(frozen=True, slots=True)
class RetryMark:
    retryable: bool
    reason: str
    retry_after_ms: int | None = None

    def headers(self) -> list[Header]:
        answer = b"true" if self.retryable else b"false"
        out: list[Header] = [
            (RETRYABLE, answer),
            (RETRY_REASON, self.reason.encode("ascii")),
            (SHOULD_RETRY, answer),
        ]
        if self.retry_after_ms is not None:
            out.append((RETRY_AFTER_MS, str(self.retry_after_ms).encode("ascii")))
        return out


def classify_upstream_response(
    status: int, headers: Sequence[Header], policy: RetryPolicy, now: float
) -> RetryMark | None:
    """None for success; otherwise whether the gateway may retry elsewhere, and why."""
    if status < 400:
        return None
    if status not in policy.retryable_status_codes:
        return RetryMark(False, "upstream_nonretryable_status")
    if policy.require_upstream_retry_header and not _engine_says_retryable(headers, policy):
        return RetryMark(False, "missing_upstream_retry_header")
    retry_after = _retry_after_ms(headers, now) if policy.propagate_retry_after else None
    return RetryMark(True, "upstream_admission_rejected", retry_after)


def local_connect_failure(policy: RetryPolicy) -> RetryMark:
    return RetryMark(policy.local_connect_failures_retryable, "local_connect_failure")


def _engine_says_retryable(headers: Sequence[Header], policy: RetryPolicy) -> bool:
    for name, value in headers:
        if name.strip(_OWS).lower() == policy.upstream_retry_header:
            return value.strip(_OWS).lower() == b"true"
    return False


def _retry_after_ms(headers: Sequence[Header], now: float) -> int | None:
    for name, value in headers:
        if name.strip(_OWS).lower() == b"retry-after":
            return parse_retry_after_ms(value.strip(_OWS), now)
    return None


def parse_retry_after_ms(value: bytes, now: float) -> int | None:
    """RFC 9110 10.2.3: delay-seconds or an HTTP-date; anything else is ignored."""
    seconds = parse_uint(value, 2**32 - 1)
    if seconds is not None:
        return seconds * 1000
    try:
        when = parsedate_to_datetime(value.decode("ascii"))
    except (ValueError, TypeError, UnicodeDecodeError):
        return None
    if when.tzinfo is None:
        return None
    return max(0, int((when.timestamp() - now) * 1000))
