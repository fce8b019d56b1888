"""Every error code renders one RFC 9457 body."""

from __future__ import annotations

import json

import pytest

from pylon.core.errors import (
    PROBLEM_TYPE_BASE,
    BodyError,
    ClientError,
    ContractError,
    ErrorCode,
    LimitError,
    PylonError,
    QueueMismatchError,
    UpstreamError,
    problem_body,
)
from pylon.proxy.relay import sse_error_payload


@pytest.mark.parametrize("code", list(ErrorCode))
def test_every_code_has_status_and_title(code: ErrorCode) -> None:
    assert 400 <= code.status <= 599
    assert code.title and code.title.strip() == code.title
    error = PylonError("detail text", code=code)
    assert error.status == code.status
    body = json.loads(problem_body(error, "req-9"))
    assert body == {
        "type": PROBLEM_TYPE_BASE + code.value,
        "title": code.title,
        "status": code.status,
        "detail": "detail text",
        "code": code.value,
        "request_id": "req-9",
        # OpenAI-style, so OpenAI SDKs show the reason (their APIError reads body["error"]).
        "error": {
            "message": "detail text",
            "type": OPENAI_TYPES[code.status],
            "code": code.value,
            "request_id": "req-9",
        },
    }


# Written out: the OpenAI API's error types by status, as its SDKs classify them.
OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    502: "server_error",
    503: "service_unavailable",
    504: "server_error",
}


def test_problem_body_without_request_id() -> None:
    body = json.loads(problem_body(ContractError("x", code=ErrorCode.MISSING_REQUEST_ID), None))
    assert "request_id" not in body
    assert "request_id" not in body["error"]
    assert body["status"] == 400
    assert body["error"]["code"] == "missing_request_id"


def test_sse_error_payload_is_the_same_error_member() -> None:
    """A stream that breaks after its head ends with the same `error` object a problem has."""
    error = UpstreamError("gap too long", code=ErrorCode.UPSTREAM_TIMEOUT, request_id="r-1")
    payload = json.loads(sse_error_payload(error))
    assert payload == {"error": json.loads(problem_body(error, "r-1"))["error"]}
    assert payload["error"] == {
        "message": "gap too long",
        "type": "server_error",
        "code": "upstream_timeout",
        "request_id": "r-1",
    }


# Written out, not derived from the enum: the server-side codes and the ones a gateway may retry.
SERVER_SIDE = {
    "upstream_unavailable",
    "upstream_timeout",
    "upstream_protocol_error",
    "upstream_busy",
    "shutting_down",
    "not_ready",
    "model_generation_unavailable",
    "no_worker",
    "body_budget_exceeded",
}
RETRYABLE = {
    "shutting_down",
    "not_ready",
    "model_generation_unavailable",
    "upstream_busy",
    "no_worker",
    "body_budget_exceeded",
    "queue_estimate_mismatch",  # 429: the engine never saw it; another node may be less busy
}


def test_client_codes_are_4xx_and_server_side_codes_5xx() -> None:
    for code in ErrorCode:
        assert (code.status >= 500) == (code.value in SERVER_SIDE), code


def test_only_answers_before_any_engine_are_retryable() -> None:
    assert {code.value for code in ErrorCode if code.retryable} == RETRYABLE


@pytest.mark.parametrize(
    ("error", "code", "status"),
    [
        (BodyError("x"), ErrorCode.BODY_NOT_JSON_OBJECT, 400),
        (LimitError("x"), ErrorCode.BODY_TOO_LARGE, 413),
        (LimitError("x", code=ErrorCode.HEADERS_TOO_LARGE), ErrorCode.HEADERS_TOO_LARGE, 431),
        (UpstreamError("x"), ErrorCode.UPSTREAM_UNAVAILABLE, 503),
        (UpstreamError("x", code=ErrorCode.UPSTREAM_TIMEOUT), ErrorCode.UPSTREAM_TIMEOUT, 504),
        (ContractError("x"), ErrorCode.MALFORMED_REQUEST, 400),
        (
            QueueMismatchError("x", expected_queue_ms=1, actual_queue_ms=2, threshold_ms=1),
            ErrorCode.QUEUE_ESTIMATE_MISMATCH,
            429,
        ),
    ],
)
def test_class_defaults(error: PylonError, code: ErrorCode, status: int) -> None:
    assert error.code is code
    assert error.status == status


def test_instance_code_does_not_leak_into_the_class() -> None:
    LimitError("x", code=ErrorCode.HEADERS_TOO_LARGE)
    assert LimitError("y").code is ErrorCode.BODY_TOO_LARGE
    assert issubclass(ContractError, ClientError) and issubclass(UpstreamError, PylonError)


def test_detail_is_escaped_json() -> None:
    body = problem_body(BodyError('quote " and \n newline'), 'id"1')
    assert json.loads(body)["detail"] == 'quote " and \n newline'
