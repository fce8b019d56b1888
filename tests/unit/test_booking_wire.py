"""The booking authority's frames (`pylon.routing.booking_wire`): every message comes back whole
and in order however the bytes are split, token ids round-trip as u32, and anything that is not
a frame of the protocol is a `FrameError`, never a half-read message."""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pylon.routing import booking_wire as wire

ids = st.integers(min_value=1, max_value=2**63 - 1)
u64 = st.integers(min_value=0, max_value=2**64 - 1)
tokens = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=300)
text = st.text(max_size=40)
messages = st.one_of(
    st.builds(
        lambda bid, t, salt: [wire.BOOK, bid, wire.pack_tokens(t) if t else None, salt],
        ids,
        tokens,
        st.none() | text,
    ),
    st.builds(lambda bid, wid: [wire.PIN, bid, wid], ids, u64),
    st.builds(lambda bid, status: [wire.HEAD, bid, status], ids, st.integers(100, 599)),
    st.builds(lambda bid: [wire.FIRST, bid], ids),
    st.builds(lambda bid, n: [wire.OUTPUT, bid, n], ids, st.integers(1, 10**6)),
    st.builds(
        lambda bid, outcome, answered, status: [wire.END, bid, outcome, answered, status],
        ids,
        text,
        st.booleans(),
        st.integers(0, 599),
    ),
    st.builds(
        lambda bid, wid, rank: [wire.BOOKED, bid, wid, rank],
        ids,
        u64,
        st.none() | st.integers(0, 255),
    ),
    st.builds(lambda bid, detail: [wire.REFUSED, bid, detail], ids, text),
    st.builds(
        lambda specs, rotation, results: [wire.SNAPSHOT, specs, rotation, results],
        st.lists(text, max_size=5),
        st.lists(text, max_size=5),
        st.lists(text, max_size=5),
    ),
)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({cut % (len(data) + 1) for cut in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


@given(st.lists(messages, max_size=20), st.lists(st.integers(min_value=0), max_size=30))
def test_messages_come_back_whole_and_in_order_however_split(
    sent: list[list[Any]], cuts: list[int]
) -> None:
    data = b"".join(wire.encode(message) for message in sent)
    reader = wire.FrameReader()
    received: list[list[Any]] = []
    for piece in split(data, cuts):
        received += reader.feed(piece)
    assert received == sent
    assert reader.pending == 0


@given(tokens)
def test_token_ids_round_trip_as_u32(ids_: list[int]) -> None:
    packed = wire.pack_tokens(ids_)
    assert len(packed) == 4 * len(ids_)
    assert wire.unpack_tokens(packed) == ids_


def test_an_id_past_u32_is_not_packed() -> None:
    with pytest.raises(OverflowError):
        wire.pack_tokens([2**32])


def test_token_bytes_not_a_multiple_of_four_are_refused() -> None:
    with pytest.raises(wire.FrameError):
        wire.unpack_tokens(b"\x01\x02\x03")


def frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never used in msgpack
        msgspec.msgpack.encode({"kind": 1}),
        msgspec.msgpack.encode([]),
        msgspec.msgpack.encode(["book", 1]),
        msgspec.msgpack.encode([99, 1]),
        msgspec.msgpack.encode([True, 1]),  # a bool is not a kind
    ],
)
def test_what_is_not_a_frame_of_the_protocol_is_refused(payload: bytes) -> None:
    with pytest.raises(wire.FrameError):
        wire.FrameReader().feed(frame(payload))


def test_a_frame_over_the_cap_is_refused_from_its_length_alone() -> None:
    reader = wire.FrameReader()
    with pytest.raises(wire.FrameError):
        reader.feed(struct.pack(">I", wire.MAX_FRAME + 1))
    with pytest.raises(wire.FrameError):
        wire.encode([wire.REFUSED, 1, "x" * (wire.MAX_FRAME + 1)])


@given(messages)
def test_a_frame_not_yet_whole_yields_nothing(message: list[Any]) -> None:
    data = wire.encode(message)
    reader = wire.FrameReader()
    assert reader.feed(data[:-1]) == []
    assert reader.pending == len(data) - 1
    assert reader.feed(data[-1:]) == [message]
