"""The KV-event wire codec: round trips in both encodings, and malformed input (properties)."""

from __future__ import annotations

import contextlib
import re
import struct

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from router_ffi.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    KvEventError,
    decode,
    encode,
)

u64 = st.integers(min_value=0, max_value=2**64 - 1)
u32 = st.integers(min_value=0, max_value=2**32 - 1)
opt_name = st.none() | st.text(min_size=1, max_size=10)
medium = st.none() | st.sampled_from(["GPU", "CPU_PINNED", "DISK"])


@st.composite
def stored(draw: st.DrawFn, salted: bool) -> BlockStored:
    size = draw(st.sampled_from([1, 4, 16]))
    hashes = draw(st.lists(u64, min_size=1, max_size=4))
    tokens = draw(st.lists(u32, min_size=size * len(hashes), max_size=size * len(hashes)))
    return BlockStored(
        block_hashes=tuple(hashes),
        parent_block_hash=draw(st.none() | u64),
        token_ids=tuple(tokens),
        block_size=size,
        lora_name=draw(opt_name),
        cache_salt=draw(opt_name) if salted else None,
        medium=draw(medium),
    )


def events(salted: bool) -> st.SearchStrategy[KvEvent]:
    removed = st.builds(BlockRemoved, st.lists(u64, max_size=4).map(tuple), medium)
    return st.one_of(stored(salted), removed, st.just(AllBlocksCleared()))


def batches(salted: bool) -> st.SearchStrategy[KvEventBatch]:
    return st.builds(
        KvEventBatch,
        seq=u64,
        ts=st.floats(allow_nan=False, allow_infinity=False),
        events=st.lists(events(salted), max_size=5).map(tuple),
        dp_rank=st.none() | st.integers(min_value=0, max_value=64),
    )


@given(batches(salted=False))
def test_array_form_round_trips(batch: KvEventBatch) -> None:
    frames = encode(batch, topic=b"kv-events", form="array")
    assert len(frames) == 3 and frames[0] == b"kv-events"
    assert frames[1] == struct.pack(">Q", batch.seq)
    assert decode(frames) == batch


@given(batches(salted=True))
def test_map_form_round_trips(batch: KvEventBatch) -> None:
    assert decode(encode(batch, form="map")) == batch


def test_array_form_cannot_carry_a_salt() -> None:
    event = BlockStored((1,), None, (1, 2), 2, cache_salt="tenant")
    with pytest.raises(ValueError, match="map form"):
        encode(KvEventBatch(0, 0.0, (event,)), form="array")


def test_signed_hashes_and_positional_tails_and_extra_map_fields() -> None:
    payload = msgspec.msgpack.encode(
        [
            1.5,
            [
                ["BlockStored", [-1, 5], -2, [1, 2, 3, 4], 2, None, "GPU", None, None, None, 0],
                ["BlockRemoved", [-1], "GPU", 0, "full", None],
                {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
                 "token_ids": [9, 9], "block_size": 2, "group_idx": 0},
                {"type": "BlockRemoved", "block_hashes": [7], "group_idx": 0},
                ["AllBlocksCleared"],
            ],
        ]
    )  # fmt: skip
    batch = decode([b"", struct.pack(">Q", 9), payload])
    assert batch.seq == 9 and batch.dp_rank is None
    first = batch.events[0]
    assert isinstance(first, BlockStored)
    assert first.block_hashes == (2**64 - 1, 5) and first.parent_block_hash == 2**64 - 2
    assert batch.events[1] == BlockRemoved((2**64 - 1,), "GPU")
    assert batch.events[2] == BlockStored((7,), None, (9, 9), 2)
    assert batch.events[3] == BlockRemoved((7,))
    assert batch.events[4] == AllBlocksCleared()


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        ([b"", b"\x00" * 8], "expected 3 frames"),
        ([b"", b"\x00" * 4, b"\x90"], "8 bytes"),
        ([b"", b"\x00" * 8, b"\xc1"], "not msgpack"),
        ([b"", b"\x00" * 8, msgspec.msgpack.encode({"ts": 1})], "array [ts, events"),
        ([b"", b"\x00" * 8, msgspec.msgpack.encode([1.0, [["Bogus"]], 0])], "unknown event tag"),
        ([b"", b"\x00" * 8, msgspec.msgpack.encode([1.0, [{"type": "X"}], 0])], "unknown event"),
        ([b"", b"\x00" * 8, msgspec.msgpack.encode([1.0, [["BlockStored", [1]]]])], "at least 5"),
        (
            [b"", b"\x00" * 8, msgspec.msgpack.encode([1.0, [["BlockRemoved", [1.5]]], 0])],
            "64-bit",
        ),
        (
            [b"", b"\x00" * 8, msgspec.msgpack.encode(
                [1.0, [["BlockStored", [1], None, [-1], 1]], 0])],
            "u32",
        ),
        ([b"", b"\x00" * 8, msgspec.msgpack.encode([1.0, [7], 0])], "tagged array or a map"),
        ([b"", b"\x00" * 8, msgspec.msgpack.encode([1.0, [], "x"])], "dp_rank"),
    ],
)  # fmt: skip
def test_malformed_messages_raise_one_typed_error(frames: list[bytes], message: str) -> None:
    with pytest.raises(KvEventError, match=re.escape(message)):
        decode(frames)


@given(st.lists(st.binary(max_size=64), min_size=3, max_size=3))
def test_decode_never_raises_anything_but_kv_event_error(frames: list[bytes]) -> None:
    with contextlib.suppress(KvEventError):
        decode(frames)


@given(st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=6)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
))  # fmt: skip
def test_decode_of_any_msgpack_value_is_a_batch_or_a_typed_error(value: object) -> None:
    payload = msgspec.msgpack.encode([0.0, [value], 0])
    with contextlib.suppress(KvEventError):
        decode([b"", b"\x00" * 8, payload])
