"""Shared builders for the unit tests."""

from __future__ import annotations

from typing import ClassVar

from pylon.core.contract import TunnelRequest, parse_request
from pylon.core.http import Header
from pylon.core.priority import PriorityAdapter, PriorityWrite, Route

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


class WithoutModelRule:
    """`inner`'s routes without the body-model rule: for tests of the body reader and the strip,
    whose bodies name no model (the rule itself is pinned in test_plan.py and test_routes.py)."""

    name: ClassVar[str] = "without-model-rule"

    def __init__(self, inner: PriorityAdapter) -> None:
        self._inner = inner

    def route(self, method: str, path: str) -> Route | None:
        route = self._inner.route(method, path)
        if route is None:
            return None
        return Route(
            schedules=route.schedules,
            body_model=False,
            streams=route.streams,
            stream_keys=route.stream_keys,
        )

    def derive(self, rank: int | None) -> PriorityWrite:
        return self._inner.derive(rank)

    def queue_level(self, rank: int | None) -> int:
        return self._inner.queue_level(rank)


class EveryRoute(WithoutModelRule):
    """`inner`'s priority on every route, steered as `route` says: for tests of the plan's
    fields, whatever the request's route."""

    def __init__(self, inner: PriorityAdapter, route: Route) -> None:
        super().__init__(inner)
        self._route = route

    def route(self, method: str, path: str) -> Route | None:
        return self._route
