"""Admission: is this head a request pylon takes? Contract, tunnel auth, then the lifecycle.

Runs at headers time on every transport (through `RequestIntake`), before any body byte is read,
so a bad, unauthenticated or untimely request is answered at once and no transport can forget a
check.
"""

from __future__ import annotations

from collections.abc import Sequence

from pylon.auth import TokenAuth, unauthorized
from pylon.core.contract import HealthRequest, TunnelRequest, parse_request
from pylon.core.errors import ClientError, ErrorCode, UpstreamError
from pylon.core.head import RequestHead
from pylon.core.http import Header
from pylon.core.intake import Admission
from pylon.lifecycle import Lifecycle, Phase


class ProxyAdmission:
    __slots__ = ("_auth", "_lifecycle")

    def __init__(self, lifecycle: Lifecycle, auth: TokenAuth | None) -> None:
        self._lifecycle = lifecycle
        self._auth = auth

    def admit(self, head: RequestHead) -> TunnelRequest | HealthRequest:
        request = parse_request(head.method, head.target, head.headers)
        if isinstance(request, HealthRequest):
            if self._lifecycle.draining:
                raise _refusal(Phase.DRAINING, request.request_id)
            return request  # the engine's health, even while pylon is starting
        if self._auth is not None and not self._auth.allows(request.headers):
            error = unauthorized()
            error.request_id = request.request_id
            raise error
        if self._lifecycle.phase is not Phase.READY:
            raise _refusal(self._lifecycle.phase, request.request_id)
        encoding = _content_encoding(head.headers)
        if encoding is not None:
            raise ClientError(
                f"request bodies must not be content-encoded (got {encoding!r}): pylon inspects "
                "and strips the body, so the engine must parse exactly the bytes pylon read",
                code=ErrorCode.CONTENT_ENCODING_NOT_SUPPORTED,
                request_id=request.request_id,
            )
        return request


def _content_encoding(headers: Sequence[Header]) -> str | None:
    """A request body coding other than identity, if the head declares one.

    Refused (415) rather than decoded: decoding inside pylon would add a decompression-bomb
    surface and CPU on the hot path for no gateway that needs it, and forwarding an encoded body
    would let an engine that decodes it parse bytes the strip never saw.
    """
    for name, value in headers:
        if len(name) == 16 and name.lower() == b"content-encoding":
            coding = value.strip(b" \t").lower()
            if coding and coding != b"identity":
                return coding.decode("latin-1")
    return None


def _refusal(phase: Phase, request_id: str | None) -> UpstreamError:
    if phase is Phase.DRAINING:
        return UpstreamError(
            "pylon is shutting down and takes no new requests",
            code=ErrorCode.SHUTTING_DOWN,
            request_id=request_id,
        )
    return UpstreamError(
        "pylon is starting and not ready for requests yet",
        code=ErrorCode.NOT_READY,
        request_id=request_id,
    )


_: type[Admission] = ProxyAdmission
