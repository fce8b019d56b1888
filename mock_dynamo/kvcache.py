"""The mock engine's prefix cache: blocks, LRU eviction, hits and misses, and the KV events.

Pure (no sockets, no clock). Block ids are computed the way Dynamo's KV router computes them,
so a router fed this cache's events (or the same token ids) arrives at the same ids:

- a prompt is cut into full blocks of `block_size` tokens (a trailing partial block is never
  cached);
- each block's *content* hash is `xxh3_64(little-endian u32 tokens, seed)`, seed 1337, plus
  `xxh3_64(cache_salt, seed=1)` when the request has a cache salt (wrapping mod 2**64): Dynamo's
  `compute_block_hash_for_seq(tokens, block_size, cache_namespace=salt)`;
- the block's *id* (the `block_hashes` of the events) chains them: the first block's id is its
  content hash, each later id is `xxh3_64(le_u64(parent id) + le_u64(content hash), seed=1337)`,
  Dynamo's `compute_seq_hash_for_block` (its `sequence_hashes`).

Cache behaviour follows vLLM's v1 prefix cache:
- a request hits the longest run of its leading blocks that the cache holds, but never its last
  token: a prompt whose every block is cached recomputes its last block (vLLM caps a hit at
  `num_tokens - 1`), so a repeated 640-token prompt hits 624 tokens with 16-token blocks;
- a request's blocks are stored when it is admitted (vLLM caches blocks as it schedules them, so
  a concurrent request with the same prefix already hits them), in one `BlockStored` whose
  `parent_block_hash` is the id of the block before the first new one;
- when the cache is full, the least recently used blocks go, one `BlockRemoved` per block (as
  vLLM sends). A request touches its blocks last-to-first, so a sequence's tail is always older
  than its head and is evicted first: the cache holds whole prefixes, never a block without its
  parent. Blocks of the request being admitted are never evicted for it; a prompt longer than
  the whole cache stores its first `capacity` blocks only;
- generated (output) tokens are not cached.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

XXH3_SEED = 1337
U64_MASK = (1 << 64) - 1
U32_MAX = (1 << 32) - 1


def salt_seed(cache_salt: str | None = None, lora_name: str | None = None) -> int:
    """The content-hash seed: 1337 plus the LoRA name and cache-salt terms (empty = absent)."""
    seed = XXH3_SEED
    if lora_name:
        seed += xxhash.xxh3_64_intdigest(lora_name.encode("utf-8"), seed=0)
    if cache_salt:
        seed += xxhash.xxh3_64_intdigest(cache_salt.encode("utf-8"), seed=1)
    return seed & U64_MASK


def block_content_hashes(
    tokens: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[int]:
    """Dynamo's `compute_block_hash_for_seq`: one content hash per full block."""
    seed = salt_seed(cache_salt)
    pack = struct.Struct(f"<{block_size}I").pack
    return [
        xxhash.xxh3_64_intdigest(pack(*tokens[start : start + block_size]), seed=seed)
        for start in range(0, len(tokens) - block_size + 1, block_size)
    ]


def chain_hashes(content_hashes: Sequence[int]) -> list[int]:
    """Dynamo's `compute_seq_hash_for_block`: the prefix-chained block ids."""
    out: list[int] = []
    pair = struct.Struct("<QQ").pack
    for content in content_hashes:
        out.append(
            content if not out else xxhash.xxh3_64_intdigest(pair(out[-1], content), XXH3_SEED)
        )
    return out


@dataclass(frozen=True, slots=True)
class Stored:
    block_hashes: tuple[int, ...]
    parent_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


CacheEvent = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class Admission:
    """What the cache made of one prompt (token counts, and blocks: `hit` + `miss` = its full
    blocks)."""

    prompt_tokens: int
    cached_tokens: int
    hit_blocks: int
    miss_blocks: int
    stored_blocks: int
    evicted_blocks: int

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    def to_json(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_blocks": self.hit_blocks,
            "miss_blocks": self.miss_blocks,
            "stored_blocks": self.stored_blocks,
            "evicted_blocks": self.evicted_blocks,
        }


class PrefixCache:
    """`capacity` blocks of `block_size` tokens, LRU, with counters (see the module docstring)."""

    def __init__(self, block_size: int, capacity: int) -> None:
        if block_size < 1 or capacity < 1:
            raise ValueError("block_size and capacity must be >= 1")
        self.block_size = block_size
        self.capacity = capacity
        # Block id -> None, least recently used first.
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.reset_counters()

    def reset_counters(self) -> None:
        self.requests = 0
        self.hits = 0
        self.misses = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.stored = 0
        self.evicted = 0
        self.clears = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def block_ids(self) -> list[int]:
        """Held block ids, least recently used first."""
        return list(self._blocks)

    def admit(
        self, tokens: Sequence[int], cache_salt: str | None = None
    ) -> tuple[Admission, list[CacheEvent]]:
        """Look the prompt up, then store its blocks; the events say what changed."""
        size, blocks = self.block_size, self._blocks
        ids = chain_hashes(block_content_hashes(tokens, size, cache_salt))
        hittable = (len(tokens) - 1) // size if tokens else 0
        hit = 0
        while hit < min(len(ids), hittable) and ids[hit] in blocks:
            hit += 1
        present = hit
        while present < len(ids) and ids[present] in blocks:
            present += 1
        new = max(0, min(len(ids), self.capacity) - present)
        events: list[CacheEvent] = []
        # Protect this request's own cached blocks, then evict from the cold end.
        for block_id in reversed(ids[:present]):
            blocks.move_to_end(block_id)
        overflow = len(blocks) + new - self.capacity
        for _ in range(max(0, overflow)):
            victim, _ = blocks.popitem(last=False)
            events.append(Removed((victim,)))
        if new:
            stored_ids = ids[present : present + new]
            for block_id in reversed(stored_ids):
                blocks[block_id] = None
            for block_id in reversed(ids[:present]):
                blocks.move_to_end(block_id)
            events.append(
                Stored(
                    block_hashes=tuple(stored_ids),
                    parent_hash=ids[present - 1] if present else None,
                    token_ids=tuple(tokens[present * size : (present + new) * size]),
                    block_size=size,
                    cache_salt=cache_salt or None,
                )
            )
        admission = Admission(
            prompt_tokens=len(tokens),
            cached_tokens=hit * size,
            hit_blocks=hit,
            miss_blocks=len(ids) - hit,
            stored_blocks=new,
            evicted_blocks=max(0, overflow),
        )
        self._count(admission)
        return admission, events

    def _count(self, admission: Admission) -> None:
        self.requests += 1
        self.hits += admission.hit_blocks
        self.misses += admission.miss_blocks
        self.prompt_tokens += admission.prompt_tokens
        self.cached_tokens += admission.cached_tokens
        self.stored += admission.stored_blocks
        self.evicted += admission.evicted_blocks

    def clear(self) -> list[CacheEvent]:
        """Drop every block (vLLM's reset_prefix_cache): one AllBlocksCleared."""
        self._blocks.clear()
        self.clears += 1
        return [Cleared()]

    def view(self) -> dict[str, Any]:
        looked_up = self.hits + self.misses
        return {
            "block_size": self.block_size,
            "capacity": self.capacity,
            "blocks": len(self._blocks),
            "requests": self.requests,
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hits / looked_up if looked_up else 0.0,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "token_hit_rate": self.cached_tokens / self.prompt_tokens
            if self.prompt_tokens
            else 0.0,
            "stored": self.stored,
            "evicted": self.evicted,
            "clears": self.clears,
        }
