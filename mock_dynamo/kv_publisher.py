"""The mock engine's KV-event publisher: a ZMQ socket bound on 127.0.0.1, vLLM's wire format.

Each message is three frames, `[topic, seq, payload]`: topic `b""` (vLLM's default), `seq` an
8-byte big-endian u64 that starts at 0 and grows by one per message, payload msgpack
`[ts, events, dp_rank]` with `dp_rank` 0. One message per admitted request (its evictions, then
its stored blocks), one per cache clear.

The encoding is pylon's one KV-event codec (`pylon.core.kv_events.encode_message`); the mock
only dresses its cache's events as the engine it imitates sends them:
- `array` (vLLM's positional arrays, the default): `medium` "GPU", no `group_idx`, no salt, so
  `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, None, "GPU", None,
  None]`, `["BlockRemoved", block_hashes, "GPU"]`, `["AllBlocksCleared"]`;
- `map` (the Dynamo 1.6.1 mocker's maps): no `medium`, `group_idx` 0, so `{"type":
  "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size", "group_idx": 0}`
  (plus `cache_salt` for a salted request: the positional form has no slot for it),
  `{"type": "BlockRemoved", "block_hashes", "group_idx": 0}`, `{"type": "AllBlocksCleared"}`.
Hashes are unsigned 64-bit ints.

The socket is an XPUB, which a SUB sees as a PUB; unlike a PUB it tells the mock who subscribed,
so `/test-control/kv` can report `subscribers` and a test can wait until its SUB is really
subscribed before it sends a request (a PUB silently drops messages sent before that).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from mock_dynamo.config import KvEventsEncoding
from pylon.core.kv_events import (
    AllBlocksCleared,
    BlockStored,
    KvEvent,
    KvEventBatch,
    encode_message,
)

MEDIUM = "GPU"
TOPIC = b""
DP_RANK = 0
# Messages queued per subscriber before ZMQ drops (a slow router loses events, sees a gap).
SEND_HWM = 100_000


def dress(event: KvEvent, encoding: KvEventsEncoding) -> KvEvent:
    """The cache's event as the imitated engine sends it (see the module docstring)."""
    if isinstance(event, AllBlocksCleared):
        return event
    if encoding == "map":
        return dataclasses.replace(event, medium=None, group_idx=0)
    if isinstance(event, BlockStored):  # vLLM's array has no slot for the salt: it goes
        return dataclasses.replace(event, medium=MEDIUM, group_idx=None, cache_salt=None)
    return dataclasses.replace(event, medium=MEDIUM, group_idx=None)


def message(seq: int, events: list[KvEvent], encoding: KvEventsEncoding, ts: float) -> list[bytes]:
    """The three frames of one message."""
    batch = KvEventBatch(seq, ts, tuple(dress(e, encoding) for e in events), DP_RANK, TOPIC)
    return encode_message(batch, form=encoding)


class KvEventPublisher:
    """Binds at `start()`; `publish()` never blocks (ZMQ drops past the high-water mark)."""

    def __init__(
        self, port: int, encoding: KvEventsEncoding, on_change: Callable[[], None]
    ) -> None:
        self._port = port
        self.encoding = encoding
        self._on_change = on_change
        self.endpoint: str | None = None
        self.next_seq = 0
        self.messages = 0
        self.dropped = 0
        self.subscribers = 0
        self._context: Any = None
        self._socket: Any = None
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        try:
            import zmq
            import zmq.asyncio
        except ImportError:  # pragma: no cover - depends on the install
            raise ValueError(
                "--kv-events-port needs the 'pyzmq' package: pip install -e '.[mock-kv]'"
            ) from None
        self._context = zmq.asyncio.Context()
        sock = self._context.socket(zmq.XPUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        # Pass every subscribe and unsubscribe up, so the subscriber count stays exact.
        sock.setsockopt(zmq.XPUB_VERBOSER, 1)
        try:
            sock.bind(f"tcp://127.0.0.1:{self._port}")
        except zmq.ZMQError as exc:
            sock.close(0)
            self._context.term()
            raise OSError(f"cannot bind KV events on 127.0.0.1:{self._port}: {exc}") from None
        self._socket = sock
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._reader = asyncio.create_task(self._read_subscriptions())

    async def _read_subscriptions(self) -> None:
        import zmq

        sock = self._socket
        with contextlib.suppress(zmq.ZMQError, asyncio.CancelledError):
            while True:
                message = await sock.recv()
                if message[:1] == b"\x01":
                    self.subscribers += 1
                elif message[:1] == b"\x00":
                    self.subscribers = max(0, self.subscribers - 1)
                self._on_change()

    def publish(self, events: list[KvEvent]) -> None:
        if not events or self._socket is None:
            return
        import zmq

        frames = message(self.next_seq, events, self.encoding, time.time())
        self.next_seq += 1
        future = self._socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=True)
        future.add_done_callback(self._sent)

    def _sent(self, future: asyncio.Future[Any]) -> None:
        if future.cancelled() or future.exception() is not None:
            self.dropped += 1
        else:
            self.messages += 1

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        if self._socket is not None:
            self._socket.close(0)
            self._socket = None
        if self._context is not None:
            self._context.term()
            self._context = None

    def view(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "encoding": self.encoding,
            "next_seq": self.next_seq,
            "messages": self.messages,
            "dropped": self.dropped,
            "subscribers": self.subscribers,
        }
