"""No client connection holds the event loop or piles up requests: a flood sent in one write
is worked through a bounded amount at a time. A `LoopLag` probe (tests/looplag.py) measures the
longest the loop went without running another task while the flood is answered."""

from __future__ import annotations

import asyncio

from pylon.core.record import RequestRecord
from pylon.server.http1 import FEED_BYTES
from tests.integration.conftest import MODEL, StackFactory
from tests.looplag import LoopLag
from tests.observers import SeenObserver

# Generous for a loaded 2-core box; a reader that parses a whole read at once (thousands of
# requests) or never yields shows up as a gap of the flood's length.
MAX_GAP_S = 0.25


class InFlight(SeenObserver):
    """Requests admitted and not finished yet, and the most there ever were at once."""

    def __init__(self) -> None:
        super().__init__()
        self.open = 0
        self.most = 0
        self.done = 0

    def admitted(self, record: RequestRecord) -> None:
        super().admitted(record)
        self.open += 1
        self.most = max(self.most, self.open)

    def complete(self, record: RequestRecord) -> None:
        super().complete(record)
        self.open -= 1
        self.done += 1


async def test_http1_pipelined_requests_in_one_write_are_parsed_one_turn_at_a_time(
    make_stack: StackFactory,
) -> None:
    """5,000 pipelined requests in one 370 KB write: every one is answered, in order, while
    pylon never holds more than one parse piece's worth of them (the rest of the input waits
    unparsed, reading paused) and the loop keeps turning."""
    observer = InFlight()
    stack = await make_stack(backend="vllm", observer=observer)
    host, port = stack.pylon_address
    one = (
        f"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-request-id: r\r\nx-model: {MODEL}\r\n\r\n"
    ).encode()
    count = 5_000
    reader, writer = await asyncio.open_connection(host, port)
    got = bytearray()

    async def read_all() -> None:
        while got.count(b"HTTP/1.1 ") < count:
            chunk = await reader.read(65536)
            if not chunk:
                return
            got.extend(chunk)

    lag = LoopLag()
    try:
        writer.write(one * count)
        reading = asyncio.create_task(read_all())
        took = await lag.until(reading.done, timeout=120)
    finally:
        writer.close()
    assert got.count(b"HTTP/1.1 200 OK\r\n") == count and observer.done == count
    # One piece of input holds at most this many whole requests (and the one running).
    assert observer.most <= FEED_BYTES // len(one) + 2, observer.most
    assert lag.max_gap < min(MAX_GAP_S, took / 4), (lag.max_gap, took)
