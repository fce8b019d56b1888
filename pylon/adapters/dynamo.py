"""Dynamo: priority travels in headers, which beat any body `nvext.agent_hints` in the frontend.

Writes, on every non-health request, exactly once each:
- `x-dynamo-request-priority: max(0, C - min(r, C))` (higher = more urgent, seconds of queue head
  start in Dynamo's router queue); absent r -> 0, the least urgent.
- `x-dynamo-request-strict-priority: 0` (no strict tier: a client must not get one).
Body: nothing (Dynamo rejects unknown `nvext` keys, and the headers win anyway).

Routes (`ROUTES`): the frontend's inference routes, where it reads the priority headers (chat,
completions, responses, embeddings, Anthropic `/v1/messages`; dynamo-contract §1e), all with a
required body `model` (embeddings with no `stream`), and `GET /v1/models`. Every other route is
refused (docs/api-contract.md, "Routes served").
"""

from __future__ import annotations

from typing import ClassVar

from pylon.adapters.base import (
    NOT_SCHEDULED,
    SCHEDULED,
    SCHEDULED_NO_STREAM,
    AdapterOptions,
    PriorityAdapter,
    PriorityWrite,
    Route,
    RouteTable,
    clamp_rank,
)

PRIORITY_HEADER = b"x-dynamo-request-priority"
STRICT_PRIORITY_HEADER = b"x-dynamo-request-strict-priority"

ROUTES: RouteTable = {
    ("POST", "/v1/chat/completions"): SCHEDULED,
    ("POST", "/v1/completions"): SCHEDULED,
    ("POST", "/v1/responses"): SCHEDULED,
    ("POST", "/v1/embeddings"): SCHEDULED_NO_STREAM,
    ("POST", "/v1/messages"): SCHEDULED,
    ("GET", "/v1/models"): NOT_SCHEDULED,
    ("HEAD", "/v1/models"): NOT_SCHEDULED,
}


class DynamoAdapter:
    name: ClassVar[str] = "dynamo"

    def __init__(self, options: AdapterOptions) -> None:
        self._ceiling = options.ceiling
        # Precomputed: the unconfigured case is the common one and must cost nothing.
        self._unconfigured = self._write(0)

    def derive(self, rank: int | None) -> PriorityWrite:
        if rank is None:
            return self._unconfigured
        return self._write(self._value(rank))

    def route(self, method: str, path: str) -> Route | None:
        return ROUTES.get((method, path))

    def queue_level(self, rank: int | None) -> int:
        # Dynamo serves higher values first: invert, so that a lower level runs first.
        return self._ceiling - (0 if rank is None else self._value(rank))

    def _value(self, rank: int) -> int:
        return max(0, self._ceiling - clamp_rank(rank, self._ceiling))

    @staticmethod
    def _write(value: int) -> PriorityWrite:
        return PriorityWrite(
            headers=((PRIORITY_HEADER, str(value).encode()), (STRICT_PRIORITY_HEADER, b"0")),
            value=value,
        )


_: type[PriorityAdapter] = DynamoAdapter
