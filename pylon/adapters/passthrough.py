"""Passthrough: pylon writes no priority at all; the strip still applies.

Routes: every route is forwarded (pylon tells the engine no priority on any of them, so no
route orders a request ahead of another); a JSON body must still name `x-model`'s model.
"""

from __future__ import annotations

from typing import ClassVar

from pylon.adapters.base import (
    NO_WRITE,
    SCHEDULED,
    AdapterOptions,
    PriorityAdapter,
    PriorityWrite,
    Route,
)


class PassthroughAdapter:
    name: ClassVar[str] = "passthrough"

    def __init__(self, options: AdapterOptions) -> None:
        del options  # nothing to configure

    def derive(self, rank: int | None) -> PriorityWrite:
        return NO_WRITE

    def route(self, method: str, path: str) -> Route | None:
        return SCHEDULED  # any route; nothing is written, so nothing jumps the queue

    def queue_level(self, rank: int | None) -> int:
        return 0  # the engine is told no priority: arrival order for everyone


_: type[PriorityAdapter] = PassthroughAdapter
