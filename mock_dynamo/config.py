"""Static configuration of a mock engine instance."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from pylon.core.kv_events import FORMS, Form

Flavor = Literal["dynamo", "vllm", "sglang"]
FLAVORS: tuple[str, ...] = get_args(Flavor)
DEFAULT_MODEL = "mock-model"
# How KV events are encoded inside vLLM's envelope: vLLM's positional arrays, or the maps
# ({"type": ...}) that SGLang and the Dynamo 1.6.1 mocker send (pylon.core.kv_events.Form).
KvEventsEncoding = Form
KV_EVENTS_ENCODINGS: tuple[str, ...] = FORMS
MAX_KV_BLOCK_SIZE = 1024


@dataclass(frozen=True, slots=True)
class MockConfig:
    """Start-up settings. Timing fields are only initial values: the
    `/test-control/knobs` endpoint can change them while the server runs."""

    flavor: Flavor = "dynamo"
    models: tuple[str, ...] = (DEFAULT_MODEL,)
    ttft_ms: float = 0.0
    token_delay_ms: float = 0.0
    num_tokens: int = 16
    capacity: int = 1000
    # The engine model (see mock_dynamo.engine). A prefix cache of `kv_cache_blocks` blocks of
    # `kv_block_size` tokens; 0 turns the cache off.
    kv_block_size: int = 16
    kv_cache_blocks: int = 0
    # Prefill speed: uncached prompt tokens add tokens / rate to the first token's delay; 0: free.
    prefill_tokens_per_s: float = 0.0
    # A local Hugging Face tokenizer dir (tokenizer.json, tokenizer_config.json); None: words.
    tokenizer: str | None = None
    # ZMQ PUB port on 127.0.0.1 for KV events (0 picks a free one); None: no events.
    kv_events_port: int | None = None
    kv_events_encoding: KvEventsEncoding = "array"

    def __post_init__(self) -> None:
        if self.flavor not in FLAVORS:
            raise ValueError(f"flavor must be one of {', '.join(FLAVORS)}, got {self.flavor!r}")
        if not self.models or any(not isinstance(m, str) or not m for m in self.models):
            raise ValueError("models must be a non-empty tuple of non-empty names")
        if self.ttft_ms < 0 or self.token_delay_ms < 0:
            raise ValueError("ttft_ms and token_delay_ms must be >= 0")
        if self.num_tokens < 0:
            raise ValueError("num_tokens must be >= 0")
        if self.capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._check_engine_model()

    def _check_engine_model(self) -> None:
        if not 1 <= self.kv_block_size <= MAX_KV_BLOCK_SIZE:
            raise ValueError(f"kv_block_size must be in 1..{MAX_KV_BLOCK_SIZE}")
        if self.kv_cache_blocks < 0:
            raise ValueError("kv_cache_blocks must be >= 0")
        if not (self.prefill_tokens_per_s >= 0 and math.isfinite(self.prefill_tokens_per_s)):
            raise ValueError("prefill_tokens_per_s must be a finite number >= 0")
        if self.kv_events_encoding not in KV_EVENTS_ENCODINGS:
            raise ValueError(f"kv_events_encoding must be one of {', '.join(KV_EVENTS_ENCODINGS)}")
        if self.kv_events_port is not None:
            if not 0 <= self.kv_events_port <= 65535:
                raise ValueError("kv_events_port must be in 0..65535")
            if self.kv_cache_blocks == 0:
                # Events without a cache would be a publisher that never says anything.
                raise ValueError("kv_events_port needs a prefix cache: set kv_cache_blocks > 0")

    @property
    def kv_enabled(self) -> bool:
        return self.kv_cache_blocks > 0
