"""Server-sent events, split event by event so pylon relays each one as soon as it is whole.

Pure and incremental: feed arbitrary chunks (a byte at a time works), get complete events back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# An event ends at a blank line. Lines end in LF or CRLF (a lone CR, also legal in SSE, is not
# produced by any engine pylon fronts, and recognising it would split a CRLF cut across chunks).
_BOUNDARY = re.compile(rb"\r?\n\r?\n")


class SseEventTooLarge(Exception):
    pass


@dataclass(slots=True)
class SseSplitter:
    max_event_bytes: int
    _buffer: bytes = b""

    def feed_block(self, chunk: bytes) -> bytes:
        """All complete events now available, as one block (empty when none is complete).

        The relay writes the block as it is: whole events only, in order, as soon as they end.
        """
        buffer = self._buffer + chunk if self._buffer else chunk
        end = _last_boundary_end(buffer, len(self._buffer))
        block, self._buffer = buffer[:end], buffer[end:]
        if len(self._buffer) > self.max_event_bytes:
            raise SseEventTooLarge(
                f"an SSE event exceeded {self.max_event_bytes} bytes without ending"
            )
        return block

    def feed(self, chunk: bytes) -> list[bytes]:
        """Complete events (each with its terminating blank line), in order."""
        return split_events(self.feed_block(chunk))

    @property
    def pending(self) -> bytes:
        """Bytes of an unterminated event (what a stream that ends mid-event leaves behind)."""
        return bytes(self._buffer)


def _last_boundary_end(buffer: bytes, old_length: int) -> int:
    """End offset of the last blank line in `buffer` (0 if none).

    Only the new bytes, plus three before them (a boundary may straddle two chunks), can hold
    a boundary the previous call did not see.
    """
    start = max(0, old_length - 3)
    if b"\r" not in buffer:
        found = buffer.rfind(b"\n\n", start)
        return found + 2 if found >= 0 else 0
    end = 0
    for match in _BOUNDARY.finditer(buffer, start):
        end = match.end()
    return end


def split_events(block: bytes) -> list[bytes]:
    """A block of complete events -> the events, each with its terminating blank line."""
    events: list[bytes] = []
    consumed = 0
    while consumed < len(block):
        match = _BOUNDARY.search(block, consumed)
        assert match is not None, "a block holds complete events only"
        events.append(block[consumed : match.end()])
        consumed = match.end()
    return events


def is_output_event(event: bytes) -> bool:
    """Does this event carry model output (as opposed to a comment or a created notice)?"""
    if not (event.startswith(b"data:") or b"\ndata:" in event):
        return False
    # Responses API bookkeeping events are not output (by event name or by JSON `type`).
    return not any(marker in event for marker in _NOT_OUTPUT_MARKERS)


_NOT_OUTPUT_MARKERS = (
    b"event: response.created",
    b"event:response.created",
    b'"type":"response.created"',
    b'"type": "response.created"',
    b"event: response.in_progress",
    b'"type":"response.in_progress"',
)


def error_event(payload: bytes) -> bytes:
    """The terminal event pylon sends when it has to end a stream early."""
    return b"event: error\ndata: " + payload + b"\n\n"
