"""vLLM: body `priority`, lower is scheduled first (with `--scheduling-policy priority`).

Writes body `priority = min(r, C)`; absent r -> C, the least urgent. Headers: nothing (the client's
`x-vllm-priority`, which would override the body, is stripped).
"""

from __future__ import annotations

from typing import ClassVar

from pylon.adapters.base import AdapterOptions, PriorityAdapter, PriorityWrite, clamp_rank


class VllmAdapter:
    name: ClassVar[str] = "vllm"

    def __init__(self, options: AdapterOptions) -> None:
        self._ceiling = options.ceiling

    def derive(self, rank: int | None) -> PriorityWrite:
        value = self.queue_level(rank)
        return PriorityWrite(body_priority=value, value=value)

    def queue_level(self, rank: int | None) -> int:
        # vLLM serves lower values first: the body value is the order itself.
        return self._ceiling if rank is None else clamp_rank(rank, self._ceiling)


_: type[PriorityAdapter] = VllmAdapter
