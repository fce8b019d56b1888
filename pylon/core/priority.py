"""What a backend adapter may write toward the engine, and the one Protocol adapters implement.

Defined in the core (not in `pylon.adapters`) so that the planner depends on the protocol only;
the adapters depend on the core, never the other way round.
"""

from __future__ import annotations

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


class PriorityAdapter(Protocol):
    name: ClassVar[str]

    def derive(self, rank: int | None) -> PriorityWrite:
        """Map the gateway rank (u32, lower = more urgent, None = unconfigured) to engine fields."""
        ...

    def queue_level(self, rank: int | None) -> int:
        """Where the engine schedules a request of this rank, in its own direction normalised:
        a lower level runs first, equal levels in arrival order (one level for every request
        when the engine is told no priority). The queue gate counts the work waiting at the
        same or a lower level as ahead of a request (`pylon.core.queue`)."""
        ...
