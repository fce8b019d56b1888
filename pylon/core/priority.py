"""What a backend adapter may write toward the engine, and the one Protocol adapters implement.

Defined in the core (not in `pylon.adapters`) so that the planner depends on the protocol only;
the adapters depend on the core, never the other way round.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Protocol

from pylon.core.http import Header


@dataclass(frozen=True, slots=True)
class PriorityWrite:
    """What pylon writes toward the engine for one request; nothing else steers it."""

    headers: tuple[Header, ...] = ()
    body_priority: int | None = None  # top-level body `priority`, when the engine reads it there
    value: int | None = None  # the engine priority value derived, wherever it is written

    @property
    def empty(self) -> bool:
        return not self.headers and self.body_priority is None


NO_WRITE = PriorityWrite()


@dataclass(frozen=True, slots=True)
class Route:
    """How pylon steers one route an engine serves (`PriorityAdapter.route`).

    `schedules`: the engine queues the request, so pylon's priority goes with it (in the body,
    where the adapter writes one there; headers go on every route). `body_model`: the engine
    serves the model the body's `model` names (its default model when there is none), so the
    body must name `x-model`'s; False where the route has no model field at all. `streams`:
    the engine's request type reads a body `stream` (chat, completions, generate); where it
    does not (embeddings, pooling, scoring), the engine answers one whole response whatever
    the body says, so pylon times and samples the request as one too. `stream_keys`: where the
    engine picks the request type by the body's shape, the top-level keys of the types that
    read `stream` (empty: every body does).
    """

    schedules: bool
    body_model: bool
    streams: bool
    stream_keys: tuple[str, ...] = ()


SCHEDULED = Route(schedules=True, body_model=True, streams=True)
# The engine's request type has no `stream` (embeddings, pooling, scoring, reranking).
SCHEDULED_NO_STREAM = Route(schedules=True, body_model=True, streams=False)
# The engine serves the model it was started with: there is no field to name another.
SCHEDULED_NO_MODEL_FIELD = Route(schedules=True, body_model=False, streams=True)
# Read-only and not queued by the engine (`GET /v1/models`): forwarded as sent.
NOT_SCHEDULED = Route(schedules=False, body_model=False, streams=False)

# (method, route) -> how pylon steers it. A route absent from a backend's table is refused.
RouteTable = Mapping[tuple[str, str], Route]


class PriorityAdapter(Protocol):
    name: ClassVar[str]

    def derive(self, rank: int | None) -> PriorityWrite:
        """Map the gateway rank (u32, lower = more urgent, None = unconfigured) to engine fields."""
        ...

    def route(self, method: str, path: str) -> Route | None:
        """How pylon steers `method` on `path` (the percent-decoded route) toward this backend;
        None: pylon does not serve it (answered 404 `route_not_served`, never forwarded)."""
        ...

    def queue_level(self, rank: int | None) -> int:
        """Where the engine schedules a request of this rank, in its own direction normalised:
        a lower level runs first, equal levels in arrival order (one level for every request
        when the engine is told no priority). The queue gate counts the work waiting at the
        same or a lower level as ahead of a request (`pylon.core.queue`)."""
        ...
