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
        if self._low_first:
            value = self._ceiling if rank is None else clamp_rank(rank, self._ceiling)
        else:
            value = 0 if rank is None else self._ceiling - clamp_rank(rank, self._ceiling)
        return PriorityWrite(body_priority=value, value=value)


_: type[PriorityAdapter] = SglangAdapter
