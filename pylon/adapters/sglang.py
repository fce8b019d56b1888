"""SGLang: body `priority`; by default a higher value is scheduled first.

Default polarity: `priority = C - min(r, C)`, absent r -> 0 (least urgent).
With `--sglang-low-priority-first` (engine runs `--schedule-low-priority-values-first`):
`priority = min(r, C)`, absent -> C. Headers: nothing (`x-override-*` is stripped).
"""

from __future__ import annotations

from typing import ClassVar

from pylon.adapters.base import AdapterOptions, PriorityAdapter, PriorityWrite, clamp_rank


class SglangAdapter:
    name: ClassVar[str] = "sglang"

    def __init__(self, options: AdapterOptions) -> None:
        self._ceiling = options.ceiling
        self._low_first = options.sglang_low_priority_first

    def derive(self, rank: int | None) -> PriorityWrite:
        value = self._value(rank)
        return PriorityWrite(body_priority=value, value=value)

    def queue_level(self, rank: int | None) -> int:
        value = self._value(rank)
        # Low-first: the value is the order. Otherwise higher values run first: invert.
        return value if self._low_first else self._ceiling - value

    def _value(self, rank: int | None) -> int:
        if self._low_first:
            return self._ceiling if rank is None else clamp_rank(rank, self._ceiling)
        return 0 if rank is None else self._ceiling - clamp_rank(rank, self._ceiling)


_: type[PriorityAdapter] = SglangAdapter
