"""Admission: is this head a request pylon takes? Contract, tunnel auth, the lifecycle, then
the model (is `x-model` published? see `pylon.models`).

Runs at headers time on every transport (through `RequestIntake`), before any body byte is read,
so a bad, unauthenticated or untimely request is answered at once and no transport can forget a
check.
"""

from __future__ import annotations

from pylon.auth import TokenAuth, unauthorized
from pylon.core.contract import HealthRequest, TunnelRequest, parse_request
from pylon.core.errors import ClientError, ErrorCode, PylonError, UpstreamError
from pylon.core.head import RequestHead
from pylon.core.intake import Admission
from pylon.lifecycle import Lifecycle, Phase

# A global, not `Phase.READY`: on Python 3.11 an enum member read through its class goes
# through EnumType.__getattr__, and this one is read for every request.
_READY = Phase.READY


class ProxyAdmission:
    __slots__ = ("_auth", "_lifecycle")

    def __init__(self, lifecycle: Lifecycle, auth: TokenAuth | None) -> None:
        self._lifecycle = lifecycle
        self._auth = auth

    @property
    def auth(self) -> TokenAuth | None:
        """The tunnel token check (`--tunnel-token-file`), for a reload to re-read."""
        return self._auth

    def admit(self, head: RequestHead) -> TunnelRequest | HealthRequest:
        request = parse_request(head.method, head.target, head.headers, head.names)
        if isinstance(request, HealthRequest):
            if self._lifecycle.draining:
                raise _refusal(Phase.DRAINING, request.request_id)
            return request  # the engine's health, even while pylon is starting
        try:  # zero-cost in 3.11 while nothing is raised
            if self._auth is not None and not self._auth.allows(request.headers):
                error = unauthorized()
                error.request_id = request.request_id
                raise error
            lifecycle = self._lifecycle
            if lifecycle.phase is not _READY:
                raise _refusal(lifecycle.phase, request.request_id)
            if request.model not in lifecycle.models.published:
                raise UpstreamError(
                    f"model {request.model!r} is not published by this pylon: the engine does "
                    "not serve it now (not yet loaded, or retired)",
                    code=ErrorCode.MODEL_GENERATION_UNAVAILABLE,
                    request_id=request.request_id,
                )
            # An encoded body is refused (415), not decoded: decoding inside pylon would add a
            # decompression-bomb surface and CPU for no gateway that needs it, and forwarding it
            # would let an engine that decodes it parse bytes the strip never saw.
            coding = head.content_coding
            if coding is not None:
                raise ClientError(
                    "request bodies must not be content-encoded (got "
                    f"{coding.decode('latin-1')!r}): pylon inspects and strips the body, so the "
                    "engine must parse exactly the bytes pylon read",
                    code=ErrorCode.CONTENT_ENCODING_NOT_SUPPORTED,
                    request_id=request.request_id,
                )
        except PylonError as error:
            error.model = request.model  # parsed and valid: the refusal is counted by it
            raise
        return request


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
