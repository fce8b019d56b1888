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
into a log line, a count and a reset of that worker in the core. A catalogue change
(`KvEventWatch.update`) closes a removed worker's SUBs and opens an added one's. A malformed
message (not three frames, a sequence frame that is not 8 bytes) is counted and logged, and
sorts nothing.

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
from pylon.routing.fleet import CatalogueChange, Worker

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
    """One SUB per (worker, KV-event endpoint); `run()` follows them all until cancelled, and
    `update(change)` follows a catalogue change: a removed worker's streams are closed, an added
    one's are opened (each stream is its own task with its own socket)."""

    def __init__(self, workers: Sequence[Worker], on_stale: OnStale, observer: Observer) -> None:
        self._streams = [(w, endpoint) for w in workers for endpoint in w.spec.kv_events]
        self._on_stale = on_stale
        self._observer = observer
        self.trackers = {endpoint: SequenceTracker() for _, endpoint in self._streams}
        self.messages = 0  # messages read, all endpoints together
        self.subscribed = asyncio.Event()  # every SUB is connected and subscribed
        self._context: Any = None
        self._followers: dict[tuple[Worker, str], asyncio.Task[None]] = {}

    async def run(self) -> None:
        import zmq.asyncio

        self._context = context = zmq.asyncio.Context()
        try:
            for worker, endpoint in self._streams:
                self._start(worker, endpoint)
            self.subscribed.set()
            await asyncio.Event().wait()  # until cancelled; the followers do the work
        finally:
            followers = list(self._followers.values())
            self._followers.clear()
            for task in followers:
                task.cancel()
            await asyncio.gather(*followers, return_exceptions=True)
            self._context = None
            context.term()

    def update(self, change: CatalogueChange) -> None:
        """Stop following the removed workers' endpoints, start following the added ones'."""
        for worker in change.removed:
            for endpoint in worker.spec.kv_events:
                task = self._followers.pop((worker, endpoint), None)
                if task is not None:
                    task.cancel()
                self.trackers.pop(endpoint, None)
        self._streams = [(w, e) for w, e in self._streams if not w.removed]
        for worker in change.added:
            for endpoint in worker.spec.kv_events:
                self._streams.append((worker, endpoint))
                self.trackers[endpoint] = SequenceTracker()
                if self._context is not None:
                    self._start(worker, endpoint)

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The endpoints followed now."""
        return tuple(endpoint for _, endpoint in self._followers)

    def _start(self, worker: Worker, endpoint: str) -> None:
        import zmq

        sock = self._context.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(endpoint)
        except BaseException:
            sock.close(0)
            raise
        key = (worker, endpoint)
        task = asyncio.create_task(self._owned(worker, endpoint, sock), name="pylon-kv-stream")
        self._followers[key] = task
        task.add_done_callback(lambda done: self._ended(key, done))

    def _ended(self, key: tuple[Worker, str], task: asyncio.Task[None]) -> None:
        if self._followers.get(key) is task:
            del self._followers[key]
        if not task.cancelled() and task.exception() is not None:
            self._observer.process_event(
                "kv_router_error", op="kv_watch", detail=f"{type(task.exception()).__name__}"
            )

    async def _owned(self, worker: Worker, endpoint: str, sock: Any) -> None:
        try:
            await self._follow(worker, endpoint, sock)
        finally:
            sock.close(0)

    async def _follow(self, worker: Worker, endpoint: str, sock: Any) -> None:
        tracker = self.trackers.setdefault(endpoint, SequenceTracker())
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
