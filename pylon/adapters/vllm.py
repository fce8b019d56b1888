"""vLLM: body `priority`, lower is scheduled first (with `--scheduling-policy priority`).

Writes body `priority = min(r, C)`; absent r -> C, the least urgent. Headers: nothing (the client's
`x-vllm-priority`, which would override the body, is stripped).

Routes (`ROUTES`): every route vLLM's OpenAI server queues whose request type reads a body
`priority` (where it is absent vLLM schedules at 0, the most urgent, so an unsteered route would
jump the queue), and `GET /v1/models`. Taken from vLLM's routers: `openai/chat_completion`,
`completion`, `responses`, `pooling/{embed,pooling,classify,score}` (`/score`, `/v1/score`,
`/rerank`, `/v1/rerank`, `/v2/rerank`), the Cohere `/v2/embed`, SageMaker's `/invocations` (run
as one of those, by body shape) and the token-in/token-out `/inference/v1/generate`. The pooling
routes' request types have no `stream` (`SCHEDULED_NO_STREAM`). Every other route is refused
(docs/api-contract.md, "Routes served").
"""

from __future__ import annotations

from typing import ClassVar

from pylon.adapters.base import (
    NOT_SCHEDULED,
    SCHEDULED,
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
    ("POST", "/v2/embed"): SCHEDULED_NO_STREAM,
    ("POST", "/pooling"): SCHEDULED_NO_STREAM,
    ("POST", "/classify"): SCHEDULED_NO_STREAM,
    ("POST", "/score"): SCHEDULED_NO_STREAM,
    ("POST", "/v1/score"): SCHEDULED_NO_STREAM,
    ("POST", "/rerank"): SCHEDULED_NO_STREAM,
    ("POST", "/v1/rerank"): SCHEDULED_NO_STREAM,
    ("POST", "/v2/rerank"): SCHEDULED_NO_STREAM,
    # Run as chat when the body has `messages`, as completions with `prompt` (the two read
    # `stream`), else as embeddings or a pooling task (no `stream`): vLLM tries them in order.
    ("POST", "/invocations"): Route(
        schedules=True, body_model=True, streams=True, stream_keys=("messages", "prompt")
    ),
    ("POST", "/inference/v1/generate"): SCHEDULED,
    ("GET", "/v1/models"): NOT_SCHEDULED,
    ("HEAD", "/v1/models"): NOT_SCHEDULED,
}


class VllmAdapter:
    name: ClassVar[str] = "vllm"

    def __init__(self, options: AdapterOptions) -> None:
        self._ceiling = options.ceiling

    def derive(self, rank: int | None) -> PriorityWrite:
        value = self.queue_level(rank)
        return PriorityWrite(body_priority=value, value=value)

    def route(self, method: str, path: str) -> Route | None:
        return ROUTES.get((method, path))

    def queue_level(self, rank: int | None) -> int:
        # vLLM serves lower values first: the body value is the order itself.
        return self._ceiling if rank is None else clamp_rank(rank, self._ceiling)


_: type[PriorityAdapter] = VllmAdapter
