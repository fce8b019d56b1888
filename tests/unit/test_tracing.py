"""Which exchanges a span marks as failed: engine failures and engine error statuses, never a
client that left or a shutdown."""

from __future__ import annotations

import pytest

from pylon.core.record import RequestRecord
from pylon.otel import remote_parent
from pylon.tracing import UPSTREAM_FAILURES, exchange_error


def record(outcome: str, status: int = 0, answered: bool = False) -> RequestRecord:
    result = RequestRecord("http1", 1, head_at=1.0)
    result.outcome, result.status = outcome, status
    result.first_byte_at = 2.0 if answered else None
    return result


@pytest.mark.parametrize(
    ("outcome", "status", "answered", "error"),
    [
        ("ok", 200, True, None),
        ("ok", 404, True, "404"),  # an engine error status (a client span's error)
        ("ok", 503, True, "503"),
        ("upstream_unavailable", 503, False, "upstream_unavailable"),  # pylon's own answer
        ("upstream_busy", 503, False, "upstream_busy"),
        ("upstream_timeout", 504, False, "upstream_timeout"),
        ("upstream_timeout", 200, True, "upstream_timeout"),  # after the head
        ("upstream_broken_mid_body", 200, True, "upstream_broken_mid_body"),
        ("upstream_protocol_error", 200, True, "upstream_protocol_error"),
        ("client_reset", 200, True, None),
        ("client_disconnected", 0, False, None),
        ("client_send_timeout", 200, True, None),
        ("shutdown", 0, False, None),
    ],
)
def test_exchange_error(outcome: str, status: int, answered: bool, error: str | None) -> None:
    assert exchange_error(record(outcome, status, answered)) == error


def test_every_upstream_error_code_is_a_failure() -> None:
    from pylon.core.errors import ErrorCode

    codes = {code.value for code in ErrorCode if code.value.startswith("upstream_")}
    assert codes <= UPSTREAM_FAILURES


def test_remote_parent_reads_the_w3c_fields() -> None:
    from opentelemetry.trace import get_current_span

    parent = get_current_span(
        remote_parent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    ).get_span_context()
    assert (parent.trace_id, parent.span_id) == (
        0x4BF92F3577B34DA6A3CE929D0E0E4736,
        0x00F067AA0BA902B7,
    )
    assert parent.is_remote and parent.trace_flags.sampled
