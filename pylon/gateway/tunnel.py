"""The reverse tunnel: pylon dials each gateway as the QUIC client and serves the requests the
gateway opens on that connection, through the same intake as direct ones.

Per gateway target on the `GatewayBoard`, `ReverseTunnels` keeps `TunnelOptions.connections`
connections up. Each one:

1. resolves the dial address (IPv4 candidates first, tried one by one, each QUIC handshake
   bounded by `connect_timeout`), with SNI the target's host (`stargate` for an IP address or
   localhost, as the reference) and the gateway's certificate verified against `--gateway-ca`
   (re-read when the file changes) unless `insecure`;
2. opens its first bidirectional stream (id 0), writes the Cap'n Proto `Handshake` (the id and the
   token, the token file re-read at every dial), finishes the stream's write side and reads the
   `HandshakeAck` (bounded by `connect_timeout`);
3. on accept serves the gateway's streams: for `http3` the role-reversed HTTP/3 of
   `pylon.server.http3.Http3Protocol` (request streams are the gateway's server-initiated
   bidirectional streams, id 1 mod 4); stream 0 never reaches the stream layer. A QUIC PING every
   `keepalive` s, and the connection's `idle_timeout`, notice a dead path.

A refusal (`tunnel_refused`, one event per reason, counted in `refusals`) or a failed dial
(`tunnel_dial_failed`) is retried after a backoff of `backoff_initial` doubling to `backoff_max`,
reset when the target changes or when a connection lived over `backoff_reset_after`. Every reason
is retried: `duplicate connection` is expected after a path break (the gateway keeps the old
connection until its idle timeout), and the others may be transient (a registration not yet
applied). A gateway that allows one connection per node refuses the extra ones as duplicates
while one is up: those wait as standbys (`standby=True`, retried at `backoff_max`). The connected
count per gateway goes to `board.set_tunnels`.

The stream layer is chosen by `TunnelOptions.protocol` through a `LinkFactory`: `http3` is built
in (`TunnelHttp3Protocol`); `raw-quic` plugs in by passing `links={"raw-quic": factory}`: a
connection protocol `TunnelLinkBase` + the raw-QUIC layer's protocol (`TunnelLink`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import socket
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, cast

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import (
    ConnectionTerminated,
    HandshakeCompleted,
    QuicEvent,
    StopSendingReceived,
    StreamDataReceived,
    StreamReset,
)
from cryptography import x509

from pylon.gateway import wire
from pylon.gateway.board import GatewayBoard, TunnelTarget
from pylon.observe import Observer
from pylon.server.http3 import H3_ALPN, Http3Protocol
from pylon.server.streams import Ingress
from pylon.tls import file_state, is_ca

TunnelProtocol = Literal["http3", "raw-quic"]
DEFAULT_SNI = "stargate"  # the reference's SNI when the target names no host (an IP, localhost)


class TunnelError(Exception):
    """A dial that did not end in a served connection (`reason` for the event)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class TunnelRefused(TunnelError):
    """The gateway answered the handshake with a NACK; `reason` is its text, verbatim."""


@dataclass(frozen=True, slots=True)
class TunnelOptions:
    """The reverse tunnel's options (from `--inference-server-id`, `--gateway-token-file`,
    `--tunnel-*`, `--gateway-ca`, `--gateway-insecure`, `--gateway-connect-timeout`)."""

    inference_server_id: str
    token_file: Path | None = None  # trimmed, re-read at every dial; None = no token sent
    protocol: TunnelProtocol = "http3"
    connections: int = 2  # per gateway
    connect_timeout: float = 5.0  # each QUIC handshake, and the tunnel handshake
    keepalive: float = 2.0  # seconds between QUIC PINGs
    idle_timeout: float = 10.0  # the QUIC idle timeout: a silent path is dropped
    ca: Path | None = None  # the CA bundle the gateway's certificate is verified against
    insecure: bool = False  # no verification (the caller logs the warning at start)
    backoff_initial: float = 1.0
    backoff_max: float = 30.0
    backoff_reset_after: float = 60.0  # a connection that lived this long resets the backoff
    retire_grace: float = 30.0  # a retired connection's in-flight requests get this long
    max_data: int = 1024 * 1024  # the connection's receive window
    max_stream_data: int = 1024 * 1024  # each stream's receive window

    def __post_init__(self) -> None:
        if not self.inference_server_id:
            raise ValueError("a reverse tunnel needs an inference server id")
        if self.ca is None and not self.insecure:
            raise ValueError("a reverse tunnel needs a CA (ca) or an explicit insecure")
        if self.ca is not None and self.insecure:
            raise ValueError("ca and insecure contradict each other")
        if self.connections < 1:
            raise ValueError("at least one connection per gateway")
        if self.idle_timeout <= self.keepalive:
            raise ValueError("the idle timeout must exceed the keepalive interval")
        if not 0 < self.backoff_initial <= self.backoff_max:
            raise ValueError("backoff: 0 < initial <= max")


# --- trust ------------------------------------------------------------------------------------


def load_gateway_ca(path: Path) -> bytes:
    """The CA bundle's PEM bytes, checked: readable, PEM certificates, at least one a CA.
    `ValueError` (with the reason) otherwise; the caller validates `--gateway-ca` with it at
    start."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"--gateway-ca {path}: {exc.strerror or exc}") from None
    try:
        certificates = x509.load_pem_x509_certificates(data)
    except ValueError:
        raise ValueError(f"--gateway-ca {path}: no PEM certificate in it") from None
    if not any(is_ca(certificate) for certificate in certificates):
        raise ValueError(f"--gateway-ca {path}: no CA certificate in it (CA:TRUE)")
    return data


class GatewayTrust:
    """The gateway CA, read at the first dial and again at each dial after the file changed
    (like pylon's own identity: a bad new file is refused, `tunnel_ca_reload_rejected`, and the
    previous bundle kept)."""

    def __init__(self, ca: Path | None, observer: Observer) -> None:
        self._path = ca
        self._observer = observer
        self._seen: tuple[int, int, int] | None = None
        self._data: bytes | None = None

    def current(self) -> bytes | None:
        """The PEM bundle to verify against; None when insecure. `TunnelError` when no valid
        bundle was ever read."""
        if self._path is None:
            return None
        state = file_state(self._path)
        if self._data is None or state != self._seen:
            self._seen = state
            try:
                data = load_gateway_ca(self._path)
            except ValueError as exc:
                if self._data is None:
                    raise TunnelError(str(exc)) from None
                self._observer.process_event("tunnel_ca_reload_rejected", reason=str(exc))
            else:
                if self._data is not None and data != self._data:
                    self._observer.process_event("tunnel_ca_reloaded", path=str(self._path))
                self._data = data
        return self._data


# --- addresses --------------------------------------------------------------------------------


def split_host_port(address: str) -> tuple[str, int | None]:
    """`host:port`, `[v6]:port`, `host` or a URL (`quic://host:port/`): (host, port or None)."""
    rest = address.split("://", 1)[-1].split("/", 1)[0]
    if rest.startswith("["):
        host, _, tail = rest[1:].partition("]")
        port = tail[1:] if tail.startswith(":") else ""
    elif rest.count(":") == 1:
        host, port = rest.split(":")
    else:
        host, port = rest, ""  # a bare host, or an unbracketed IPv6 address
    if not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        return host, None
    return host, int(port)


def derive_sni(target: str) -> str:
    """The SNI for a target: its host name, or `stargate` for an IP address or localhost."""
    host, _ = split_host_port(target)
    if not host or host.lower() == "localhost":
        return DEFAULT_SNI
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return host
    return DEFAULT_SNI


async def resolve(host: str, port: int) -> list[str]:
    """The addresses to try for `host`, IPv4 first, each once."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError as exc:
        raise TunnelError(f"cannot resolve {host}: {exc.strerror or exc}") from None
    ordered = [i for i in infos if i[0] == socket.AF_INET] + [
        i for i in infos if i[0] == socket.AF_INET6
    ]
    return list(dict.fromkeys(str(info[4][0]) for info in ordered))


# --- the handshake stream (either stream layer) -----------------------------------------------


class HandshakeStream:
    """Sans-I/O: the tunnel's own first bidirectional stream. `send` opens it and writes the
    handshake with the FIN; `owns` says whether a QUIC event is this stream's (never hand those
    to the stream layer); `feed` returns the ack once it is whole (`TunnelError` when the
    stream ends or is reset first, or carries a malformed one)."""

    def __init__(self, quic: QuicConnection) -> None:
        self._quic = quic
        self.stream_id: int | None = None
        self._reader = wire.FrameReader(wire.MAX_HANDSHAKE_BYTES)
        self.ack: wire.HandshakeAck | None = None

    def send(self, handshake: wire.Handshake) -> None:
        self.stream_id = self._quic.get_next_available_stream_id()
        self._quic.send_stream_data(self.stream_id, wire.encode_handshake(handshake), True)

    def owns(self, event: QuicEvent) -> bool:
        if self.stream_id is None:
            return False
        if isinstance(event, StreamDataReceived | StreamReset | StopSendingReceived):
            return event.stream_id == self.stream_id
        return False

    def feed(self, event: QuicEvent) -> wire.HandshakeAck | None:
        if self.ack is not None:
            return None  # anything after the ack is ignored
        if isinstance(event, StreamReset):
            raise TunnelError(f"handshake stream reset (code {event.error_code})")
        if not isinstance(event, StreamDataReceived):
            return None
        try:
            messages = self._reader.feed(event.data)
            if messages:
                self.ack = wire.decode_handshake_ack(messages[0])
                return self.ack
        except wire.WireError as exc:
            raise TunnelError(f"bad handshake ack: {exc}") from None
        if event.end_stream:
            raise TunnelError("handshake stream ended without an ack")
        return None


# --- a tunnel connection ----------------------------------------------------------------------


class TunnelLink(Protocol):
    """What `ReverseTunnels` needs of a connection's protocol, whatever its stream layer (an
    aioquic `QuicConnectionProtocol`, built by a `LinkFactory`)."""

    def transmit(self) -> None: ...

    def release_socket(self) -> None:
        """Close the link's UDP socket, whatever aioquic's `connect()` did on its way out."""
        ...

    async def wait_handshake(self) -> None:
        """Until the QUIC (TLS) handshake completed; `TunnelError` when the connection ended
        first (the reason: a TLS alert, an idle timeout). Not aioquic's `wait_connected`,
        whose shielded waiter is left unretrieved when the wait is abandoned."""
        ...

    def send_handshake(self, handshake: wire.Handshake) -> None: ...

    async def read_ack(self) -> wire.HandshakeAck:
        """The gateway's answer (`TunnelError` when the stream or connection ends first)."""
        ...

    def serve(self) -> None:
        """Accepted: start taking the gateway's streams, and the keepalive (idempotent: a
        link may start at once when it reads an accepting ack, before its reader wakes)."""
        ...

    def drain(self) -> None:
        """Take no new stream (GOAWAY), finish the ones in flight, then close."""
        ...

    def close_now(self) -> None:
        """Cancel what still runs (outcome `shutdown`) and close."""
        ...

    @property
    def in_progress(self) -> int: ...

    @property
    def end_reason(self) -> str: ...

    async def wait_closed(self) -> None: ...


class TunnelOwner(Protocol):
    """What a link needs of `ReverseTunnels` (the `Http3Owner` of `pylon.server.http3`)."""

    @property
    def ingress(self) -> Ingress: ...

    @property
    def max_header_block(self) -> int: ...

    def forget(self, protocol: Any) -> None: ...


# Builds a link's protocol for aioquic's `connect(create_protocol=...)`.
LinkFactory = Callable[[QuicConnection, TunnelOwner, TunnelOptions, dict[str, Any]], TunnelLink]


class TunnelLinkBase(QuicConnectionProtocol):
    """What every tunnel link does whatever its stream layer: the QUIC-handshake wait, the
    handshake stream (its events never reach the stream layer), the keepalive and the end's
    reason. A link is this first, then its stream layer's connection protocol, e.g.
    `class TunnelHttp3Protocol(TunnelLinkBase, Http3Protocol)`; a raw-QUIC link the same way
    over its own protocol, overriding `start_streams`. The stream layer provides `drain`,
    `close_now` and `in_progress` (`TunnelLink`)."""

    def __init__(
        self, quic: QuicConnection, *args: Any, options: TunnelOptions, **kwargs: Any
    ) -> None:
        super().__init__(quic, *args, **kwargs)
        self._handshake = HandshakeStream(quic)
        self._quic_ready: asyncio.Future[None] = self._loop.create_future()
        self._ack: asyncio.Future[wire.HandshakeAck] = self._loop.create_future()
        self._keepalive = options.keepalive
        self._ping: asyncio.TimerHandle | None = None
        self._end_reason = "closed"
        self._serving = False
        self._datagrams: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._datagrams = transport
        super().connection_made(transport)

    def release_socket(self) -> None:
        # aioquic's `connect()` closes its socket only after `wait_closed()`: a dial task
        # cancelled there (a retired slot, the shutdown) would leak one socket per dial.
        if self._datagrams is not None and not self._datagrams.is_closing():
            self._datagrams.close()

    def start_streams(self) -> None:
        """Start the stream layer (the handshake was accepted)."""
        raise NotImplementedError

    # TunnelLink
    async def wait_handshake(self) -> None:
        await asyncio.shield(self._quic_ready)

    def send_handshake(self, handshake: wire.Handshake) -> None:
        self._handshake.send(handshake)
        self.transmit()

    async def read_ack(self) -> wire.HandshakeAck:
        return await asyncio.shield(self._ack)

    def serve(self) -> None:
        if self._serving:
            return
        self._serving = True
        self.start_streams()
        self._ping = self._loop.call_later(self._keepalive, self._send_ping)
        self.transmit()

    @property
    def end_reason(self) -> str:
        return self._end_reason

    def quic_event_received(self, event: QuicEvent) -> None:
        if self._handshake.owns(event):
            try:
                ack = self._handshake.feed(event)
            except TunnelError as exc:
                self._fail(self._ack, exc)
                return
            if ack is not None and not self._ack.done():
                if ack.accepted:
                    # At once: the gateway may open its first request in the same datagram.
                    self.serve()
                self._ack.set_result(ack)
            return
        if isinstance(event, HandshakeCompleted) and not self._quic_ready.done():
            self._quic_ready.set_result(None)
        elif isinstance(event, ConnectionTerminated):
            detail = event.reason_phrase or f"code 0x{event.error_code:x}"
            self._end_reason = f"connection closed: {detail}"
            self._fail(self._quic_ready, TunnelError(self._end_reason))
            self._fail(self._ack, TunnelError(self._end_reason))
            if self._ping is not None:
                self._ping.cancel()
        super().quic_event_received(event)

    @staticmethod
    def _fail(waiter: asyncio.Future[Any], error: TunnelError) -> None:
        if not waiter.done():
            waiter.set_exception(error)
            waiter.exception()  # retrieved: nobody may be waiting any more

    def _send_ping(self) -> None:
        if self._closed.is_set():
            return
        self._quic.send_ping(0)
        self.transmit()
        self._ping = self._loop.call_later(self._keepalive, self._send_ping)


class _Stillborn(QuicConnectionProtocol):
    """Stands in for a link whose factory raised inside aioquic's `connect()`: asyncio does not
    close the socket it was given when the protocol factory raises, so this takes the socket
    (sending nothing) for the dial's cleanup to close, and the dial raises `error` after."""

    def __init__(self, quic: QuicConnection, error: Exception) -> None:
        super().__init__(quic)
        self.error = error
        self._datagrams: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._datagrams = transport  # not aioquic's: nothing is ever sent

    def release_socket(self) -> None:
        if self._datagrams is not None:
            self._datagrams.close()

    def close(self, *args: Any, **kwargs: Any) -> None:
        self.release_socket()

    async def wait_closed(self) -> None:
        return


class TunnelHttp3Protocol(TunnelLinkBase, Http3Protocol):
    """A reverse tunnel's connection with role-reversed HTTP/3: the QUIC client serves the
    requests the gateway opens (`Http3Protocol`), after the handshake on stream 0."""

    def __init__(
        self, quic: QuicConnection, owner: TunnelOwner, options: TunnelOptions, **kwargs: Any
    ) -> None:
        super().__init__(
            quic, owner, options=options, follow_lifecycle=False, serve_on_alpn=False, **kwargs
        )

    def start_streams(self) -> None:
        self.start_http()


def http3_link(
    quic: QuicConnection, owner: TunnelOwner, options: TunnelOptions, kwargs: dict[str, Any]
) -> TunnelLink:
    return TunnelHttp3Protocol(quic, owner, options, **kwargs)


LINKS: Mapping[str, LinkFactory] = {"http3": http3_link}


# --- the connections --------------------------------------------------------------------------


@dataclass(slots=True, eq=False)  # hashed by identity
class _Slot:
    gateway: str
    target: TunnelTarget
    index: int
    task: asyncio.Task[None] | None = None
    link: TunnelLink | None = None
    retired: bool = False


class ReverseTunnels:
    """Every gateway's reverse-tunnel connections (see the module docstring).

    `start()` follows the board's targets until `drain()` or `close()`. `links` maps a tunnel
    protocol to its `LinkFactory` (default: `LINKS`, http3 only); `clock` (the loop's) times how
    long a connection lived; `resolver` gives a dial host's addresses in the order tried.
    """

    def __init__(
        self,
        options: TunnelOptions,
        board: GatewayBoard,
        ingress: Ingress,
        observer: Observer,
        *,
        links: Mapping[str, LinkFactory] | None = None,
        clock: Callable[[], float] | None = None,
        resolver: Callable[[str, int], Awaitable[list[str]]] = resolve,
    ) -> None:
        factories = LINKS if links is None else links
        if options.protocol not in factories:
            raise ValueError(f"no stream layer for tunnel protocol {options.protocol!r}")
        self.options = options
        self._factory = factories[options.protocol]
        self._board = board
        self._ingress = ingress
        self._observer = observer
        self._clock = clock
        self._resolve = resolver  # host, port -> the addresses to try, in order
        self._trust = GatewayTrust(options.ca, observer)
        self.max_header_block = ingress.limits.max_header_bytes + 1024
        self._slots: dict[str, list[_Slot]] = {}
        self._retiring: set[_Slot] = set()
        self._connected: collections.Counter[str] = collections.Counter()
        self.refusals: collections.Counter[str] = collections.Counter()  # by NACK reason
        # (gateway, reason) -> refusals, the reason one of the gateway's NACK reasons or
        # "other" (a label of pylon_gateway_tunnel_refusals_total: bounded).
        self.refusals_by_gateway: collections.Counter[tuple[str, str]] = collections.Counter()
        self.dial_failures = 0
        self.dials = 0  # connections accepted
        self._unsubscribe: Callable[[], None] | None = None
        self._stopping = False
        self._wake = asyncio.Event()

    # -- Http3Owner / TunnelOwner --
    @property
    def ingress(self) -> Ingress:
        return self._ingress

    def forget(self, protocol: Any) -> None:
        pass  # each slot holds its own link; nothing else keeps connections

    # -- the public surface --
    def start(self) -> None:
        """Dial every target on the board now, and follow its changes."""
        if self._unsubscribe is None and not self._stopping:
            self._unsubscribe = self._board.subscribe(self._board_changed)
            self._reconcile()

    def connected(self, gateway: str) -> int:
        return self._connected[gateway]

    def refusals_of(self, gateway: str) -> dict[str, int]:
        """That gateway's handshake refusals by reason (NACK reason, or "other")."""
        return {r: n for (g, r), n in self.refusals_by_gateway.items() if g == gateway}

    @property
    def in_progress(self) -> int:
        """Requests started on every tunnel connection and not answered yet."""
        return sum(slot.link.in_progress for slot in self._all_slots() if slot.link is not None)

    def begin_drain(self) -> None:
        """Stop dialling; every connection sends GOAWAY (no new streams), lets its in-flight
        requests finish and closes. Synchronous, so it can be a `Lifecycle.on_drain` listener."""
        self._stop_following()
        for slot in self._all_slots():
            slot.retired = True
            if slot.link is not None:
                slot.link.drain()
            elif slot.task is not None:
                slot.task.cancel()  # still dialling or backing off

    async def drain(self, grace: float) -> bool:
        """`begin_drain`, then wait: True when every connection closed within `grace` s (call
        `close()` after either way)."""
        self.begin_drain()
        tasks = [slot.task for slot in self._all_slots() if slot.task is not None]
        if not tasks:
            return True
        _, pending = await asyncio.wait(tasks, timeout=grace)
        return not pending

    async def close(self) -> None:
        """End every connection now (their requests are cancelled, outcome `shutdown`)."""
        self._stop_following()
        slots = self._all_slots()
        for slot in slots:
            slot.retired = True
            if slot.link is not None:
                slot.link.close_now()
            if slot.task is not None:
                slot.task.cancel()
        tasks = [slot.task for slot in slots if slot.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=max(5.0, self.options.connect_timeout))
        self._slots.clear()
        self._retiring.clear()

    # -- following the board --
    def _stop_following(self) -> None:
        self._stopping = True
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def _all_slots(self) -> list[_Slot]:
        return [slot for slots in self._slots.values() for slot in slots] + list(self._retiring)

    def _board_changed(self, kind: str) -> None:
        if kind == "target" and not self._stopping:
            self._reconcile()

    def _reconcile(self) -> None:
        targets = self._board.targets()
        for gateway, slots in list(self._slots.items()):
            if targets.get(gateway) != slots[0].target:
                del self._slots[gateway]
                for slot in slots:
                    self._retire(slot)
        for gateway, target in targets.items():
            if gateway not in self._slots:
                self._slots[gateway] = [
                    self._spawn(_Slot(gateway, target, index))
                    for index in range(self.options.connections)
                ]

    def _spawn(self, slot: _Slot) -> _Slot:
        slot.task = asyncio.get_running_loop().create_task(
            self._run(slot), name=f"tunnel {slot.gateway}#{slot.index}"
        )
        return slot

    def _retire(self, slot: _Slot) -> None:
        """The target changed or went away: no redial; in-flight work gets `retire_grace`."""
        slot.retired = True
        if slot.link is None:
            if slot.task is not None:
                slot.task.cancel()
            return
        self._retiring.add(slot)
        slot.link.drain()
        link = slot.link
        asyncio.get_running_loop().call_later(self.options.retire_grace, link.close_now)

    # -- one connection slot --
    def _now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    async def _run(self, slot: _Slot) -> None:
        options = self.options
        backoff = options.backoff_initial
        try:
            while not slot.retired:
                try:
                    lived = await self._connect_and_serve(slot)
                except TunnelRefused as refused:
                    self.refusals[refused.reason] += 1
                    known = refused.reason if refused.reason in wire.NACK_REASONS else "other"
                    self.refusals_by_gateway[(slot.gateway, known)] += 1
                    standby = (
                        refused.reason == wire.NACK_DUPLICATE and self._connected[slot.gateway] > 0
                    )
                    if standby:
                        # A gateway that takes one connection per node (the reference's): this
                        # one waits as a standby, retried at the longest backoff, and takes over
                        # once the gateway lets go of the live one.
                        backoff = options.backoff_max
                    self._observer.process_event(
                        "tunnel_refused",
                        gateway=slot.gateway,
                        index=slot.index,
                        reason=refused.reason,
                        backoff_s=backoff,
                        **({"standby": True} if standby else {}),
                    )
                except TunnelError as failed:
                    self._dial_failed(slot, failed.reason, backoff)
                except Exception as bug:
                    # A fault in a link or in aioquic: without this the slot's task would end
                    # with the exception unread, and the node would sit without a tunnel and
                    # without a log line saying why. Logged, counted and retried like a dial.
                    reason = f"internal error: {type(bug).__name__}: {bug}"
                    self._dial_failed(slot, reason, backoff, exc_info=bug)  # with its traceback
                else:
                    if lived > options.backoff_reset_after:
                        backoff = options.backoff_initial
                if slot.retired:
                    break
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, options.backoff_max)
        finally:
            self._retiring.discard(slot)

    def _dial_failed(self, slot: _Slot, reason: str, backoff: float, **extra: Any) -> None:
        self.dial_failures += 1
        self._observer.process_event(
            "tunnel_dial_failed",
            gateway=slot.gateway,
            index=slot.index,
            reason=reason,
            backoff_s=backoff,
            **extra,
        )

    async def _connect_and_serve(self, slot: _Slot) -> float:
        """Dial, handshake, serve until the connection ends; returns how long it lived."""
        options = self.options
        host, port = split_host_port(slot.target.dial_addr)
        if port is None:
            raise TunnelError(f"dial address {slot.target.dial_addr!r} has no port")
        handshake = wire.Handshake(options.inference_server_id, self._token())
        configuration = self._configuration(derive_sni(slot.target.target))
        candidates = await self._resolve(host, port)
        errors: list[str] = []

        made: list[TunnelLink | _Stillborn] = []

        def create(quic: QuicConnection, **kwargs: Any) -> QuicConnectionProtocol:
            try:
                link = self._factory(quic, self, options, kwargs)
            except Exception as exc:
                stillborn = _Stillborn(quic, exc)
                made.append(stillborn)
                return stillborn
            made.append(link)
            return cast(QuicConnectionProtocol, link)

        for address in candidates:
            try:
                async with contextlib.AsyncExitStack() as stack:
                    try:
                        async with asyncio.timeout(options.connect_timeout):
                            protocol = await stack.enter_async_context(
                                connect(
                                    address,
                                    port,
                                    configuration=configuration,
                                    create_protocol=create,
                                    wait_connected=False,
                                )
                            )
                            if isinstance(protocol, _Stillborn):
                                raise protocol.error
                            link = cast(TunnelLink, protocol)
                            link.transmit()  # the Initial (connect() sends nothing unasked)
                            await link.wait_handshake()
                    except (OSError, TunnelError, TimeoutError) as exc:
                        errors.append(f"{address}: {_describe(exc)}")
                        continue
                    return await self._handshake_and_serve(slot, link, handshake, address, port)
            finally:
                for made_link in made:  # however the dial ended, cancelled too
                    made_link.release_socket()
                made.clear()
        raise TunnelError("; ".join(errors) or f"no address for {host}")

    async def _handshake_and_serve(
        self, slot: _Slot, link: TunnelLink, handshake: wire.Handshake, address: str, port: int
    ) -> float:
        link.send_handshake(handshake)
        try:
            async with asyncio.timeout(self.options.connect_timeout):
                ack = await link.read_ack()
        except TimeoutError:
            raise TunnelError("no handshake ack in time") from None
        if not ack.accepted:
            raise TunnelRefused(ack.reason)
        if slot.retired:
            return 0.0
        slot.link = link
        link.serve()
        started = self._now()
        self.dials += 1
        self._count(slot.gateway, +1)
        self._observer.process_event(
            "tunnel_connected",
            gateway=slot.gateway,
            target=slot.target.target,
            dial=f"{address}:{port}",
            index=slot.index,
        )
        try:
            await link.wait_closed()
        finally:
            lived = self._now() - started
            slot.link = None
            self._count(slot.gateway, -1)
            self._observer.process_event(
                "tunnel_lost",
                gateway=slot.gateway,
                index=slot.index,
                reason=link.end_reason,
                lived_s=round(lived, 3),
            )
        return lived

    def _count(self, gateway: str, delta: int) -> None:
        self._connected[gateway] += delta
        if self._connected[gateway] <= 0:
            del self._connected[gateway]
        self._board.set_tunnels(gateway, self._connected[gateway])

    def _token(self) -> str | None:
        path = self.options.token_file
        if path is None:
            return None
        try:
            token = path.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise TunnelError(f"token file {path}: {_describe(exc)}") from None
        return token or None

    def _configuration(self, sni: str) -> QuicConfiguration:
        options = self.options
        configuration = QuicConfiguration(
            is_client=True,
            alpn_protocols=list(H3_ALPN) if options.protocol == "http3" else None,
            server_name=sni,
            idle_timeout=options.idle_timeout,
            max_data=options.max_data,
            max_stream_data=options.max_stream_data,
        )
        cadata = self._trust.current()
        if cadata is None:
            configuration.verify_mode = ssl.CERT_NONE
        else:
            configuration.verify_mode = ssl.CERT_REQUIRED
            configuration.load_verify_locations(cadata=cadata)
        return configuration


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, TunnelError):
        return exc.reason
    text = str(exc) or type(exc).__name__
    return text
