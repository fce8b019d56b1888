"""Shared builders for the unit tests."""

from __future__ import annotations

from pylon.core.contract import TunnelRequest, parse_request
from pylon.core.http import Header

BASE_HEADERS: tuple[Header, ...] = ((b"x-request-id", b"req-1"), (b"x-model", b"m"))
TRACEPARENT = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def tunnel(
    *extra: Header, target: bytes = b"/v1/chat/completions", method: bytes = b"POST"
) -> TunnelRequest:
    request = parse_request(method, target, [*BASE_HEADERS, *extra])
    assert isinstance(request, TunnelRequest)
    return request


def with_priority(rank: int | None, *extra: Header, target: bytes = b"/v1/chat/completions"):
    headers = list(extra)
    if rank is not None:
        headers.append((b"x-priority", str(rank).encode()))
    return tunnel(*headers, target=target)
