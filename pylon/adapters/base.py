"""Options shared by the backend adapters; the Protocol itself lives in `pylon.core.priority`."""

from __future__ import annotations

from dataclasses import dataclass

from pylon.core.priority import (
    NO_WRITE,
    NOT_SCHEDULED,
    SCHEDULED,
    SCHEDULED_NO_MODEL_FIELD,
    SCHEDULED_NO_STREAM,
    PriorityAdapter,
    PriorityWrite,
    Route,
    RouteTable,
)

I32_MAX = 2**31 - 1


@dataclass(frozen=True, slots=True)
class AdapterOptions:
    ceiling: int  # C: ranks at or above it are all "least urgent"; 1..I32_MAX
    sglang_low_priority_first: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.ceiling <= I32_MAX:
            raise ValueError(f"priority ceiling must be in 1..{I32_MAX}, got {self.ceiling}")


def clamp_rank(rank: int, ceiling: int) -> int:
    return min(rank, ceiling)


__all__ = [
    "I32_MAX",
    "NOT_SCHEDULED",
    "NO_WRITE",
    "SCHEDULED",
    "SCHEDULED_NO_MODEL_FIELD",
    "SCHEDULED_NO_STREAM",
    "AdapterOptions",
    "PriorityAdapter",
    "PriorityWrite",
    "Route",
    "RouteTable",
    "clamp_rank",
]
