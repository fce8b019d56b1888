"""Server-sent events, split event by event so pylon relays each one as soon as it is whole.

Pure and incremental: feed arbitrary chunks (a byte at a time works), get complete events back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# An event ends at a blank line. Lines end in LF or CRLF (a lone CR, also legal in SSE, is not
# produced by any engine pylon fronts, and recognising it would split a CRLF cut across chunks).
_BOUNDARY = re.compile(rb"\r?\n\r?\n")


class SseEventTooLarge(Exception):
    pass


@dataclass(slots=True)
class SseSplitter:
    max_event_bytes: int
    _buffer: bytearray = field(default_factory=bytearray)

    def feed(self, chunk: bytes) -> list[bytes]:
        """Complete events (each with its terminating blank line), in order."""
        buffer = self._buffer
        # Rescan from a little before the old end: a boundary may straddle two chunks.
        start = max(0, len(buffer) - 3)
        buffer += chunk
        events: list[bytes] = []
        consumed = 0
        while True:
            match = _BOUNDARY.search(buffer, max(start, consumed))
            if match is None:
                break
            events.append(bytes(buffer[consumed : match.end()]))
            consumed = match.end()
        if consumed:
            del buffer[:consumed]
        if len(buffer) > self.max_event_bytes:
            raise SseEventTooLarge(
                f"an SSE event exceeded {self.max_event_bytes} bytes without ending"
            )
        return events

    @property
    def pending(self) -> bytes:
        """Bytes of an unterminated event (what a stream that ends mid-event leaves behind)."""
        return bytes(self._buffer)


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
