"""The stateless reset packet (RFC 9000 10.3): its format, the size rules that stop loops and
amplification, what is never answered, the shared-key token, and the flood budget."""

from __future__ import annotations

import hashlib
import hmac
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pylon.server.stateless_reset import (
    MIN_RESET_SIZE,
    TOKEN_SIZE,
    ResetBudget,
    build_reset,
    is_reset,
    min_trigger_size,
    reset_token,
    short_header_cid,
)

CID_LENGTH = 8  # aioquic's default connection_id_length, what pylon's server issues
TOKEN = bytes(range(16))


def test_the_token_is_the_rfc_keyed_hash_of_the_connection_id() -> None:
    key, cid = b"node key", b"\x01" * 8
    # RFC 9000 10.3.2: a static key and the connection id through a keyed hash; ours is
    # HMAC-SHA256 truncated to 16 bytes, written out independently here.
    assert reset_token(key, cid) == hmac.new(key, cid, hashlib.sha256).digest()[:16]
    assert reset_token(key, cid) == reset_token(key, bytes(cid)), "the same in every process"
    assert reset_token(b"other key", cid) != reset_token(key, cid)
    assert reset_token(key, b"\x02" * 8) != reset_token(key, cid)


@given(st.integers(0, 2000), st.binary(min_size=TOKEN_SIZE, max_size=TOKEN_SIZE))
def test_a_reset_is_shorter_than_its_trigger_and_never_below_the_minimum(
    trigger: int, token: bytes
) -> None:
    packet = build_reset(token, trigger, os.urandom)
    if trigger - 1 < MIN_RESET_SIZE:
        assert packet is None, f"a {trigger}-byte datagram cannot get a shorter valid reset"
        return
    assert packet is not None
    assert MIN_RESET_SIZE <= len(packet) < trigger
    assert len(packet) <= 3 * trigger  # RFC 9000 10.3: no amplification
    assert packet[0] & 0xC0 == 0x40, "first bits 01: looks like a short-header packet"
    assert packet[-TOKEN_SIZE:] == token
    assert is_reset(packet, {token})
    assert not is_reset(packet, {bytes(16)} if token != bytes(16) else {b"\x01" * 16})


def test_a_small_trigger_gets_a_reset_one_byte_shorter() -> None:
    """RFC 9000 10.3: a reset to a packet of 43 bytes or fewer is one byte shorter than it."""
    for trigger in range(MIN_RESET_SIZE + 1, 44):
        packet = build_reset(TOKEN, trigger, os.urandom)
        assert packet is not None and len(packet) == trigger - 1


def test_the_unpredictable_bytes_come_from_the_random_source() -> None:
    packet = build_reset(TOKEN, 40, lambda n: b"\xff" * n)
    assert packet == bytes([0x7F]) + b"\xff" * (39 - 1 - TOKEN_SIZE) + TOKEN
    with pytest.raises(ValueError, match="16 bytes"):
        build_reset(b"short", 40, os.urandom)


@given(st.binary(max_size=200))
def test_only_a_real_sized_short_header_packet_is_a_trigger(datagram: bytes) -> None:
    cid = short_header_cid(datagram, CID_LENGTH)
    if cid is None:
        return
    assert len(datagram) >= min_trigger_size(CID_LENGTH)
    assert datagram[0] & 0x80 == 0 and datagram[0] & 0x40
    assert cid == datagram[1 : 1 + CID_LENGTH]
    # Every trigger can be answered, and the answer is no trigger for the same rule elsewhere:
    # a reset of a reset is smaller again, until the loop stops (RFC 9000 10.3.3).
    packet = build_reset(TOKEN, len(datagram), os.urandom)
    assert packet is not None and len(packet) < len(datagram)


def test_what_is_never_answered() -> None:
    size = min_trigger_size(CID_LENGTH)
    # Header protection samples 16 bytes from 4 past the packet number: 1 + cid + 4 + 16.
    assert size == 1 + CID_LENGTH + 20 == 29
    short = bytes([0x40]) + b"\x07" * (size - 1)
    assert short_header_cid(short, CID_LENGTH) == b"\x07" * 8
    assert short_header_cid(short[:-1], CID_LENGTH) is None, "too small to be a real packet"
    assert short_header_cid(bytes([0xC0]) + short[1:], CID_LENGTH) is None, "a long header"
    assert short_header_cid(bytes([0x00]) + short[1:], CID_LENGTH) is None, "no fixed bit"
    assert short_header_cid(b"", CID_LENGTH) is None
    # With no connection id at all, the floor is still above the smallest reset.
    assert min_trigger_size(0) == MIN_RESET_SIZE + 1 == 22


def test_a_long_header_datagram_is_never_taken_for_a_reset() -> None:
    assert not is_reset(bytes([0xC0]) + b"\x00" * 30 + TOKEN, {TOKEN})
    assert not is_reset(TOKEN, {TOKEN}), "shorter than any reset"
    assert is_reset(bytes([0x40]) + b"\x00" * 4 + TOKEN, {TOKEN})


def test_the_budget_allows_a_burst_then_the_rate() -> None:
    budget = ResetBudget(rate=10.0, burst=3.0)
    assert [budget.take(0.0) for _ in range(5)] == [True, True, True, False, False]
    assert budget.take(0.05) is False, "half a reset's worth of time"
    assert budget.take(0.1) is True
    assert budget.take(0.1) is False
    assert [budget.take(10.0) for _ in range(4)] == [True, True, True, False], "capped at burst"


def test_the_budget_survives_a_clock_that_goes_back() -> None:
    budget = ResetBudget(rate=10.0, burst=1.0)
    assert budget.take(5.0)
    assert not budget.take(4.0), "no credit from time running backwards"
    assert not budget.take(5.0)
    assert budget.take(5.2)


@given(st.lists(st.floats(0, 100, allow_nan=False), max_size=300))
def test_the_budget_bounds_resets_over_any_window(times: list[float]) -> None:
    budget = ResetBudget(rate=20.0, burst=5.0)
    ordered = sorted(times)
    taken = sum(budget.take(now) for now in ordered)
    span = ordered[-1] - ordered[0] if ordered else 0.0
    assert taken <= 5 + 20.0 * span + 1e-9
