"""Builders for OpenAI-compatible reply bodies and SSE event sequences.

Streams are produced as `(delay_seconds, bytes)` pairs so the writer in
`app.py` owns all timing and fault injection, and these stay pure.
"""

from __future__ import annotations

import base64
import hashlib
import struct
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from mock_dynamo.engine import PromptPlan

Event = tuple[float, bytes]
DONE = b"data: [DONE]\n\n"

# A short fixed vocabulary keeps replies deterministic and readable.
_VOCAB = ("Hello", ",", " this", " is", " a", " mock", " reply", " from", " the", " engine", ".")


@dataclass(frozen=True, slots=True)
class ReplyPlan:
    model: str
    n_tokens: int
    finish_reason: str
    prompt_tokens: int
    ttft_s: float
    token_delay_s: float
    include_usage: bool
    # Prompt tokens served from the prefix cache; None when the mock models no cache.
    cached_tokens: int | None = None
    # The engine model's view of the prompt (mock_dynamo.engine.PromptPlan), when it is on.
    prompt: PromptPlan | None = None

    @property
    def total_delay_s(self) -> float:
        """Wall time a non-streaming reply takes to "generate"."""
        return self.ttft_s + self.token_delay_s * max(0, self.n_tokens - 1)

    def tokens(self) -> Iterator[str]:
        return (_VOCAB[i % len(_VOCAB)] for i in range(self.n_tokens))

    def text(self) -> str:
        return "".join(self.tokens())

    def usage(self) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.n_tokens,
            "total_tokens": self.prompt_tokens + self.n_tokens,
        }
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage


def count_words(value: object) -> int:
    """Rough prompt-token estimate: words in every string, one per token id."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, int):
        return 1
    if isinstance(value, list):
        return sum(count_words(v) for v in value)
    if isinstance(value, dict):
        # Only text-bearing fields: roles and part types are not prompt tokens.
        return sum(count_words(value.get(k)) for k in ("content", "text"))
    return 0


def sse(payload: dict[str, Any], event: str | None = None) -> bytes:
    data = b"data: " + orjson.dumps(payload) + b"\n\n"
    return b"event: " + event.encode() + b"\n" + data if event else data


def _delays(plan: ReplyPlan) -> Iterator[float]:
    """Delay before each token: TTFT for the first, the inter-token gap after."""
    yield plan.ttft_s
    while True:
        yield plan.token_delay_s


# --- chat completions -------------------------------------------------------


def chat_body(plan: ReplyPlan) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": plan.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": plan.text()},
                "logprobs": None,
                "finish_reason": plan.finish_reason,
            }
        ],
        "usage": plan.usage(),
    }


def chat_stream(plan: ReplyPlan) -> Iterator[Event]:
    base = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": plan.model,
    }

    def chunk(delta: dict[str, str], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return sse({**base, "choices": [choice]})

    # Engines emit the role chunk together with the first generated token, so
    # it carries the TTFT; the first content chunk follows immediately.
    delays = _delays(plan)
    yield next(delays), chunk({"role": "assistant", "content": ""})
    for i, token in enumerate(plan.tokens()):
        yield (0.0 if i == 0 else next(delays)), chunk({"content": token})
    yield 0.0, chunk({}, plan.finish_reason)
    if plan.include_usage:
        yield 0.0, sse({**base, "choices": [], "usage": plan.usage()})
    yield 0.0, DONE


# --- legacy completions -----------------------------------------------------


def completion_body(plan: ReplyPlan) -> dict[str, Any]:
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": plan.model,
        "choices": [
            {"index": 0, "text": plan.text(), "logprobs": None, "finish_reason": plan.finish_reason}
        ],
        "usage": plan.usage(),
    }


def completion_stream(plan: ReplyPlan) -> Iterator[Event]:
    base = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": plan.model,
    }

    def chunk(text: str, finish: str | None = None) -> bytes:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return sse({**base, "choices": [choice]})

    delays = _delays(plan)
    for token in plan.tokens():
        yield next(delays), chunk(token)
    # With zero tokens the finish chunk is the first output, so it pays TTFT.
    yield (next(delays) if plan.n_tokens == 0 else 0.0), chunk("", plan.finish_reason)
    if plan.include_usage:
        yield 0.0, sse({**base, "choices": [], "usage": plan.usage()})
    yield 0.0, DONE


# --- responses API ----------------------------------------------------------


def _response_object(plan: ReplyPlan, rid: str, msg_id: str, done: bool) -> dict[str, Any]:
    content = [{"type": "output_text", "text": plan.text(), "annotations": []}]
    message = {
        "type": "message",
        "id": msg_id,
        "status": "completed",
        "role": "assistant",
        "content": content,
    }
    usage: dict[str, Any] = {
        "input_tokens": plan.prompt_tokens,
        "output_tokens": plan.n_tokens,
        "total_tokens": plan.prompt_tokens + plan.n_tokens,
    }
    if plan.cached_tokens is not None:
        usage["input_tokens_details"] = {"cached_tokens": plan.cached_tokens}
    incomplete = plan.finish_reason == "length"
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "model": plan.model,
        "status": ("incomplete" if incomplete else "completed") if done else "in_progress",
        "incomplete_details": {"reason": "max_output_tokens"} if done and incomplete else None,
        "output": [message] if done else [],
        "usage": usage if done else None,
    }


def responses_body(plan: ReplyPlan) -> dict[str, Any]:
    return _response_object(plan, f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}", True)


def responses_stream(plan: ReplyPlan) -> Iterator[Event]:
    rid, msg_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
    seq = iter(range(1 << 62))
    loc = {"item_id": msg_id, "output_index": 0, "content_index": 0}

    def ev(kind: str, **payload: Any) -> bytes:
        return sse({"type": kind, "sequence_number": next(seq), **payload}, event=kind)

    started = _response_object(plan, rid, msg_id, False)
    item = {
        "type": "message",
        "id": msg_id,
        "status": "in_progress",
        "role": "assistant",
        "content": [],
    }
    part = {"type": "output_text", "text": "", "annotations": []}
    yield 0.0, ev("response.created", response=started)
    yield 0.0, ev("response.in_progress", response=started)
    yield 0.0, ev("response.output_item.added", output_index=0, item=item)
    yield 0.0, ev("response.content_part.added", **loc, part=part)
    delays = _delays(plan)
    for token in plan.tokens():
        yield next(delays), ev("response.output_text.delta", **loc, delta=token)
    final = _response_object(plan, rid, msg_id, True)
    text_part = final["output"][0]["content"][0]
    yield (
        (next(delays) if plan.n_tokens == 0 else 0.0),
        ev("response.output_text.done", **loc, text=plan.text()),
    )
    yield 0.0, ev("response.content_part.done", **loc, part=text_part)
    yield 0.0, ev("response.output_item.done", output_index=0, item=final["output"][0])
    # Like vLLM, always close with response.completed; a max_output_tokens
    # cut-off shows only in response.status ("incomplete").
    yield 0.0, ev("response.completed", response=final)


# --- embeddings -------------------------------------------------------------


def _embedding_inputs(raw: object) -> list[object]:
    """OpenAI accepts a string, a token list, or a list of either."""
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw):
        return [raw]
    if isinstance(raw, list) and raw:
        return list(raw)
    raise ValueError("input must be a non-empty string or list")


def embedding_vector(item: object, dims: int) -> list[float]:
    """Deterministic unit-range floats derived from a hash of the input."""
    digest = hashlib.shake_256(orjson.dumps(item)).digest(4 * dims)
    words = struct.unpack(f"<{dims}I", digest)
    return [round(w / 0xFFFFFFFF * 2.0 - 1.0, 6) for w in words]


def embeddings_body(model: str, raw_input: object, dims: int, fmt: str) -> dict[str, Any]:
    items = _embedding_inputs(raw_input)
    data: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        vector = embedding_vector(item, dims)
        encoded: object = vector
        if fmt == "base64":
            encoded = base64.b64encode(struct.pack(f"<{dims}f", *vector)).decode()
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    prompt_tokens = max(1, count_words(items))
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
