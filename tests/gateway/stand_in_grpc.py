"""A stand-in gateway's gRPC control plane (`StargateControlPlane`) for tests, on 127.0.0.1:0.

- `WatchStargates` answers the configured gateway set and extra watch URLs, and pushes a new
  answer to every open watch when `set_watch` changes them.
- `RegisterInferenceServer` checks the bearer token (UNAUTHENTICATED when wrong or missing,
  when a token is set), records every registration with the stream's metadata, sends one ack
  per registration (`ack_target` / `ack_dial_addr`), and drops a stream that stays silent for
  3x its heartbeat metadata (clamped to [`idle_min`, `idle_max`]), as the gateway does.
- `kick()` ends every open registration stream (the gateway restarting, say).

Usage: `gw = StandInGrpc(...); await gw.start(); ...; await gw.stop()`; `gw.address`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio

from pylon.gateway import stargate_pb2 as pb
from pylon.gateway import stargate_pb2_grpc as pb_grpc

HEARTBEAT_METADATA = "x-stargate-registration-heartbeat-ms"


@dataclass
class Received:
    """One registration the stand-in read."""

    stream: int
    message: pb.InferenceServerRegistration
    metadata: dict[str, str]
    at: float  # time.monotonic()


@dataclass
class StreamRecord:
    stream: int
    metadata: dict[str, str]
    opened: float
    ended: float | None = None
    outcome: str = ""  # "idle timeout", "client ended", "kicked", "unauthenticated", ...
    idle_timeout: float = 0.0


def gateway_info(advertise: str, dial: str = "", stargate_id: str = "") -> pb.StargateInfo:
    return pb.StargateInfo(
        stargate_id=stargate_id or advertise,
        advertise_addr=advertise,
        http_advertise_addr="",
        grpc_pylon_dial_addr=dial,
    )


@dataclass
class _Watch:
    version: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class StandInGrpc(pb_grpc.StargateControlPlaneServicer):
    def __init__(
        self,
        *,
        token: str | None = None,
        gateways: Sequence[pb.StargateInfo] = (),
        watch_urls: Sequence[str] = (),
        ack_target: str = "",
        ack_dial_addr: str = "",
        idle_min: float = 60.0,
        idle_max: float = 300.0,
        ack: bool = True,
        tls: tuple[bytes, bytes] | None = None,
    ) -> None:
        self.tls = tls  # (cert chain PEM, key PEM): serve gRPC over TLS
        self.token = token
        self.gateways: list[pb.StargateInfo] = list(gateways)
        self.watch_urls: list[str] = list(watch_urls)
        self.ack_target = ack_target
        self.ack_dial_addr = ack_dial_addr
        self.idle_min = idle_min
        self.idle_max = idle_max
        self.ack = ack
        self.received: list[Received] = []
        self.streams: list[StreamRecord] = []
        self.watch_calls = 0
        self._version = 0
        self._watch_changed = asyncio.Event()
        self._kicks: set[Callable[[], None]] = set()
        self._activity = asyncio.Event()
        self._server: grpc.aio.Server | None = None
        self.port = 0

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> str:
        self._server = grpc.aio.server()
        pb_grpc.add_StargateControlPlaneServicer_to_server(self, self._server)
        if self.tls is None:
            self.port = self._server.add_insecure_port("127.0.0.1:0")
        else:
            credentials = grpc.ssl_server_credentials([(self.tls[1], self.tls[0])])
            self.port = self._server.add_secure_port("127.0.0.1:0", credentials)
        await self._server.start()
        return self.address

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None

    # -- test controls -----------------------------------------------------------------------

    def set_watch(
        self,
        gateways: Iterable[pb.StargateInfo] | None = None,
        watch_urls: Iterable[str] | None = None,
    ) -> None:
        if gateways is not None:
            self.gateways = list(gateways)
        if watch_urls is not None:
            self.watch_urls = list(watch_urls)
        self._version += 1
        self._watch_changed.set()
        self._watch_changed = asyncio.Event()

    def kick(self) -> None:
        kicks, self._kicks = self._kicks, set()
        for kick in kicks:
            kick()

    def open_streams(self) -> list[StreamRecord]:
        return [s for s in self.streams if s.ended is None]

    def registrations(self, stream: int | None = None) -> list[Received]:
        return [r for r in self.received if stream is None or r.stream == stream]

    async def wait_for(
        self, predicate: Any, timeout: float = 5.0, what: str = "a condition"
    ) -> None:
        """Waits (bounded) until `predicate()` is true, woken by the stand-in's activity."""
        try:
            async with asyncio.timeout(timeout):
                while not predicate():
                    self._activity.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(0.05):
                            await self._activity.wait()
        except TimeoutError:
            raise AssertionError(f"stand-in: timed out waiting for {what}") from None

    def _note(self) -> None:
        self._activity.set()

    # -- the service -------------------------------------------------------------------------

    def _answer(self) -> pb.WatchStargatesResponse:
        return pb.WatchStargatesResponse(
            stargates=self.gateways, watch_stargate_urls=self.watch_urls
        )

    async def WatchStargates(  # type: ignore[override]
        self, request: pb.WatchStargatesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.WatchStargatesResponse]:
        self.watch_calls += 1
        self._note()
        while True:
            changed = self._watch_changed
            yield self._answer()
            await changed.wait()

    async def RegisterInferenceServer(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[pb.InferenceServerRegistration],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        metadata = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        record = StreamRecord(len(self.streams), metadata, time.monotonic())
        self.streams.append(record)
        self._note()
        try:
            if self.token is not None and metadata.get("authorization") != f"Bearer {self.token}":
                record.outcome = "unauthenticated"
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "authentication failed")
            heartbeat = metadata.get(HEARTBEAT_METADATA)
            idle = self.idle_max
            if heartbeat is not None and heartbeat.isdigit():
                idle = min(max(3 * int(heartbeat) / 1000, self.idle_min), self.idle_max)
            record.idle_timeout = idle
            # The read is awaited in the handler's own task: grpc.aio does not complete a
            # server read awaited from another task. A kick makes the idle timeout fire now.
            loop = asyncio.get_running_loop()
            kicked = False
            scope: asyncio.Timeout | None = None

            def kick() -> None:
                nonlocal kicked
                kicked = True
                if scope is not None:
                    scope.reschedule(loop.time())

            self._kicks.add(kick)
            while True:
                try:
                    async with asyncio.timeout(idle) as scope:
                        if kicked:
                            scope.reschedule(loop.time())
                        try:
                            message = await context.read()
                        finally:
                            scope = None
                except TimeoutError:
                    record.outcome = "kicked" if kicked else "idle timeout"
                    await context.abort(grpc.StatusCode.UNAVAILABLE, record.outcome)
                if message is grpc.aio.EOF:
                    record.outcome = "client ended"
                    return
                assert isinstance(message, pb.InferenceServerRegistration)
                self.received.append(Received(record.stream, message, metadata, time.monotonic()))
                self._note()
                if self.ack:
                    await context.write(
                        pb.InferenceServerAck(
                            reverse_tunnel_target=self.ack_target,
                            reverse_tunnel_pylon_dial_addr=self.ack_dial_addr,
                        )
                    )
        except asyncio.CancelledError:
            record.outcome = record.outcome or "cancelled"
            raise
        finally:
            record.ended = time.monotonic()
            self._note()
