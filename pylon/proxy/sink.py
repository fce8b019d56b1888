"""What a transport offers the proxy for one response, and pylon's own problem responses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pylon.core.errors import PylonError, problem_body
from pylon.core.http import Header
from pylon.core.retry import RetryMark

PROBLEM_HEADERS: tuple[Header, ...] = ((b"content-type", b"application/problem+json"),)
REQUEST_ID = b"x-request-id"


def echo_request_id(request_id: str | None) -> list[Header]:
    """The request's validated `x-request-id`, echoed on every response pylon sends (its own
    problems and relayed engine responses alike; the engine's copy is dropped, see
    `sanitize_response_headers`)."""
    return [] if request_id is None else [(REQUEST_ID, request_id.encode("ascii"))]


class ResponseSink(Protocol):
    """One response stream of a transport (HTTP/1.1 connection, HTTP/2 or HTTP/3 stream)."""

    @property
    def paused(self) -> bool:
        """True while the client is not keeping up; the proxy then awaits `drain`."""
        ...

    def start(self, status: int, headers: Sequence[Header], content_length: int | None) -> None:
        """Send the response head; `content_length` None means a streamed body.

        `headers` are normalised by the sender, and framed as they are on every transport:
        names lower case (HTTP/2 and HTTP/3 require it), values without surrounding
        whitespace, no connection-specific or framing field (RFC 9113 8.2.2, RFC 9114 4.2).
        The engine's head gets so in `pylon.core.sanitize.sanitize_response_head`; pylon's
        own answers are built so."""
        ...

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

    def end(self) -> None:
        """The body is complete."""
        ...

    def abort(self) -> None:
        """The body cannot be completed: reset the stream / close the connection."""
        ...


def send_problem(sink: ResponseSink, error: PylonError, mark: RetryMark | None = None) -> int:
    """Answer with pylon's RFC 9457 problem, the request's id and its retry marking, as one
    complete response; returns the body's size."""
    body = problem_body(error, error.request_id)
    headers = list(PROBLEM_HEADERS)
    headers += echo_request_id(error.request_id)
    if mark is None:
        mark = RetryMark(error.code.retryable, error.code.value, error.retry_after_ms)
    headers += mark.headers()
    sink.start(error.status, headers, len(body))
    sink.write(body)
    sink.end()
    return len(body)
