"""Dynamo 1.6.1 block hashing (xxhash), bit-exact with the native router: the one implementation.

pylon's KV-aware routing, router_ffi's `hash_prompt` and mock_dynamo's prefix cache all hash here.

- Content hash of a full block: `xxh3_64(little-endian u32 token ids, seed)`; a trailing partial
  block is dropped. The seed is 1337, plus `xxh3_64(lora_name, seed=0)` when a LoRA name is set,
  plus `xxh3_64(cache_salt, seed=1)` when a salt is set (wrapping mod 2^64; empty = absent).
  Equal to `dynamo._core.compute_block_hash_for_seq(tokens, block_size, lora_name=,
  cache_namespace=)` (tested against it under the `dynamo` marker, and against fixed vectors).
- Sequence hash (the prefix chain the router indexes, and the block ids in the engines' KV
  events): the first block's content hash, then
  `xxh3_64(u64 LE parent_sequence_hash || u64 LE content_hash, seed=1337)`
  (Dynamo's `compute_seq_hash_for_block`, its `sequence_hashes`).
- All values are unsigned 64-bit; Dynamo's wire form for them is signed i64 (`to_i64`, `to_u64`).

xxhash is optional: it ships with the `dynamo` extra (which KV-aware routing needs anyway, for
router_ffi's native core), the `mock-kv` extra and `dev`. It is imported on first use, so that
importing pylon never needs it; a missing xxhash raises `HashingUnavailable` (an `ImportError`).
Code that will hash checks `ensure_available()` at start-up, so that the lack is a refusal to
start, not a failed request.
"""

from __future__ import annotations

import array
import struct
import sys
from collections.abc import Callable, Sequence

__all__ = [
    "BASE_SEED",
    "HashingUnavailable",
    "block_hashes",
    "block_seed",
    "ensure_available",
    "sequence_hashes",
    "to_i64",
    "to_u64",
]

BASE_SEED = 1337
_U64 = 1 << 64
_I64_MAX = (1 << 63) - 1
_pack_pair = struct.Struct("<QQ").pack
# Token ids are packed as native u32 (array 'I'), then byte-swapped on a big-endian host.
_SWAP = sys.byteorder == "big"
assert array.array("I").itemsize == 4

_xxh3: Callable[..., int] | None = None


class HashingUnavailable(ImportError):
    """xxhash is not importable, so no block can be hashed."""


def _hasher() -> Callable[..., int]:
    global _xxh3
    if _xxh3 is None:
        try:
            import xxhash
        except ImportError as exc:
            raise HashingUnavailable(f"block hashing needs the xxhash package ({exc})") from exc
        _xxh3 = xxhash.xxh3_64_intdigest
    return _xxh3


def ensure_available() -> None:
    """Raise `HashingUnavailable` now if hashing would fail later (for start-up checks)."""
    _hasher()


def block_seed(*, lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """The xxh3 seed of a prompt's content hashes (1337, shifted by LoRA name and salt)."""
    h = _hasher()
    seed = BASE_SEED
    if lora_name:
        seed += h(lora_name.encode("utf-8"), 0)
    if cache_salt:
        seed += h(cache_salt.encode("utf-8"), 1)
    return seed % _U64


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """Unsigned content hashes of the full blocks of `token_ids` (== compute_block_hash_for_seq).

    Token ids must be u32 (`OverflowError` otherwise); `block_size` must be >= 1."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    h = _hasher()
    seed = block_seed(lora_name=lora_name, cache_salt=cache_salt)
    packed = array.array("I", token_ids)
    if _SWAP:
        packed.byteswap()
    buf = memoryview(packed).cast("B")
    width = block_size * 4
    return [
        h(buf[i : i + width], seed) for i in range(0, (len(token_ids) // block_size) * width, width)
    ]


def sequence_hashes(content_hashes: Sequence[int]) -> list[int]:
    """Unsigned prefix-chained sequence hashes (block ids) of unsigned content hashes."""
    h = _hasher()
    out: list[int] = []
    parent: int | None = None
    for content in content_hashes:
        parent = content if parent is None else h(_pack_pair(parent, content), BASE_SEED)
        out.append(parent)
    return out


def to_i64(value: int) -> int:
    """A u64 as the signed i64 with the same bits (Dynamo's wire form for hashes)."""
    return value - _U64 if value > _I64_MAX else value


def to_u64(value: int) -> int:
    """The inverse of `to_i64`."""
    return value + _U64 if value < 0 else value
