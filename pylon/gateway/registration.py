"""Registration with the gateways: one `RegisterInferenceServer` stream per discovered gateway,
each sending the full snapshot at open, every `interval`, and at once when the `GatewayBoard`
changes; each ack tells the board where that gateway wants the reverse tunnel.

- Discovery (`pylon.gateway.discovery`) names the gateways; a gateway that disappears has its
  stream retired (its target cleared on the board).
- Metadata per stream: `x-stargate-registration-heartbeat-ms` (the interval, the gateway times
  the stream out at 3x) and `authorization: Bearer <token>`, the token file re-read (trimmed) at
  every open, so a rotated token is used by the next stream.
- A failed stream reopens after `reconnect_base` seconds, doubling to `reconnect_max` while
  attempts keep failing (reset once a stream was acked), or after `first_send_retry` when the
  very first send of the stream failed.
- Drain: `drain()` starts the board's drain (every model INACTIVE), sends that snapshot on every
  stream and waits (bounded) until each stream acked it or failed.

Control-plane channels are plaintext gRPC (no TLS on the registration side yet).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from grpc.aio import EOF  # type: ignore[attr-defined]  # not in grpc-stubs

from pylon.gateway import stargate_pb2 as pb
from pylon.gateway import stargate_pb2_grpc as pb_grpc
from pylon.gateway.board import GatewayBoard, ModelStatus, TunnelTarget
from pylon.gateway.discovery import (
    ControlPlaneTls,
    Discovery,
    DiscoveryOptions,
    GatewayAddress,
    open_channel,
)
from pylon.gateway.stats import ModelStatsValue
from pylon.observe import Observer

HEARTBEAT_METADATA = "x-stargate-registration-heartbeat-ms"
MAX_TOKEN_BYTES = 64 * 1024

_STATUS = {
    ModelStatus.ACTIVE: pb.INFERENCE_SERVER_STATUS_ACTIVE,
    ModelStatus.INACTIVE: pb.INFERENCE_SERVER_STATUS_INACTIVE,
}

Models = Callable[[], Iterable[str]]
Stats = Callable[[], Mapping[str, ModelStatsValue]]


@dataclass(frozen=True, slots=True)
class RegistrationOptions:
    seeds: tuple[str, ...]
    inference_server_id: str
    cluster_id: str | None = None  # None: the inference server id
    token_file: Path | None = None
    tls: ControlPlaneTls | None = None  # None: plaintext gRPC to the gateway
    # Direct mode: quic://HOST:PORT of the listener; reverse mode: what the caller registers.
    inference_server_url: str = ""
    reverse_tunnel: bool = False
    interval: float = 1.0
    connect_timeout: float = 5.0
    reconnect_base: float = 1.0
    reconnect_max: float = 30.0
    first_send_retry: float = 0.2
    watch_retry: float = 1.0
    discovery_publish_after: float = 5.0
    max_watched: int = 64
    max_gateways: int = 64
    drain_timeout: float = 2.0
    close_timeout: float = 2.0


@dataclass(frozen=True, slots=True)
class GatewayReport:
    """One gateway's registration state, read at a metrics scrape (`Registration.report`)."""

    connected: bool  # the stream is open and acked at least once
    acks_total: int
    reconnects_total: Mapping[str, int]  # reason class (`REASONS`) -> stream ends
    model_status: Mapping[str, ModelStatus]  # as last sent on the open stream
    # Reverse mode (filled by `pylon.gateway.side`): tunnel connections up, and the
    # handshake refusals by reason.
    tunnels: int = 0
    tunnel_refusals: Mapping[str, int] = field(default_factory=dict)


# The bounded reasons a stream ended, a label of pylon_gateway_reconnects_total.
REASONS = (
    "unauthenticated",
    "unavailable",
    "connect_timeout",
    "token_unreadable",
    "ended",
    "error",
)


def reason_class(reason: str) -> str:
    """The bounded class (`REASONS`) of a stream's end reason."""
    if reason.startswith("UNAUTHENTICATED") or reason.startswith("PERMISSION_DENIED"):
        return "unauthenticated"
    if reason.startswith("UNAVAILABLE") or reason.startswith("CANCELLED"):
        return "unavailable"
    if reason == "connect timeout":
        return "connect_timeout"
    if reason == "token unreadable":
        return "token_unreadable"
    if reason == "ended by gateway":
        return "ended"
    return "error"


class TokenUnreadable(Exception):
    pass


def read_token(path: Path | None) -> str | None:
    """The trimmed token in `path` (None without a file); `TokenUnreadable` when it cannot be
    read, is too large, or is empty."""
    if path is None:
        return None
    try:
        with path.open("rb") as file:
            data = file.read(MAX_TOKEN_BYTES + 1)
    except OSError as exc:
        raise TokenUnreadable(f"{type(exc).__name__}: {exc.strerror or exc}") from exc
    if len(data) > MAX_TOKEN_BYTES:
        raise TokenUnreadable(f"larger than {MAX_TOKEN_BYTES} bytes")
    try:
        token = data.decode("ascii").strip()
    except UnicodeDecodeError as exc:
        raise TokenUnreadable("not ASCII") from exc
    if not token:
        raise TokenUnreadable("empty")
    return token


def build_snapshot(
    options: RegistrationOptions,
    board: GatewayBoard,
    gateway: str,
    models: Iterable[str],
    stats: Mapping[str, ModelStatsValue],
) -> pb.InferenceServerRegistration:
    """The full registration snapshot one gateway is told now."""
    message = pb.InferenceServerRegistration(
        inference_server_id=options.inference_server_id,
        inference_server_url=options.inference_server_url,
        reverse_tunnel=options.reverse_tunnel,
        cluster_id=options.cluster_id or options.inference_server_id,
    )
    for model in dict.fromkeys(models):
        entry = message.models[model]
        entry.stats.CopyFrom(stats.get(model, ModelStatsValue()).to_proto())
        entry.status = _STATUS[board.status(gateway, model)]
    return message


class _Stream:
    """One gateway's registration stream, reopened until retired."""

    def __init__(self, owner: Registration, address: GatewayAddress) -> None:
        self.owner = owner
        self.address = address
        self.key = address.key
        self.connected = False
        self.acks_total = 0
        self.reconnects: dict[str, int] = {}
        self.statuses: dict[str, ModelStatus] = {}
        # Per open stream: snapshots sent and acks read (the gateway acks each in order).
        self.sent = 0
        self.acked = 0
        self.drain_seq: int | None = None  # the first sent snapshot that was draining
        self.open = False
        self._wake = asyncio.Event()
        self._progress = asyncio.Event()
        self.task = asyncio.create_task(self._run(), name=f"registration {self.key}")

    def wake(self) -> None:
        self._wake.set()

    def _event(self, kind: str, **fields: Any) -> None:
        self.owner._observer.process_event(kind, gateway=self.key, **fields)

    async def _run(self) -> None:
        options = self.owner._options
        failures = 0
        try:
            while True:
                acked_before = self.acks_total
                first_send_failed, reason = await self._attempt()
                self._lost()
                if self.acks_total > acked_before:
                    failures = 0
                if first_send_failed:
                    delay = options.first_send_retry
                else:
                    delay = min(options.reconnect_base * 2**failures, options.reconnect_max)
                failures = min(failures + 1, 32)
                label = reason_class(reason)
                self.reconnects[label] = self.reconnects.get(label, 0) + 1
                self._event("gateway_stream_lost", reason=reason, retry_in=delay)
                await asyncio.sleep(delay)
        finally:
            self._lost()

    def _lost(self) -> None:
        self.open = False
        self._progress.set()
        if self.connected:
            self.connected = False
        self.statuses.clear()
        self.owner._board.set_target(self.key, None)

    async def _attempt(self) -> tuple[bool, str]:
        """One stream open; returns (the first send failed, why it ended)."""
        options = self.owner._options
        try:
            token = read_token(options.token_file)
        except TokenUnreadable as exc:
            self._event("gateway_token_unreadable", path=str(options.token_file), reason=str(exc))
            return False, "token unreadable"
        metadata: list[tuple[str, str]] = [
            (HEARTBEAT_METADATA, str(max(1, round(options.interval * 1000))))
        ]
        if token is not None:
            metadata.append(("authorization", f"Bearer {token}"))
        authority = self.key if self.address.dial != self.key else None
        try:
            channel = open_channel(self.address.dial, options.tls, authority)
        except OSError as exc:
            self._event("gateway_ca_unreadable", reason=str(exc))
            return False, "ca unreadable"
        reader: asyncio.Task[str] | None = None
        try:
            try:
                async with asyncio.timeout(options.connect_timeout):
                    await channel.channel_ready()
            except TimeoutError:
                return False, "connect timeout"
            stub = pb_grpc.StargateControlPlaneStub(channel)
            # grpc.aio's bidi call (write/read; grpc-stubs types only the sync API).
            register: Any = stub.RegisterInferenceServer
            call = register(metadata=metadata)
            self.sent = self.acked = 0
            self.drain_seq = None
            self.open = True
            reader = asyncio.create_task(self._read(call), name=f"acks {self.key}")
            while True:
                self._wake.clear()
                try:
                    # Bounded: a gateway that stops reading (flow control) fails the stream.
                    async with asyncio.timeout(options.connect_timeout):
                        await self._send(call)
                except TimeoutError:
                    return self.sent == 0, "send timeout"
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
                    return self.sent == 0, await self._why(reader, exc)
                self.sent += 1
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(options.interval):
                        waker = asyncio.create_task(self._wake.wait())
                        try:
                            await asyncio.wait({waker, reader}, return_when=asyncio.FIRST_COMPLETED)
                        finally:
                            waker.cancel()
                if reader.done():
                    return False, reader.result()
        finally:
            self.open = False
            if reader is not None and not reader.done():
                reader.cancel()
                with contextlib.suppress(BaseException):
                    await reader
            with contextlib.suppress(Exception):
                await channel.close(grace=None)

    async def _why(self, reader: asyncio.Task[str], exc: BaseException) -> str:
        """Why a send failed: the reader's status when it has one (briefly awaited)."""
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            async with asyncio.timeout(0.5):
                return await asyncio.shield(reader)
        if isinstance(exc, grpc.aio.AioRpcError):
            return exc.code().name
        return "send failed"

    async def _send(self, call: Any) -> None:
        owner = self.owner
        board = owner._board
        snapshot = build_snapshot(
            owner._options, board, self.key, list(owner._models()), owner._stats()
        )
        if board.draining and self.drain_seq is None:
            self.drain_seq = self.sent + 1
        self.statuses = {
            model: ModelStatus.ACTIVE
            if entry.status == pb.INFERENCE_SERVER_STATUS_ACTIVE
            else ModelStatus.INACTIVE
            for model, entry in snapshot.models.items()
        }
        await call.write(snapshot)

    async def _read(self, call: Any) -> str:
        """Reads acks until the stream ends; returns why it ended."""
        board = self.owner._board
        try:
            while True:
                ack = await call.read()
                if ack is EOF:
                    return "ended by gateway"
                self.acked += 1
                self.acks_total += 1
                self._progress.set()
                if not self.connected:
                    self.connected = True
                    self._event("gateway_registered", target=ack.reverse_tunnel_target)
                if board.reverse and ack.reverse_tunnel_target:
                    board.set_target(
                        self.key,
                        TunnelTarget(
                            ack.reverse_tunnel_target,
                            ack.reverse_tunnel_pylon_dial_addr or ack.reverse_tunnel_target,
                        ),
                    )
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
        finally:
            self._progress.set()

    async def drained(self, deadline: float) -> bool:
        """Waits until the draining snapshot was acked on this stream (True), or the stream is
        not open (False); bounded by `deadline` (loop time)."""
        loop = asyncio.get_running_loop()
        while True:
            if not self.open:
                return False
            if self.drain_seq is not None and self.acked >= self.drain_seq:
                return True
            left = deadline - loop.time()
            if left <= 0:
                return False
            self._progress.clear()
            if self.drain_seq is None:
                self.wake()  # the draining snapshot is not sent yet on this stream
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, 0.05)):
                    await self._progress.wait()


class Registration:
    """Registers this node with every gateway discovery names."""

    def __init__(
        self,
        options: RegistrationOptions,
        board: GatewayBoard,
        *,
        models: Models,
        stats: Stats,
        observer: Observer,
    ) -> None:
        self._options = options
        self._board = board
        self._models = models
        self._stats = stats
        self._observer = observer
        self._streams: dict[str, _Stream] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        self._unsubscribe: Callable[[], None] | None = None
        self._discovery = Discovery(
            DiscoveryOptions(
                seeds=options.seeds,
                tls=options.tls,
                connect_timeout=options.connect_timeout,
                retry=options.watch_retry,
                publish_after=options.discovery_publish_after,
                max_watched=options.max_watched,
                max_gateways=options.max_gateways,
            ),
            self._published,
            observer,
        )

    async def start(self) -> None:
        self._unsubscribe = self._board.subscribe(self._board_changed)
        await self._discovery.start()

    def _board_changed(self, kind: str) -> None:
        if kind == "target":  # our own acks: nothing a gateway is told changed
            return
        for stream in self._streams.values():
            stream.wake()

    def _published(self, gateways: Mapping[str, GatewayAddress]) -> None:
        for key in [k for k in self._streams if k not in gateways]:
            self._retire(key, "gone from the watch")
        for key, address in gateways.items():
            stream = self._streams.get(key)
            if stream is not None and stream.address != address:
                self._retire(key, "dial address changed")
                stream = None
            if stream is None:
                self._streams[key] = _Stream(self, address)
                self._observer.process_event("gateway_discovered", gateway=key, dial=address.dial)

    def _retire(self, key: str, reason: str) -> None:
        stream = self._streams.pop(key)
        stream.task.cancel()
        self._retiring.add(stream.task)
        stream.task.add_done_callback(self._retiring.discard)
        self._board.set_target(key, None)
        self._observer.process_event("gateway_retired", gateway=key, reason=reason)

    # -- what the rest of pylon reads ------------------------------------------------------

    def gateways(self) -> list[str]:
        return list(self._streams)

    def connected(self, key: str) -> bool:
        stream = self._streams.get(key)
        return stream is not None and stream.connected

    def report(self) -> dict[str, GatewayReport]:
        """Per registered gateway: connected, acks, reconnects by reason class, each model's
        status as last sent (the metrics scrape reads it: `MetricsObserver.gateway_report`)."""
        return {
            key: GatewayReport(
                connected=stream.connected,
                acks_total=stream.acks_total,
                reconnects_total=dict(stream.reconnects),
                model_status=dict(stream.statuses),
            )
            for key, stream in self._streams.items()
        }

    # -- the end ---------------------------------------------------------------------------

    async def drain(self) -> bool:
        """Every model advertised INACTIVE on every open stream; True when each acked it."""
        self._board.start_drain()
        for stream in self._streams.values():
            stream.wake()
        deadline = asyncio.get_running_loop().time() + self._options.drain_timeout
        streams = list(self._streams.values())
        results = await asyncio.gather(*(s.drained(deadline) for s in streams))
        acked = [s.key for s, ok in zip(streams, results, strict=True) if ok]
        self._observer.process_event(
            "gateway_drain_advertised",
            acked=acked,
            not_acked=[s.key for s in streams if s.key not in acked],
        )
        return all(results)

    async def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        await self._discovery.close(self._options.close_timeout)
        tasks = [s.task for s in self._streams.values()] + list(self._retiring)
        for key in list(self._streams):
            self._streams.pop(key)
            self._board.set_target(key, None)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=self._options.close_timeout)
