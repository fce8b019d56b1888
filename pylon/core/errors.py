"""One error taxonomy, mapped once to an HTTP status and an RFC 9457 problem body.

    PylonError
    ├── ClientError          the request is at fault (4xx); nothing reached the engine
    │   ├── ContractError    a tunnel header is missing or malformed
    │   ├── BodyError        the body is not what the route needs
    │   └── LimitError       a size limit was exceeded
    ├── UpstreamError        the engine could not be used (5xx)
    └── QueueMismatchError   the engine's queue is clearly longer than the gateway expected
                             (429, retryable; `pylon.core.queue`); nothing reached the engine

Every error carries an `ErrorCode`; `ErrorCode.status` is the single place that turns a code into
an HTTP status, and `problem_body` the single place that renders the body: RFC 9457 members
plus an OpenAI-style `error` member (`openai_error`, also the payload of a terminal SSE error).
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar

import orjson


class ErrorCode(StrEnum):
    MISSING_REQUEST_ID = "missing_request_id"
    INVALID_REQUEST_ID = "invalid_request_id"
    MISSING_MODEL = "missing_model"
    INVALID_MODEL = "invalid_model"
    INVALID_INPUT_TOKENS = "invalid_input_tokens"
    INVALID_PRIORITY = "invalid_priority"
    INVALID_TRACEPARENT = "invalid_traceparent"
    MALFORMED_REQUEST = "malformed_request"
    BODY_NOT_JSON_OBJECT = "body_not_json_object"
    MODEL_MISMATCH = "model_mismatch"
    BODY_MODEL_MISSING = "body_model_missing"
    BODY_FIELD_INVALID = "body_field_invalid"
    ROUTE_NOT_SERVED = "route_not_served"
    CONTENT_ENCODING_NOT_SUPPORTED = "content_encoding_not_supported"
    BODY_TOO_COMPLEX = "body_too_complex"
    BODY_TOO_LARGE = "body_too_large"
    HEADERS_TOO_LARGE = "headers_too_large"
    UNAUTHORIZED = "unauthorized"
    REQUEST_TIMEOUT = "request_timeout"
    UPSTREAM_UNAVAILABLE = "upstream_unavailable"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    UPSTREAM_PROTOCOL_ERROR = "upstream_protocol_error"
    SHUTTING_DOWN = "shutting_down"
    NOT_READY = "not_ready"
    MODEL_GENERATION_UNAVAILABLE = "model_generation_unavailable"
    UPSTREAM_BUSY = "upstream_busy"
    NO_WORKER = "no_worker"
    BODY_BUDGET_EXCEEDED = "body_budget_exceeded"
    QUEUE_ESTIMATE_MISMATCH = "queue_estimate_mismatch"

    @property
    def status(self) -> int:
        return _STATUS[self]

    @property
    def title(self) -> str:  # type: ignore[override]  # an error's title, not str.title()
        return _TITLES[self]

    @property
    def retryable(self) -> bool:
        """May the gateway retry elsewhere? Only for answers given before any engine saw the
        request (an engine's own statuses are classified by `pylon.core.retry`)."""
        return self in _RETRYABLE


_STATUS: dict[ErrorCode, int] = {
    ErrorCode.MISSING_REQUEST_ID: 400,
    ErrorCode.INVALID_REQUEST_ID: 400,
    ErrorCode.MISSING_MODEL: 400,
    ErrorCode.INVALID_MODEL: 400,
    ErrorCode.INVALID_INPUT_TOKENS: 400,
    ErrorCode.INVALID_PRIORITY: 400,
    ErrorCode.INVALID_TRACEPARENT: 400,
    ErrorCode.MALFORMED_REQUEST: 400,
    ErrorCode.BODY_NOT_JSON_OBJECT: 400,
    ErrorCode.MODEL_MISMATCH: 400,
    ErrorCode.BODY_MODEL_MISSING: 400,
    ErrorCode.BODY_FIELD_INVALID: 400,
    ErrorCode.ROUTE_NOT_SERVED: 404,
    ErrorCode.CONTENT_ENCODING_NOT_SUPPORTED: 415,
    ErrorCode.BODY_TOO_COMPLEX: 400,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.REQUEST_TIMEOUT: 408,
    ErrorCode.BODY_TOO_LARGE: 413,
    ErrorCode.HEADERS_TOO_LARGE: 431,
    ErrorCode.QUEUE_ESTIMATE_MISMATCH: 429,
    ErrorCode.UPSTREAM_PROTOCOL_ERROR: 502,
    ErrorCode.UPSTREAM_UNAVAILABLE: 503,
    ErrorCode.SHUTTING_DOWN: 503,
    ErrorCode.NOT_READY: 503,
    ErrorCode.MODEL_GENERATION_UNAVAILABLE: 503,
    ErrorCode.UPSTREAM_BUSY: 503,
    ErrorCode.NO_WORKER: 503,
    ErrorCode.BODY_BUDGET_EXCEEDED: 503,
    ErrorCode.UPSTREAM_TIMEOUT: 504,
}

_TITLES: dict[ErrorCode, str] = {
    ErrorCode.MISSING_REQUEST_ID: "Missing x-request-id",
    ErrorCode.INVALID_REQUEST_ID: "Invalid x-request-id",
    ErrorCode.MISSING_MODEL: "Missing x-model",
    ErrorCode.INVALID_MODEL: "Invalid x-model",
    ErrorCode.INVALID_INPUT_TOKENS: "Invalid x-input-tokens",
    ErrorCode.INVALID_PRIORITY: "Invalid x-priority",
    ErrorCode.INVALID_TRACEPARENT: "Invalid traceparent",
    ErrorCode.MALFORMED_REQUEST: "Malformed request",
    ErrorCode.BODY_NOT_JSON_OBJECT: "Body is not a JSON object",
    ErrorCode.MODEL_MISMATCH: "Body model differs from x-model",
    ErrorCode.BODY_MODEL_MISSING: "Body names no model",
    ErrorCode.BODY_FIELD_INVALID: "Body field pylon reads is ambiguous",
    ErrorCode.ROUTE_NOT_SERVED: "Route not served",
    ErrorCode.CONTENT_ENCODING_NOT_SUPPORTED: "Request content encoding not supported",
    ErrorCode.BODY_TOO_COMPLEX: "Request body too complex",
    ErrorCode.UNAUTHORIZED: "Unauthorized",
    ErrorCode.REQUEST_TIMEOUT: "Request timeout",
    ErrorCode.BODY_TOO_LARGE: "Request body too large",
    ErrorCode.HEADERS_TOO_LARGE: "Request header fields too large",
    ErrorCode.QUEUE_ESTIMATE_MISMATCH: "Queue estimate mismatch",
    ErrorCode.UPSTREAM_PROTOCOL_ERROR: "Bad response from the engine",
    ErrorCode.UPSTREAM_UNAVAILABLE: "Engine unavailable",
    ErrorCode.SHUTTING_DOWN: "Shutting down",
    ErrorCode.NOT_READY: "Not ready",
    ErrorCode.MODEL_GENERATION_UNAVAILABLE: "Model not published",
    ErrorCode.UPSTREAM_BUSY: "Engine connections busy",
    ErrorCode.NO_WORKER: "No engine worker available",
    ErrorCode.BODY_BUDGET_EXCEEDED: "Request body budget exceeded",
    ErrorCode.UPSTREAM_TIMEOUT: "Engine timed out",
}

_RETRYABLE = frozenset(
    {
        ErrorCode.SHUTTING_DOWN,
        ErrorCode.NOT_READY,
        ErrorCode.MODEL_GENERATION_UNAVAILABLE,
        ErrorCode.UPSTREAM_BUSY,
        ErrorCode.NO_WORKER,
        ErrorCode.BODY_BUDGET_EXCEEDED,
        ErrorCode.QUEUE_ESTIMATE_MISMATCH,
    }
)

PROBLEM_TYPE_BASE = "https://pylon.dev/problems/"
PROBLEM_CONTENT_TYPE = b"application/problem+json"


class PylonError(Exception):
    """Base of every error pylon answers with its own problem response."""

    code: ClassVar[ErrorCode] = ErrorCode.MALFORMED_REQUEST
    # `x-stargate-retry-after-ms` on the problem response, where pylon has a hint to give.
    retry_after_ms: int | None = None
    # The request's `x-model`, where admission had parsed it (a valid model name) before it
    # refused the request: the record, its log line and metrics carry it.
    model: str | None = None

    def __init__(
        self, detail: str, *, code: ErrorCode | None = None, request_id: str | None = None
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.request_id = request_id
        if code is not None:
            self.code = code  # type: ignore[misc]  # instance override of the class default

    @property
    def status(self) -> int:
        return self.code.status

    def extensions(self) -> dict[str, object] | None:
        """Extra problem members for machines (RFC 9457 extension members); None: none."""
        return None


class ClientError(PylonError):
    """The request is at fault; it never reaches the engine."""


class ContractError(ClientError):
    """A tunnel header is missing or malformed."""


class BodyError(ClientError):
    code = ErrorCode.BODY_NOT_JSON_OBJECT


class BodyFieldError(BodyError):
    """A body field pylon acts on has a value the engine could read otherwise than pylon does
    (`"stream": "true"`): refused, so that both always read the same request. The problem
    names the field (`field`)."""

    code = ErrorCode.BODY_FIELD_INVALID

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(detail)
        self.field = field

    def extensions(self) -> dict[str, object]:
        return {"field": self.field}


class RouteError(ClientError):
    """A route pylon does not steer toward this backend: refused, never forwarded unsteered."""

    code = ErrorCode.ROUTE_NOT_SERVED


class LimitError(ClientError):
    code = ErrorCode.BODY_TOO_LARGE


class UpstreamError(PylonError):
    code = ErrorCode.UPSTREAM_UNAVAILABLE


class QueueMismatchError(PylonError):
    """The local queue estimate for the request is clearly above what the gateway expected; the
    gateway may retry it on another node. The problem carries the three figures."""

    code = ErrorCode.QUEUE_ESTIMATE_MISMATCH

    def __init__(
        self,
        detail: str,
        *,
        expected_queue_ms: int,
        actual_queue_ms: int,
        threshold_ms: int,
        retry_after_ms: int | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(detail, request_id=request_id)
        self.expected_queue_ms = expected_queue_ms
        self.actual_queue_ms = actual_queue_ms
        self.threshold_ms = threshold_ms
        self.retry_after_ms = retry_after_ms

    def extensions(self) -> dict[str, object]:
        return {
            "expected_queue_ms": self.expected_queue_ms,
            "actual_queue_ms": self.actual_queue_ms,
            "threshold_ms": self.threshold_ms,
        }


def openai_error_type(status: int) -> str:
    """The OpenAI API's error `type` for a status, so OpenAI SDKs classify pylon's errors."""
    if status == 503:
        return "service_unavailable"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def openai_error(error: PylonError, request_id: str | None) -> dict[str, object]:
    """The OpenAI-style `error` member: what OpenAI SDKs show as the reason. The same object
    ends a broken SSE stream (`pylon.proxy.relay`), so both say the same thing."""
    member: dict[str, object] = {
        "message": error.detail,
        "type": openai_error_type(error.status),
        "code": error.code.value,
    }
    if request_id is not None:
        member["request_id"] = request_id
    return member


def problem_body(error: PylonError, request_id: str | None) -> bytes:
    """RFC 9457 body; `code` and `request_id` are extension members for machines and humans,
    and `error` the OpenAI-style member for OpenAI SDKs."""
    problem: dict[str, object] = {
        "type": PROBLEM_TYPE_BASE + error.code.value,
        "title": error.code.title,
        "status": error.status,
        "detail": error.detail,
        "code": error.code.value,
    }
    if request_id is not None:
        problem["request_id"] = request_id
    extensions = error.extensions()
    if extensions is not None:
        problem.update(extensions)
    problem["error"] = openai_error(error, request_id)
    return orjson.dumps(problem)
