"""A prompt hashed for a `SelectRequest`: Dynamo's block and sequence hashes as a `HashedPrompt`.

The hashing itself is `pylon.core.blocks` (the one implementation, shared with pylon's KV routing
and mock_dynamo's prefix cache); this module only shapes its output into the native wire form
(signed i64) and turns a missing xxhash into router_ffi's `DependencyMissing`.

xxhash ships with the `dynamo` extra; it is imported on first use, so importing router_ffi never
fails.
"""

from __future__ import annotations

from collections.abc import Sequence

from pylon.core.blocks import HashingUnavailable, block_hashes, sequence_hashes, to_i64
from router_ffi.errors import DependencyMissing
from router_ffi.types import HashedPrompt


def hash_prompt(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> HashedPrompt:
    """A prompt hashed once, ready for `SelectRequest(prompt=...)` (signed i64 hashes).

    `DependencyMissing` without xxhash; `ValueError` for a block size < 1, `OverflowError` for a
    token id outside u32."""
    try:
        content = block_hashes(token_ids, block_size, lora_name=lora_name, cache_salt=cache_salt)
        chained = sequence_hashes(content)
    except HashingUnavailable as exc:
        raise DependencyMissing("xxhash", str(exc)) from exc
    return HashedPrompt(
        block_hashes=[to_i64(x) for x in content],
        sequence_hashes=[to_i64(x) for x in chained],
        isl_tokens=len(token_ids),
    )
