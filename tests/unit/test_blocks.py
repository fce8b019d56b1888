"""pylon.core.blocks, Dynamo's block hashing: fixed vectors printed by the 1.6.1 native core, an
independent write-up of the algorithm, and properties. (The bit-exact comparison against the
native `compute_block_hash_for_seq` on random inputs is in tests/router_ffi/test_native.py and
tests/dynamo/test_mock_kv.py, under the `dynamo` marker.)"""

from __future__ import annotations

import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("xxhash", reason="pip install -e '.[dev]'")

from pylon.core import blocks
from pylon.core.blocks import (
    HashingUnavailable,
    block_hashes,
    block_seed,
    ensure_available,
    sequence_hashes,
    to_i64,
    to_u64,
)
from tests.mock_dynamo.kv_helpers import reference_ids

# compute_block_hash_for_seq(tokens, block_size, lora_name=, cache_namespace=) on 1.6.1.
VECTORS = [
    (list(range(40)), 16, None, None, [15310707395893867146, 15292316782987903195]),
    (list(range(40)), 16, None, "tenant-a", [2130915519417463704, 14342547135021016991]),
    (list(range(40)), 16, "lora-x", None, [6953624899002871923, 9171188290829005176]),
    (list(range(40)), 16, "lora-x", "tenant-a", [2860446151562390357, 5939071865607955529]),
    ([2**32 - 1, 0, 7, 123456789] * 8, 4, None, "é租户", [11620928351072342177] * 8),
    (
        list(range(100, 164)),
        1,
        None,
        None,
        [12915512876420934230, 10561049055309327483, 10814973089139326741],
    ),
    (
        list(range(100, 148)),
        16,
        None,
        None,
        [10823191264391160519, 1219978239041041138, 11579058346470406089],
    ),
]


@pytest.mark.parametrize(("tokens", "size", "lora", "salt", "expected"), VECTORS)
def test_block_hashes_match_the_native_vectors(
    tokens: list[int], size: int, lora: str | None, salt: str | None, expected: list[int]
) -> None:
    got = block_hashes(tokens, size, lora_name=lora, cache_salt=salt)
    assert got[: len(expected)] == expected
    assert len(got) == len(tokens) // size


def test_sequence_hashes_match_the_native_chain() -> None:
    # The `sequence_hashes` a SelectionService selection returned for the same prompts (i64).
    content = block_hashes(list(range(40)), 16)
    assert sequence_hashes(content) == [15310707395893867146, 13769157705258532664]
    one = block_hashes(list(range(100, 164)), 1)
    assert sequence_hashes(one)[:3] == [
        12915512876420934230,
        4341091374283856370,
        10713079147237632182,
    ]
    printed_i64 = [-7623552809318391097, 4102179227871607950, -36008782455231298]
    ids = sequence_hashes(block_hashes(list(range(100, 148)), 16))
    assert [to_i64(h) for h in ids] == printed_i64


tokens_st = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=200)
size_st = st.sampled_from([1, 2, 4, 8, 16, 32, 64])
name_st = st.none() | st.text(max_size=12)


@given(
    tokens=st.lists(st.integers(0, (1 << 32) - 1), max_size=40),
    size=st.integers(1, 9),
    salt=st.none() | st.text(max_size=5),
)
def test_block_ids_match_an_independent_computation(
    tokens: list[int], size: int, salt: str | None
) -> None:
    ids = sequence_hashes(block_hashes(tokens, size, cache_salt=salt))
    assert ids == reference_ids(tokens, size, salt)


@given(tokens_st, size_st, name_st, name_st)
def test_a_prefix_hashes_to_a_prefix(
    tokens: list[int], size: int, lora: str | None, salt: str | None
) -> None:
    full = block_hashes(tokens, size, lora_name=lora, cache_salt=salt)
    assert len(full) == len(tokens) // size  # a trailing partial block is dropped
    for cut in (0, len(tokens) // 2, len(tokens)):
        part = block_hashes(tokens[:cut], size, lora_name=lora, cache_salt=salt)
        assert full[: len(part)] == part
    chained = sequence_hashes(full)
    assert chained[:1] == full[:1]
    assert sequence_hashes(full[: len(full) // 2]) == chained[: len(full) // 2]
    assert all(0 <= h < 2**64 for h in full + chained)


@given(tokens_st.filter(lambda t: len(t) >= 16), st.text(min_size=1, max_size=12))
def test_a_salt_changes_every_block_hash(tokens: list[int], salt: str) -> None:
    plain = block_hashes(tokens, 16)
    salted = block_hashes(tokens, 16, cache_salt=salt)
    assert all(a != b for a, b in zip(plain, salted, strict=True))
    assert block_hashes(tokens, 16, cache_salt="") == plain  # empty = absent


def test_block_seed_shifts_wrap_mod_2_64() -> None:
    assert block_seed() == 1337
    assert 0 <= block_seed(lora_name="x" * 50, cache_salt="y" * 50) < 2**64


@given(st.integers(min_value=0, max_value=2**64 - 1))
def test_i64_conversion_round_trips(value: int) -> None:
    signed = to_i64(value)
    assert -(2**63) <= signed < 2**63
    assert signed % 2**64 == value
    assert to_u64(signed) == value


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0)
    with pytest.raises(OverflowError):
        block_hashes([2**32], 1)
    with pytest.raises(OverflowError):
        block_hashes([-1], 1)


def test_without_xxhash_hashing_raises_hashing_unavailable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(blocks, "_xxh3", None)
    monkeypatch.setitem(sys.modules, "xxhash", None)  # as on an install without the extra
    with pytest.raises(HashingUnavailable, match="xxhash"):
        ensure_available()
    with pytest.raises(ImportError):
        block_hashes([1, 2], 1)
