"""router_ffi.hashing.hash_prompt: pylon.core.blocks' hashes in the native wire form (signed i64),
and router_ffi's error for a missing xxhash. (The hashing itself: tests/unit/test_blocks.py.)"""

from __future__ import annotations

import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pylon.core import blocks
from pylon.core.blocks import block_hashes, sequence_hashes, to_u64
from router_ffi import DependencyMissing
from router_ffi.hashing import hash_prompt

tokens_st = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=200)
size_st = st.sampled_from([1, 2, 4, 8, 16, 32, 64])


@given(tokens_st, size_st)
def test_hash_prompt_is_the_signed_chain(tokens: list[int], size: int) -> None:
    prompt = hash_prompt(tokens, size, cache_salt="t")
    content = block_hashes(tokens, size, cache_salt="t")
    assert [to_u64(h) for h in prompt.block_hashes] == content
    assert [to_u64(h) for h in prompt.sequence_hashes] == sequence_hashes(content)
    assert all(-(2**63) <= h < 2**63 for h in prompt.block_hashes + prompt.sequence_hashes)
    assert prompt.isl_tokens == len(tokens)


def test_hash_prompt_keeps_the_native_vector() -> None:
    prompt = hash_prompt(list(range(100, 148)), 16)
    assert prompt.sequence_hashes == [-7623552809318391097, 4102179227871607950, -36008782455231298]


def test_a_missing_xxhash_is_dependency_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blocks, "_xxh3", None)
    monkeypatch.setitem(sys.modules, "xxhash", None)
    with pytest.raises(DependencyMissing) as info:
        hash_prompt([1, 2], 1)
    assert info.value.module == "xxhash"
    assert "pip install 'pylon[dynamo]'" in str(info.value)


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError):
        hash_prompt([1, 2], 0)
    with pytest.raises(OverflowError):
        hash_prompt([2**32], 1)
