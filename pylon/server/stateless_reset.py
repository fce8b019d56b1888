"""QUIC stateless reset (RFC 9000 10.3): pure, the randomness and the clock passed in.

Several pylon processes share one UDP port (`SO_REUSEPORT`) and the kernel picks a socket by the
4-tuple's hash, so a restarted process, or a client whose address changed, can receive packets
of a connection that another (or a dead) process holds. Such a process cannot decrypt them; it
answers with a stateless reset, which the client recognises by the 16-byte token that the
connection's own process announced for that connection id, and the client ends the connection
at once instead of waiting for its idle timeout.

Every process of a node derives the token from the connection id with one shared key
(`reset_token`, RFC 9000 10.3.2), so any of them can reset any connection of the node; nobody
without the key can forge one.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Collection

TOKEN_SIZE = 16
# 5 unpredictable bytes (38 random bits after the two fixed bits) plus the token: the smallest
# datagram that passes for a short-header packet (RFC 9000 10.3).
MIN_RESET_SIZE = 5 + TOKEN_SIZE
# The largest reset sent: past it a reset is no more like a packet, only costlier to send.
MAX_RESET_SIZE = 64
# A short-header packet's header protection samples 16 bytes from 4 past the packet number,
# which follows the connection id: nothing shorter than 1 + cid + 4 + 16 is a real packet.
_SAMPLE_REACH = 4 + 16
# 1000 resets a second at most, 100 at once: a flood of unknown connection ids costs a bounded
# few milliseconds of CPU a second, and a restart with hundreds of live connections still
# resets every one of them within its first retransmission or two.
RESET_RATE = 1000.0
RESET_BURST = 100.0


def reset_token(key: bytes, cid: bytes) -> bytes:
    """The stateless reset token of connection id `cid`: HMAC-SHA256(key, cid), first 16 bytes
    (RFC 9000 10.3.2: a keyed hash of the connection id, the same in every process that holds
    the key)."""
    return hmac.digest(key, cid, hashlib.sha256)[:TOKEN_SIZE]


def min_trigger_size(cid_length: int) -> int:
    """The shortest datagram answered with a reset: one that could be a real short-header
    packet, and longer than the smallest reset, so every reset is shorter than its trigger."""
    return max(1 + cid_length + _SAMPLE_REACH, MIN_RESET_SIZE + 1)


def short_header_cid(datagram: bytes, cid_length: int) -> bytes | None:
    """The destination connection id of a short-header (1-RTT) packet, None for anything else:
    a long header (an Initial, a Handshake: aioquic's own business), a datagram without the
    fixed bit, or one too short to be a real packet (RFC 9000 10.3.3: never answer those, so
    two endpoints cannot reset each other's resets forever)."""
    if len(datagram) < min_trigger_size(cid_length):
        return None
    first = datagram[0]
    if first & 0xC0 != 0x40:  # header form 0 (short), fixed bit 1
        return None
    return datagram[1 : 1 + cid_length]


def build_reset(token: bytes, trigger_size: int, random: Callable[[int], bytes]) -> bytes | None:
    """A stateless reset for a datagram of `trigger_size` bytes: first bits 01, unpredictable
    bytes, then the token; strictly shorter than the trigger (RFC 9000 10.3.3: a loop of resets
    shrinks until it stops) and at least `MIN_RESET_SIZE`. None when no such size exists."""
    if len(token) != TOKEN_SIZE:
        raise ValueError(f"a stateless reset token is {TOKEN_SIZE} bytes, not {len(token)}")
    size = min(trigger_size - 1, MAX_RESET_SIZE)
    if size < MIN_RESET_SIZE:
        return None
    unpredictable = random(size - TOKEN_SIZE)
    first = 0x40 | (unpredictable[0] & 0x3F)
    return bytes([first]) + unpredictable[1:] + token


def is_reset(datagram: bytes, tokens: Collection[bytes]) -> bool:
    """Whether `datagram` is a stateless reset carrying one of `tokens` (RFC 9000 10.3.1: the
    last 16 bytes of a datagram that looks like a short-header packet)."""
    if len(datagram) < MIN_RESET_SIZE or datagram[0] & 0x80:
        return False
    return datagram[-TOKEN_SIZE:] in tokens


class ResetBudget:
    """A token bucket of resets: `rate` a second, `burst` at once. `take(now)` is True for a
    reset that may go out; False under a flood (the datagram is dropped, as aioquic would)."""

    __slots__ = ("_available", "_last", "burst", "rate")

    def __init__(self, rate: float = RESET_RATE, burst: float = RESET_BURST) -> None:
        self.rate = rate
        self.burst = burst
        self._available = burst
        self._last: float | None = None

    def take(self, now: float) -> bool:
        if self._last is not None and now > self._last:
            self._available = min(self.burst, self._available + (now - self._last) * self.rate)
        self._last = now if self._last is None else max(self._last, now)
        if self._available < 1.0:
            return False
        self._available -= 1.0
        return True
