"""The one Protocol every backend priority adapter implements, and what an adapter may write."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

from pylon.core.contract import Header

I32_MAX = 2**31 - 1


@dataclass(frozen=True, slots=True)
class AdapterOptions:
    ceiling: int  # C: ranks at or above it are all "least urgent"; 1..I32_MAX
    sglang_low_priority_first: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.ceiling <= I32_MAX:
            raise ValueError(f"priority ceiling must be in 1..{I32_MAX}, got {self.ceiling}")


@dataclass(frozen=True, slots=True)
class PriorityWrite:
    """What pylon writes toward the engine for one request; nothing else steers it."""

    headers: tuple[Header, ...] = ()
    body_priority: int | None = None  # top-level body `priority`, when the engine reads it there

    @property
    def empty(self) -> bool:
        return not self.headers and self.body_priority is None


NO_WRITE = PriorityWrite()


class PriorityAdapter(Protocol):
    name: ClassVar[str]

    def derive(self, rank: int | None) -> PriorityWrite:
        """Map the gateway rank (u32, lower = more urgent, None = unconfigured) to engine fields."""
        ...


def clamp_rank(rank: int, ceiling: int) -> int:
    return min(rank, ceiling)
