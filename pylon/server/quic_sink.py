"""`QuicResponder`: the `ResponseSink` of one response stream on a QUIC connection, whatever the
stream layer above QUIC (HTTP/3, `pylon.server.http3`; raw QUIC, `pylon.server.rawquic`).

What the sink does is the same for both: the response's pieces are held until the connection's
next flush (one transmit per loop iteration, corked), the relay pauses while the stream's
unacknowledged send buffer is above `SEND_HIGH_WATER` and resumes below `SEND_LOW_WATER`, and an
abort resets the stream. What differs, each layer's subclass says: how a head is held (`start`)
and how the held pieces become frames (`flush`), and the code an abort resets with.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from mypy_extensions import mypyc_attr

# A stream whose unacknowledged send buffer is above HIGH pauses the relay until it is below LOW.
SEND_HIGH_WATER = 1024 * 1024
SEND_LOW_WATER = 256 * 1024

Head = TypeVar("Head")


class StreamGone(Exception):
    """The stream can no longer carry what was sent: reset by us, STOP_SENDING from the peer, or
    already ended. Raised by either stream layer's send methods (`H3Layer.send_headers` /
    `send_data`, `RawQuicLayer.send_head` / `send_data` / `end`)."""

    def __init__(self, stream_id: int, reason: str) -> None:
        super().__init__(f"stream {stream_id}: {reason}")
        self.stream_id = stream_id
        self.reason = reason


class ResponderOwner(Protocol):
    """What a responder needs of its connection's protocol."""

    def schedule(self, responder: Any) -> None: ...  # its own responder type

    def backlog(self, sid: int) -> int: ...

    def _reset(self, sid: int, code: int) -> None: ...


@mypyc_attr(allow_interpreted_subclasses=True)  # rawquic's responder is interpreted
class QuicResponder(Generic[Head]):
    """`ResponseSink` for one response stream (see the module docstring)."""

    __slots__ = (
        "_conn",
        "_ended",
        "_head",
        "_parts",
        "_queued",
        "_unsure",
        "closed",
        "is_head",
        "sid",
        "waiter",
    )
    ABORT_CODE: ClassVar[int] = 0  # the stream reset an abort sends (each layer's own)

    def __init__(self, conn: ResponderOwner, sid: int, is_head: bool = False) -> None:
        self._conn = conn
        self.sid = sid
        self.is_head = is_head  # the answer to a HEAD request: a head without content
        self._head: Head | None = None
        self._parts: list[bytes] = []
        self._ended = False
        self._queued = False
        # An upper bound of the stream's unacknowledged bytes: the last reading plus what was
        # written since. Only when it passes the high-water mark is the real backlog read.
        self._unsure = 0
        self.closed = False
        self.waiter: asyncio.Future[None] | None = None

    @property
    def paused(self) -> bool:
        if self._unsure <= SEND_HIGH_WATER:
            return False
        self._unsure = self._conn.backlog(self.sid)
        return self._unsure > SEND_HIGH_WATER

    def write(self, data: bytes) -> None:
        if data and not self.closed and not self.is_head:
            self._parts.append(data)
            self._unsure += len(data)
            self._queue()

    async def drain(self) -> None:
        if self.closed or self._conn.backlog(self.sid) <= SEND_LOW_WATER:
            return
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None
            self._unsure = self._conn.backlog(self.sid)

    def wake(self, error: BaseException | None) -> None:
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        if error is None:
            waiter.set_result(None)
        else:
            waiter.set_exception(error)
            waiter.exception()  # retrieved: the drain may already be cancelled

    def end(self) -> None:
        self._ended = True
        self._queue()

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self._parts.clear()
            self._conn._reset(self.sid, self.ABORT_CODE)

    def _queue(self) -> None:
        if not self._queued and not self.closed:
            self._queued = True
            self._conn.schedule(self)

    def _take(self) -> tuple[bool, Head | None, list[bytes]]:
        """What the flush sends: (ended, the held head, the held parts), now cleared."""
        self._queued = False
        taken = self._ended, self._head, self._parts
        self._head, self._parts = None, []
        return taken
