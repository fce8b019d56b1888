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


_: type[PriorityAdapter] = PassthroughAdapter
