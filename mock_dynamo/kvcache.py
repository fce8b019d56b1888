"""The mock engine's prefix cache: blocks, LRU eviction, hits and misses, and the KV events.

Pure (no sockets, no clock). Block ids are computed the way Dynamo's KV router computes them,
with pylon's one implementation of Dynamo's hashing (`pylon.core.blocks`), so a router fed this
cache's events (or the same token ids) arrives at the same ids:

- a prompt is cut into full blocks of `block_size` tokens (a trailing partial block is never
  cached);
- each block's *content* hash is `block_hashes(tokens, block_size, cache_salt=salt)`, Dynamo's
  `compute_block_hash_for_seq`;
- the block's *id* (the `block_hashes` of the events) is the prefix chain of those,
  `sequence_hashes`, Dynamo's `compute_seq_hash_for_block`.

The events are pylon's typed KV events (`pylon.core.kv_events`: `BlockStored`, `BlockRemoved`,
`AllBlocksCleared`), which the publisher encodes with the same module.

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

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pylon.core.blocks import block_hashes, ensure_available, sequence_hashes
from pylon.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent


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
        ensure_available()  # HashingUnavailable (an ImportError) without xxhash
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
    ) -> tuple[Admission, list[KvEvent]]:
        """Look the prompt up, then store its blocks; the events say what changed."""
        size, blocks = self.block_size, self._blocks
        ids = sequence_hashes(block_hashes(tokens, size, cache_salt=cache_salt))
        hittable = (len(tokens) - 1) // size if tokens else 0
        hit = 0
        while hit < min(len(ids), hittable) and ids[hit] in blocks:
            hit += 1
        present = hit
        while present < len(ids) and ids[present] in blocks:
            present += 1
        new = max(0, min(len(ids), self.capacity) - present)
        events: list[KvEvent] = []
        # Protect this request's own cached blocks, then evict from the cold end.
        for block_id in reversed(ids[:present]):
            blocks.move_to_end(block_id)
        overflow = len(blocks) + new - self.capacity
        for _ in range(max(0, overflow)):
            victim, _ = blocks.popitem(last=False)
            events.append(BlockRemoved((victim,)))
        if new:
            stored_ids = ids[present : present + new]
            for block_id in reversed(stored_ids):
                blocks[block_id] = None
            for block_id in reversed(ids[:present]):
                blocks.move_to_end(block_id)
            events.append(
                BlockStored(
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

    def clear(self) -> list[KvEvent]:
        """Drop every block (vLLM's reset_prefix_cache): one AllBlocksCleared."""
        self._blocks.clear()
        self.clears += 1
        return [AllBlocksCleared()]

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
