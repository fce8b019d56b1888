"""The frames between a node's pylon processes and their booking authority (`authority`,
`remote`): each a 4-byte big-endian length, then one msgpack array `[kind, ...]`. Pure: no I/O.

From a serving process (the client), in the order its requests live:

- `BOOK  [1, id, tokens, salt]`: choose a worker and book it. `tokens`: the prompt's token ids
  as native `array('I')` bytes (`kv`; both ends are on one host), or None (book by load);
  `salt`: the trusted cache salt, or None. Answered by `BOOKED` or `REFUSED` with the same id.
- `PIN   [2, id, worker_id]`: a booking the client made itself on that worker (a move off a
  worker it could not reach, or one made while the authority was away), counted from now on.
- `HEAD  [3, id, status]`, `FIRST [4, id]`, `OUTPUT [5, id, n]`: the exchange's moments.
- `END   [6, id, outcome, answered, status]`: its terminal moment (`answered`: a response
  head came); the booking is released.

From the authority:

- `BOOKED  [16, id, worker_id, dp_rank]` (`dp_rank` None: no rank pin), `REFUSED [17, id,
  detail]`: no worker can take it (503 retryable);
- `SNAPSHOT [18, specs, in_rotation, results]`: the whole catalogue (each worker's spec text),
  the labels in rotation and each worker's last health answer; sent at connect and after every
  change, so a catalogue reload needs nothing new on the wire.

Ids are the client's (one counter per process), so moments need no reply and stay ordered per
connection. A frame over `MAX_FRAME` bytes, or one that does not decode to an array with an int
kind, is a `FrameError`: the connection is closed, never half-read.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from typing import Any, Final

import msgspec

BOOK: Final = 1
PIN: Final = 2
HEAD: Final = 3
FIRST: Final = 4
OUTPUT: Final = 5
END: Final = 6
BOOKED: Final = 16
REFUSED: Final = 17
SNAPSHOT: Final = 18
KINDS: Final = frozenset({BOOK, PIN, HEAD, FIRST, OUTPUT, END, BOOKED, REFUSED, SNAPSHOT})

# A frame's payload cap: a 1 MiB prompt is about a quarter of a million ids (1 MiB as u32),
# and a catalogue snapshot of a few thousand workers fits well below it.
MAX_FRAME: Final = 8 * 1024 * 1024
_LENGTH = struct.Struct(">I")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


class FrameError(Exception):
    """The peer sent something that is not a frame of this protocol."""


def encode(message: Sequence[Any]) -> bytes:
    """One frame: the length, then the msgpack array."""
    payload = _encoder.encode(message)
    if len(payload) > MAX_FRAME:
        raise FrameError(f"a frame of {len(payload)} bytes is over the {MAX_FRAME}-byte cap")
    return _LENGTH.pack(len(payload)) + payload


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as native u32 bytes (4 bytes an id instead of msgpack's 1 to 5 plus a list);
    raises `OverflowError` for an id outside u32 (no vocabulary has one)."""
    return array("I", tokens).tobytes()


def unpack_tokens(data: bytes) -> list[int]:
    if len(data) % 4:
        raise FrameError(f"token bytes of length {len(data)} are not u32 ids")
    ids = array("I")
    ids.frombytes(data)
    return ids.tolist()


class FrameReader:
    """Bytes in (in whatever pieces the socket gives), whole messages out."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = bytearray()

    @property
    def pending(self) -> int:
        """Bytes held of a frame not yet whole."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[list[Any]]:
        """The messages `data` completes (possibly none); raises `FrameError`."""
        buffer = self._buffer
        buffer += data
        out: list[list[Any]] = []
        start = 0
        end = len(buffer)
        while end - start >= 4:
            (length,) = _LENGTH.unpack_from(buffer, start)
            if length > MAX_FRAME:
                raise FrameError(f"a frame of {length} bytes is over the {MAX_FRAME}-byte cap")
            if end - start - 4 < length:
                break
            body = bytes(buffer[start + 4 : start + 4 + length])
            start += 4 + length
            out.append(_message(body))
        del buffer[:start]
        return out


def _message(body: bytes) -> list[Any]:
    try:
        message = _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise FrameError(f"a frame that is not msgpack ({exc})") from None
    if (
        not isinstance(message, list)
        or not message
        or type(message[0]) is not int
        or message[0] not in KINDS
    ):
        raise FrameError("a frame that is not a [kind, ...] array of a known kind")
    return message
