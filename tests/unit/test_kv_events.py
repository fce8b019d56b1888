"""pylon.core.kv_events: the three-frame KV-event envelope, both event encodings (decoded and
encoded), sequence gaps.

The decoder is pinned against hand-written golden bytes and hand-built payloads (never only
against the encoder); the encoder against the same golden bytes; round trips join the two."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pylon.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeLimits,
    Form,
    KvEvent,
    KvEventBatch,
    KvEventDecodeError,
    SequenceTracker,
    decode_message,
    decode_payload,
    encode_event,
    encode_message,
    normalize_hash,
    read_sequence,
)

U64 = (1 << 64) - 1


def _frames(seq: int, payload: object, topic: bytes = b"") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), msgspec.msgpack.encode(payload)]


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


hashes = st.integers(0, U64)
names = st.none() | st.text(max_size=8)


@st.composite
def stored(draw: st.DrawFn, salted: bool) -> BlockStored:
    return BlockStored(
        block_hashes=tuple(draw(st.lists(hashes, max_size=6))),
        parent_hash=draw(st.none() | hashes),
        token_ids=draw(st.none() | st.lists(st.integers(0, (1 << 32) - 1), max_size=20).map(tuple)),
        block_size=draw(st.none() | st.integers(1, 1024)),
        medium=draw(names),
        lora_name=draw(names),
        cache_salt=draw(names) if salted else None,
        group_idx=draw(st.none() | st.integers(0, 1000)),
    )


def events(salted: bool) -> st.SearchStrategy[KvEvent]:
    removed = st.builds(
        BlockRemoved,
        block_hashes=st.lists(hashes, max_size=6).map(tuple),
        medium=names,
        group_idx=st.none() | st.integers(0, 1000),
    )
    return st.one_of(stored(salted), removed, st.just(AllBlocksCleared()))


@st.composite
def batches(draw: st.DrawFn, salted: bool) -> KvEventBatch:
    return KvEventBatch(
        seq=draw(st.integers(0, U64)),
        ts=draw(st.floats(allow_nan=False)),
        events=tuple(draw(st.lists(events(salted), max_size=5))),
        dp_rank=draw(st.none() | st.integers(0, 64)),
        topic=draw(st.binary(max_size=12)),
    )


@given(batch=batches(salted=False))
def test_round_trip_positional_arrays(batch: KvEventBatch) -> None:
    frames = encode_message(batch, form="array")
    assert frames[0] == batch.topic and frames[1] == batch.seq.to_bytes(8, "big")
    assert decode_message(frames) == batch


@given(batch=batches(salted=True))
def test_round_trip_maps(batch: KvEventBatch) -> None:
    assert decode_message(encode_message(batch, form="map")) == batch


@given(event=stored(salted=False), cut=st.integers(2, 11))
def test_a_positional_event_may_end_early(event: BlockStored, cut: int) -> None:
    # The array keeps the tag and its first `cut - 1` slots; a cut slot reads as absent (None).
    # Positions as in Dynamo's contract: 1 block_hashes, 2 parent, 3 token_ids, 4 block_size,
    # 5 lora_id, 6 medium, 7 lora_name, 8 extra_keys, 9 block_mm_infos, 10 group_idx.
    event = dataclasses.replace(event, group_idx=event.group_idx or 0)
    full = encode_event(event, "array")
    assert isinstance(full, list) and len(full) == 11

    def kept(position: int, value: object) -> Any:
        return value if position < cut else None

    expected = BlockStored(
        block_hashes=event.block_hashes,
        parent_hash=kept(2, event.parent_hash),
        token_ids=kept(3, event.token_ids),
        block_size=kept(4, event.block_size),
        medium=kept(6, event.medium),
        lora_name=kept(7, event.lora_name),
        group_idx=kept(10, event.group_idx),
    )
    assert decode_message(_frames(0, [0.0, [full[:cut]], 0])).events == (expected,)


@given(hashes_in=st.lists(hashes, max_size=6), parent=hashes)
def test_signed_i64_hashes_decode_to_the_same_unsigned_ids(
    hashes_in: list[int], parent: int
) -> None:
    # Built by hand (not by the encoder, which writes unsigned): Dynamo prints ids as i64.
    signed = [_signed(h) for h in hashes_in]
    events_in = [
        ["BlockRemoved", signed],
        {"type": "BlockStored", "block_hashes": signed, "parent_block_hash": _signed(parent)},
    ]
    batch = decode_message(_frames(3, [0.0, events_in, None]))
    assert batch.events == (
        BlockRemoved(tuple(hashes_in)),
        BlockStored(tuple(hashes_in), parent, None, None),
    )


# --- golden bytes: each form, decoded and encoded -------------------------------------------

GOLDEN_ARRAY = (
    b"\x93"  # [ts, events, dp_rank]
    b"\xcb\x3f\xf8\x00\x00\x00\x00\x00\x00"  # ts 1.5 (float 64)
    b"\x93"  # 3 events
    b"\x99\xabBlockStored"  # 9 slots, the tag
    b"\x92\x01\xcf\xff\xff\xff\xff\xff\xff\xff\xff"  # block_hashes [1, 2**64 - 1]
    b"\xc0"  # parent_block_hash nil
    b"\x92\x07\x08"  # token_ids [7, 8]
    b"\x01"  # block_size 1
    b"\xc0\xa3GPU\xc0\xc0"  # lora_id nil, medium "GPU", lora_name nil, extra_keys nil
    b"\x93\xacBlockRemoved\x91\x01\xa3GPU"  # ["BlockRemoved", [1], "GPU"]
    b"\x91\xb0AllBlocksCleared"  # ["AllBlocksCleared"]
    b"\x00"  # dp_rank 0
)
GOLDEN_ARRAY_BATCH = KvEventBatch(
    seq=258,
    ts=1.5,
    events=(
        BlockStored((1, U64), None, (7, 8), 1, medium="GPU"),
        BlockRemoved((1,), medium="GPU"),
        AllBlocksCleared(),
    ),
    dp_rank=0,
    topic=b"kv",
)
GOLDEN_MAP = (
    b"\x93\xcb\x3f\xf8\x00\x00\x00\x00\x00\x00\x93"  # [1.5, 3 events, ...
    b"\x87\xa4type\xabBlockStored"  # a map of 7 keys
    b"\xacblock_hashes\x91\x05"
    b"\xb1parent_block_hash\x03"
    b"\xa9token_ids\x92\x09\x09"
    b"\xaablock_size\x02"
    b"\xaacache_salt\xa1t"
    b"\xa9group_idx\x00"
    b"\x83\xa4type\xacBlockRemoved\xacblock_hashes\x91\x05\xa9group_idx\x00"
    b"\x81\xa4type\xb0AllBlocksCleared"
    b"\xc0"  # ... dp_rank nil]
)
GOLDEN_MAP_BATCH = KvEventBatch(
    seq=0,
    ts=1.5,
    events=(
        BlockStored((5,), 3, (9, 9), 2, cache_salt="t", group_idx=0),
        BlockRemoved((5,), group_idx=0),
        AllBlocksCleared(),
    ),
    dp_rank=None,
)


@pytest.mark.parametrize(
    ("form", "frames", "batch"),
    [
        ("array", [b"kv", b"\0\0\0\0\0\0\x01\x02", GOLDEN_ARRAY], GOLDEN_ARRAY_BATCH),
        ("map", [b"", b"\0" * 8, GOLDEN_MAP], GOLDEN_MAP_BATCH),
    ],
)
def test_golden_bytes_decode_and_encode(
    form: Form, frames: list[bytes], batch: KvEventBatch
) -> None:
    assert decode_message(frames) == batch
    assert encode_message(batch, form=form) == frames


def test_the_encoder_refuses_what_the_wire_cannot_carry() -> None:
    salted = BlockStored((1,), None, (1, 2), 2, cache_salt="tenant")
    with pytest.raises(ValueError, match="map form"):
        encode_message(KvEventBatch(0, 0.0, (salted,), 0), form="array")
    assert encode_message(KvEventBatch(0, 0.0, (salted,), 0), form="map")
    for seq in (-1, 1 << 64):
        with pytest.raises(ValueError, match="seq"):
            encode_message(KvEventBatch(seq, 0.0, (), 0))
    with pytest.raises(ValueError, match="dp_rank"):
        encode_message(KvEventBatch(0, 0.0, (), -1))


@settings(max_examples=300)
@given(frames=st.lists(st.binary(max_size=64), max_size=4))
@example(frames=[b"", bytes(8), b"\xa1\x80"])  # a str that is not UTF-8
def test_arbitrary_bytes_raise_only_the_typed_error(frames: list[bytes]) -> None:
    try:
        decode_message(frames)
    except KvEventDecodeError as exc:
        assert exc.reason


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), U64)
    | st.floats()
    | st.text(max_size=6)
    | st.binary(max_size=10)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"]),
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(
            st.sampled_from(["type", "block_hashes", "token_ids", "x"]) | st.text(max_size=4),
            inner,
            max_size=5,
        )
    ),
    max_leaves=30,
)


# Random values are (nearly) never a whole batch: one that decodes, both event forms and signed
# hashes, so the property's accepting branch runs too.
VALID_BATCH = [
    1.0,
    [
        {
            "type": "BlockStored",
            "block_hashes": [-1, U64],
            "parent_block_hash": None,
            "token_ids": [1, 2, 3, 4],
            "block_size": 2,
        },
        ["BlockRemoved", [-5], None],
        ["AllBlocksCleared"],
    ],
    0,
]


@settings(max_examples=300)
@given(payload=msgpack_values, seq=st.binary(min_size=8, max_size=8))
@example(payload=VALID_BATCH, seq=bytes(8))
def test_arbitrary_msgpack_raises_only_the_typed_error(payload: object, seq: bytes) -> None:
    frames = [b"", seq, msgspec.msgpack.encode(payload)]
    try:
        batch = decode_message(frames)
    except KvEventDecodeError as exc:
        assert exc.reason
    else:
        assert all(
            0 <= h <= U64
            for e in batch.events
            if not isinstance(e, AllBlocksCleared)
            for h in e.block_hashes
        )


@settings(max_examples=200)
@given(
    event=st.lists(msgpack_values, max_size=8).map(lambda rest: ["BlockStored", *rest])
    | st.lists(msgpack_values, max_size=4).map(lambda rest: ["BlockRemoved", *rest]),
)
def test_arbitrary_event_fields_raise_only_the_typed_error(event: list[object]) -> None:
    with_event = _frames(1, [0.0, [event], 0])
    try:
        decode_message(with_event)
    except KvEventDecodeError as exc:
        assert exc.reason


# --- the encodings the engines send ---------------------------------------------------------


def test_vllm_positional_event_as_in_the_dynamo_wire_readme() -> None:
    stored_event = ["BlockStored", [11, 12], None, list(range(32)), 16, None, "GPU", None, None]
    frames = _frames(
        7, [1.5, [stored_event, ["BlockRemoved", [11], "GPU"], ["AllBlocksCleared"]], 0]
    )
    batch = decode_message(frames)
    assert batch.seq == 7 and batch.ts == 1.5 and batch.dp_rank == 0 and batch.ignored == 0
    assert batch.events == (
        BlockStored((11, 12), None, tuple(range(32)), 16, medium="GPU"),
        BlockRemoved((11,), medium="GPU"),
        AllBlocksCleared(),
    )


def test_dynamo_mocker_map_events() -> None:
    # The Dynamo 1.6.1 mocker's shape (dynamo-contract.md section 11): no medium, no LoRA.
    big = (1 << 64) - 5
    events_out = [
        {
            "type": "BlockStored",
            "block_hashes": [big, 3],
            "parent_block_hash": 9,
            "token_ids": [1] * 32,
            "block_size": 16,
            "group_idx": 0,
        },
        {"type": "BlockRemoved", "block_hashes": [big], "group_idx": 0},
    ]
    batch = decode_message(_frames(0, [2.0, events_out, 0]))
    assert batch.events == (
        BlockStored((big, 3), 9, (1,) * 32, 16, group_idx=0),
        BlockRemoved((big,), group_idx=0),
    )


def test_later_slots_and_unknown_keys_are_ignored() -> None:
    # Tails a newer engine adds (kv_cache_spec_kind, ...) and map keys this decoder does not read.
    events_in = [
        ["BlockRemoved", [4], "GPU", 0, "full", None],
        ["BlockStored", [5], 4, [1, 2], 2, None, None, None, None, None, 1, "full", 128],
        {"type": "BlockStored", "block_hashes": [6], "locality": "LOCAL", "is_eagle": False},
    ]
    batch = decode_message(_frames(0, [0.0, events_in, 0]))
    assert batch.events == (
        BlockRemoved((4,), medium="GPU", group_idx=0),
        BlockStored((5,), 4, (1, 2), 2, group_idx=1),
        BlockStored((6,), None, None, None),
    )


def test_negative_i64_hashes_are_their_unsigned_twos_complement() -> None:
    # Dynamo prints sequence hashes as i64: -7623552809318391097 is 10823191264391160519.
    assert normalize_hash(-7623552809318391097) == 10823191264391160519
    assert normalize_hash(-1) == U64
    batch = decode_message(_frames(0, [0, [["BlockRemoved", [-1, -(1 << 63)]]], None]))
    assert batch.events == (BlockRemoved((U64, 1 << 63)),)


def test_bytes_digests_fold_to_vllms_integer_form() -> None:
    digest = bytes(range(32))
    assert normalize_hash(digest) == int.from_bytes(digest, "big") & U64
    with pytest.raises(KvEventDecodeError):
        normalize_hash(b"1234567")


def test_payload_without_rank_and_unknown_tags() -> None:
    batch = decode_payload(
        msgspec.msgpack.encode([0.0, [["Future", 1], {"type": "Other"}, ["AllBlocksCleared"]]])
    )
    assert batch.dp_rank is None and batch.ignored == 2
    assert batch.events == (AllBlocksCleared(),)


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"", b"\0" * 8], "frames"),
        ([b"", b"\0" * 8, b"\x90", b""], "frames"),
        ([b"", b"\0" * 4, msgspec.msgpack.encode([0, [], 0])], "seq"),
        ([b"", b"\0" * 8, b"\xc1"], "msgpack"),
        ([b"", b"\0" * 8, b"\x91" * 10_000 + b"\x90"], "msgpack"),  # nesting beyond the limit
        (_frames(0, {"ts": 0}), "batch"),
        (_frames(0, [0, [], 0, 1]), "batch"),
        (_frames(0, ["now", [], 0]), "batch"),
        (_frames(0, [0, [], -1]), "batch"),
        (_frames(0, [0, {}, 0]), "batch"),
        (_frames(0, [0, [7], 0]), "event"),
        (_frames(0, [0, [[]], 0]), "event"),
        (_frames(0, [0, [{"block_hashes": []}], 0]), "event"),
        (_frames(0, [0, [["BlockStored", 5]], 0]), "field"),
        (_frames(0, [0, [["BlockStored", [True]]], 0]), "hash"),
        (_frames(0, [0, [["BlockStored", [1.5]]], 0]), "hash"),
        (_frames(0, [0, [["BlockStored", [1], None, [-1]]], 0]), "field"),
        (_frames(0, [0, [["BlockStored", [1], None, [1 << 32]]], 0]), "field"),
        (_frames(0, [0, [["BlockStored", [1], None, [1], 0]], 0]), "field"),
        (_frames(0, [0, [["BlockRemoved", [1], 5]], 0]), "field"),
        (
            _frames(0, [0, [{"type": "BlockRemoved", "block_hashes": [1], "group_idx": -1}], 0]),
            "field",
        ),
    ],
)
def test_malformed_messages_raise_the_typed_error(frames: list[bytes], reason: str) -> None:
    with pytest.raises(KvEventDecodeError) as info:
        decode_message(frames)
    assert info.value.reason == reason
    assert isinstance(info.value, ValueError)


def test_limits_bound_the_work_per_message() -> None:
    limits = DecodeLimits(max_payload_bytes=64, max_events=2, max_hashes=3, max_token_ids=4)
    with pytest.raises(KvEventDecodeError) as info:
        decode_message(_frames(0, [0, [["AllBlocksCleared"]] * 3, 0]), limits)
    assert info.value.reason == "limit"
    with pytest.raises(KvEventDecodeError) as info:
        decode_message(_frames(0, [0, [["BlockRemoved", [1, 2, 3, 4]]], 0]), limits)
    assert info.value.reason == "limit"
    with pytest.raises(KvEventDecodeError) as info:
        decode_message(_frames(0, [0, [["BlockStored", [1], None, [1] * 5]], 0]), limits)
    assert info.value.reason == "limit"
    with pytest.raises(KvEventDecodeError) as info:
        decode_message(_frames(0, [0, [], "x" * 100]), limits)
    assert info.value.reason == "too_large"


# --- sequence numbers -----------------------------------------------------------------------


def test_sequence_tracker_reports_gaps_and_regressions() -> None:
    tracker = SequenceTracker()
    first = tracker.observe(5)
    assert first.kind == "first" and not first.stale
    assert tracker.observe(6).kind == "in_order"
    gap = tracker.observe(9)
    assert (gap.kind, gap.expected, gap.received, gap.missed, gap.stale) == ("gap", 7, 9, 2, True)
    assert tracker.observe(10).kind == "in_order"
    back = tracker.observe(0)  # the publisher restarted
    assert back.kind == "regressed" and back.stale
    assert tracker.observe(1).kind == "in_order"
    assert (tracker.gaps, tracker.missed, tracker.regressions) == (1, 2, 1)
    tracker.reset()
    assert tracker.observe(100).kind == "first"


def test_read_sequence_reads_the_frame_without_the_payload() -> None:
    frames = [b"kv", bytes.fromhex("0000000000000102"), b"\xc1 not msgpack"]
    assert read_sequence(frames) == 258
    assert read_sequence([b"", b"\xff" * 8, b""]) == U64
    for bad, reason in (
        ([b"", bytes(8)], "frames"),
        ([b"", bytes(8), b"", b""], "frames"),
        ([b"", bytes(7), b""], "seq"),
        ([b"", bytes(9), b""], "seq"),
    ):
        with pytest.raises(KvEventDecodeError) as info:
            read_sequence(bad)
        assert info.value.reason == reason


def test_sequence_wraps_at_u64() -> None:
    tracker = SequenceTracker()
    tracker.observe(U64)
    assert tracker.observe(0).kind == "in_order"


@given(seqs=st.lists(st.integers(0, 1000), min_size=1, max_size=30))
def test_sequence_tracker_counts_exactly_the_missing_numbers(seqs: list[int]) -> None:
    tracker = SequenceTracker()
    missed = 0
    for prev, cur in itertools.pairwise(seqs):
        if cur > prev + 1:
            missed += cur - prev - 1
    stale = [tracker.observe(s).stale for s in seqs]
    assert tracker.missed == missed
    assert stale[0] is False
    assert stale[1:] == [cur != prev + 1 for prev, cur in itertools.pairwise(seqs)]
