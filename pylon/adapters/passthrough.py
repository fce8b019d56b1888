"""Passthrough: pylon writes no priority at all; the strip still applies."""

from __future__ import annotations

from typing import ClassVar

from pylon.adapters.base import NO_WRITE, AdapterOptions, PriorityAdapter, PriorityWrite


class PassthroughAdapter:
    name: ClassVar[str] = "passthrough"

    def __init__(self, options: AdapterOptions) -> None:
        del options  # nothing to configure

    def derive(self, rank: int | None) -> PriorityWrite:
        return NO_WRITE

    def queue_level(self, rank: int | None) -> int:
        return 0  # the engine is told no priority: arrival order for everyone


_: type[PriorityAdapter] = PassthroughAdapter
