"""SGLang: body `priority`; by default a higher value is scheduled first.

Default polarity: `priority = C - min(r, C)`, absent r -> 0 (least urgent).
With `--sglang-low-priority-first` (engine runs `--schedule-low-priority-values-first`):
`priority = min(r, C)`, absent -> C. Headers: nothing (`x-override-*` is stripped).

Routes (`ROUTES`), from SGLang's `srt/entrypoints/http_server.py`: the OpenAI routes whose request
types read a body `priority` (chat, completions, responses, embeddings, `/v1/classify`), SageMaker's
`/invocations` (run as chat), the native `/generate` (POST and PUT; `GenerateReqInput` has no
`model` field: SGLang serves the model it was started with), and `GET /v1/models`. Every other
route is refused (docs/api-contract.md, "Routes served").
"""

from __future__ import annotations

from typing import ClassVar

from pylon.adapters.base import (
    NOT_SCHEDULED,
    SCHEDULED,
    SCHEDULED_NO_MODEL_FIELD,
    SCHEDULED_NO_STREAM,
    AdapterOptions,
    PriorityAdapter,
    PriorityWrite,
    Route,
    RouteTable,
    clamp_rank,
)

ROUTES: RouteTable = {
    ("POST", "/v1/chat/completions"): SCHEDULED,
    ("POST", "/v1/completions"): SCHEDULED,
    ("POST", "/v1/responses"): SCHEDULED,
    ("POST", "/v1/embeddings"): SCHEDULED_NO_STREAM,
    ("POST", "/v1/classify"): SCHEDULED_NO_STREAM,
    ("POST", "/invocations"): SCHEDULED,
    ("POST", "/generate"): SCHEDULED_NO_MODEL_FIELD,
    ("PUT", "/generate"): SCHEDULED_NO_MODEL_FIELD,
    ("GET", "/v1/models"): NOT_SCHEDULED,
    ("HEAD", "/v1/models"): NOT_SCHEDULED,
}


class SglangAdapter:
    name: ClassVar[str] = "sglang"

    def __init__(self, options: AdapterOptions) -> None:
        self._ceiling = options.ceiling
        self._low_first = options.sglang_low_priority_first

    def derive(self, rank: int | None) -> PriorityWrite:
        value = self._value(rank)
        return PriorityWrite(body_priority=value, value=value)

    def route(self, method: str, path: str) -> Route | None:
        return ROUTES.get((method, path))

    def queue_level(self, rank: int | None) -> int:
        value = self._value(rank)
        # Low-first: the value is the order. Otherwise higher values run first: invert.
        return value if self._low_first else self._ceiling - value

    def _value(self, rank: int | None) -> int:
        if self._low_first:
            return self._ceiling if rank is None else clamp_rank(rank, self._ceiling)
        return 0 if rank is None else self._ceiling - clamp_rank(rank, self._ceiling)


_: type[PriorityAdapter] = SglangAdapter
