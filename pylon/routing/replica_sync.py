"""`--replica-peer`: what each peer replica's sync stream carries, counted per peer.

Dynamo's selection core applies its peers' booking events itself (router_ffi, `ReplicaSync`)
and says nothing about the ones it drops: an event for a worker this core does not know (the
replicas' worker catalogues differ, `pylon.routing.spec.catalogue_digest`) is discarded without
a trace. So pylon listens to every peer's PUB a second time, with a SUB of its own on a thread
of its own, and counts per peer (`ReplicaSyncWatch.counts`, the metric
`pylon_router_replica_sync_events_total`):

- `applied`: an event for a worker this pylon knows (the core applies it);
- `unknown_worker`: an event for a worker it does not (the core drops it), with a warning
  (`replica_sync_dropped`, at most one per peer and worker per `REPEAT_INTERVAL_S`) naming the
  worker id and this pylon's catalogue digest, to compare with the peer's;
- `malformed`: a message that is not the sync's two frames and msgpack map (skipped).

The wire format is Dynamo 1.6.1's (docs/routing.md, "Replicas across nodes"): topic
`dynamo.slot-tracker.v1`, then a msgpack map whose `event.worker.worker_id` names the worker.
It is internal to Dynamo, so this is a read-only observer: nothing here changes what the core
applies, and a message it cannot read is counted, never fatal. Bounded: the SUB's receive
high-water mark is `RCV_HWM` messages (beyond it libzmq drops, uncounted) of at most
`MAX_MESSAGE_BYTES`, the warnings are rate-limited, and the thread polls with a timeout so
`aclose` ends it within `POLL_MS`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Final

from pylon.core.log_rate import LogRate

if TYPE_CHECKING:
    from pylon.observe import Observer

TOPIC: Final = b"dynamo.slot-tracker.v1"
RESULTS: Final = ("applied", "unknown_worker", "malformed")
RCV_HWM: Final = 10_000  # messages queued per peer before libzmq drops (10x its default)
# A sync message is a few hundred bytes plus 9 per prompt block (an AddRequest's sequence
# hashes: ~150 KB for a 262,144-token prompt of 16-token blocks). Past this the peer is
# disconnected (ZMQ reconnects): the watch's own SUB only, the core's is not touched.
MAX_MESSAGE_BYTES: Final = 4 * 1024 * 1024
POLL_MS: Final = 200
REPEAT_INTERVAL_S: Final = 10.0


def event_worker(frames: list[bytes]) -> int | None:
    """The worker id one sync message is about, or None when it is not a sync message of the
    1.6.1 shape (two frames, the topic, a msgpack map with `event.worker.worker_id`)."""
    import msgspec

    if len(frames) != 2 or frames[0] != TOPIC:
        return None
    try:
        message = msgspec.msgpack.decode(frames[1])
    except (msgspec.MsgspecError, ValueError, RecursionError):  # whatever the bytes are
        return None
    event = message.get("event") if isinstance(message, dict) else None
    worker = event.get("worker") if isinstance(event, dict) else None
    worker_id = worker.get("worker_id") if isinstance(worker, dict) else None
    if isinstance(worker_id, int) and not isinstance(worker_id, bool) and worker_id >= 0:
        return worker_id
    return None


class ReplicaSyncWatch:
    """One SUB per peer (`peers`: label -> `tcp://HOST:PORT`), read on one daemon thread.

    `known`: the worker ids of this pylon's catalogue; `digest`: its catalogue digest (named in
    the warnings). `counts[(peer, result)]` is exact (written on the watch thread only, read at
    scrape time). Warnings go to `observer` on the event loop that built the watch.
    """

    def __init__(
        self,
        peers: dict[str, str],
        known: Iterable[int],
        digest: str,
        observer: Observer,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._peers = dict(peers)
        self._known = frozenset(known)
        self._digest = digest
        self._observer = observer
        self._clock = clock
        self._loop = asyncio.get_running_loop()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._repeats = LogRate(REPEAT_INTERVAL_S)
        self.counts: dict[tuple[str, str], int] = {
            (peer, result): 0 for peer in self._peers for result in RESULTS
        }

    def catalogue_changed(self, known: Iterable[int], digest: str) -> None:
        """The catalogue was reloaded: judge later events against the new one (a frozenset
        swapped whole, so the watch thread reads one catalogue or the other)."""
        self._known = frozenset(known)
        self._digest = digest

    def start(self) -> None:
        """Connect to every peer and start reading (the SUBs connect in the background: a
        peer that is not up yet is joined when it is)."""
        if self._thread is not None:
            return
        import zmq

        context: zmq.Context[Any] = zmq.Context.instance()
        sockets: dict[Any, str] = {}
        for peer, endpoint in self._peers.items():
            sock = context.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, RCV_HWM)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
            sock.connect(endpoint)
            sockets[sock] = peer
        self._thread = threading.Thread(
            target=self._run, args=(sockets,), name="pylon-replica-sync-watch", daemon=True
        )
        self._thread.start()

    def _run(self, sockets: dict[Any, str]) -> None:
        import zmq

        poller = zmq.Poller()
        for sock in sockets:
            poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(POLL_MS):
                    peer = sockets[sock]
                    for _ in range(1000):  # a burst, then the stop flag is looked at again
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self.heard(peer, frames)
        finally:
            for sock in sockets:
                sock.close(0)

    def heard(self, peer: str, frames: list[bytes]) -> None:
        """Count one message from `peer` (on the watch thread; tests call it directly)."""
        worker_id = event_worker(frames)
        if worker_id is None:
            result = "malformed"
        elif worker_id in self._known:
            result = "applied"
        else:
            result = "unknown_worker"
        key = (peer, result)
        self.counts[key] = self.counts.get(key, 0) + 1
        if result == "unknown_worker":
            held = self._repeats.admit((peer, worker_id), self._clock())
            if held is not None:
                self._warn(peer, str(worker_id), held)

    def _warn(self, peer: str, worker: str, held: int) -> None:
        fields: dict[str, Any] = {"endpoint": peer, "worker": worker, "digest": self._digest}
        if held:
            fields["suppressed"] = held
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to tell
            self._loop.call_soon_threadsafe(self._report, fields)

    def _report(self, fields: dict[str, Any]) -> None:
        self._observer.process_event(
            "replica_sync_dropped",
            detail="the peer booked a worker this pylon does not know: Dynamo's core drops "
            "its bookings; compare the replicas' catalogue digests (replica_sync_started)",
            **fields,
        )

    async def aclose(self) -> None:
        """Stop the thread (within `POLL_MS`) and close its sockets."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            await asyncio.to_thread(thread.join, 5.0)
