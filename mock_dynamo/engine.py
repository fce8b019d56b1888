"""The mock's engine model: tokenize the prompt, look it up in the prefix cache, time the prefill.

Off by default (the mock then counts prompt words and waits `ttft_ms`, as it always did). It is
on when any of `tokenizer`, `kv_cache_blocks > 0` or `prefill_tokens_per_s > 0` is set:

- prompts are tokenized (`mock_dynamo.tokens`: the model dir's tokenizer and chat template
  through pylon's `pylon.tokenize`, in the dialect of the mock's flavor, or words) and
  `usage.prompt_tokens` is their count;
- with a cache (`mock_dynamo.kvcache`), the request's leading cached blocks are its
  `cached_tokens` (also in `usage.prompt_tokens_details.cached_tokens`), its blocks are stored,
  and the cache's events go to the KV-event publisher when there is one;
- the first token waits `ttft_ms + queue + uncached_tokens / prefill_tokens_per_s`. Prefills run
  one at a time in arrival order, as on one GPU: `queue` is the time until the prefills admitted
  before this one are done (0 when the engine is idle). Decoding is not queued.

The cache salt is the request's `cache_salt`, else `nvext.cache_salt` (what pylon writes for
vLLM and for Dynamo); salted prompts share blocks only with the same salt.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from mock_dynamo.config import MockConfig
from mock_dynamo.tokens import Endpoint, PromptTokenizer, load_tokenizer, prompts, token_data
from pylon.core.blocks import HashingUnavailable

if TYPE_CHECKING:
    from mock_dynamo.kvcache import PrefixCache
    from pylon.core.kv_events import KvEvent


class EventSink(Protocol):
    """Where the cache's events go (mock_dynamo.kv_publisher.KvEventPublisher)."""

    next_seq: int  # the next message's sequence number (settable: tests make gaps with it)

    def publish(self, events: list[KvEvent]) -> None: ...

    def view(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


MISSING_XXHASH = "--kv-cache-blocks needs the 'xxhash' package: pip install -e '.[mock-kv]'"


@dataclass(frozen=True, slots=True)
class PromptPlan:
    """One generation request's prompt as the engine model saw it."""

    prompt_tokens: int
    # None without a prefix cache.
    cached_tokens: int | None
    hit_blocks: int
    miss_blocks: int
    queue_s: float
    prefill_s: float

    @property
    def first_token_delay_s(self) -> float:
        """Prefill's share of the time to first token (the `ttft_ms` knob comes on top)."""
        return self.queue_s + self.prefill_s

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_blocks": self.hit_blocks,
            "miss_blocks": self.miss_blocks,
            "queue_s": self.queue_s,
            "prefill_s": self.prefill_s,
        }


def cache_salt(body: dict[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    if isinstance(salt, str) and salt:
        return salt
    nvext = body.get("nvext")
    salt = nvext.get("cache_salt") if isinstance(nvext, dict) else None
    return salt if isinstance(salt, str) and salt else None


class EngineModel:
    """Tokenizer, prefix cache and prefill lane of one mock engine."""

    def __init__(self, config: MockConfig) -> None:
        self.tokenizer: PromptTokenizer | None = (
            load_tokenizer(config.tokenizer, config.flavor)
            if config.tokenizer or config.kv_enabled
            else None
        )
        # A Dynamo frontend takes a router's `nvext.token_data` as the prompt, untemplated.
        self.takes_token_data = config.flavor == "dynamo"
        self.cache: PrefixCache | None = None
        if config.kv_enabled:
            from mock_dynamo.kvcache import PrefixCache

            try:  # without a cache the mock needs no xxhash (imported by the cache's hashing)
                self.cache = PrefixCache(config.kv_block_size, config.kv_cache_blocks)
            except HashingUnavailable:
                raise ValueError(MISSING_XXHASH) from None
        # Monotonic time at which the prefills admitted so far are done.
        self._lane_free_at = 0.0
        # Set by the app while a KV-event publisher runs.
        self.events: EventSink | None = None

    def prompt_ids(self, endpoint: Endpoint, body: dict[str, Any]) -> list[list[int]]:
        """Each prompt's token ids as the engine sees them. ValueError: a prompt it refuses."""
        assert self.tokenizer is not None
        given = token_data(body) if self.takes_token_data else None
        if given is not None:
            return [given]
        return prompts(self.tokenizer, endpoint, body)

    def active(self, prefill_tokens_per_s: float) -> bool:
        return self.tokenizer is not None or prefill_tokens_per_s > 0

    def plan(
        self,
        endpoint: Endpoint,
        body: dict[str, Any],
        *,
        now: float,
        prefill_tokens_per_s: float,
        word_count: Callable[[], int],
    ) -> PromptPlan:
        """Admit one request at monotonic time `now`. ValueError: a prompt the engine refuses."""
        cached: int | None = None
        hits = misses = 0
        if self.tokenizer is None:
            total = word_count()
        else:
            token_lists = self.prompt_ids(endpoint, body)
            total = sum(len(t) for t in token_lists)
            if self.cache is not None:
                cached = 0
                salt = cache_salt(body)
                events: list[KvEvent] = []
                for tokens in token_lists:
                    admission, more = self.cache.admit(tokens, salt)
                    cached += admission.cached_tokens
                    hits += admission.hit_blocks
                    misses += admission.miss_blocks
                    events.extend(more)
                if events and self.events is not None:
                    self.events.publish(events)
        total = max(1, total)
        uncached = total - (cached or 0)
        queue_s = prefill_s = 0.0
        if prefill_tokens_per_s > 0:
            start = max(now, self._lane_free_at)
            prefill_s = uncached / prefill_tokens_per_s
            self._lane_free_at = start + prefill_s
            queue_s = start - now
        return PromptPlan(total, cached, hits, misses, queue_s, prefill_s)

    def clear_cache(self) -> None:
        """Drop every cached block (an AllBlocksCleared event); counters stay."""
        if self.cache is None:
            return
        events = self.cache.clear()
        if self.events is not None:
            self.events.publish(events)

    def reset(self) -> None:
        """Clear the cache and its counters, and forget queued prefills."""
        self.clear_cache()
        if self.cache is not None:
            self.cache.reset_counters()
        self._lane_free_at = 0.0

    def view(self) -> dict[str, Any]:
        cache = self.cache.view() if self.cache is not None else None
        return {
            "enabled": self.cache is not None,
            "tokenizer": None if self.tokenizer is None else self.tokenizer.name,
            **(cache or {}),
            "events": None if self.events is None else self.events.view(),
        }
