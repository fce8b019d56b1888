"""Each worker's KV-event stream followed by its sequence numbers, so a lost or restarted stream
resets what the selection core believes that worker's cache holds.

Dynamo's native core subscribes to the engines' KV-event sockets itself and takes no events
from pylon. On a sequence gap it asks the engine to replay only when the worker has a replay
endpoint; without one it logs and keeps its view, so blocks the engine evicted in the lost
messages keep attracting requests (verified on 1.6.1: blocks stored before a gap still count
after it). A sequence that goes back (the engine restarted with an empty cache) is the same
problem. Later Dynamo clears the rank's view on a gap; pylon does that here, for 1.6.1.

`KvEventWatch` holds one ZMQ SUB per KV-event endpoint (next to the native core's own SUB on
the same PUB socket) and reads only each message's 8-byte sequence frame, never the payload.
Per endpoint, a `SequenceTracker` sorts each message as first / in order / gap / regressed;
a gap or a regression calls `on_stale(worker, endpoint, check)`, which the `kv` router turns
into a log line, a count and a reset of that worker in the core. A malformed message (not
three frames, a sequence frame that is not 8 bytes) is counted and logged, and sorts nothing.

Bounded: each SUB queues at most `RECEIVE_HWM` messages (ZMQ drops beyond, which shows up as
a gap: the reset is then the right answer) and refuses messages over `MAX_MESSAGE_BYTES`
(the peer is disconnected; ZMQ reconnects and the next message is a gap or a regression).

Fair to the rest of the loop: while messages are queued, `recv_multipart()` resolves at once
and awaiting it never yields, so a burst would hold the event loop until the queue is empty
(seconds, for a hundred thousand messages). Each stream yields after `MESSAGES_PER_TURN`
messages read without a wait: every message is still read and sorted, in order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pylon.core.kv_events import (
    DEFAULT_LIMITS,
    KvEventDecodeError,
    SequenceCheck,
    SequenceTracker,
    read_sequence,
)
from pylon.routing.fleet import Worker

if TYPE_CHECKING:
    from pylon.observe import Observer

RECEIVE_HWM = 100_000
# Three frames: topic, 8-byte sequence, the payload (bounded by the decoder's own limit).
MAX_MESSAGE_BYTES = DEFAULT_LIMITS.max_payload_bytes + 4096
# Messages one stream reads in one loop turn before it lets the other tasks run (a message
# costs a few microseconds here: a turn stays around a millisecond).
MESSAGES_PER_TURN = 64
OnStale = Callable[[Worker, str, SequenceCheck], None]


class KvEventWatch:
    """One SUB per (worker, KV-event endpoint); `run()` follows them all until cancelled."""

    def __init__(self, workers: Sequence[Worker], on_stale: OnStale, observer: Observer) -> None:
        self._streams = tuple(
            (worker, endpoint) for worker in workers for endpoint in worker.spec.kv_events
        )
        self._on_stale = on_stale
        self._observer = observer
        self.trackers = {endpoint: SequenceTracker() for _, endpoint in self._streams}
        self.messages = 0  # messages read, all endpoints together
        self.subscribed = asyncio.Event()  # every SUB is connected and subscribed

    async def run(self) -> None:
        import zmq
        import zmq.asyncio

        context = zmq.asyncio.Context()
        sockets: list[Any] = []
        try:
            for _, endpoint in self._streams:
                sock = context.socket(zmq.SUB)
                sockets.append(sock)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
                sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
                sock.setsockopt(zmq.SUBSCRIBE, b"")
                sock.connect(endpoint)
            self.subscribed.set()
            async with asyncio.TaskGroup() as group:
                for (worker, endpoint), sock in zip(self._streams, sockets, strict=True):
                    group.create_task(self._follow(worker, endpoint, sock))
        finally:
            for sock in sockets:
                sock.close(0)
            context.term()

    async def _follow(self, worker: Worker, endpoint: str, sock: Any) -> None:
        tracker = self.trackers[endpoint]
        budget = MESSAGES_PER_TURN
        while True:
            frames = await sock.recv_multipart(copy=False)
            self.messages += 1
            budget -= 1
            if budget == 0:  # a queued burst never makes the await above yield: do it here
                budget = MESSAGES_PER_TURN
                await asyncio.sleep(0)
            try:
                seq = read_sequence([frame.buffer for frame in frames])
            except KvEventDecodeError as exc:
                faults = worker.kv_faults
                faults["malformed"] = faults.get("malformed", 0) + 1
                self._observer.process_event(
                    "kv_events_malformed", worker=worker.label, endpoint=endpoint, detail=str(exc)
                )
                continue
            check = tracker.observe(seq)
            if check.stale:
                try:
                    self._on_stale(worker, endpoint, check)
                except Exception as exc:  # a bug there must not end the watch
                    self._observer.process_event(
                        "kv_router_error", op="on_stale", detail=f"{type(exc).__name__}: {exc}"
                    )
