"""Server-sent events, split event by event so pylon relays each one as soon as it is whole.

Pure and incremental: feed arbitrary chunks (a byte at a time works), get complete events back.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

# An event ends at a blank line. Lines end in LF or CRLF (a lone CR, also legal in SSE, is not
# produced by any engine pylon fronts, and recognising it would split a CRLF cut across chunks).
_BOUNDARY = re.compile(rb"\r?\n\r?\n")


class SseEventTooLarge(Exception):
    pass


@dataclass(slots=True)
class SseSplitter:
    max_event_bytes: int
    # The start of an event still unterminated: a bytearray, so an event that arrives in many
    # small pieces costs its bytes once, not its size once per piece.
    _pending: bytearray = field(default_factory=bytearray)

    def feed_block(self, chunk: bytes) -> bytes:
        """All complete events now available, as one block (empty when none is complete).

        The relay writes the block as it is: whole events only, in order, as soon as they end.
        """
        pending = self._pending
        if not pending:
            end = _last_boundary_end(chunk, 0)
            if end < len(chunk):
                self._keep(chunk[end:])
            return chunk if end == len(chunk) else chunk[:end]
        # The pending bytes hold no boundary; one may straddle them and the chunk, so look at
        # their last three bytes with the chunk, and at nothing older.
        tail = bytes(pending[-3:])
        end = _last_boundary_end(tail + chunk, 0) - len(tail)
        if end <= 0:
            self._keep(chunk)
            return b""
        block = bytes(pending) + chunk[:end]
        pending.clear()
        if end < len(chunk):
            self._keep(chunk[end:])
        return block

    def _keep(self, rest: bytes) -> None:
        self._pending += rest
        if len(self._pending) > self.max_event_bytes:
            raise SseEventTooLarge(
                f"an SSE event exceeded {self.max_event_bytes} bytes without ending"
            )

    def feed(self, chunk: bytes) -> list[bytes]:
        """Complete events (each with its terminating blank line), in order."""
        return split_events(self.feed_block(chunk))

    @property
    def pending(self) -> bytes:
        """Bytes of an unterminated event (what a stream that ends mid-event leaves behind)."""
        return bytes(self._pending)


def _last_boundary_end(buffer: bytes, old_length: int) -> int:
    """End offset of the last blank line in `buffer` (0 if none).

    Only the new bytes, plus three before them (a boundary may straddle two chunks), can hold
    a boundary the previous call did not see.
    """
    start = max(0, old_length - 3)
    if buffer.find(b"\r") < 0:  # (not `in`: bytes `in` builds a TypeError first, per chunk)
        found = buffer.rfind(b"\n\n", start)
        if found < 0:
            return 0
        if found > start and buffer[found - 1] == _LF:
            return _lf_run_end(buffer, start, found)  # rare: three or more LFs in a row
        return found + 2
    end = 0
    for match in _BOUNDARY.finditer(buffer, start):
        end = match.end()
    return end


_LF = ord("\n")


def _lf_run_end(buffer: bytes, start: int, found: int) -> int:
    """Where the regex search would end in the run of LFs that `found` (the last `\\n\\n`) ends:
    it pairs the LFs from the run's start, so an odd run leaves its last LF to the next event
    (as `iter_events` reads the block). The last boundary of `\\n\\n\\n` ends at 2, not 3."""
    run = found
    while run > start and buffer[run - 1] == _LF:
        run -= 1
    return run + (found + 2 - run) // 2 * 2


def split_events(block: bytes) -> list[bytes]:
    """A block of complete events -> the events, each with its terminating blank line."""
    return list(iter_events(block))


def iter_events(block: bytes) -> Iterator[bytes]:
    """Lazily, so a caller looking for the first event of a kind stops there.

    A block without CR (what engines write) is cut with `find`: the boundary regex has no
    literal to skip ahead to, so its search tries a match at every byte (~100 instructions a
    byte, the largest single cost of a streamed request's first event).
    """
    consumed = 0
    plain = block.find(b"\r") < 0
    while consumed < len(block):
        if plain:
            end = block.find(b"\n\n", consumed) + 2
            assert end > 1, "a block holds complete events only"
        else:
            match = _BOUNDARY.search(block, consumed)
            assert match is not None, "a block holds complete events only"
            end = match.end()
        yield block[consumed:end]
        consumed = end


_DATA_LINE = re.compile(rb"^data: ?(.*?)\r?$", re.MULTILINE)
_EVENT_LINE = re.compile(rb"^event: ?(.*?)\r?$", re.MULTILINE)
_JSON_TYPE = re.compile(rb'"type"\s*:\s*"([^"]*)"')
# Responses API bookkeeping: announced before any token, so not output (by name or JSON type).
_NOT_OUTPUT_TYPES = frozenset({b"response.created", b"response.in_progress", b"response.queued"})


def is_output_event(event: bytes) -> bool:
    """Does this event carry model output (not a comment, `[DONE]` or a bookkeeping notice)?

    Consulted until the first output of a stream, i.e. once per request for most streams.
    """
    # The event engines write: one `data:` line, then the blank line. Read without the regexes
    # and the generator (a tenth of a streamed request's cost, measured); the general reading
    # below gives the same answer for it (a property test holds them equal).
    if event.startswith(b"data:") and event.find(b"\n") == len(event) - 2:
        data = event[5:-2].strip()
        if not data or data == b"[DONE]":
            return False
        return data.find(b'"type"') < 0 or _output_type(data)
    return _is_output_event(event)


def _output_type(data: bytes) -> bool:
    kind = _JSON_TYPE.search(data)
    return kind is None or kind.group(1) not in _NOT_OUTPUT_TYPES


def _is_output_event(event: bytes) -> bool:
    """`is_output_event` for any event: every line read."""
    data = b"\n".join(match.group(1) for match in _DATA_LINE.finditer(event)).strip()
    if not data or data == b"[DONE]":
        return False
    name = _EVENT_LINE.search(event)
    if name is not None and name.group(1).strip() in _NOT_OUTPUT_TYPES:
        return False
    return _output_type(data)


def error_event(payload: bytes) -> bytes:
    """The terminal event pylon sends when it has to end a stream early."""
    return b"event: error\ndata: " + payload + b"\n\n"
